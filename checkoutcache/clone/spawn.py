"""Starting a clone worker that outlives its caller.

The caller already holds the commit's clone lock (it decided, by taking it,
that it is the one to start the clone). The worker inherits that very lock
descriptor, so the lock passes to the worker without ever being free: no
second clone can start in between, and when the worker dies the lock dies
with it. The worker runs in its own session with no terminal and no pipes to
the caller, so a caller that times out or is killed never strands it.
Credentials travel in the worker's environment only, never in argv: a
forked worker would keep the CLI's argv (where a URL may carry a token), so
both the middle child and the worker replace their process title at once
(setproctitle rewrites /proc/<pid>/cmdline, which `ps` shows).

Two ways to start it:
- fork (the CLI): a double fork of the caller itself, which has already paid
  for starting Python and importing what the worker needs (about 100 ms of
  a new commit's ~500). Only for a process we own: the child closes every
  descriptor but the lock, which is safe in the CLI and not in a host process.
- a worker server (serve): a pre-forked single-threaded child of serve forks
  the worker as the CLI does (workserver.py), so serve pays no Python start;
- spawn (the library, or serve when its worker server is gone): a fresh
  `python -m checkoutcache.clone.worker`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import setproctitle

from checkoutcache.cones import Cone
from checkoutcache.config import Config
from checkoutcache.credentials import (
    Credential,
    credential_env,
    redact,
    without_credentials,
)
from checkoutcache.store.layout import RepoPaths
from checkoutcache.store import tree

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Workers started by a long-lived caller (serve, the library in a pipeline) must
# be waited for, or they linger as zombies that still look alive to psutil.
_STARTED: list[subprocess.Popen] = []


_WORKER_SERVER = None  # a WorkerServer (workserver.py) this process started, if any


class WorkerServerGone(OSError):
    """A request never reached the worker server: spawning a worker instead is safe."""


def use_worker_server(server) -> None:
    """Start this process's workers through a pre-forked worker server (None: spawn them)."""
    global _WORKER_SERVER
    _WORKER_SERVER = server


def reap_finished_workers() -> None:
    _STARTED[:] = [proc for proc in _STARTED if proc.poll() is None]


def worker_starter(fork: bool = False):
    """The coordinator's Start for a detached worker (coordinator.py): forked from this
    process (the CLI), else from serve's worker server, else spawned."""
    def start(paths: RepoPaths, name: str, lock_fd: int, config: Config, credential: Credential | None,
              deaths: int, cone: Cone = ()) -> int:
        return start_worker(paths.root, paths, name, lock_fd, config, credential, fork=fork, deaths=deaths,
                            cone=cone)

    return start


def start_worker(root: str, paths: RepoPaths, name: str, lock_fd: int, config: Config,
                 credential: Credential | None, fork: bool = False, deaths: int = 0, cone: Cone = ()) -> int:
    """Start the worker of checkout NAME (a sparse one: its cone); returns its pid. deaths: how
    many workers died on this checkout in a row."""
    if fork:
        return _fork_worker(root, paths, name, lock_fd, config, credential, deaths, cone=cone)
    if _WORKER_SERVER is not None:
        try:
            return _WORKER_SERVER.start_worker(root, paths.key, name, lock_fd, config, credential, deaths, cone)
        except WorkerServerGone:
            _WORKER_SERVER.reap()  # gone (killed) with nothing of ours: spawning still works
    return _spawn_worker(root, paths, name, lock_fd, config, credential, deaths, cone)


def _spawn_worker(root: str, paths: RepoPaths, name: str, lock_fd: int, config: Config,
                  credential: Credential | None, deaths: int, cone: Cone = ()) -> int:
    reap_finished_workers()
    env = without_credentials(os.environ)
    env.update(config.to_env())
    env.update(credential_env(credential))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "checkoutcache.clone.worker", "--root", root, "--key", paths.key,
           "--checkout", name, "--lock-fd", str(lock_fd), "--deaths", str(deaths)]
    cmd += [arg for dir_ in cone for arg in ("--sparse", dir_)]
    # The worker's stderr goes to the commit's log (appended: the history of attempts),
    # so even a crash before the worker sets up its own logging leaves a trace.
    log_fd = tree.open_file(paths.clone_log(name), os.O_WRONLY | os.O_APPEND, create=True)
    with os.fdopen(log_fd, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                pass_fds=(lock_fd,), start_new_session=True, cwd="/", env=env)
    _STARTED.append(proc)
    return proc.pid


def hide_caller_secrets() -> None:
    """Our own argv may carry a token in a URL: clean it, so that no child we start
    (a forked worker, or git in the instant between vfork and exec) ever shows it."""
    setproctitle.setproctitle(redact(" ".join(sys.argv)))


def _fork_worker(root: str, paths: RepoPaths, name: str, lock_fd: int, config: Config,
                 credential: Credential | None, deaths: int, retitle_caller: bool = True, cone: Cone = ()) -> int:
    if retitle_caller:
        # A child starts with our argv, which may carry a token in a URL: clean ours
        # first, so that no instant of any child shows it.
        hide_caller_secrets()
    from checkoutcache.clone.process import fork_detached

    return fork_detached(lambda: _become_worker(root, paths, name, lock_fd, config, credential, deaths, cone),
                         "worker")


def worker_title(name: str) -> str:
    """What `ps` shows of a forked worker (serve/reaper.py knows it by this)."""
    return f"checkoutcache-worker {name}"


def _become_worker(root: str, paths: RepoPaths, name: str, lock_fd: int, config: Config,
                   credential: Credential | None, deaths: int, cone: Cone = ()) -> None:
    # Imported in the child: the CLI's own path (tests/test_import_cost.py) never needs it.
    from checkoutcache.clone.process import become_detached

    def work() -> int:
        from checkoutcache.clone.worker import run_worker

        return run_worker(root, paths.key, name, config, credential, deaths, cone)

    become_detached(paths, name, lock_fd, credential, worker_title(name), work)
