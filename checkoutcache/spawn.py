"""Starting a clone worker that outlives its caller.

The caller already holds the commit's clone lock (it decided, by taking it,
that it is the one to start the clone). The worker inherits that very lock
descriptor, so the lock passes to the worker without ever being free: no
second clone can start in between, and when the worker dies the lock dies
with it. The worker runs in its own session with no terminal and no pipes to
the caller, so a caller that times out or is killed never strands it.
Credentials travel in the worker's environment only, never in argv.
"""

from __future__ import annotations

import os
import subprocess
import sys

from .config import Config
from .gitenv import CREDENTIAL_VARS, credential_env
from .layout import RepoPaths
from .repospec import Credential

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Workers started by a long-lived caller (serve, the library in a pipeline) must
# be waited for, or they linger as zombies that still look alive to psutil.
_STARTED: list[subprocess.Popen] = []


def reap_finished_workers() -> None:
    _STARTED[:] = [proc for proc in _STARTED if proc.poll() is None]


def start_worker(root: str, paths: RepoPaths, sha: str, lock_fd: int, config: Config,
                 credential: Credential | None) -> subprocess.Popen:
    reap_finished_workers()
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIAL_VARS}
    env.update(config.to_env())
    env.update(credential_env(credential))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "checkoutcache.worker", "--root", root, "--key", paths.key,
           "--commit", sha, "--lock-fd", str(lock_fd)]
    # The worker's stderr goes to the commit's log (appended: the history of attempts),
    # so even a crash before the worker sets up its own logging leaves a trace.
    with open(paths.clone_log(sha), "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                pass_fds=(lock_fd,), start_new_session=True, cwd="/", env=env)
    _STARTED.append(proc)
    return proc
