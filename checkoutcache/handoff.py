"""Asking the store's writer (a `serve`) for what this process cannot or should not
do itself: one HTTP request, standard library only (the CLI's ready answer comes
through here when it reads a root it may not write).

Where the writer is: the root's socket (CHECKOUTCACHE_UNIX_SOCKET, else
<root>/checkoutcache.sock), then CHECKOUTCACHE_API_URL (http://host:port, the
shipped pod's review containers: they are outside the store's group and may not
connect to its 0660 socket). CHECKOUTCACHE_API_TOKEN is sent when set, else the
first token of CHECKOUTCACHE_API_TOKEN_FILE, read at each request so a rotated
Secret takes effect without a restart.

What it keeps:
- The token is never sent: every request is signed with it (signing.py), and an
  answer counts only with serve's proof that it holds the token, so whoever
  binds the port while serve is down (a restart, an OOM kill: any process in the
  pod may) learns no token and cannot answer in the writer's name. Over the
  socket, moreover, the kernel's SO_PEERCRED must name this uid, root, or the
  root directory's owner (a group member can put its own socket at that path).
  Over TCP, only to the URL the operator configured. No redirect is followed,
  no proxy is used.
- Every request is bounded as a whole: a peer that trickles bytes never holds
  the caller past its timeout; an answer larger than MAX_ANSWER is refused.
- None of it is trusted further than an answer's shape: the callers check a
  ready answer on disk (its marker at the very path they computed).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time

# serve answers when its wait ends (or at its own cap, sooner); this is for the answer's trip.
HANDOFF_SLACK = 5.0
MAX_ANSWER = 1 << 20
# A socket nobody accepts on, or a URL nobody listens at, is no writer.
CONNECT_TIMEOUT = 0.5
API_URL_VAR, TOKEN_VAR, SOCKET_VAR = "CHECKOUTCACHE_API_URL", "CHECKOUTCACHE_API_TOKEN", "CHECKOUTCACHE_UNIX_SOCKET"
TOKEN_FILE_VAR = "CHECKOUTCACHE_API_TOKEN_FILE"


def token_from_file(path: str) -> str | None:
    """The first token of a tokens file (serve's format: `TOKEN [SCOPE,...]` a line, # comments),
    read anew at each use, so a Secret rotated in place (the kubelet's ..data swap) reaches the
    very next request; None when it holds none or cannot be read."""
    try:
        with open(path, "rb") as handle:
            text = handle.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return None
    for line in text.removeprefix("\ufeff").splitlines():
        # A comment starts at the line's start or after a blank only, as serve reads the file
        # (serve/policy.py token_words): a word that starts with '#' begins it.
        words = line.split()
        if words and not words[0].startswith("#"):
            return words[0]
    return None


def api_token(environ=os.environ) -> str | None:
    """CHECKOUTCACHE_API_TOKEN, else the first token of CHECKOUTCACHE_API_TOKEN_FILE (read now)."""
    token = environ.get(TOKEN_VAR)
    if token:
        return token
    path = environ.get(TOKEN_FILE_VAR)
    return token_from_file(path) if path else None


class NoWriter(Exception):
    """No writer answered: why, in one line (never the token)."""


def trusted_peers(root: str) -> set[int]:
    """Whom the token may go to over the socket: this uid, root, the root directory's
    owner; never the overflow uid, which stands for every uid a user namespace does not
    map (a stranger's socket and the root's owner would look alike there)."""
    trusted = {os.getuid(), 0, os.stat(root).st_uid}
    try:
        with open("/proc/sys/kernel/overflowuid") as handle:
            trusted.discard(int(handle.read()))
    except (OSError, ValueError):
        trusted.discard(65534)
    return trusted


def socket_path(root: str) -> str:
    return os.environ.get(SOCKET_VAR) or os.path.join(root, "checkoutcache.sock")


def post(root: str, endpoint: str, body: dict, timeout: float, api_url: bool = True) -> tuple[int, dict]:
    """(HTTP status, JSON answer) of the first writer that answers: the root's socket, then
    (api_url) CHECKOUTCACHE_API_URL. NoWriter when neither is there; a writer that was reached
    but failed mid-answer raises what failed (OSError, TimeoutError, ValueError)."""
    why = []
    answered = _post_unix(socket_path(root), endpoint, body, timeout, root, why)
    if answered is None and api_url:
        url = os.environ.get(API_URL_VAR)
        if url:
            answered = _post_tcp(url, endpoint, body, timeout, why)
        else:
            why.append(f"{API_URL_VAR} is not set")
    if answered is None:
        raise NoWriter("; ".join(why))
    return answered


def record_use(root: str, path: str, repo: str, commit: str, scope: str, sparse, lfs: str | None = None,
               submodules: str | None = None) -> str | None:
    """A reader's use of the checkout at path, recorded by the writer (serve's ready answer
    touches the marker). Called while the caller holds the marker's shared lock, so the
    writer's record comes before any eviction decision. None when recorded, else why not
    (Unrecorded: its not_ready says the writer answered the checkout is not ready).
    lfs, submodules: the reader's settings that make the store's key (a writer keyed
    otherwise answers SETTINGS_MISMATCH, which is then why)."""
    from checkoutcache.credentials import strip_userinfo

    request = {"repo": strip_userinfo(repo), "commit": commit, "wait": 0, "scope": scope,
               **({"sparse": list(sparse)} if sparse else {}), **({"lfs": lfs} if lfs else {}),
               **({"submodules": submodules} if submodules else {})}
    try:
        status, answer = post(root, "/v1/ensure", request, HANDOFF_SLACK)
    except NoWriter as exc:
        return Unrecorded(f"no writer answered ({exc})")
    except Exception as exc:  # a writer that failed mid-answer: the checkout is still ready
        return Unrecorded(f"the writer did not answer ({type(exc).__name__})")
    if status == 200 and answer.get("state") == "ready" and same_checkout(answer.get("path"), root, path):
        return None
    if answer.get("error") == "SETTINGS_MISMATCH":
        return Unrecorded(f"the writer answered {status} SETTINGS_MISMATCH: {answer.get('message')}")
    # The writer itself (proved) says the checkout is not ready: gc is moving it away.
    return Unrecorded(f"the writer answered {status} {answer.get('error') or answer.get('state')}",
                      not_ready=answer.get("state") == "cloning")


class Unrecorded(str):
    """Why a reader's use was not recorded; not_ready: because the writer answered that the
    checkout is not ready (then it is not answered ready: store/ready.py)."""

    not_ready = False

    def __new__(cls, why: str, not_ready: bool = False):
        made = super().__new__(cls, why)
        made.not_ready = not_ready
        return made


def same_checkout(answered: object, root: str, path: str) -> bool:
    """The writer's path names our checkout: the same path below the root (the writer may
    see the volume at another mount point than this reader does)."""
    below = path[len(root):] if path.startswith(root + "/") else path
    return isinstance(answered, str) and (answered == path or answered.endswith(below))


class Signed:
    """One request to the writer: its bytes, and what checks the answer's proof (signing.py)."""

    __slots__ = ("data", "token", "mac")

    def __init__(self, endpoint: str, body: dict, host: str):
        from checkoutcache import signing

        payload = json.dumps(body).encode()
        self.token = api_token()
        self.mac = None
        authorization = ""
        if self.token:
            value, self.mac = signing.sign_request(self.token, "POST", endpoint, payload)
            authorization = f"Authorization: {value}\r\n"
        self.data = (f"POST {endpoint} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n{authorization}\r\n").encode() + payload

    def proven(self, status: int, headers: dict[str, str], body: bytes) -> bool:
        """Whether the answer is the token holder's (always, when no token was used: the socket's
        peer check is then the only evidence, as before)."""
        from checkoutcache import signing

        if self.token is None or status == 401:  # 401: serve cannot prove it (not its token); it tells nothing
            return True
        return signing.proves_answer(self.token, self.mac, status, body, headers.get(signing.PROOF_HEADER))


