"""serve's HTTP layer: parsing, routing, status codes and the listening socket.

Every request is hostile until shown otherwise (the code under review can
reach this port or socket), so before any work:
- connections beyond `max_connections` get 503 SERVER_BUSY with Retry-After;
- the request line and headers must arrive within HEADER_DEADLINE of the
  connection's turn, the body within BODY_DEADLINE: a slow sender is dropped;
- a body is at most MAX_BODY bytes (413), its Content-Length a plain number
  (400 otherwise), and chunked bodies are refused;
- a request with an Origin header (a browser page) or, over TCP, a Host that
  is not the listen address (DNS rebinding) is refused (403);
- over TCP every endpoint but /healthz and /openapi.json needs the bearer
  token (401); what a token may then do is the policy's (policy.py).
Only known endpoints become metrics labels.

Server: the standard library's ThreadingHTTPServer. Every call into the cache
blocks (locks, waits), so a thread per connection is the natural shape.

On SIGTERM: stop accepting, let in-flight requests finish, release holds,
exit 0. Clone workers are detached and publish on their own.
"""

from __future__ import annotations

import http.server
import io
import ipaddress
import json
import logging
import os
import signal
import socket
import socketserver
import stat
import sys
import threading
import time
import urllib.parse

from checkoutcache.answers import Answer
from checkoutcache.cache import Cache
from checkoutcache.config import Config
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.serve.metrics import CONTENT_TYPE_LATEST, generate_latest
from checkoutcache.clone.spawn import use_worker_server
from checkoutcache.clone.submodules import POLICY_LOCAL_VAR, POLICY_REPOS_VAR
from checkoutcache.clone.workserver import WorkerServer
from checkoutcache.serve.policy import ApiPolicy, Grant
from checkoutcache.serve.service import Bounds, Service, http_status
from checkoutcache.store.create import init_root, make_dirs

log = logging.getLogger("checkoutcache.serve")

MAX_BODY = 64 * 1024
IDLE_CONNECTION_TIMEOUT = 5.0  # so shutdown never waits on an idle keep-alive connection
HEADER_DEADLINE = 10.0  # from the start of a request's turn to its last header line
BODY_DEADLINE = 10.0
# Each endpoint and its methods (the OpenAPI document says the same; a test compares).
ROUTES = {"/healthz": ("GET",), "/metrics": ("GET",), "/openapi.json": ("GET",), "/v1/ensure": ("GET", "POST"),
          "/v1/status": ("GET",), "/v1/gc": ("POST",), "/v1/hold": ("POST",), "/v1/release": ("POST",)}
ENDPOINTS = tuple(ROUTES)
PUBLIC = ("/healthz", "/openapi.json")
OPENAPI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openapi.json")


def parse_listen(value: str, allow_remote: bool) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
        if not 0 < number < 65536:
            raise ValueError
    except ValueError:
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"--listen {value[:60]!r} is not HOST:PORT") from None
    if not allow_remote:
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"--listen {host!r} is not a loopback address; "
                                                          f"pass --allow-remote to listen there on purpose")
    return host, number


def error_body(exc: CheckoutCacheError) -> tuple[int, dict]:
    answer = Answer.from_error(exc)
    return http_status(answer), answer.to_json()


