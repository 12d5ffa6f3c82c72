"""A typed client of the sidecar's HTTP API (`checkoutcache serve`), returning
the same Answer objects as the library.

    from checkoutcache.client import Client
    client = Client("http://127.0.0.1:8787", token=open("/run/secrets/cc-token").read().strip())
    client = Client(unix="/cache/checkoutcache.sock")           # the socket; a token only if serve wants one
    answer = client.ensure(repo, commit, wait="15m")              # Answer: ready, cloning or failed
    with client.hold(repo, commit, wait=60) as held:              # held against gc until the block ends
        run_tool(held.answer.path)                                # (HoldFailed if it could not be held)
    report = client.status()                                      # Status: .repos, .totals, ...
    with client.workspace(repo, commit, wait=60) as ws:           # a writable tree of its own
        subprocess.run(["make", "test"], cwd=ws.path)             # (HoldFailed if not made)

The sidecar makes no workspace (it cannot write the caller's directory): the
client holds the checkout through /v1/hold while it copies it into this
process's workspaces directory (CHECKOUTCACHE_WORKSPACES, as the CLI's), then
holds it itself (the marker's shared lock, through the root it reads) for as
long as the workspace lives. The copy is owned by this process: it goes at
remove() or the end of the `with`, or, when the process dies, at its uid's
next workspace call or the writer's gc (workspaces.py).

Every API failure (bad input, unauthorized, forbidden repository, too many
holds, a busy server) comes back as an Answer with state `failed` and its
error code, as the library answers, except from `hold()`, which raises
HoldFailed (carrying that Answer) so that a `with` block never runs unheld.
ClientError is raised when the server cannot be reached or does not answer
as the API says. Durations are what the API takes: seconds, or a form such as
"15m". One Client keeps one keep-alive connection and may be shared by
threads (requests take turns); use a Client per thread for parallel
requests. A connection the server closed (after a refused request, or idle)
is opened anew for the next request.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import urllib.parse
from typing import Any, Mapping, Sequence

import attrs

from checkoutcache import signing
from checkoutcache.answers import Answer, State
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.handoff import TOKEN_FILE_VAR, TOKEN_VAR, token_from_file, unauthorized

Duration = float | int | str


class ClientError(Exception):
    """The server could not be reached, or answered outside the API."""


class NotTheWriter(ClientError):
    """What answered could not prove it holds the token (signing.py): its answer is not used."""


class HoldFailed(Exception):
    """A hold the server did not make: `answer` says why (cloning, failed, TOO_MANY_HOLDS...)."""

    def __init__(self, answer: Answer):
        super().__init__(f"not held: {answer.state}" + (f" {answer.error}: {answer.message}" if answer.error else ""))
        self.answer = answer


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


answer_from_json = Answer.from_json


def _typed(cls, data: dict):
    """An attrs value from a JSON object: its known fields (a newer server may add others)."""
    names = {field.name for field in attrs.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@attrs.frozen
class Totals:
    checkouts: int
    bytes: int
    max_checkouts: int | None = None
    max_bytes: int | None = None
    grace_seconds: float | None = None
    min_free: str | None = None
    disk: dict | None = None
    workspaces: int | None = None  # live ones in the workspaces directory the sidecar sees
    free_headroom: str | None = None
    max_age_seconds: float | None = None
    clone_timeout_seconds: float | None = None
    limits_from: dict | None = None  # whose limits these are: the writer's record (serve, gc) or the caller's


@attrs.frozen
class Checkout:
    commit: str
    path: str
    ready: bool
    intact: bool
    size: int
    held: bool
    last_used: str | None = None
    idle_seconds: int | None = None
    protected: str | None = None
    lfs: str | None = None
    lfs_why: str | None = None
    unreadable: str | None = None


@attrs.frozen
class RepoStatus:
    key: str
    repo: str | None
    scope: str | None
    checkouts: list[Checkout]
    clones: list[dict] = attrs.Factory(list)
    failures: list[dict] = attrs.Factory(list)
    scratch: list[dict] = attrs.Factory(list)
    stuck_in_trash: list[dict] = attrs.Factory(list)
    lfs: dict | None = None
    seed: dict | None = None
    problems: list[dict] = attrs.Factory(list)


@attrs.frozen
class Status:
    """GET /v1/status: what the root holds (a scoped token sees its scopes only)."""

    root: str
    repos: list[RepoStatus]
    totals: Totals
    unreachable: list[dict] = attrs.Factory(list)
    workspaces: dict | None = None  # {"dir", "workspaces": [...]}, as GET /v1/workspaces

    @classmethod
    def from_json(cls, data: dict) -> "Status":
        repos = [_typed(RepoStatus, {**r, "checkouts": [_typed(Checkout, c) for c in r.get("checkouts", [])]})
                 for r in data.get("repos", [])]
        return cls(root=data["root"], repos=repos, totals=_typed(Totals, data["totals"]),
                   unreachable=data.get("unreachable", []), workspaces=data.get("workspaces"))


@attrs.frozen
class GcResult:
    """POST /v1/gc: what one gc run removed, kept and could not do."""

    dry_run: bool
    skipped: str | None
    removed: list[dict]
    kept_over_limit: list[dict]
    unmet: list[dict]
    bytes_freed: int
    mirrors: list[dict] = attrs.Factory(list)
    unremovable: list[dict] = attrs.Factory(list)
    clock_repaired: list[dict] = attrs.Factory(list)
    problems: list[dict] = attrs.Factory(list)
    disk_before: dict | None = None
    disk_after: dict | None = None
    totals_after: dict | None = None

    @classmethod
    def from_json(cls, data: dict) -> "GcResult":
        return _typed(cls, data)


@attrs.define
class ClientHold:
    """A checkout held through /v1/hold; release() (or leaving the `with`) ends it."""

    client: "Client"
    answer: Answer
    hold_id: str | None
    expires_in: float | None = None

    @property
    def held(self) -> bool:
        return self.hold_id is not None

    def release(self) -> None:
        if self.hold_id is not None:
            hold_id, self.hold_id = self.hold_id, None
            self.client.release(hold_id)

    def __enter__(self) -> "ClientHold":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _seconds(wait: Duration) -> float:
    """How long a request may take beyond the client's timeout: the wait it asks for."""
    from checkoutcache.units import parse_duration

    try:
        return parse_duration(wait, "wait")
    except Exception:
        return 0.0  # the server answers the input error


