"""serve: the long-running sidecar. An HTTP JSON API on loopback or a Unix
socket, gc on a schedule, health and Prometheus metrics.

It owns no state the CLI cannot read: every answer comes from the same Cache,
coordinator and gc as the CLI, on the same root, side by side. Holds (for
callers that run commands themselves) are the marker's shared lock, held by
this process, with a lease: a hold not released within its TTL is dropped, so
a client that died cannot pin a checkout forever.

Server: the standard library's ThreadingHTTPServer. Every call into the cache
blocks (locks, waits), so a thread per connection is the natural shape; it
serves 64 concurrent clients on loopback without a framework. Metrics:
prometheus_client, for a correct exposition format (escaping, histograms)
that hand-written text would only approximate.

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
import uuid

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from . import locks
from .answers import CLONING, READY, Answer
from .cache import Cache, Hold
from .config import Config
from .errors import CheckoutCacheError, is_input_error
from .gc import run_gc
from .status import build_status
from .store import init_root
from .units import parse_duration

log = logging.getLogger("checkoutcache.serve")

MAX_BODY = 64 * 1024
MAX_HOLD_TTL = 24 * 3600.0
DEFAULT_HOLD_TTL = 3600.0
IDLE_CONNECTION_TIMEOUT = 5.0  # so shutdown never waits on an idle keep-alive connection
HTTP_STATUS = {READY: 200, CLONING: 202}
GC_SETTINGS = ("max_checkouts", "max_bytes", "min_free", "free_headroom", "max_age", "grace")
JOURNAL_ROTATE_BYTES = 1 << 20


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


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.answers = Counter("checkoutcache_answers", "Answers to ensure, by state and error code",
                               ["state", "error"], registry=r)
        self.requests = Histogram("checkoutcache_request_seconds", "HTTP request latency by endpoint",
                                  ["endpoint"], registry=r,
                                  buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120))
        self.clones = Counter("checkoutcache_clones", "Clones started by this sidecar, by outcome",
                              ["outcome", "error"], registry=r)
        self.clone_seconds = Histogram("checkoutcache_clone_seconds", "Clone durations (published ones)",
                                       registry=r, buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600))
        self.evictions = Counter("checkoutcache_evictions", "Removals by gc, by reason", ["reason"], registry=r)
        self.gc_runs = Counter("checkoutcache_gc_runs", "gc runs, by result", ["result"], registry=r)
        self.gc_seconds = Histogram("checkoutcache_gc_seconds", "gc durations", registry=r)
        self.checkouts = Gauge("checkoutcache_checkouts", "Checkouts in the store (at the last gc)", registry=r)
        self.bytes = Gauge("checkoutcache_checkout_bytes", "Bytes of checkouts (at the last gc)", registry=r)
        self.limit = Gauge("checkoutcache_limit", "Configured limits (absent when unlimited)", ["limit"], registry=r)
        self.disk_free = Gauge("checkoutcache_disk_free_bytes", "Free bytes on the root's filesystem", registry=r)
        self.holds = Gauge("checkoutcache_holds", "Checkouts held through /v1/hold", registry=r)


@attrs.define
class HeldCheckout:
    hold: Hold
    expires_at: float


class Service:
    """Everything the HTTP layer calls; one per serve process."""

    def __init__(self, cache: Cache, config: Config, gc_interval: float, journal: str):
        self.cache = cache
        self.config = config
        self.gc_interval = gc_interval
        self.journal = journal
        self.metrics = Metrics()
        self.holds: dict[str, HeldCheckout] = {}
        self.holds_lock = threading.Lock()
        self.stopping = threading.Event()
        for name in ("max_checkouts", "max_bytes"):
            value = getattr(config, name)
            if value is not None:
                self.metrics.limit.labels(name).set(value)

    # ---------------------------------------------------------------- API
    def ensure(self, params: dict) -> Answer:
        wait = parse_duration(params.get("wait", 0), "wait")
        answer = self.cache.ensure(str(params.get("repo", "")), str(params.get("commit", "")), wait=wait,
                                   scope=str(params.get("scope", "default")))
        self.metrics.answers.labels(answer.state, answer.error or "").inc()
        return answer

    def hold(self, params: dict) -> tuple[int, dict]:
        ttl = parse_duration(params.get("ttl", DEFAULT_HOLD_TTL), "ttl")
        if not 0 < ttl <= MAX_HOLD_TTL:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"ttl must be 0 to {MAX_HOLD_TTL:g} seconds")
        held = self.cache.hold(str(params.get("repo", "")), str(params.get("commit", "")),
                               wait=parse_duration(params.get("wait", 0), "wait"),
                               scope=str(params.get("scope", "default")))
        if not held.held:
            return answer_status(held.answer), held.answer.to_json()
        hold_id = uuid.uuid4().hex
        with self.holds_lock:
            self.holds[hold_id] = HeldCheckout(held, time.monotonic() + ttl)
            self.metrics.holds.set(len(self.holds))
        return 200, {"hold": hold_id, "expires_in": ttl, **held.answer.to_json()}

    def release(self, params: dict) -> tuple[int, dict]:
        with self.holds_lock:
            held = self.holds.pop(str(params.get("hold", "")), None)
            self.metrics.holds.set(len(self.holds))
        if held is None:
            return 404, {"released": False, "error": "UNKNOWN_HOLD", "message": "no such hold (released or expired)",
                         "next": "hold again with POST /v1/hold"}
        held.hold.release()
        return 200, {"released": True}

    def expire_holds(self) -> None:
        now = time.monotonic()
        with self.holds_lock:
            expired = [k for k, v in self.holds.items() if v.expires_at <= now]
            for key in expired:
                self.holds.pop(key).hold.release()
            self.metrics.holds.set(len(self.holds))

    def release_all(self) -> None:
        with self.holds_lock:
            for held in self.holds.values():
                held.hold.release()
            self.holds.clear()

    def gc(self, params: dict) -> dict:
        config = self.config.with_overrides(**{k: params.get(k) for k in GC_SETTINGS})
        started = time.monotonic()
        try:
            report = run_gc(self.cache.paths, config, dry_run=bool(params.get("dry_run")))
        except Exception:
            self.metrics.gc_runs.labels("error").inc()
            raise
        self.metrics.gc_seconds.observe(time.monotonic() - started)
        self.metrics.gc_runs.labels("skipped" if report.skipped else "ok").inc()
        for removed in report.removed:
            self.metrics.evictions.labels(removed.reason).inc()
        if report.disk_after:
            self.metrics.disk_free.set(report.disk_after["free"])
        status = build_status(self.cache.paths, config)
        self.metrics.checkouts.set(status["totals"]["checkouts"])
        self.metrics.bytes.set(status["totals"]["bytes"])
        return report.to_json()

    def status(self) -> dict:
        return build_status(self.cache.paths, self.config)

    def health(self) -> tuple[bool, dict]:
        checks = {}
        try:
            init_root(self.cache.paths)
            probe = os.path.join(self.cache.paths.locks_dir, f".health-{os.getpid()}")
            with open(probe, "w") as handle:
                handle.write("ok")
            os.unlink(probe)
            checks["root_writable"] = True
        except (OSError, CheckoutCacheError) as exc:
            checks["root_writable"] = False
            checks["root_error"] = getattr(exc, "message", str(exc))
        try:
            held = locks.try_lock(os.path.join(self.cache.paths.locks_dir, "health.lock"))
            checks["locks_work"] = held is not None
            if held is not None:
                held.release()
        except (OSError, CheckoutCacheError):
            checks["locks_work"] = False
        import shutil

        checks["git"] = shutil.which("git") is not None
        try:
            import pygit2  # noqa: F401  (importable is the check)

            checks["pygit2"] = True
        except ImportError:
            checks["pygit2"] = False
        ok = checks["root_writable"] and checks["locks_work"] and (checks["git"] or checks["pygit2"])
        return ok, {"ok": ok, "checks": checks}

    # ---------------------------------------------------------------- background
    def follow_journal(self) -> None:
        """Count the clones this sidecar's workers report in their journal."""
        offset = 0
        while not self.stopping.wait(0.5):
            try:
                if offset > JOURNAL_ROTATE_BYTES:  # workers append with O_APPEND: they go on at the new end
                    os.truncate(self.journal, 0)
                    offset = 0
                with open(self.journal) as handle:
                    handle.seek(offset)
                    for line in handle:
                        offset += len(line.encode())
                        event = json.loads(line)
                        if event["event"] == "published":
                            self.metrics.clones.labels("published", "").inc()
                            self.metrics.clone_seconds.observe(event.get("seconds", 0))
                        elif event["event"] == "failed":
                            self.metrics.clones.labels("failed", event.get("error", "")).inc()
                        elif event["event"] == "started":
                            self.metrics.clones.labels("started", "").inc()
            except (OSError, ValueError, KeyError):
                continue

    def maintain(self) -> None:
        next_gc = time.monotonic() + self.gc_interval
        while not self.stopping.wait(1.0):
            self.expire_holds()
            if self.gc_interval > 0 and time.monotonic() >= next_gc:
                next_gc = time.monotonic() + self.gc_interval
                try:
                    self.gc({})
                except Exception:  # a failed scheduled gc is counted and retried next interval
                    log.exception("scheduled gc failed")


