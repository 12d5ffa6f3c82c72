"""A pre-forked worker server: clone workers for a long-lived, multi-threaded
process (serve) without starting Python for each (multiprocessing's
forkserver, in miniature).

At serve's start, before any thread exists, one single-threaded child forks
off, imports everything a worker needs, and waits on a socket pair. To start a
worker, serve sends it the request (a JSON message: root, key, commit, deaths,
the config's and the credential's environment) and, as SCM_RIGHTS, the clone
lock descriptor it holds; the server double-forks the worker exactly as the
CLI does (spawn.py: a new session, detached, inheriting the very lock) and
answers the worker's pid. The lock passes from serve to the worker without
ever being free, so single flight holds as with the other two ways.

Credentials travel in the message (memory, a socket pair only these two
processes hold), never in argv or a file. If the server is gone (killed), its
caller falls back to spawning; when serve exits, the server reads EOF and
exits too (and dies with it by PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import threading

import setproctitle

from checkoutcache.clone.spawn import WorkerServerGone, _fork_worker
from checkoutcache.config import Config
from checkoutcache.credentials import Credential, credential_env, credential_from_env
from checkoutcache.store.layout import RootPaths

MAX_MESSAGE = 1 << 16
ANSWER_WAIT = 10.0  # a fork takes milliseconds; a server stopped (SIGSTOP) must not hang serve


class WorkerServer:
    """The serving side lives in a forked child; this object is the client in serve."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # the server: single-threaded from here on
            ours.close()
            _serve_forever(theirs)  # never returns
        theirs.close()
        ours.settimeout(ANSWER_WAIT)
        self.pid = pid
        self._sock = ours
        self._lock = threading.Lock()  # serve's threads take turns on the one socket

    def start_worker(self, root: str, key: str, name: str, lock_fd: int, config: Config,
                     credential: Credential | None, deaths: int, cone: tuple[str, ...] = ()) -> int:
        request = json.dumps({"root": root, "key": key, "name": name, "cone": list(cone), "deaths": deaths,
                              "config": config.to_env(), "credential": credential_env(credential)}).encode()
        with self._lock:
            try:
                socket.send_fds(self._sock, [request], [lock_fd])
            except OSError as exc:  # nothing was handed over: the caller may spawn instead
                raise WorkerServerGone(f"the worker server is gone ({exc.strerror or exc})") from None
            try:
                answer = self._sock.recv(64)
            except OSError as exc:  # socket timeout included
                answer = b""
                detail = exc.strerror or str(exc)
            else:
                detail = "it did not answer"
        if not answer.isdigit():
            # The lock may have reached a worker: never start a second one. The commit
            # is answered from its record (or found absent once the lock is free).
            raise OSError(f"the worker server may not have started the worker ({detail})")
        return int(answer)

    def reap(self) -> None:
        """Collect the server if it died (killed): it must not stay a zombie."""
        try:
            os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pass

    def close(self) -> None:
        self._sock.close()  # the server reads EOF and exits
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _serve_forever(sock: socket.socket) -> None:
    code = 0
    try:
        _die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # serve handles ^C; we go when it goes
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        setproctitle.setproctitle("checkoutcache-worker-server")
        # Everything a worker imports, imported once here: a forked worker starts warm.
        import checkoutcache.clone.worker  # noqa: F401
        import checkoutcache.git.transport  # noqa: F401
        while True:
            try:
                message, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 1)
            except InterruptedError:
                continue
            if not message:
                break  # serve closed its end
            try:
                request = json.loads(message)
                config = Config.from_env(request["config"])
                credential = credential_from_env(request["credential"])
                paths = RootPaths(request["root"]).repo(request["key"])
                pid = _fork_worker(request["root"], paths, request["name"], fds[0], config, credential,
                                   int(request["deaths"]), retitle_caller=False, cone=tuple(request["cone"]))
                sock.send(str(pid).encode())
            except Exception:  # one bad request never stops the server; the caller falls back
                sock.send(b"error")
            finally:
                for fd in fds:
                    os.close(fd)  # the worker has its own copy of the lock now
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
