"""serve's HTTP API as an RSGI application (granian's own interface): routing,
admission, bodies, JSON answers, threads, the access log.

granian (Rust's hyper) owns the protocol: it parses requests, holds the
header deadline and the header size limits, frames bodies, closes idle
connections, and answers what it refuses before this code runs (400, 414,
431 with an empty body and `Connection: close`). Everything this code answers
is JSON: the `{error, message, next}` object for every error.

Every request is hostile until shown otherwise (the code under review can
reach this port or socket), so before any work:
- a request with an Origin header (a browser page) or, over a loopback TCP
  listener, a Host that is not the listen address (DNS rebinding) is refused
  (403); a wildcard listener (`0.0.0.0`, `--allow-remote`) takes any Host;
- every endpoint but /healthz, /readyz and /openapi.json needs the bearer
  token (401) over TCP; what a token may then do is the policy's (policy.py);
- a body is at most MAX_BODY bytes (413, refused before it is read), chunked
  or otherwise encoded bodies are refused (400), a body must arrive within
  BODY_DEADLINE, and JSON must be an object of valid Unicode strings.

Threads: the event loop answers a ready checkout inline (it never blocks:
`Service.ready_now`), and hands everything that may block to a pool: `quick`
(a not-ready ensure without `wait`, metrics), `waiting` (requests
that wait on a clone: at most --max-waiting, the next one SERVER_BUSY), `reports`
(status and workspaces: two threads, REPORTS_QUEUED at most), `upkeep`
(gc over the API, one at a time) and `probe` (/readyz). A request waiting on a
clone, or a report walking the store, thus never takes a thread a ready answer
or a new commit needs.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

from checkoutcache import signing
from checkoutcache.answers import Answer, State
from checkoutcache.credentials import strip_userinfo
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.serve import logs
from checkoutcache.serve.metrics import CONTENT_TYPE_LATEST, generate_latest
from checkoutcache.serve.policy import CAPABILITY_OF, Grant
from checkoutcache.serve.service import Service, Stopping, Waited, http_status

log = logging.getLogger("checkoutcache.serve")

MAX_BODY = 64 * 1024
BODY_DEADLINE = 5.0  # as granian's header deadline: a stalled body is closed as a stalled header is
READY_PROBE_DEADLINE = 2.0
REPORT_THREADS = 2
REPORTS_QUEUED = 16
RETRY_AFTER = "1"
# Each endpoint and its methods (the OpenAPI document says the same; a test compares).
# HEAD /metrics is answered as GET without a body (scrapers and load balancers check with HEAD).
ROUTES = {"/healthz": ("GET",), "/readyz": ("GET",), "/metrics": ("GET", "HEAD"), "/openapi.json": ("GET",),
          "/v1/ensure": ("GET", "POST"), "/v1/status": ("GET",), "/v1/gc": ("POST",), "/v1/hold": ("POST",),
          "/v1/release": ("POST",), "/v1/workspaces": ("GET",)}
ENDPOINTS = tuple(ROUTES)
PUBLIC = ("/healthz", "/readyz", "/openapi.json")
HEALTH_ONLY = ("/healthz", "/readyz", "/metrics")
# Probes and scrapes: one a few seconds from each kubelet and Prometheus. Their access
# lines are debug ones when they succeed (an INFO line each buried what a request was about).
QUIET = ("/healthz", "/readyz", "/metrics")
PUBLIC_GRANT = Grant("public", frozenset())
JSON = [("content-type", "application/json")]
CLOSE = ("connection", "close")
Reply = tuple[int, bytes, list[tuple[str, str]]]


class Listener(NamedTuple):
    """Where a request came in: the API over TCP (allowed_hosts: the Host headers a
    request may carry; None: any) or the Unix socket (tcp False), or the health port."""

    tcp: bool
    allowed_hosts: frozenset[str] | None
    health_only: bool = False


def allowed_hosts(host: str, port: int) -> frozenset[str] | None:
    """The Host headers a TCP request may carry: the listen address, and its loopback
    names when it is loopback; None (any) for a wildcard address (the operator chose
    remote clients, who name the host as they reach it)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None and address.is_unspecified:
        return None
    names = {f"[{host}]:{port}" if ":" in host else f"{host}:{port}"}
    if host == "localhost" or (address is not None and address.is_loopback):
        names |= {f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"}
    return frozenset(name.lower() for name in names)


class Pools:
    """The threads blocking work runs on (see the module docstring)."""

    def __init__(self, max_waiting: int, max_waiting_per_caller: int | None = None):
        self.quick = ThreadPoolExecutor(16, thread_name_prefix="cc-quick")
        self.waiting = ThreadPoolExecutor(max(1, max_waiting), thread_name_prefix="cc-wait")
        self.upkeep = ThreadPoolExecutor(1, thread_name_prefix="cc-upkeep")
        self.probe = ThreadPoolExecutor(1, thread_name_prefix="cc-probe")
        # status and workspaces walk the store and the reviews' volume: never on the threads a
        # new commit's ensure or a scrape needs, and never more than REPORTS_QUEUED waiting.
        self.reports = ThreadPoolExecutor(REPORT_THREADS, thread_name_prefix="cc-report")
        self.max_waiting = max_waiting
        self.max_waiting_per_caller = max_waiting if max_waiting_per_caller is None else max_waiting_per_caller
        self.in_waiting = 0  # touched on the event loop only
        self.waiting_by: dict[str, int] = {}  # caller (a grant's name) -> its requests waiting; likewise
        self.in_reports = 0  # likewise

    def shutdown(self) -> None:
        for pool in (self.quick, self.waiting, self.upkeep, self.probe, self.reports):
            pool.shutdown(wait=False, cancel_futures=True)


def keeps_alive(listener: Listener, grant: Grant | None) -> bool:
    """Whether the connection stays open after this answer: only for a request that showed
    who it is (a valid token, or the Unix socket's permissions when it needs no token). A
    connection held open costs one of --max-connections slots until it has been idle 5 s,
    so a client that never authenticated (a public endpoint, a 401, a refused Origin, the
    health port) holds one for a single request, never for as long as it keeps asking:
    floods of them cannot keep a ready answer waiting for a slot."""
    return not listener.health_only and grant is not None and grant is not PUBLIC_GRANT


def error_reply(exc: CheckoutCacheError, headers: list[tuple[str, str]] | None = None) -> Reply:
    answer = Answer.from_error(exc)
    return http_status(answer), json_bytes(answer.to_json()), JSON + (headers or [])


def json_bytes(value: dict) -> bytes:
    return (json.dumps(value, sort_keys=True) + "\n").encode()


class Request(Waited):
    """What the access log and the latency histogram say of one request: who asked,
    what about (repository without credentials, commit), the answer's state and kind,
    and its error code."""

    __slots__ = ("grant", "error", "why", "kind", "repo", "commit", "state", "signature", "token")

    def __init__(self):
        super().__init__()
        self.grant: Grant | None = None
        # A signed request (signing.py): its signature, and the token that made it (to prove the answer).
        self.signature: signing.Signature | None = None
        self.token: str | None = None
        self.error: str | None = None
        self.why: str | None = None
        self.kind: str | None = None  # metrics.KINDS; None: from the HTTP status
        self.repo: str | None = None
        self.commit: str | None = None
        self.state: str | None = None

    def about(self, params: dict) -> None:
        """What the request names (kept raw: made fit for a log line only when one is written)."""
        repo, commit = params.get("repo"), params.get("commit")
        if isinstance(repo, str) and repo:
            self.repo = repo
        if isinstance(commit, str) and commit:
            self.commit = commit

    def answered(self, state: str, error: str | None, at_once: bool) -> None:
        """A checkout's answer: its state, its error code, and its kind (ready at once or
        after waiting on a clone, cloning, failed)."""
        self.state = str(state)
        if error:
            self.error = error
        if state == State.READY:
            self.kind = "waited" if self.waited and not at_once else "ready"
        else:
            self.kind = "cloning" if state == State.CLONING else "failed"


def loggable_repo(repo: str) -> str:
    """A repository as a log line may show it: credentials, a query and a fragment removed,
    at most a line's worth."""
    return strip_userinfo(repo).split("?", 1)[0].split("#", 1)[0][:300]


class Api:
    """One listener's application (RSGI: `await app(scope, proto)`)."""

    def __init__(self, service: Service, listener: Listener, pools: Pools, openapi: bytes):
        self.service = service
        self.listener = listener
        self.pools = pools
        self.openapi = openapi

    async def __call__(self, scope, proto) -> None:
        if scope.proto != "http":
            return
        started = time.monotonic()
        request = Request()
        try:
            status, body, headers = await self.answer(scope, proto, request)
        except Exception:  # a bug: answered as one, logged with its traceback, the server goes on
            log.exception("request failed: %s %s", scope.method, scope.path[:200])
            status, body, headers = error_reply(CheckoutCacheError("INTERNAL_ERROR", detail="see serve's log"))
            request.error = "INTERNAL_ERROR"
        if scope.method == "HEAD" and status == 200:
            body = b""  # as GET, without the body (its length is said)
            headers = headers + [("content-length", "0")]
        if request.token is not None and request.signature is not None:  # the answer is ours, provably
            headers = headers + [(signing.PROOF_HEADER, signing.answer_proof(request.token, request.signature.mac,
                                                                             status, body))]
        if not keeps_alive(self.listener, request.grant) and CLOSE not in headers:
            headers = headers + [CLOSE]
        proto.response_bytes(status, headers, body)
        seconds = time.monotonic() - started
        endpoint = scope.path if scope.path in ROUTES else "other"  # only known endpoints become labels
        kind = request.kind or ("failed" if status >= 400 else "ok")
        self.service.metrics.request(endpoint, kind, seconds)
        quiet = endpoint in QUIET and status < 400
        if logs.access_enabled(debug=quiet):
            grant = request.grant
            fields = {"method": scope.method[:16], "endpoint": endpoint, "status": status,
                      "ms": round(seconds * 1000, 2), "listener": "health" if self.listener.health_only else
                      ("tcp" if self.listener.tcp else "unix")}
            if grant is not None and grant is not PUBLIC_GRANT:
                fields.update(token=grant.name, scopes=sorted(grant.scopes) if grant.scopes is not None else "*")
            if request.repo is not None:
                fields["repo"] = loggable_repo(request.repo)
            if request.commit is not None:
                fields["commit"] = request.commit[:80]
            if request.state is not None:
                fields["state"] = request.state
            if request.error:
                fields["error"] = request.error
            if request.why:
                fields["refused"] = request.why
            logs.access(f"{fields['method']} {endpoint} {status}", fields, debug=quiet)

    # ------------------------------------------------------------ admission
    async def answer(self, scope, proto, request: Request) -> Reply:
        method, path = scope.method, scope.path
        try:
            if self.listener.health_only and path not in HEALTH_ONLY:
                raise CheckoutCacheError("NOT_FOUND", what=f"{method[:16]} {path[:100]} (this port serves "
                                                           f"{', '.join(HEALTH_ONLY)})")
            request.grant = self.admit(scope, request)
            if path in ROUTES and method not in ROUTES[path]:
                return error_reply(CheckoutCacheError("METHOD_NOT_ALLOWED", method=method[:16], path=path),
                                   [("allow", ", ".join(ROUTES[path]))])
            return await self.route(scope, proto, request.grant, request)
        except CheckoutCacheError as exc:
            request.error = exc.code
            headers = []
            if exc.code == "UNAUTHORIZED":
                headers.append(("www-authenticate", 'Bearer realm="checkoutcache"'))
            elif exc.code in ("TOO_MANY_HOLDS", "SERVER_BUSY"):
                headers.append(("retry-after", "5" if exc.code == "TOO_MANY_HOLDS" else RETRY_AFTER))
            elif exc.code in ("PAYLOAD_TOO_LARGE",) or (exc.code == "BAD_ARGUMENT" and getattr(exc, "close", False)):
                headers.append(CLOSE)  # what follows on this connection cannot be framed
            return error_reply(exc, headers)
        except Stopping:
            request.error = "SHUTTING_DOWN"
            return error_reply(CheckoutCacheError("SHUTTING_DOWN"), [("retry-after", RETRY_AFTER)])

    def admit(self, scope, request: Request) -> Grant:
        """Origin, Host and token checks: who is asking, before any work. A signed request's
        signature is looked at first, so that every answer to it, a refusal included, carries
        the proof its caller checks (signing.py); a bad signature counts only where a token
        is needed."""
        headers = scope.headers
        authorization = headers.get("authorization")
        signed: Grant | None = None
        refused: CheckoutCacheError | None = None
        if authorization and authorization.startswith(signing.SCHEME + " ") and not self.listener.health_only:
            try:
                signed = self.signed(scope, authorization[len(signing.SCHEME) + 1:], request)
            except CheckoutCacheError as exc:
                refused = exc
        if headers.get("origin") is not None:
            request.why = "origin"
            self.service.metrics.refused.labels("origin").inc()
            raise CheckoutCacheError("FORBIDDEN_ORIGIN", why="an Origin header")
        allowed = self.listener.allowed_hosts
        if self.listener.tcp and allowed is not None:
            host = (headers.get("host") or scope.authority or "").lower()
            if host not in allowed:
                request.why = "host"
                self.service.metrics.refused.labels("host").inc()
                raise CheckoutCacheError("FORBIDDEN_ORIGIN", why=f"Host {host[:80]!r}")
        if scope.path in PUBLIC or self.listener.health_only:
            return PUBLIC_GRANT  # no token needed (a signed caller's answer is proved all the same)
        try:
            if refused is not None:
                raise refused
            grant = signed if signed is not None else self.service.policy.authenticate(authorization,
                                                                                        self.listener.tcp)
        except CheckoutCacheError:
            request.why = "token"
            self.service.metrics.refused.labels("token").inc()
            raise
        capability = CAPABILITY_OF.get(scope.path)
        if capability is not None:
            try:
                self.service.policy.check_call(grant, capability)
            except CheckoutCacheError:
                request.why = "endpoint"
                self.service.metrics.refused.labels("endpoint").inc()
                raise
        return grant

    def signed(self, scope, value: str, request: Request) -> Grant:
        """The grant of a signed request (signing.py), or UNAUTHORIZED: a token in force made it
        for this method and target, within the window, with a nonce never seen. Its body is
        checked against the signed digest when it is read (params), or here when it has none."""
        signature = signing.parse_signature(value)
        if signature is None:
            raise CheckoutCacheError("UNAUTHORIZED")
        target = scope.path + (f"?{scope.query_string}" if scope.query_string else "")
        token, grant = self.service.policy.verify_signature(signature, scope.method, target, time.time())
        if not self.service.first_use_of(grant.name, signature.nonce):
            raise CheckoutCacheError("UNAUTHORIZED")  # a replay: that request was answered already
        if scope.method != "POST" and signature.body != signing.EMPTY_BODY:
            raise CheckoutCacheError("UNAUTHORIZED")
        request.signature, request.token = signature, token
        return grant

    # ------------------------------------------------------------ routes
    async def route(self, scope, proto, grant: Grant, request: Request) -> Reply:
        path, service = scope.path, self.service
        if path == "/healthz":
            ok, body = service.health()
            return 200 if ok else 503, json_bytes(body), JSON
        if path == "/readyz":
            try:
                ok, body = await asyncio.wait_for(self.run(self.pools.probe, service.readiness),
                                                  READY_PROBE_DEADLINE)
            except asyncio.TimeoutError:
                ok, body = False, {"ok": False, "checks": {"root_answers_within_seconds": READY_PROBE_DEADLINE}}
            return 200 if ok else 503, json_bytes(body), JSON
        if path == "/openapi.json":
            return 200, self.openapi, JSON
        if path == "/metrics":
            data = await self.run(self.pools.quick, generate_latest, service.metrics.registry)
            return 200, data, [("content-type", CONTENT_TYPE_LATEST)]
        if service.stopping.is_set():
            raise Stopping()
        if path == "/v1/ensure":
            params = await self.params(scope, proto, request)
            request.about(params)
            answer, wait = service.ready_now(params, grant)
            at_once = answer is not None
            if answer is None:
                answer = await self.blocking(wait, service.ensure, params, grant, request)
            request.answered(answer.state, answer.error, at_once)
            headers = JSON + ([("retry-after", str(answer.retry_after))] if answer.retry_after else [])
            return http_status(answer), json_bytes(answer.to_json()), headers
        if path == "/v1/hold":
            params = await self.params(scope, proto, request)
            request.about(params)
            status, body = await self.blocking(self.asked_wait(params), service.hold, params, grant, request)
            if isinstance(body.get("state"), str):
                request.answered(body["state"], body.get("error"), False)
            return status, json_bytes(body), JSON
        if path == "/v1/release":
            status, body = service.release(await self.params(scope, proto, request), grant)
            return status, json_bytes(body), JSON
        if path == "/v1/status":
            return 200, json_bytes(await self.report(service.status, grant)), JSON
        if path == "/v1/workspaces":
            return 200, json_bytes(await self.report(service.workspaces, grant)), JSON
        if path == "/v1/gc":
            params = await self.params(scope, proto, request)
            return 200, json_bytes(await self.run(self.pools.upkeep, service.gc, params, True, grant)), JSON
        raise CheckoutCacheError("NOT_FOUND", what=f"{scope.method[:16]} {path[:100]}")

    @staticmethod
    def asked_wait(params: dict) -> float:
        try:
            from checkoutcache.units import parse_duration

            return parse_duration(params.get("wait", 0), "wait")
        except CheckoutCacheError:
            return 0.0  # the service answers the input error itself

    async def blocking(self, wait: float, fn: Callable[..., Any], *args: Any) -> Any:
        """fn on the pool its wait calls for: `waiting` (bounded in all, and per caller: one
        caller's parked waits never take every slot) for a wait on a clone."""
        if wait <= 0:
            return await self.run(self.pools.quick, fn, *args)
        pools = self.pools
        caller = args[1].name if len(args) > 1 and isinstance(args[1], Grant) else ""
        mine = pools.waiting_by.get(caller, 0)
        if pools.in_waiting >= pools.max_waiting:
            raise CheckoutCacheError("SERVER_BUSY", why=f"{pools.max_waiting} requests wait on clones already")
        if mine >= pools.max_waiting_per_caller:
            raise CheckoutCacheError("SERVER_BUSY", why=f"{mine} requests of this token wait on clones already "
                                                        f"(at most {pools.max_waiting_per_caller} of "
                                                        f"{pools.max_waiting})")
        pools.in_waiting += 1
        pools.waiting_by[caller] = mine + 1
        self.service.metrics.waiting.set(pools.in_waiting)
        try:
            return await self.run(pools.waiting, fn, *args)
        finally:
            pools.in_waiting -= 1
            pools.waiting_by[caller] -= 1
            if not pools.waiting_by[caller]:
                del pools.waiting_by[caller]
            self.service.metrics.waiting.set(pools.in_waiting)

    async def report(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn on the reports pool, at most REPORTS_QUEUED of them taken at once (the next SERVER_BUSY)."""
        pools = self.pools
        if pools.in_reports >= REPORTS_QUEUED:
            raise CheckoutCacheError("SERVER_BUSY", why=f"{REPORTS_QUEUED} status or workspaces requests are in "
                                                        f"progress already")
        pools.in_reports += 1
        try:
            return await self.run(pools.reports, fn, *args)
        finally:
            pools.in_reports -= 1

    @staticmethod
    async def run(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    # ------------------------------------------------------------ bodies
    async def params(self, scope, proto, request: Request | None = None) -> dict:
        """The query string's fields, then the JSON body's (POST). A signed request's body must
        be the one it signed (UNAUTHORIZED otherwise: a MAC seen on the way is no licence for
        another body)."""
        data = await self.body(scope, proto)
        if request is not None and request.signature is not None and \
                signing.sha256_hex(data) != request.signature.body:
            raise closing(CheckoutCacheError("UNAUTHORIZED"))
        return self.fields_of(scope, data)

    async def body(self, scope, proto) -> bytes:
        """A POST's body, bounded in size and time (b"" for other methods and empty bodies)."""
        if scope.method != "POST":
            return b""
        headers = scope.headers
        if headers.get("transfer-encoding") is not None:
            raise closing(CheckoutCacheError("BAD_ARGUMENT", what="chunked or encoded request bodies are not "
                                                                  "accepted; send Content-Length"))
        length = headers.get("content-length") or "0"
        if not length.isascii() or not length.isdigit():
            raise closing(CheckoutCacheError("BAD_ARGUMENT", what="Content-Length must be one non-negative "
                                                                  "whole number"))
        if len(length) > 12 or int(length) > MAX_BODY:
            raise CheckoutCacheError("PAYLOAD_TOO_LARGE", limit=MAX_BODY)
        if int(length) == 0:
            return b""
        try:
            # proto() raises on a body that ends early (iterating it would not).
            data = await asyncio.wait_for(proto(), BODY_DEADLINE)
        except asyncio.TimeoutError:
            raise closing(CheckoutCacheError("BAD_ARGUMENT", what=f"the body did not arrive within "
                                                                  f"{BODY_DEADLINE:g}s")) from None
        except RuntimeError:  # RSGIProtocolClosed: the body ended early or was malformed
            raise closing(CheckoutCacheError("BAD_ARGUMENT", what="the body ended early")) from None
        if len(data) != int(length):
            raise closing(CheckoutCacheError("BAD_ARGUMENT", what="the body ended early"))
        return data

    @staticmethod
    def fields_of(scope, data: bytes) -> dict:
        """The query string's fields, then those of the JSON object in data (if any)."""
        pairs = urllib.parse.parse_qsl(scope.query_string, errors="replace")
        query: dict[str, Any] = dict(pairs)
        if any(name == "sparse" for name, _ in pairs):  # repeated: one directory each
            query["sparse"] = [value for name, value in pairs if name == "sparse"]
        if not data:
            return query
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):
            raise CheckoutCacheError("BAD_ARGUMENT", what="the request body is not JSON") from None
        if not isinstance(body, dict):
            raise CheckoutCacheError("BAD_ARGUMENT", what="the request body must be a JSON object")
        try:  # JSON's \\ud800 escapes make strings no UTF-8 can hold: refused here, never deeper
            for value in body.values():
                if isinstance(value, str):
                    value.encode("utf-8")
        except UnicodeEncodeError:
            raise CheckoutCacheError("BAD_ARGUMENT", what="the request body holds a lone surrogate "
                                                          "(not valid Unicode)") from None
        query.update(body)
        return query


def closing(exc: CheckoutCacheError) -> CheckoutCacheError:
    """An error after which the connection's bytes cannot be framed: answered with Connection: close."""
    exc.close = True  # type: ignore[attr-defined]
    return exc