def _post_unix(where: str, endpoint: str, body: dict, timeout: float, root: str,
               why: list[str]) -> tuple[int, dict] | None:
    """None when no serve of a trusted uid listens there (nothing is sent then)."""
    import _socket  # not socket: it imports selectors and array, a few ms of a reader's ready answer

    try:
        mode = os.lstat(where).st_mode  # a symlink there is somebody's pointer to somewhere else
    except OSError:
        why.append(f"no socket at {where}")
        return None
    if not stat.S_ISSOCK(mode):
        why.append(f"{where} is not a socket")
        return None
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:  # (_socket's socket is no context manager)
        conn.settimeout(CONNECT_TIMEOUT)
        try:
            conn.connect(where)
        except OSError as exc:
            why.append(f"{where}: {exc.strerror or exc}")
            return None
        # Who listens, as the kernel says (struct ucred: pid, uid, gid): a group member may have
        # put its own socket at this path (the root's folders are the group's to write in that mode).
        creds = conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
        peer_uid = int.from_bytes(creds[4:8], sys.byteorder)
        if peer_uid not in trusted_peers(root):
            why.append(f"{where} is served by uid {peer_uid}, not the store's writer")
            return None
        return _exchange(conn, Signed(endpoint, body, "localhost"), timeout, where, why)
    finally:
        conn.close()


