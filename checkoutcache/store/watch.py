"""Waiting for a clone to finish without polling: an inotify watch on the
repository's state/ directory, where every clone leaves a trace the moment
its outcome is known (the worker removes its clone record right after the
ready marker is written, and a failure record appears by rename), and where
progress records are rewritten as the clone goes. A waiter sleeps until one
of those events or its timeout: it learns of a publish within a millisecond,
and of a worker's death (which writes nothing) by the timeout, as before.

Where inotify is unavailable, wait() simply sleeps the timeout (polling).
"""

from __future__ import annotations

import ctypes
import os
import select
import time

_IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x80, 0x100, 0x200

try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.inotify_init1.argtypes = [ctypes.c_int]
    _LIBC.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _LIBC = None


class StateWatch:
    """A context manager: wait(timeout) returns early when state/ changes."""

    def __init__(self, directory: str):
        self.fd = -1
        if _LIBC is None:
            return
        fd = _LIBC.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return
        if _LIBC.inotify_add_watch(fd, os.fsencode(directory), _IN_MOVED_TO | _IN_CREATE | _IN_DELETE) < 0:
            os.close(fd)
            return
        self.fd = fd

    def wait(self, timeout: float) -> None:
        if self.fd < 0:
            time.sleep(max(0.0, timeout))
            return
        readable, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if readable:
            try:
                while os.read(self.fd, 65536):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "StateWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
