"""Waiting for a clone to finish without polling: an inotify watch on the
repository's state/ directory, where every clone leaves a trace the moment
its outcome is known (the worker removes its clone record right after the
ready marker is written, and a failure record appears by rename), and where
progress records are rewritten as the clone goes. A waiter sleeps until one
of those events or its timeout: it learns of a publish within a millisecond,
and of a worker's death (which writes nothing) by the timeout, as before.

A host process (serve, a pipeline's library) answers before the close: its
watches are closed by a thread of its own (close_aside), one per process.

A waiter may poll first (poll_first seconds, looking every POLL seconds) and
watch only after that: closing a watch waits for a kernel grace period
(fsnotify's SRCU, measured 15-20 ms here), which a process that waits once and
exits (the CLI, most of whose waits end within a second) pays at the end of
every answer; its polling costs at most POLL of latency. A long wait watches.

Where inotify is unavailable, wait() simply sleeps the timeout (polling).
"""

from __future__ import annotations

import ctypes
import os
import select
import threading
import time

_IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x80, 0x100, 0x200

try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.inotify_init1.argtypes = [ctypes.c_int]
    _LIBC.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _LIBC = None


# How often a waiter that polls first looks again.
POLL = 0.005


class StateWatch:
    """A context manager: wait(timeout) returns early when state/ changes. poll_first: seconds
    of looking every POLL before the watch is made (the caller looks after each wait, so the
    change that happens while the watch is made is seen by the look that follows it)."""

    def __init__(self, directory: str, poll_first: float = 0.0, close_aside: bool = False):
        self.directory = directory
        self.close_aside = close_aside
        self.fd = -1
        self.poll_until: float | None = time.monotonic() + poll_first if poll_first > 0 else None
        if self.poll_until is None:
            self._watch()

    def _watch(self) -> None:
        if _LIBC is None:
            return
        fd = _LIBC.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return
        if _LIBC.inotify_add_watch(fd, os.fsencode(self.directory), _IN_MOVED_TO | _IN_CREATE | _IN_DELETE) < 0:
            os.close(fd)
            return
        self.fd = fd

    def wait(self, timeout: float) -> None:
        if self.poll_until is not None:
            left = self.poll_until - time.monotonic()
            if left > 0:
                time.sleep(max(0.0, min(timeout, POLL, left)))
                return
            self.poll_until = None
            self._watch()
            return  # the caller looks once more, now watching: nothing happens unseen
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
            fd, self.fd = self.fd, -1
            if not (self.close_aside and _close_aside(fd)):
                os.close(fd)

    def __enter__(self) -> "StateWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_CLOSER: tuple[int, "queue.SimpleQueue[int]"] | None = None  # (the pid it runs in, its queue)
_CLOSER_LOCK = threading.Lock()


def _close_aside(fd: int) -> bool:
    """Hand fd to this process's closing thread (started on first use); False in a child
    forked from a process that had one (the thread did not come along): close it yourself."""
    global _CLOSER
    with _CLOSER_LOCK:
        if _CLOSER is None or _CLOSER[0] != os.getpid():
            if _CLOSER is not None:
                return False
            import queue  # a host process's only: not on the CLI's path

            closing: queue.SimpleQueue[int] = queue.SimpleQueue()
            threading.Thread(target=_closing, args=(closing,), name="cc-watch-close", daemon=True).start()
            _CLOSER = (os.getpid(), closing)
        _CLOSER[1].put(fd)
    return True


def _closing(closing: "queue.SimpleQueue[int]") -> None:
    while True:
        os.close(closing.get())