def _post_tcp(url: str, endpoint: str, body: dict, timeout: float, why: list[str]) -> tuple[int, dict] | None:
    import _socket

    host, port = _host_port(url)
    if host is None:
        why.append(f"{API_URL_VAR} is not http://HOST:PORT")
        return None
    conn = _socket.socket(_socket.AF_INET6 if ":" in host else _socket.AF_INET, _socket.SOCK_STREAM)
    try:
        conn.settimeout(CONNECT_TIMEOUT)
        conn.connect((host, port))
    except OSError as exc:
        conn.close()
        why.append(f"{API_URL_VAR} ({host}:{port}): {exc.strerror or exc}")
        return None
    try:
        return _exchange(conn, Signed(endpoint, body, f"{host}:{port}"), timeout, f"{API_URL_VAR} ({host}:{port})",
                         why)
    finally:
        conn.close()


def _host_port(url: str) -> tuple[str | None, int]:
    """http://HOST:PORT (a trailing / allowed; [v6] hosts too); (None, 0) for anything else:
    no https here (the pod's writer listens on loopback), no credentials in the URL."""
    if not url.startswith("http://"):
        return None, 0
    rest = url[len("http://"):].rstrip("/")
    host, _, port = rest.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536 or not host or "@" in host or "/" in host:
        return None, 0
    return host.strip("[]"), int(port)


def _exchange(conn, request: Signed, timeout: float, where: str, why: list[str]) -> tuple[int, dict] | None:
    """Send, then read to the end (Connection: close) within timeout in all; None (and why)
    when the answer does not prove it is the token holder's: no writer is there."""
    deadline = time.monotonic() + timeout
    conn.settimeout(timeout)
    conn.sendall(request.data)
    chunks, size = [], 0
    while size <= MAX_ANSWER:
        left = deadline - time.monotonic()
        if left <= 0:  # a peer that trickles bytes never holds us past the bound
            raise TimeoutError("the writer's answer did not come in time")
        conn.settimeout(left)
        chunk = conn.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > MAX_ANSWER:
        raise ValueError("the writer's answer is too large")
    data = b"".join(chunks)
    status_line, _, rest = data.partition(b"\r\n")
    head, _, body_bytes = rest.partition(b"\r\n\r\n")
    status = int(status_line.split()[1])
    headers = {}
    for line in head.split(b"\r\n"):
        name, colon, value = line.partition(b":")
        if colon:
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    if not request.proven(status, headers, body_bytes):
        why.append(f"{where} did not prove it holds the token (not the writer; a squatter on its address?)")
        return None
    if status == 401 and request.token is not None:
        # The one answer serve cannot prove: nothing of its body is used (a squatter's words),
        # it is UNAUTHORIZED as this side's own table says it.
        return 401, unauthorized()
    answer = json.loads(body_bytes)
    return status, answer if isinstance(answer, dict) else {}


def unauthorized() -> dict:
    """UNAUTHORIZED as the error table says it (errors.py): what an unproven 401 stands for."""
    from checkoutcache.errors import describe

    message, next_step = describe("UNAUTHORIZED")
    return {"state": "failed", "error": "UNAUTHORIZED", "message": message, "next": next_step}


class WriterHold:
    """A read-only reader's hold registered with the writer: a /v1/hold of serve's (which
    serve registers in <root>/holds/), taken anew before its ttl ends for as long as this
    lasts, then released. If the writer cannot be reached the hold goes on unregistered (the
    reader's shared lock alone protects it, within gc's bounds on readers' locks)."""

    TTL = 600.0

    def __init__(self, root: str, request: dict, hold_id: str):
        import threading

        self.root, self.request, self.hold_id = root, request, hold_id
        self.fd = -1  # nothing for a child to inherit: the writer holds it
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.renew, name="cc-writer-hold", daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, root: str, request: dict) -> "WriterHold | None":
        hold_id = cls.ask(root, request)
        return cls(root, request, hold_id) if hold_id else None

    @classmethod
    def ask(cls, root: str, request: dict) -> str | None:
        try:
            status, answer = post(root, "/v1/hold", {**request, "wait": 0, "ttl": cls.TTL}, HANDOFF_SLACK)
        except Exception:  # no writer, or one that failed: unregistered
            return None
        hold_id = answer.get("hold")
        return hold_id if status == 200 and isinstance(hold_id, str) else None

    def renew(self) -> None:
        while not self.stopped.wait(self.TTL / 3):
            fresh = self.ask(self.root, self.request)
            if fresh:  # the new one first: never a moment unregistered
                self.drop(self.hold_id)
                self.hold_id = fresh

    def drop(self, hold_id: str | None) -> None:
        if hold_id:
            try:
                post(self.root, "/v1/release", {"hold": hold_id}, HANDOFF_SLACK)
            except Exception:
                pass  # its ttl ends it

    def release(self) -> None:
        self.stopped.set()
        self.drop(self.hold_id)
        self.hold_id = None

