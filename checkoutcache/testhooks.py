"""Test hooks for the fault tests, read only by the clone worker and gc,
documented in the README; never set them in production.

- CHECKOUTCACHE_TEST_KILL_AT=<step>: SIGKILL ourselves at that named step, as
  a crash would.
- CHECKOUTCACHE_TEST_ENOSPC_AT=<step>: raise OSError(ENOSPC) there, for
  machines where no small filesystem can be mounted to fill for real.
"""

from __future__ import annotations

import errno
import os
import signal

KILL_HOOK = "CHECKOUTCACHE_TEST_KILL_AT"
ENOSPC_HOOK = "CHECKOUTCACHE_TEST_ENOSPC_AT"


def checkpoint(name: str) -> None:
    if os.environ.get(KILL_HOOK) == name:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(ENOSPC_HOOK) == name:
        raise OSError(errno.ENOSPC, "No space left on device (injected by the test hook)")
