"""Test hooks for the fault tests, read only by the clone worker, the background history
(clone/history.py), gc and `bundle publish`, documented in docs/operations.md; never set
them in production.

- CHECKOUTCACHE_TEST_KILL_AT=<step>: SIGKILL ourselves at that named step, as
  a crash would.
- CHECKOUTCACHE_TEST_KILL_LOG=<path>: just before such a kill, append one line
  "<step> <pid>" to that file, so a test can prove the process died there.
- CHECKOUTCACHE_TEST_ENOSPC_AT=<step>: raise OSError(ENOSPC) there, for
  machines where no small filesystem can be mounted to fill for real.
- CHECKOUTCACHE_TEST_STALL_AT=<step>: the thread that reaches that step never
  leaves it (it sleeps), as a thread stuck in a system call would; with the
  kill log set, it first appends "<step> <pid>" there, so a test can prove the
  stall began. For the tests that show what must never wait on a stuck step.
"""

from __future__ import annotations

import errno
import os
import signal
import time

KILL_HOOK = "CHECKOUTCACHE_TEST_KILL_AT"
KILL_LOG = "CHECKOUTCACHE_TEST_KILL_LOG"
ENOSPC_HOOK = "CHECKOUTCACHE_TEST_ENOSPC_AT"
STALL_HOOK = "CHECKOUTCACHE_TEST_STALL_AT"


def _log_kill(path: str, name: str) -> None:
    # One O_APPEND write: lines from several dying processes never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{name} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


def checkpoint(name: str) -> None:
    if os.environ.get(KILL_HOOK) == name:
        log = os.environ.get(KILL_LOG)
        if log:
            _log_kill(log, name)
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(ENOSPC_HOOK) == name:
        raise OSError(errno.ENOSPC, "No space left on device (injected by the test hook)")
    if os.environ.get(STALL_HOOK) == name:
        log = os.environ.get(KILL_LOG)
        if log:
            _log_kill(log, name)
        while True:
            time.sleep(3600)