class _DeadlineIO(io.RawIOBase):
    """A socket's reads, each bounded by what is left of one deadline: a sender
    of one byte a second cannot hold a thread longer than the deadline."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline = time.monotonic() + IDLE_CONNECTION_TIMEOUT

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        self.sock.settimeout(remaining)
        return self.sock.recv_into(buffer)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "checkoutcache"
    service: Service  # set on the subclass made by make_server
    allowed_hosts: frozenset[str] | None  # None: no Host check (the Unix socket)

    def setup(self) -> None:
        super().setup()
        if self.request.family in (socket.AF_INET, socket.AF_INET6):
            # Headers and body would otherwise wait on the client's delayed ACK (~40 ms each).
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = _DeadlineIO(self.connection)
        self.rfile = io.BufferedReader(self.reader, 65536)

    def handle_one_request(self) -> None:
        # An idle keep-alive connection waits IDLE_CONNECTION_TIMEOUT for its next
        # request (so shutdown never waits long on it); once a request starts, its
        # line and headers get HEADER_DEADLINE in all.
        self.reader.deadline = time.monotonic() + IDLE_CONNECTION_TIMEOUT
        try:
            started = self.rfile.peek(1)
        except (TimeoutError, OSError):
            started = b""
        if not started:
            self.close_connection = True
            return
        self.reader.deadline = time.monotonic() + HEADER_DEADLINE
        super().handle_one_request()

    def log_message(self, format: str, *args) -> None:
        # The request line may carry a repository URL with credentials: log only the path.
        log.debug("%s %s", self.command, urllib.parse.urlsplit(self.path or "").path)

    def send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        self.send_body(status, (json.dumps(body, sort_keys=True) + "\n").encode(), "application/json", headers)

    def send_body(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self._headers_buffer.append(b"\r\n")
        self.wfile.write(b"".join(self._headers_buffer) + data)  # one write: headers and body together
        self._headers_buffer = []

    def body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise CheckoutCacheError("BAD_ARGUMENT", what="chunked or encoded request bodies are not accepted; "
                                                          "send Content-Length")
        lengths = self.headers.get_all("Content-Length") or []
        if len(lengths) > 1 or (lengths and not lengths[0].strip().isdigit()):
            self.close_connection = True  # what follows on this connection cannot be framed
            raise CheckoutCacheError("BAD_ARGUMENT", what="Content-Length must be one non-negative whole number")
        length = int(lengths[0]) if lengths else 0
        if length > MAX_BODY:
            self.close_connection = True
            raise CheckoutCacheError("PAYLOAD_TOO_LARGE", limit=MAX_BODY)
        self.reader.deadline = time.monotonic() + BODY_DEADLINE
        data = self.rfile.read(length) if length else b""
        if len(data) != length:
            self.close_connection = True
            raise TimeoutError("the body ended early")
        return data

    def params(self) -> dict:
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
        data = self.body()
        if data:
            try:
                body = json.loads(data)
            except ValueError:
                raise CheckoutCacheError("BAD_ARGUMENT", what="the request body is not JSON") from None
            if not isinstance(body, dict):
                raise CheckoutCacheError("BAD_ARGUMENT", what="the request body must be a JSON object")
            query.update(body)
        return query

    def admit(self, path: str) -> Grant:
        """Origin, Host and token checks: who is asking, before any work."""
        if self.headers.get("Origin") is not None:
            raise CheckoutCacheError("FORBIDDEN_ORIGIN", why="an Origin header")
        host = (self.headers.get("Host") or "").lower()
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            raise CheckoutCacheError("FORBIDDEN_ORIGIN", why=f"Host {host[:80]!r}")
        if path in PUBLIC:
            return Grant("public", frozenset())
        return self.service.policy.authenticate(self.headers.get("Authorization"), self.allowed_hosts is not None)

    def handle_request(self, method: str) -> None:
        path = urllib.parse.urlsplit(self.path).path
        started = time.monotonic()
        service = self.service
        try:
            grant = self.admit(path)
            if path in ROUTES and method not in ROUTES[path]:
                raise CheckoutCacheError("METHOD_NOT_ALLOWED", method=method[:16], path=path)
            if path == "/healthz" and method == "GET":
                ok, body = service.health()
                self.send_json(200 if ok else 503, body)
            elif path == "/openapi.json" and method == "GET":
                with open(OPENAPI, "rb") as handle:
                    self.send_body(200, handle.read(), "application/json")
            elif path == "/metrics" and method == "GET":
                self.send_body(200, generate_latest(service.metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/v1/ensure" and method in ("GET", "POST"):
                answer = service.ensure(self.params(), grant)
                headers = {"Retry-After": str(answer.retry_after)} if answer.retry_after else {}
                self.send_json(http_status(answer), answer.to_json(), headers)
            elif path == "/v1/status" and method == "GET":
                self.send_json(200, service.status(grant))
            elif path == "/v1/gc" and method == "POST":
                self.send_json(200, service.gc(self.params(), grant=grant))
            elif path == "/v1/hold" and method == "POST":
                self.send_json(*service.hold(self.params(), grant))
            elif path == "/v1/release" and method == "POST":
                self.send_json(*service.release(self.params(), grant))
            else:
                raise CheckoutCacheError("NOT_FOUND", what=f"{method} {path[:100]}")
        except CheckoutCacheError as exc:
            status, body = error_body(exc)
            headers = {}
            if exc.code == "UNAUTHORIZED":
                headers["WWW-Authenticate"] = 'Bearer realm="checkoutcache"'
            elif exc.code == "TOO_MANY_HOLDS":
                headers["Retry-After"] = "5"
            elif exc.code == "METHOD_NOT_ALLOWED":
                headers["Allow"] = ", ".join(ROUTES[path])
            self.send_json(status, body, headers)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True  # a slow or vanished sender: drop it, answer nothing
        except Exception as exc:  # a bug: answered as one, the server goes on
            log.exception("request failed")
            self.send_json(*error_body(CheckoutCacheError("INTERNAL_ERROR", detail=type(exc).__name__)))
        finally:
            # Only known endpoints become labels: no request can grow /metrics.
            service.metrics.requests.labels(path if path in ENDPOINTS else "other").observe(
                time.monotonic() - started)

    def do_GET(self) -> None:
        self.handle_request("GET")

    def do_POST(self) -> None:
        self.handle_request("POST")

    def __getattr__(self, name: str):
        if name.startswith("do_"):  # any other method: the same JSON 404, never http.server's HTML 501
            return lambda: self.handle_request(name[3:])
        raise AttributeError(name)


LISTEN_BACKLOG = 256  # socketserver's default of 5 resets a burst of concurrent clients
BUSY_RETRY_AFTER = 1


class BoundedThreads(socketserver.ThreadingMixIn):
    """A thread per connection, at most max_connections at once: the next one
    gets 503 SERVER_BUSY with Retry-After at once, from the accepting thread."""

    daemon_threads = False  # in-flight requests finish before we exit
    block_on_close = True
    request_queue_size = LISTEN_BACKLOG
    max_connections = 256

    def server_activate(self) -> None:
        super().server_activate()
        self.slots = threading.BoundedSemaphore(self.max_connections)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            refuse_busy(request, self.max_connections)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def refuse_busy(request: socket.socket, limit: int) -> None:
    _status, body = error_body(CheckoutCacheError("SERVER_BUSY", limit=limit))
    data = (json.dumps(body, sort_keys=True) + "\n").encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nRetry-After: {BUSY_RETRY_AFTER}\r\nConnection: close\r\n\r\n")
    try:
        request.settimeout(1.0)
        request.sendall(head.encode() + data)
    except OSError:
        pass


class TCPServer(BoundedThreads, http.server.HTTPServer):
    allow_reuse_address = True


class UnixServer(BoundedThreads, socketserver.UnixStreamServer):
    def get_request(self):
        conn, _ = super().get_request()
        return conn, ("unix", 0)  # BaseHTTPRequestHandler expects (host, port)


def allowed_hosts(host: str, port: int) -> frozenset[str]:
    """The Host headers a TCP request may carry: the listen address, and its
    loopback names when it is loopback."""
    names = {f"[{host}]:{port}" if ":" in host else f"{host}:{port}"}
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        names |= {f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"}
    return frozenset(name.lower() for name in names)


def bind_unix(path: str, handler, max_connections: int) -> UnixServer:
    """The socket appears with its final mode (0660: umask set around bind), and
    only a dead server's socket is ever replaced: never a file of another kind."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is not None:
        if not stat.S_ISSOCK(info.st_mode):
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"{path} exists and is not a socket; not touching it")
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(path)
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"another server is listening on {path}")
        except ConnectionRefusedError:
            os.unlink(path)  # a dead server's socket
        finally:
            probe.close()
    previous = os.umask(0o117)
    try:
        server_class = type("Server", (UnixServer,), {"max_connections": max_connections})
        return server_class(path, handler)
    finally:
        os.umask(previous)