AUTO = "auto"


class Client:
    def __init__(self, url: str | None = None, unix: str | None = None, token: str | None = None,
                 timeout: float = 60.0, token_file: str | None = None, root: str | None = AUTO):
        """token_file: a tokens file (a mounted Secret) whose first token is read at each request,
        so a rotation reaches the next request without a new Client; token wins when both are given.
        root: the cache root as this process sees it (the sidecar's volume, mounted here): a ready
        answer counts only as this root's own checkout of the very commit asked for, ready on
        this side (its path then is the one here), as the CLI checks; "auto": CHECKOUTCACHE_ROOT
        or the default root when that directory exists here; None: no such check (a caller on
        another machine, for which the path is only a name)."""
        if (url is None) == (unix is None):
            raise ValueError("give exactly one of url= (http://host:port) and unix= (a socket path)")
        self.token = token
        self.token_file = token_file
        self.timeout = timeout
        if root == AUTO:
            from checkoutcache.store.layout import default_root

            root = default_root()
            root = root if os.path.isdir(root) else None
        self.root = os.path.realpath(root) if root else None
        if url is not None:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError("url must be http://host:port")
            self._connect = lambda extra=0.0: http.client.HTTPConnection(parts.hostname, parts.port or 80,
                                                                         timeout=timeout + extra)
        else:
            self._connect = lambda extra=0.0: _UnixConnection(unix, timeout + extra)
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, timeout: float = 60.0) -> "Client":
        """The client a review container's environment describes (deploy/): CHECKOUTCACHE_API_URL
        (http://host:port), else the socket CHECKOUTCACHE_UNIX_SOCKET; with CHECKOUTCACHE_API_TOKEN,
        or CHECKOUTCACHE_API_TOKEN_FILE (read at each request: rotation needs no restart)."""
        environ = os.environ if environ is None else environ
        token = environ.get(TOKEN_VAR) or None
        token_file = environ.get(TOKEN_FILE_VAR) or None
        if environ.get("CHECKOUTCACHE_API_URL"):
            return cls(environ["CHECKOUTCACHE_API_URL"], token=token, timeout=timeout, token_file=token_file)
        if environ.get("CHECKOUTCACHE_UNIX_SOCKET"):
            return cls(unix=environ["CHECKOUTCACHE_UNIX_SOCKET"], token=token, timeout=timeout,
                       token_file=token_file)
        raise ValueError("set CHECKOUTCACHE_API_URL (http://host:port, with CHECKOUTCACHE_API_TOKEN) or "
                         "CHECKOUTCACHE_UNIX_SOCKET")

    # ------------------------------------------------------------ endpoints
    def ensure(self, repo: str, commit: str, wait: Duration = 0, scope: str = "default",
               sparse: Sequence[str] | None = None, history: str | None = None, base: str | None = None) -> Answer:
        """sparse: the directories of a sparse checkout (cone mode); none: the whole tree.
        history "full": ready only once the checkout's history is complete (answer.history);
        base: a commit id, the answer then carries merge_base (Cache.ensure's)."""
        request: dict[str, Any] = {"repo": repo, "commit": commit, "wait": wait, "scope": scope}
        if sparse:
            request["sparse"] = list(sparse)
        if history is not None:
            request["history"] = history
        if base is not None:
            request["base"] = base
        _status, body = self._request("POST", "/v1/ensure", request, _seconds(wait))
        return self._ours(answer_from_json(body), repo, commit, scope, sparse)

    def _ours(self, answer: Answer, repo: str, commit: str, scope: str, sparse: Sequence[str] | None) -> Answer:
        """A ready answer as this process's own view of its root shows it (see root): the
        path below the root must be the store's checkout of the commit asked for (the key as
        this side computes it, with its LFS and submodule settings), published here. Else the
        answer is NO_WRITER, naming what was answered: whatever answered is not this root's
        writer (another pod's, a squatter's, one keyed with other settings)."""
        if self.root is None or answer.state != State.READY:
            return answer
        from checkoutcache.cache import Cache
        from checkoutcache.store.layout import RepoPaths
        from checkoutcache.store.ready import looks_intact, marker_record, open_marker_shared

        cache = Cache(self.root)
        try:
            want = cache.request(repo, commit, scope, sparse)
        except CheckoutCacheError as exc:
            return Answer.from_error(exc)
        mine = cache.paths.repo(want.spec.key).checkout(want.name)
        below = mine[len(self.root):]
        answered = answer.path or ""
        fd = None
        if answer.commit == want.sha and (answered == mine or answered.endswith(below)):
            fd = open_marker_shared(RepoPaths.ready_marker_in(mine), wait=0.5)
        try:
            if fd is not None and looks_intact(mine, marker_record(fd)):
                return attrs.evolve(answer, path=mine)
        finally:
            if fd is not None:
                os.close(fd)
        return Answer.from_error(CheckoutCacheError(
            "NO_WRITER", root=self.root, why=f"it answered ready at {answered[:300]!r}, which is not this root's "
                                             f"checkout of {want.sha} ready here (is it the writer of this root, "
                                             f"keyed with the same CHECKOUTCACHE_LFS and _SUBMODULES?)"),
            want.sha, answer.repo or repo)

    def hold(self, repo: str, commit: str, wait: Duration = 0, scope: str = "default",
             ttl: Duration | None = None, sparse: Sequence[str] | None = None) -> ClientHold:
        """Hold the checkout (ready first, within wait); HoldFailed when it is not held."""
        request: dict[str, Any] = {"repo": repo, "commit": commit, "wait": wait, "scope": scope}
        if sparse:
            request["sparse"] = list(sparse)
        if ttl is not None:
            request["ttl"] = ttl
        _status, body = self._request("POST", "/v1/hold", request, _seconds(wait))
        answer = answer_from_json(body)
        if not body.get("hold"):
            raise HoldFailed(answer)
        held = ClientHold(self, answer, body["hold"], body.get("expires_in"))
        mine = self._ours(answer, repo, commit, scope, sparse)
        if mine.state != State.READY:
            held.release()
            raise HoldFailed(mine)
        held.answer = mine
        return held

    def workspace(self, repo: str, commit: str, wait: Duration = 0, scope: str = "default",
                  sparse: Sequence[str] | None = None):
        """A writable workspace of the commit, made on this side (see the module's docstring):
        a workspaces.Workspace owned by this process; HoldFailed when it could not be made."""
        from checkoutcache.cache import Hold
        from checkoutcache.config import Config
        from checkoutcache.cones import cone_digest, parse_cone
        from checkoutcache.repospec import parse_commit
        from checkoutcache.store.layout import RepoPaths, checkout_name, root_of_checkout
        from checkoutcache.store.ready import open_marker_shared
        from checkoutcache.workspaces import Workspace, copy_checkout, reap_own, workspaces_dir_of

        if self.root is None:
            raise HoldFailed(Answer.from_error(CheckoutCacheError(
                "WORKSPACE_FAILED", detail="a workspace is copied from the cache root as this process sees it: "
                                           "give Client(root=...) or set CHECKOUTCACHE_ROOT"), repo=repo))
        with self.hold(repo, commit, wait=wait, scope=scope, sparse=sparse) as held:
            answer = held.answer  # this root's own checkout of the commit, ready here (hold: _ours)
            try:
                # Only this root's checkout of this very commit is copied, and only beside this root
                # is a workspace made: never whatever a server, ours or not, names.
                cone = parse_cone(sparse)
                sha = parse_commit(commit)
                if answer.commit != sha or root_of_checkout(answer.path or "", checkout_name(
                        sha, cone_digest(cone) if cone else None)) != self.root:
                    raise CheckoutCacheError("WORKSPACE_FAILED", detail=f"the sidecar answered {answer.path!r} for "
                                             f"commit {answer.commit}: not the store's checkout of {sha}")
                # The same path: the review mounts the root where the sidecar does (deploy/).
                fd = open_marker_shared(RepoPaths.ready_marker_in(answer.path or ""))
                if fd is None:
                    raise CheckoutCacheError("WORKSPACE_FAILED", detail=f"the checkout {answer.path} the sidecar "
                                             f"answered is not visible here: mount the cache volume at the same path")
                local = Hold(answer, fd)
                try:
                    repo_paths = RepoPaths(os.path.dirname(os.path.dirname(answer.path)))
                    paths = workspaces_dir_of(repo_paths.root, Config.from_env())
                    reap_own(paths)
                    made = copy_checkout(paths, answer.path, fd, {"repo": answer.repo or repo})
                except BaseException:
                    local.release()
                    raise
            except CheckoutCacheError as exc:
                raise HoldFailed(Answer.from_error(exc, commit=answer.commit, repo=answer.repo)) from None
        return Workspace(answer, made, local, answer.path)

    def workspaces(self) -> dict:
        """GET /v1/workspaces: the workspaces directory as the sidecar sees it."""
        return self._json_or_error("GET", "/v1/workspaces")

    def release(self, hold_id: str) -> Answer | None:
        """None when released; the failed Answer (UNKNOWN_HOLD) otherwise."""
        status, body = self._request("POST", "/v1/release", {"hold": hold_id})
        return None if status == 200 else answer_from_json(body)

    def status(self) -> Status:
        return Status.from_json(self._json_or_error("GET", "/v1/status"))

    def gc(self, dry_run: bool = False, **limits: Any) -> GcResult:
        return GcResult.from_json(self._json_or_error("POST", "/v1/gc", {"dry_run": dry_run, **limits}))

    def health(self) -> dict:
        return self._request("GET", "/healthz")[1]

    def ready(self) -> dict:
        return self._request("GET", "/readyz")[1]

    def openapi(self) -> dict:
        return self._json_or_error("GET", "/openapi.json")

    def metrics(self) -> str:
        return self._raw("GET", "/metrics")[2].decode()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ transport
    def _json_or_error(self, method: str, path: str, body: dict | None = None) -> dict:
        status, answer = self._request(method, path, body)
        if status >= 400:
            failed = answer_from_json(answer)
            raise ClientError(f"{failed.error}: {failed.message}")
        return answer

    def _request(self, method: str, path: str, body: dict | None = None, wait: float = 0.0) -> tuple[int, dict]:
        status, content_type, data = self._raw(method, path, body, wait)
        if not content_type.startswith("application/json"):
            raise ClientError(f"{method} {path}: HTTP {status} without a JSON body")
        try:
            parsed = json.loads(data)
        except ValueError:
            raise ClientError(f"{method} {path}: HTTP {status} with a body that is not JSON") from None
        if not isinstance(parsed, dict):
            raise ClientError(f"{method} {path}: HTTP {status} with a JSON body that is not an object")
        return status, parsed

    def _raw(self, method: str, path: str, body: dict | None = None, wait: float = 0.0) -> tuple[int, str, bytes]:
        headers = {}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        token = self.token or (token_from_file(self.token_file) if self.token_file else None)
        mac = None
        with self._lock:
            for attempt in (1, 2):  # a kept-alive connection the server closed: one fresh try
                if token:  # signed anew for each try (a nonce is answered once): the token never leaves us
                    headers["Authorization"], mac = signing.sign_request(token, method, path, data or b"")
                if self._conn is None:
                    self._conn = self._connect(float(wait))
                try:
                    self._conn.timeout = self.timeout + float(wait)
                    if self._conn.sock is not None:
                        self._conn.sock.settimeout(self._conn.timeout)
                    self._conn.request(method, path, body=data, headers=headers)
                    response = self._conn.getresponse()
                    payload = response.read()
                    if response.will_close or response.getheader("Connection", "").lower() == "close":
                        self._conn.close()  # the next request opens a fresh connection
                        self._conn = None
                    # 401 is the one answer serve cannot prove (the token is not one it holds): it says
                    # nothing a squatter could use; every other answer must be proved.
                    if mac is not None and response.status != 401 and not signing.proves_answer(
                            token, mac, response.status, payload, response.getheader(signing.PROOF_HEADER)):
                        raise NotTheWriter(f"{method} {path}: the answer (HTTP {response.status}) does not prove "
                                           f"it comes from the holder of the token: not the sidecar (a process "
                                           f"squatting its address?); nothing of it is used")
                    if mac is not None and response.status == 401:  # unproven by design: its body is not used
                        return 401, "application/json", json.dumps(unauthorized()).encode()
                    return response.status, response.getheader("Content-Type", ""), payload
                except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                        http.client.BadStatusLine) as exc:
                    self._conn.close()
                    self._conn = None
                    if attempt == 2:
                        raise ClientError(f"{method} {path}: {exc}") from None
                except OSError as exc:
                    if self._conn is not None:
                        self._conn.close()
                    self._conn = None
                    raise ClientError(f"{method} {path}: {exc}") from None
        raise ClientError(f"{method} {path}: no answer")  # pragma: no cover - the loop returns or raises