def answer_status(answer: Answer) -> int:
    if answer.state in HTTP_STATUS:
        return HTTP_STATUS[answer.state]
    return 400 if is_input_error(answer.error) else 503


def error_body(exc: CheckoutCacheError) -> tuple[int, dict]:
    answer = Answer.from_error(exc)
    return answer_status(answer), answer.to_json()


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
                self.send_json(answer_status(answer), answer.to_json(), headers)
            elif path == "/v1/status" and method == "GET":
                self.send_json(200, service.status())
            elif path == "/v1/gc" and method == "POST":
                self.send_json(200, service.gc(self.params()))
            elif path == "/v1/hold" and method == "POST":
                self.send_json(*service.hold(self.params()))
            elif path == "/v1/release" and method == "POST":
                self.send_json(*service.release(self.params()))
            else:
                self.send_json(404, {"error": "NOT_FOUND", "message": f"no endpoint {method} {path}",
                                     "next": "see the README's serve section for the /v1 endpoints"})
        except CheckoutCacheError as exc:
            self.send_json(*error_body(exc))
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # a bug: answered as one, the server goes on
            log.exception("request failed")
            self.send_json(*error_body(CheckoutCacheError("INTERNAL_ERROR", detail=type(exc).__name__)))
        finally:
            service.metrics.requests.labels(path if path.startswith(("/v1/", "/healthz", "/metrics"))
                                            else "other").observe(time.monotonic() - started)

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
