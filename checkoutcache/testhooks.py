"""Test hook for the crash tests: CHECKOUTCACHE_TEST_KILL_AT=<step> makes the
clone worker or gc SIGKILL itself at that named step, as a crash would.
Read only by the worker and gc; documented in the README; never set it in
production."""

from __future__ import annotations

import os
import signal

KILL_HOOK = "CHECKOUTCACHE_TEST_KILL_AT"


def checkpoint(name: str) -> None:
    if os.environ.get(KILL_HOOK) == name:
        os.kill(os.getpid(), signal.SIGKILL)
