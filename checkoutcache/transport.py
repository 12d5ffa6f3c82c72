"""Talking to the upstream repository: probe it, fetch into the mirror.

One small interface, two implementations: the git CLI (used when installed:
measured faster than libgit2 over git:// and much faster over file://) and
pygit2 (used when git is absent, or when CHECKOUTCACHE_TRANSPORT=pygit2).
Both are tested. Neither ever sees a credential in a URL or argv; both report
failures as TransportError with a code from the error table and one redacted
line of detail.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from typing import Callable

from .errors import CheckoutCacheError
from .gitenv import git_env
from .redact import redact
from .repospec import Credential

Progress = Callable[[dict], None]

_UNREACHABLE = re.compile(
    r"could not resolve|connection refused|timed out|unable to access|could not read from remote"
    r"|repository not found|does not appear to be a git repository|authentication failed"
    r"|could not read username|permission denied|early eof|unable to connect|failed to connect"
    r"|ssl|http[^\n]*\b(401|403|404)\b|not found|unexpected http status|no such device or address"
    r"|connection reset|network is unreachable|host key verification", re.I)
_DISK_FULL = re.compile(r"no space left on device|disk quota exceeded", re.I)
_PROGRESS = re.compile(r"^(?:remote: )?(?P<phase>[A-Za-z ]+):\s+(?P<pct>\d+)% \((?P<done>\d+)/(?P<total>\d+)\)"
                       r"(?:, (?P<size>[\d.]+) (?P<unit>[KMG]i?B|bytes))?")
_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


class TransportError(Exception):
    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


def classify(text: str) -> str:
    if _DISK_FULL.search(text):
        return "DISK_FULL"
    if _UNREACHABLE.search(text):
        return "UNREACHABLE"
    return "CLONE_FAILED"


def last_meaningful_line(text: str) -> str:
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]
    lines = [ln for ln in lines if not _PROGRESS.match(ln) and not ln.startswith("From ")]
    fatal = [ln for ln in lines if ln.lower().startswith(("fatal:", "error:"))]
    return (fatal or lines or ["(git printed nothing)"])[-1][:300]


def parse_progress(line: str) -> dict | None:
    match = _PROGRESS.match(line.strip())
    if not match:
        return None
    phase = match.group("phase").strip().lower()
    update = {"phase": phase}
    if phase.endswith("receiving objects"):
        update.update(objects=int(match.group("done")), total_objects=int(match.group("total")))
        if match.group("size"):
            update["bytes"] = int(float(match.group("size")) * _UNITS[match.group("unit")])
    elif phase.endswith("resolving deltas"):
        update.update(deltas=int(match.group("done")), total_deltas=int(match.group("total")))
    return update


def _fail(code: str, detail: str, secrets: list[str]) -> TransportError:
    return TransportError(code, redact(detail, secrets))


# ---------------------------------------------------------------- the git CLI

try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not Linux
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # A git child must not outlive its clone worker: an orphaned fetch would keep
    # writing to the mirror after the worker's locks and records say it is gone.
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class RunningProcesses:
    """The git processes a worker has running, so a timeout can stop them."""

    def __init__(self):
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.add(proc)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def kill_all(self) -> None:
        with self._lock:
            for proc in self._procs:
                try:
                    proc.kill()
                except OSError:
                    pass


RUNNING = RunningProcesses()


class GitCliTransport:
    name = "cli"

    def __init__(self, git: str = "git"):
        self.git = git

    def probe(self, url: str, is_local: bool, credential: Credential | None, timeout: float) -> None:
        secrets = credential.secrets() if credential else []
        try:
            done = subprocess.run([self.git, "ls-remote", "--", url], capture_output=True, text=True,
                                  env=git_env(credential=credential, url=url), timeout=timeout,
                                  stdin=subprocess.DEVNULL, cwd="/", errors="replace")
        except subprocess.TimeoutExpired:
            raise _fail("UNREACHABLE", f"no answer within {timeout:g}s", secrets) from None
        if done.returncode != 0:
            _raise_probe_failure(url, is_local, last_meaningful_line(done.stderr), secrets)

    def fetch(self, mirror: str, url: str, refspecs: list[str], credential: Credential | None,
              on_progress: Progress, log: Callable[[str], None], keep_fds: tuple[int, ...] = ()) -> None:
        secrets = credential.secrets() if credential else []
        cmd = [self.git, "-C", mirror, "fetch", "--no-tags", "--no-write-fetch-head", "--progress",
               "--", url, *refspecs]
        log("$ " + redact(" ".join(cmd[3:]), secrets))
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=git_env(credential=credential, url=url),
                                pass_fds=keep_fds, preexec_fn=_die_with_parent, cwd="/")
        RUNNING.add(proc)
        try:
            output = self._read_progress(proc, on_progress, log, secrets)
            code = proc.wait()
        finally:
            RUNNING.discard(proc)
        if code != 0:
            raise _fail(classify(output), last_meaningful_line(output), secrets)

    @staticmethod
    def _read_progress(proc: subprocess.Popen, on_progress: Progress, log, secrets) -> str:
        seen: list[str] = []
        pending = b""
        while True:
            chunk = proc.stderr.read1(65536) if hasattr(proc.stderr, "read1") else proc.stderr.read(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = re.split(rb"[\r\n]", pending)
            for raw in lines:
                line = raw.decode("utf-8", "replace").strip()
                if not line:
                    continue
                update = parse_progress(line)
                if update is not None:
                    on_progress(update)
                    if "done" not in line:
                        continue
                line = redact(line, secrets)
                seen.append(line)
                log(line)
        if pending.strip():
            line = redact(pending.decode("utf-8", "replace").strip(), secrets)
            seen.append(line)
            log(line)
        return "\n".join(seen)


def _raise_probe_failure(url: str, is_local: bool, detail: str, secrets: list[str]) -> None:
    if is_local:
        raise CheckoutCacheError("NOT_A_REPOSITORY", path=repr(url[:200]))
    raise CheckoutCacheError("UNREACHABLE", detail=redact(detail, secrets))


# ---------------------------------------------------------------- libgit2

class Pygit2Transport:
    name = "pygit2"

    @staticmethod
    def _callbacks(credential: Credential | None, on_progress: Progress | None):
        import pygit2

        class Callbacks(pygit2.RemoteCallbacks):
            def __init__(self):
                super().__init__()
                self.asked = 0

            def credentials(self, url, username_from_url, allowed_types):
                self.asked += 1
                if credential is None or self.asked > 1:
                    return None  # no (more) credentials: fail instead of looping
                return pygit2.UserPass(credential.username, credential.password)

            def transfer_progress(self, stats):
                if on_progress is not None:
                    on_progress({"phase": "receiving objects", "objects": stats.received_objects,
                                 "total_objects": stats.total_objects, "bytes": stats.received_bytes})

        return Callbacks()

    def probe(self, url: str, is_local: bool, credential: Credential | None, timeout: float) -> None:
        import pygit2

        secrets = credential.secrets() if credential else []
        pygit2.settings.server_connect_timeout = int(timeout * 1000)
        pygit2.settings.server_timeout = int(timeout * 1000)
        if is_local and not os.path.isdir(url):
            _raise_probe_failure(url, is_local, "no such directory", secrets)
        scratch = tempfile.mkdtemp(prefix="checkoutcache-probe-")
        try:
            repo = pygit2.init_repository(scratch, bare=True)
            repo.remotes.create_anonymous(url).list_heads(callbacks=self._callbacks(credential, None))
        except (pygit2.GitError, KeyError, ValueError) as exc:
            _raise_probe_failure(url, is_local, str(exc), secrets)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def fetch(self, mirror: str, url: str, refspecs: list[str], credential: Credential | None,
              on_progress: Progress, log: Callable[[str], None], keep_fds: tuple[int, ...] = ()) -> None:
        import pygit2

        secrets = credential.secrets() if credential else []
        log("libgit2 fetch " + redact(url, secrets) + " " + " ".join(refspecs))
        try:
            repo = pygit2.Repository(mirror)
            stats = repo.remotes.create_anonymous(url).fetch(
                refspecs, callbacks=self._callbacks(credential, on_progress))
        except (pygit2.GitError, OSError, KeyError) as exc:
            text = str(exc) or type(exc).__name__
            log(redact(text, secrets))
            raise _fail(classify(text), text, secrets) from None
        log(f"received {stats.received_objects} objects, {stats.received_bytes} bytes")


def pick_transport(choice: str) -> GitCliTransport | Pygit2Transport:
    if choice == "pygit2" or (choice == "auto" and shutil.which("git") is None):
        return Pygit2Transport()
    return GitCliTransport()