def make_server(service: Service, listen: tuple[str, int] | None, unix: str | None, max_connections: int = 256):
    if unix:
        handler = type("BoundHandler", (Handler,), {"service": service, "allowed_hosts": None})
        return bind_unix(unix, handler, max_connections)
    host, port = listen
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("Server", (TCPServer,), {"address_family": family, "max_connections": max_connections})
    server = server_class((host, port), http.server.BaseHTTPRequestHandler)
    server.RequestHandlerClass = type("BoundHandler", (Handler,), {
        "service": service, "allowed_hosts": allowed_hosts(host, server.server_address[1])})
    return server


def serve(cache: Cache, config: Config, listen: tuple[str, int] | None, unix: str | None,
          gc_interval: float, policy: ApiPolicy | None = None, bounds: Bounds | None = None,
          max_connections: int = 256, ready_file: str | None = None) -> int:
    policy = policy or ApiPolicy()
    if unix is None and not policy.tokens:
        raise CheckoutCacheError("BAD_ARGUMENT", what="serving over TCP needs a bearer token: pass --token-file "
                                                      "or set CHECKOUTCACHE_API_TOKEN (or serve on --unix)")
    # Many threads, each a short burst of work between socket waits: the default 5 ms
    # GIL switch interval convoys them (measured: 64 clients fell to ~300 answers/s).
    sys.setswitchinterval(0.0005)
    init_root(cache.paths)
    make_dirs(cache.paths.serve_dir)
    journal = cache.paths.serve_journal(os.getpid())
    os.environ["CHECKOUTCACHE_CLONE_JOURNAL"] = journal  # workers we start report to us
    # The policy goes to our workers too: a .gitmodules names nothing the API could not.
    os.environ[POLICY_REPOS_VAR] = ",".join(policy.repo_patterns)
    os.environ[POLICY_LOCAL_VAR] = "1" if policy.allow_local else "0"
    # Forked while we are still single-threaded: it forks our clone workers later.
    worker_server = WorkerServer()
    use_worker_server(worker_server)
    service = Service(cache, config, gc_interval, journal, policy, bounds)
    server = make_server(service, listen, unix, max_connections)
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        if not stop.is_set():
            stop.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    background = [threading.Thread(target=service.maintain, daemon=True),
                  threading.Thread(target=service.follow_journal, daemon=True)]
    for thread in background:
        thread.start()
    where = unix or f"http://{server.server_address[0]}:{server.server_address[1]}"
    log.warning("checkoutcache serving %s on %s", cache.root, where)
    if ready_file:
        with open(ready_file, "w") as handle:
            handle.write(json.dumps({"listening": where, "pid": os.getpid()}))
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        service.stopping.set()
        server.server_close()  # waits for in-flight requests
        service.release_all()
        use_worker_server(None)
        worker_server.close()
        try:
            os.unlink(journal)
        except FileNotFoundError:
            pass
        if unix:
            try:
                if stat.S_ISSOCK(os.lstat(unix).st_mode):
                    os.unlink(unix)
            except FileNotFoundError:
                pass
    return 0
