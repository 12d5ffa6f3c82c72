"""serve's HTTP layer: parsing, routing, status codes and the listening socket.

Server: the standard library's ThreadingHTTPServer. Every call into the cache
blocks (locks, waits), so a thread per connection is the natural shape; it
serves 64 concurrent clients on loopback without a framework.

On SIGTERM: stop accepting, let in-flight requests finish, release holds,
exit 0. Clone workers are detached and publish on their own.
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import logging
import os
import signal
import socket
import socketserver
import sys
import tempfile
import threading
import time
import urllib.parse

from checkoutcache.answers import Answer
from checkoutcache.cache import Cache
from checkoutcache.config import Config
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.serve.metrics import CONTENT_TYPE_LATEST, generate_latest
from checkoutcache.serve.service import Service, http_status
from checkoutcache.store.create import init_root

log = logging.getLogger("checkoutcache.serve")

MAX_BODY = 64 * 1024
IDLE_CONNECTION_TIMEOUT = 5.0  # so shutdown never waits on an idle keep-alive connection
ENDPOINTS = ("/healthz", "/metrics", "/v1/ensure", "/v1/status", "/v1/gc", "/v1/hold", "/v1/release")


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


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "checkoutcache"
    timeout = IDLE_CONNECTION_TIMEOUT
    service: Service  # set on the subclass made by make_server

    def setup(self) -> None:
        super().setup()
        if self.request.family in (socket.AF_INET, socket.AF_INET6):
            # Headers and body would otherwise wait on the client's delayed ACK (~40 ms each).
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args) -> None:
        # The request line may carry a repository URL with credentials: log only the path.
        log.debug("%s %s", self.command, urllib.parse.urlsplit(self.path).path)

    def send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        self.send_body(status, (json.dumps(body, sort_keys=True) + "\n").encode(), "application/json", headers)

    def send_body(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self._headers_buffer.append(b"\r\n")
        self.wfile.write(b"".join(self._headers_buffer) + data)  # one write: headers and body together
        self._headers_buffer = []

    def params(self) -> dict:
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"the request body is over {MAX_BODY} bytes")
        if length:
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError:
                raise CheckoutCacheError("BAD_ARGUMENT", what="the request body is not JSON") from None
            if not isinstance(body, dict):
                raise CheckoutCacheError("BAD_ARGUMENT", what="the request body must be a JSON object")
            query.update(body)
        return query

    def handle_request(self, method: str) -> None:
        path = urllib.parse.urlsplit(self.path).path
        started = time.monotonic()
        service = self.service
        try:
            if path == "/healthz" and method == "GET":
                ok, body = service.health()
                self.send_json(200 if ok else 503, body)
            elif path == "/metrics" and method == "GET":
                self.send_body(200, generate_latest(service.metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/v1/ensure" and method in ("GET", "POST"):
                answer = service.ensure(self.params())
                headers = {"Retry-After": str(answer.retry_after)} if answer.retry_after else {}
                self.send_json(http_status(answer), answer.to_json(), headers)
            elif path == "/v1/status" and method == "GET":
                self.send_json(200, service.status())
            elif path == "/v1/gc" and method == "POST":
                self.send_json(200, service.gc(self.params()))
            elif path == "/v1/hold" and method == "POST":
                self.send_json(*service.hold(self.params()))
            elif path == "/v1/release" and method == "POST":
                self.send_json(*service.release(self.params()))
            else:
                raise CheckoutCacheError("NOT_FOUND", what=f"{method} {path[:100]}")
        except CheckoutCacheError as exc:
            self.send_json(*error_body(exc))
        except (BrokenPipeError, ConnectionResetError):
            pass
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


LISTEN_BACKLOG = 256  # socketserver's default of 5 resets a burst of concurrent clients


class TCPServer(http.server.ThreadingHTTPServer):
    daemon_threads = False  # in-flight requests finish before we exit
    block_on_close = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = False
    block_on_close = True
    request_queue_size = LISTEN_BACKLOG

    def get_request(self):
        conn, _ = super().get_request()
        return conn, ("unix", 0)  # BaseHTTPRequestHandler expects (host, port)


def make_server(service: Service, listen: tuple[str, int] | None, unix: str | None):
    handler = type("BoundHandler", (Handler,), {"service": service})
    if unix:
        if os.path.exists(unix):
            probe = socket.socket(socket.AF_UNIX)
            try:
                probe.connect(unix)
                raise CheckoutCacheError("BAD_ARGUMENT", what=f"another server is listening on {unix}")
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(unix)  # a dead server's socket
            finally:
                probe.close()
        server = UnixServer(unix, handler)
        os.chmod(unix, 0o660)
        return server
    host, port = listen
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("Server", (TCPServer,), {"address_family": family})
    return server_class((host, port), handler)


def serve(cache: Cache, config: Config, listen: tuple[str, int] | None, unix: str | None,
          gc_interval: float, journal: str | None = None, ready_file: str | None = None) -> int:
    journal = journal or os.path.join(tempfile.gettempdir(), f"checkoutcache-serve-{os.getpid()}.journal")
    # Many threads, each a short burst of work between socket waits: the default 5 ms
    # GIL switch interval convoys them (measured: 64 clients fell to ~300 answers/s).
    sys.setswitchinterval(0.0005)
    init_root(cache.paths)
    os.environ["CHECKOUTCACHE_CLONE_JOURNAL"] = journal  # workers we spawn report to us
    service = Service(cache, config, gc_interval, journal)
    server = make_server(service, listen, unix)
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
        try:
            os.unlink(journal)
        except FileNotFoundError:
            pass
        if unix:
            try:
                os.unlink(unix)
            except FileNotFoundError:
                pass
    return 0
