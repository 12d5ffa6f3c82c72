#!/usr/bin/env python3
"""Candidate HTTP servers for `checkoutcache serve`, side by side on one minimal app.

    python benchmarks/serve_stacks.py --quick                 # about two minutes
    python benchmarks/serve_stacks.py --rounds 3 --json-out stacks.json
    python benchmarks/serve_stacks.py --only embed,uvicorn-httptools

What each stack serves is the same MINIMAL app (this file: `asgi_app`,
`wsgi_app`), doing what our ready answer does in syscalls: the bearer token
(constant-time compare), a JSON body (64 KiB cap), open the checkout's marker
O_CLOEXEC, flock it shared, fstat+stat, pread its JSON record, lstat the
recorded top-level names, utime the marker, close, a small JSON answer. Also
/hello (no work at all: "what a minimal app does on the same server"),
/healthz, /readyz, /metrics, and a long-poll (`POST /v1/ensure?longpoll=S`)
that blocks in synchronous code on a file lock the benchmark holds (a clone
that takes minutes), in its own bounded thread pool on the ASGI stacks.

For each stack, three measurements:
1. load (wrk -t1, 64 keep-alive connections): /hello, then ready answers;
   rounds interleaved across stacks;
2. attack: 1,000 idle + 20 header-flooding unauthenticated connections and 64
   waiting long-polls held open (a helper process), then /healthz and an
   authenticated ready answer timed on fresh connections, and the RSS
   (VmRSS, VmHWM from /proc/<pid>/status) summed over the server's processes;
3. battery: malformed and hostile requests over raw sockets: what comes back
   (status line, content type), whether the connection closes, whether a
   refused request's body is answered as a next request (`/smuggled`);
then SIGTERM with two long-polls waiting: what they get, and how long the
process takes to exit.

Stacks: granian embedded in our own asyncio loop and process (granian.server.
embed: the API on TCP + a Unix socket (0660) + a health-only second port, our
own SIGTERM/SIGCHLD handling: the recipe this file argues for), granian's CLI
(ASGI and WSGI), uvicorn (httptools, h11), hypercorn. `--with-serve` adds
today's `checkoutcache serve` through `serve_variant` (the slot for our own
server: any command that knows its URL and token).

Self-contained: its own root and marker in a temporary directory (the
"checkout" is a repository made with git), servers on 127.0.0.1 on free ports,
no network beyond loopback. Needs wrk (`apt-get install wrk`) and the servers:
pip install granian uvicorn httptools h11 hypercorn uvloop
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import fcntl
import hmac
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT = os.path.dirname(HERE)
PY = sys.executable
MAX_BODY = 64 * 1024
CONNECTIONS = 64
BAR_P99_MS = 20.0
BAR_READY_VS_HELLO = 0.5
BAR_ATTACK_MS = 250.0
BAR_RSS_MIB = 250.0
PROBE_TIMEOUT = 2.0
MODULES = ("granian", "uvicorn", "httptools", "h11", "hypercorn", "uvloop")


# =============================================================== the minimal app
# Runs inside each server's process, configured by SERVE_STACKS_* in the environment.

class AppState:
    def __init__(self):
        self.root = os.environ["SERVE_STACKS_ROOT"]
        self.token = os.environ["SERVE_STACKS_TOKEN"].encode()
        self.marker = os.path.join(self.root, "marker.json")
        self.checkout = os.path.join(self.root, "checkout")
        self.clone_lock = os.path.join(self.root, "clone.lock")
        self.ready_mode = os.environ.get("SERVE_STACKS_READY", "inline")  # inline | pool (ASGI only)
        self.shutdown = threading.Event()  # long-polls answer 503 once set
        self.longpoll_max = int(os.environ.get("SERVE_STACKS_LONGPOLL_MAX", "256"))
        self.longpolls = 0
        self.lock = threading.Lock()
        # Two pools: a long-poll never takes a thread that a quick answer needs.
        self.ready_pool = ThreadPoolExecutor(8, thread_name_prefix="ready")
        self.longpoll_pool = ThreadPoolExecutor(self.longpoll_max, thread_name_prefix="longpoll")
        self.requests = 0
        self.body_deadline = float(os.environ.get("SERVE_STACKS_BODY_DEADLINE", "10"))


_STATE: AppState | None = None


def state() -> AppState:
    global _STATE
    if _STATE is None:
        _STATE = AppState()
    return _STATE


def _json(status: int, data: dict, extra: list | None = None) -> tuple[int, bytes, list]:
    return status, (json.dumps(data, sort_keys=True) + "\n").encode(), extra or []


def authorized(st: AppState, authorization: bytes | None) -> bool:
    if not authorization or not authorization.startswith(b"Bearer "):
        return False
    return hmac.compare_digest(authorization[7:].strip(), st.token)


def ready_answer(st: AppState) -> tuple[int, bytes, list]:
    """The syscalls of a ready answer (store/ready.py): open, flock shared, fstat+stat,
    pread the record, lstat the top names, utime, close."""
    fd = os.open(st.marker, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        if not os.path.samestat(os.fstat(fd), os.stat(st.marker)):
            return _json(503, {"state": "moved"})
        record = json.loads(os.pread(fd, 1 << 16, 0))
        for name in [".git", *record["top"]]:
            os.lstat(os.path.join(st.checkout, name))
        os.utime(fd)
    finally:
        os.close(fd)
    return _json(200, {"state": "ready", "path": st.checkout, "commit": record["commit"]})


def longpoll_wait(st: AppState, seconds: float) -> tuple[int, bytes, list]:
    """Blocks (in a thread) until the clone lock is free, the server shuts down, or time is up."""
    deadline = time.monotonic() + seconds
    fd = os.open(st.clone_lock, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            if st.shutdown.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
                return _json(503, {"error": "SHUTTING_DOWN"}, [(b"retry-after", b"5")])
            if time.monotonic() >= deadline:
                return _json(202, {"state": "pending"}, [(b"retry-after", b"5")])
    finally:
        os.close(fd)
    return ready_answer(st)


CHUNKED_REFUSED = (400, b'{"error": "BAD_ARGUMENT", "what": "send Content-Length, not a chunked body"}\n',
                   [(b"connection", b"close")])


def parse_body(body: bytes) -> dict | tuple[int, bytes, list]:
    if not body:
        return {}
    try:
        params = json.loads(body)
    except (ValueError, RecursionError):
        return _json(400, {"error": "BAD_ARGUMENT", "what": "the request body is not JSON"})
    if not isinstance(params, dict):
        return _json(400, {"error": "BAD_ARGUMENT", "what": "the body must be a JSON object"})
    return params


def route(method: str, path: str) -> str:
    """Which handler: hello, health, metrics, ensure, 405 or 404."""
    if path == "/hello":
        return "hello"
    if path in ("/healthz", "/readyz"):
        return "health"
    if path == "/metrics":
        return "metrics"
    if path == "/v1/ensure":
        return "ensure" if method == "POST" else "method"
    return "missing"


def simple(kind: str, st: AppState, path: str) -> tuple[int, bytes, list]:
    if kind == "hello":
        return 200, b'{"ok": true}\n', []
    if kind == "health":
        return 200, b'{"status": "ok"}\n', []
    if kind == "metrics":
        return 200, f"requests_total {st.requests}\n".encode(), [(b"content-type", b"text/plain; version=0.0.4")]
    if kind == "method":
        return _json(405, {"error": "METHOD_NOT_ALLOWED"})
    return _json(404, {"error": "NOT_FOUND", "path": path[:200]})


def _longpoll_seconds(query: bytes) -> float | None:
    m = re.search(rb"(?:^|&)longpoll=(\d{1,4})(?:&|$)", query)
    return float(m.group(1)) if m else None


async def asgi_app(scope, receive, send) -> None:
    """The minimal app as ASGI. Sync work: ready answers inline (or in the ready pool),
    long-polls in their own bounded pool."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                state()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                state().shutdown.set()
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    st = state()
    st.requests += 1
    method, path = scope["method"], scope["path"]
    kind = route(method, path)
    if scope.get("checkoutcache.health_only") and kind not in ("health", "metrics"):
        kind = "missing"
    if kind != "ensure":
        status, data, extra = simple(kind, st, path)
    else:
        status, data, extra = await asgi_ensure(st, scope, receive)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if extra and extra[0][0] == b"content-type":
        headers = headers[1:]
    await send({"type": "http.response.start", "status": status, "headers": headers + extra})
    await send({"type": "http.response.body", "body": data})


async def asgi_ensure(st: AppState, scope, receive) -> tuple[int, bytes, list]:
    headers = dict(scope["headers"])
    if not authorized(st, headers.get(b"authorization")):
        return _json(401, {"error": "UNAUTHORIZED"}, [(b"www-authenticate", b'Bearer realm="checkoutcache"')])
    if b"transfer-encoding" in headers:
        return CHUNKED_REFUSED  # as serve today: a body's length is known before it is read
    length = headers.get(b"content-length", b"0")
    if not length.isdigit() or int(length) > MAX_BODY:
        # not read: the server must not take what follows as a next request
        return _json(413, {"error": "PAYLOAD_TOO_LARGE"}, [(b"connection", b"close")])
    chunks, size, more = [], 0, True
    deadline = time.monotonic() + st.body_deadline  # no ASGI server bounds a body's arrival: the app does
    while more:
        try:
            message = await asyncio.wait_for(receive(), max(0.001, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return _json(408, {"error": "BODY_TIMEOUT"}, [(b"connection", b"close")])
        if message["type"] == "http.disconnect":
            return _json(400, {"error": "DISCONNECTED"})
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return _json(413, {"error": "PAYLOAD_TOO_LARGE"}, [(b"connection", b"close")])
        chunks.append(chunk)
        more = message.get("more_body", False)
    if size != int(length):
        return _json(400, {"error": "BAD_ARGUMENT", "what": "the body ended early"}, [(b"connection", b"close")])
    params = parse_body(b"".join(chunks))
    if isinstance(params, tuple):
        return params
    loop = asyncio.get_running_loop()
    wait = _longpoll_seconds(scope.get("query_string", b""))
    if wait is not None:
        with st.lock:
            if st.longpolls >= st.longpoll_max:
                return _json(503, {"error": "SERVER_BUSY"}, [(b"retry-after", b"1")])
            st.longpolls += 1
        try:
            return await loop.run_in_executor(st.longpoll_pool, longpoll_wait, st, wait)
        finally:
            with st.lock:
                st.longpolls -= 1
    if st.ready_mode == "pool":
        return await loop.run_in_executor(st.ready_pool, ready_answer, st)
    return ready_answer(st)


def make_rsgi_app(health_only: bool = False):
    """The minimal app as RSGI (granian's own interface: no scope dicts, no send messages)."""
    async def rsgi_app(scope, proto) -> None:
        st = state()
        st.requests += 1
        kind = route(scope.method, scope.path)
        if health_only and kind not in ("health", "metrics"):
            kind = "missing"
        if kind != "ensure":
            status, data, extra = simple(kind, st, scope.path)
        else:
            status, data, extra = await rsgi_ensure(st, scope, proto)
        headers = [] if extra and extra[0][0] == b"content-type" else [("content-type", "application/json")]
        proto.response_bytes(status, headers + [(k.decode(), v.decode()) for k, v in extra], data)
    return rsgi_app


async def rsgi_ensure(st: AppState, scope, proto) -> tuple[int, bytes, list]:
    h = scope.headers
    if not authorized(st, (h.get("authorization") or "").encode("latin-1")):
        return _json(401, {"error": "UNAUTHORIZED"}, [(b"www-authenticate", b'Bearer realm="checkoutcache"')])
    if "transfer-encoding" in h:
        return CHUNKED_REFUSED
    length = h.get("content-length") or "0"
    if not length.isdigit() or int(length) > MAX_BODY:
        return _json(413, {"error": "PAYLOAD_TOO_LARGE"}, [(b"connection", b"close")])
    # `await proto()`, not `async for chunk in proto`: the iterator ends quietly on a
    # truncated or malformed body (the app would see a short body); the call raises.
    try:
        body = await asyncio.wait_for(proto(), st.body_deadline) if int(length) else b""
    except asyncio.TimeoutError:
        return _json(408, {"error": "BODY_TIMEOUT"}, [(b"connection", b"close")])
    except RuntimeError:  # RSGIProtocolClosed: the body ended early or was malformed
        return _json(400, {"error": "BAD_ARGUMENT", "what": "the body ended early"}, [(b"connection", b"close")])
    if len(body) != int(length):
        return _json(400, {"error": "BAD_ARGUMENT", "what": "the body ended early"}, [(b"connection", b"close")])
    params = parse_body(body)
    if isinstance(params, tuple):
        return params
    wait = _longpoll_seconds(scope.query_string.encode())
    if wait is not None:
        with st.lock:
            if st.longpolls >= st.longpoll_max:
                return _json(503, {"error": "SERVER_BUSY"}, [(b"retry-after", b"1")])
            st.longpolls += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(st.longpoll_pool, longpoll_wait, st, wait)
        finally:
            with st.lock:
                st.longpolls -= 1
    if st.ready_mode == "pool":
        return await asyncio.get_running_loop().run_in_executor(st.ready_pool, ready_answer, st)
    return ready_answer(st)


def wsgi_app(environ, start_response):
    """The minimal app as WSGI: everything, long-polls too, on the server's blocking threads."""
    st = state()
    st.requests += 1
    method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
    kind = route(method, path)
    if kind != "ensure":
        status, data, extra = simple(kind, st, path)
    else:
        status, data, extra = wsgi_ensure(st, environ)
    names = {k for k, _ in extra}
    headers = ([] if b"content-type" in names else [("Content-Type", "application/json")])
    headers += [("Content-Length", str(len(data)))] + [(k.decode(), v.decode()) for k, v in extra]
    start_response(f"{status} {STATUS_TEXT.get(status, 'X')}", headers)
    return [data]


STATUS_TEXT = {200: "OK", 202: "Accepted", 400: "Bad Request", 408: "Request Timeout", 401: "Unauthorized",
               404: "Not Found",
               405: "Method Not Allowed", 413: "Payload Too Large", 503: "Service Unavailable"}


def wsgi_ensure(st: AppState, environ) -> tuple[int, bytes, list]:
    if not authorized(st, (environ.get("HTTP_AUTHORIZATION") or "").encode("latin-1")):
        return _json(401, {"error": "UNAUTHORIZED"}, [(b"www-authenticate", b'Bearer realm="checkoutcache"')])
    if environ.get("HTTP_TRANSFER_ENCODING"):
        return CHUNKED_REFUSED
    length = environ.get("CONTENT_LENGTH") or "0"
    if not length.isdigit() or int(length) > MAX_BODY:
        return _json(413, {"error": "PAYLOAD_TOO_LARGE"}, [(b"connection", b"close")])
    params = parse_body(environ["wsgi.input"].read(int(length)) if int(length) else b"")
    if isinstance(params, tuple):
        return params
    wait = _longpoll_seconds(environ.get("QUERY_STRING", "").encode())
    if wait is not None:
        return longpoll_wait(st, wait)
    return ready_answer(st)


# =============================================================== granian embedded: the recipe
# `python serve_stacks.py --_embed SPEC`: one process, our asyncio loop, granian's
# Rust HTTP/1 on three listeners, our signals, our reaper, our pools.

PR_SET_CHILD_SUBREAPER = 36


class Reaper:
    """PID 1 / subreaper duty without stealing our own children's exit codes: every
    half second, reap zombie children that are not ours (not registered) and have been
    zombies for longer than `grace` (our own Popen.wait() reaps its child at once)."""

    def __init__(self, grace: float = 0.5):
        self.grace = grace
        self.own: set[int] = set()  # pids our code spawned and waits for itself
        self.seen: dict[int, float] = {}
        self.reaped = 0

    def children(self) -> list[int]:
        pids = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/children") as handle:
                    pids += [int(p) for p in handle.read().split()]
            except OSError:
                pass
        return pids

    def sweep(self) -> None:
        now = time.monotonic()
        for pid in self.children():
            try:
                with open(f"/proc/{pid}/stat") as handle:
                    zombie = handle.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                continue
            if not zombie or pid in self.own:
                continue
            first = self.seen.setdefault(pid, now)
            if now - first >= self.grace:
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        self.reaped += 1
                except ChildProcessError:
                    pass
                self.seen.pop(pid, None)


def embed_main(spec: dict) -> int:
    """The recipe, runnable: see the module docstring and benchmarks/README.md."""
    import logging

    from granian.constants import HTTPModes, Interfaces
    from granian.http import HTTP1Settings
    from granian.server.embed import Server

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("prctl(PR_SET_CHILD_SUBREAPER) failed", file=sys.stderr)
    reaper = Reaper()
    access = logging.getLogger("checkoutcache.access")  # off in the benchmark; the cost of the call stays
    os.environ["SERVE_STACKS_READY"] = spec.get("ready", "inline")
    st = state()

    def with_access_log(app, health_only: bool):
        async def logged(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            started, status = time.monotonic(), [0]

            async def send_and_note(message):
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            if health_only:
                scope["checkoutcache.health_only"] = True
            try:
                await app(scope, receive, send_and_note)
            finally:
                if access.isEnabledFor(logging.INFO):
                    access.info("%s %s %d %.1fms", scope["method"], scope["path"], status[0],
                                (time.monotonic() - started) * 1000)
        return logged

    class NotingProto:
        """An RSGI protocol that notes the status for the access log."""
        __slots__ = ("inner", "status")

        def __init__(self, inner):
            self.inner, self.status = inner, 0

        def __call__(self):
            return self.inner()

        def __aiter__(self):
            return self.inner.__aiter__()

        def response_bytes(self, status, headers, body):
            self.status = status
            return self.inner.response_bytes(status, headers, body)

    def rsgi_with_access_log(app):
        async def logged(scope, proto):
            started, noted = time.monotonic(), NotingProto(proto)
            try:
                await app(scope, noted)
            finally:
                if access.isEnabledFor(logging.INFO):
                    access.info("%s %s %d %.1fms", scope.method, scope.path, noted.status,
                                (time.monotonic() - started) * 1000)
        return logged

    h1 = HTTP1Settings(header_read_timeout=int(spec["header_timeout"] * 1000), keep_alive=True,
                       max_buffer_size=spec.get("max_buffer", 64 * 1024))
    rsgi = spec.get("interface") == "rsgi"
    common = dict(interface=Interfaces.RSGI if rsgi else Interfaces.ASGINL, http=HTTPModes.http1, websockets=False,
                  http1_settings=h1,
                  backlog=2048, backpressure=spec.get("backpressure", 4096), log_level="warning")
    api = rsgi_with_access_log(make_rsgi_app(False)) if rsgi else with_access_log(asgi_app, False)
    health = rsgi_with_access_log(make_rsgi_app(True)) if rsgi else with_access_log(asgi_app, True)
    servers = [Server(api, address="127.0.0.1", port=spec["port"], **common)]
    if spec.get("uds"):
        uds = Server(api, uds=__import__("pathlib").Path(spec["uds"]), **common)
        uds.uds_permissions = 0o660  # embed's __init__ takes no uds_permissions; the attribute is read at bind
        servers.append(uds)
    if spec.get("health_port"):
        servers.append(Server(health, address="127.0.0.1", port=spec["health_port"], **common))

    async def main() -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # uvloop refuses loop.add_signal_handler(SIGCHLD) (libuv owns it), and
        # signal.signal(SIGCHLD) would break uvloop's own subprocesses: sweep on a timer.
        tasks = [asyncio.ensure_future(s.serve()) for s in servers]
        reaper_tick = asyncio.ensure_future(_periodic(reaper.sweep, 0.5))
        self_test = asyncio.ensure_future(loop.run_in_executor(None, _reaper_self_test, reaper))
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        started = time.monotonic()
        # The bound holds even if something blocks the loop: a watchdog thread exits.
        watchdog = threading.Timer(spec["drain"] + 1.0, os._exit, (1,))
        watchdog.daemon = True
        watchdog.start()
        st.shutdown.set()  # waiting long-polls answer 503 + Retry-After now
        for s in servers:
            s.stop()  # stop accepting, close idle keep-alive connections, let in-flight answers finish
        _, pending = await asyncio.wait(tasks, timeout=spec["drain"])
        result = await self_test
        print("EMBED " + json.dumps({"drain_s": round(time.monotonic() - started, 3), "undrained": len(pending),
                                     "orphans_reaped": reaper.reaped, **result}), flush=True)
        reaper_tick.cancel()
        if pending:
            os._exit(1)  # the bound passed: what is still in flight is cut off
        watchdog.cancel()
        return 0

    import uvloop
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        code = runner.run(main())
    st.ready_pool.shutdown(wait=False)
    st.longpoll_pool.shutdown(wait=False)
    sys.stdout.flush()
    # os._exit, not return: interpreter exit joins executor threads, and a thread
    # stuck in flock() would hold the exit past any bound.
    os._exit(code)


async def _periodic(fn, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        fn()


def _reaper_self_test(reaper: Reaper) -> dict:
    """An orphan (a grandchild whose parent exited) is reaped by us; our own child's
    exit code still reaches subprocess."""
    own = subprocess.run(["sh", "-c", "sleep 0.05; exit 3"]).returncode
    subprocess.run(["sh", "-c", "sleep 0.2 & exit 0"])  # the sleep is reparented to us
    time.sleep(1.5)
    return {"own_exit_code": own, "orphans_after_1_5s": sum(
        1 for p in reaper.children() if open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] == "Z")}


# =============================================================== variants

@dataclass
class Ports:
    api: int
    health: int
    uds: str
    work: str


@dataclass
class Variant:
    name: str
    command: Callable[[Ports], list[str]]
    notes: str = ""
    hello: bool = True            # the stack also serves /hello (the minimal app)
    longpoll: bool = True         # POST /v1/ensure?longpoll=S blocks until the clone lock is free
    health_port: bool = False     # /healthz also on a second, health-only port
    uds: bool = False             # the API also on a Unix socket (mode 0660)
    ready_body: str = "{}"        # the JSON body of a ready request
    token: str | None = None      # None: the run's token
    env: dict = field(default_factory=dict)


def variants(args) -> list[Variant]:
    hdr_ms = str(int(args.header_timeout * 1000))
    grace = str(int(args.drain))
    granian = [PY, "-m", "granian", "--host", "127.0.0.1", "--workers", "1", "--http", "1", "--no-ws",
               "--http1-header-read-timeout", hdr_ms, "--http1-buffer-size", str(64 * 1024), "--backlog", "2048",
               "--backpressure", "4096", "--workers-kill-timeout", grace, "--log-level", "warning",
               "--working-dir", HERE]
    uvicorn = [PY, "-m", "uvicorn", "--app-dir", HERE, "--host", "127.0.0.1", "--loop", "uvloop",
               "--no-access-log", "--log-level", "warning", "--timeout-keep-alive", str(int(args.header_timeout)),
               "--backlog", "2048",
               "--timeout-graceful-shutdown", grace]

    def embed(ready: str, interface: str = "asgi") -> Callable[[Ports], list[str]]:
        return lambda p: [PY, os.path.abspath(__file__), "--_embed", json.dumps(
            {"port": p.api, "health_port": p.health, "uds": p.uds, "ready": ready, "interface": interface,
             "header_timeout": args.header_timeout, "drain": args.drain})]

    return [
        Variant("granian-embed", embed("inline"), health_port=True, uds=True,
                notes="granian.server.embed in our own uvloop, one process; API on TCP + UDS 0660, health port; "
                      "ready answers inline on the loop, long-polls in their own pool"),
        Variant("granian-embed-pool", embed("pool"), health_port=True, uds=True,
                notes="as granian-embed, ready answers in an 8-thread pool (loop never blocks on a flock)"),
        Variant("granian-embed-rsgi", embed("inline", "rsgi"), health_port=True, uds=True,
                notes="as granian-embed, through granian's own RSGI interface instead of ASGI"),
        Variant("granian-asgi", lambda p: granian + ["--port", str(p.api), "--interface", "asgi",
                                                     "serve_stacks:asgi_app"],
                notes="granian CLI, 1 worker process under a supervisor"),
        Variant("granian-wsgi", lambda p: granian + ["--port", str(p.api), "--interface", "wsgi",
                                                     "--blocking-threads", "16", "serve_stacks:wsgi_app"],
                notes="granian CLI WSGI, 16 blocking threads: long-polls share them with ready answers"),
        Variant("uvicorn-httptools", lambda p: uvicorn + ["--port", str(p.api), "--http", "httptools",
                                                          "serve_stacks:asgi_app"]),
        Variant("uvicorn-h11", lambda p: uvicorn + ["--port", str(p.api), "--http", "h11", "serve_stacks:asgi_app"]),
        Variant("hypercorn", lambda p: [PY, "-m", "hypercorn", "--bind", f"127.0.0.1:{p.api}",
                                        "--keep-alive", str(int(args.header_timeout)),
                                        "--read-timeout", str(int(args.header_timeout)), "--graceful-timeout", grace,
                                        "--backlog", "2048", "--log-level", "warning", "--worker-class", "uvloop",
                                        "serve_stacks:asgi_app"],
                env={"PYTHONPATH": HERE}),
    ]


def serve_variant(root: str, repo: str, commit: str, extra_args: list[str] | None = None) -> Variant:
    """The slot for our own server: today's `checkoutcache serve` (or its successor)
    as a command that knows its URL (127.0.0.1:<api port>) and token (the run's,
    through CHECKOUTCACHE_API_TOKEN). It has no /hello or long-poll here."""
    return Variant(
        "serve", lambda p: [PY, "-m", "checkoutcache", "--root", root, "serve", "--listen", f"127.0.0.1:{p.api}",
                            "--gc-interval", "0", "--allow-local", *(extra_args or [])],
        notes="checkoutcache serve from this checkout", hello=False, longpoll=False,
        ready_body=json.dumps({"repo": repo, "commit": commit}))


# =============================================================== processes and /proc

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(pid: int) -> list[int]:
    """The process and all its descendants."""
    parents: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parents[int(handle.read().rsplit(")", 1)[1].split()[1])].append(int(entry))
            except OSError:
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents.get(p, [])
    return out


def memory_mib(pid: int) -> dict:
    rss = hwm = 0
    pids = tree(pid)
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1])
                    elif line.startswith("VmHWM:"):
                        hwm += int(line.split()[1])
        except OSError:
            pass
    return {"processes": len(pids), "rss_mib": round(rss / 1024, 1), "hwm_mib": round(hwm / 1024, 1)}


def cpu_seconds(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return total


def machine_busy_s() -> float:
    with open("/proc/stat") as handle:
        v = [int(x) for x in handle.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> int:
    return sum(len(os.listdir(f"/proc/{p}/task")) for p in tree(pid) if os.path.isdir(f"/proc/{p}/task"))


class Running:
    """A started server: its process, ports, and how to ask it things."""

    def __init__(self, variant: Variant, env: dict, token: str, work: str):
        self.variant, self.token = variant, variant.token or token
        self.ports = Ports(free_port(), free_port(), os.path.join(work, f"api-{secrets.token_hex(3)}.sock"), work)
        self.log_path = os.path.join(work, f"{variant.name}.log")
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(variant.command(self.ports), cwd=HERE, stdout=self.log, stderr=self.log,
                                     env={**env, **variant.env}, start_new_session=True)
        self.started = time.monotonic()
        deadline = time.monotonic() + 30
        while True:
            try:
                probe_req = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{self.ports.api}\r\n\r\n".encode()
                if raw_request(self.ports.api, probe_req, 2)["status"] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{variant.name} did not start: {self.tail()}")
            time.sleep(0.1)
        self.startup_s = time.monotonic() - self.started

    def tail(self) -> str:
        with open(self.log_path, "rb") as handle:
            return handle.read()[-3000:].decode(errors="replace")

    def ready_request(self, authorized: bool = True, query: str = "") -> bytes:
        body = self.variant.ready_body.encode()
        auth = f"Authorization: Bearer {self.token}\r\n" if authorized else ""
        return (f"POST /v1/ensure{query} HTTP/1.1\r\nHost: 127.0.0.1:{self.ports.api}\r\n{auth}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.log.close()


# =============================================================== raw HTTP over sockets

def parse_responses(data: bytes) -> list[dict]:
    """Split what a server sent into responses (Content-Length or chunked framing)."""
    out = []
    while data:
        head_end = data.find(b"\r\n\r\n")
        if head_end < 0:
            out.append({"status_line": data[:80].decode("latin-1"), "incomplete": True})
            break
        head, rest = data[:head_end].decode("latin-1"), data[head_end + 4:]
        lines = head.split("\r\n")
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        m = re.match(r"HTTP/\d\.\d (\d{3})", lines[0])
        status = int(m.group(1)) if m else None
        if status == 100:
            out.append({"status": 100, "status_line": lines[0]})
            data = rest
            continue
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size_end = rest.find(b"\r\n")
                if size_end < 0:
                    break
                try:
                    size = int(rest[:size_end].split(b";")[0], 16)
                except ValueError:
                    break
                body += rest[size_end + 2:size_end + 2 + size]
                rest = rest[size_end + 2 + size + 2:]
                if size == 0:
                    break
        elif headers.get("content-length", "").isdigit():
            n = int(headers["content-length"])
            body, rest = rest[:n], rest[n:]
        else:  # no framing: the body runs to the connection's close
            body, rest = rest, b""
        out.append({"status": status, "status_line": lines[0][:80], "content_type": headers.get("content-type"),
                    "connection": headers.get("connection"), "body": body[:160].decode("latin-1")})
        data = rest
    return out


def raw_request(port: int, payload: bytes, timeout: float) -> dict:
    """One request on a fresh connection; the first response's status and the latency."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        data = b""
        while not _complete(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    got = parse_responses(data)
    return {"status": got[0].get("status") if got else None, "ms": (time.perf_counter() - started) * 1000,
            "responses": got}


def _complete(data: bytes) -> bool:
    """A whole response (not a 100 Continue) with its Content-Length body is in."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep or head.startswith(b"HTTP/1.1 100"):
        return False
    m = re.search(rb"content-length:\s*(\d+)", head, re.I)
    return not m or len(body) >= int(m.group(1))


def unix_request(path: str, payload: bytes, timeout: float = 5) -> int | None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(payload)
        data = b""
        while not _complete(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    got = parse_responses(data)
    return got[0].get("status") if got else None


# =============================================================== 1. load (wrk)

WRK_LUA = """
wrk.method = %(method)s
wrk.body = %(body)s
%(headers)s
done = function(summary, latency, requests)
  io.write(string.format('JSON {"requests":%%d,"duration_s":%%f,"err_connect":%%d,"err_read":%%d,' ..
    '"err_write":%%d,"err_status":%%d,"err_timeout":%%d,"p50_ms":%%.3f,"p90_ms":%%.3f,"p99_ms":%%.3f,' ..
    '"max_ms":%%.3f}\\n',
    summary.requests, summary.duration / 1e6, summary.errors.connect, summary.errors.read,
    summary.errors.write, summary.errors.status, summary.errors.timeout, latency:percentile(50)/1000,
    latency:percentile(90)/1000, latency:percentile(99)/1000, latency.max/1000))
end
"""


def wrk(port: int, path: str, method: str, body: str, headers: dict, seconds: float, work: str,
        connections: int = CONNECTIONS, name: str = "load") -> dict:
    lua = os.path.join(work, f"{name}.lua")
    with open(lua, "w") as handle:
        handle.write(WRK_LUA % {"method": json.dumps(method), "body": json.dumps(body) if body else "nil",
                                "headers": "\n".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}"
                                                     for k, v in headers.items())})
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "5s", "-s", lua,
           f"http://127.0.0.1:{port}{path}"]
    with tempfile.TemporaryFile("w+") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, text=True)
        _, _, usage = os.wait4(proc.pid, 0)
        handle.seek(0)
        out = handle.read()
    lines = [line for line in out.splitlines() if line.startswith("JSON ")]
    if not lines:
        raise RuntimeError(f"wrk failed: {out[-2000:]}")
    result = json.loads(lines[0][5:])
    result["rps"] = round(result["requests"] / result["duration_s"], 1)
    result["wrk_cpu_s"] = usage.ru_utime + usage.ru_stime
    result["errors"] = sum(v for k, v in result.items() if k.startswith("err_"))
    return result


def measure_load(run: Running, args) -> dict:
    port, work = run.ports.api, run.ports.work
    auth = {"Authorization": f"Bearer {run.token}", "Content-Type": "application/json"}
    wrk(port, "/v1/ensure", "POST", run.variant.ready_body, auth, args.warmup, work)
    out = {}
    if run.variant.hello:
        out["hello"] = wrk(port, "/hello", "GET", "", {}, args.seconds, work)
    cpu0, t0, busy0 = cpu_seconds(run.proc.pid), time.monotonic(), machine_busy_s()
    out["ready"] = wrk(port, "/v1/ensure", "POST", run.variant.ready_body, auth, args.seconds, work)
    out["ready"]["server_cpu_us_per_req"] = round(
        (cpu_seconds(run.proc.pid) - cpu0) / max(1, out["ready"]["requests"]) * 1e6, 1)
    wall, server = time.monotonic() - t0, cpu_seconds(run.proc.pid) - cpu0
    out["ready"]["server_cores"] = round(server / wall, 2)
    # machine CPU less the server's and wrk's: other sessions on this machine
    others = machine_busy_s() - busy0 - server - out["ready"]["wrk_cpu_s"]
    out["ready"]["other_cores"] = round(max(0.0, others) / wall, 2)
    return out


# =============================================================== 2. attack (a helper process)

async def _attack(spec: dict) -> dict:
    port, host = spec["port"], f"127.0.0.1:{spec['port']}"
    stats = collections.Counter()
    answers: dict[str, collections.Counter] = {"flood": collections.Counter(), "longpoll": collections.Counter(),
                                                "idle": collections.Counter()}
    stop = asyncio.Event()

    async def until_stop(coro):
        task = asyncio.ensure_future(coro)
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not task.done():
            task.cancel()
            return None
        return task.result() if not task.exception() else task.exception()

    async def idle(first: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                stats["idle_connect_errors"] += 1
                await asyncio.sleep(0.2)
                continue
            stats["idle_connections"] += 1
            if not first.is_set():
                first.set()
            got = await until_stop(reader.read(200))
            if got is not None:  # the server spoke or closed
                stats["idle_closed_by_server"] += 1
                status = got[:12].decode("latin-1") if isinstance(got, bytes) and got else "EOF"
                answers["idle"][status if not isinstance(got, Exception) else type(got).__name__] += 1
            writer.close()

    async def flood() -> None:
        line = b"X-Flood: " + b"a" * 1000 + b"\r\n"
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                stats["flood_connect_errors"] += 1
                await asyncio.sleep(0.2)
                continue
            stats["flood_connections"] += 1
            reply = asyncio.ensure_future(reader.read(200))
            try:
                writer.write(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n".encode())
                while not stop.is_set() and not reply.done():
                    writer.write(line * spec["flood_lines"])
                    stats["flood_bytes"] += len(line) * spec["flood_lines"]
                    await writer.drain()
                    await asyncio.sleep(spec["flood_interval"])
            except OSError:
                pass
            if reply.done() and not reply.exception():
                data = reply.result()
                answers["flood"][data.split(b"\r\n")[0][:40].decode("latin-1") if data else "EOF"] += 1
            elif reply.done():
                answers["flood"][type(reply.exception()).__name__] += 1
            elif not stop.is_set():
                answers["flood"]["write error"] += 1
            reply.cancel()
            writer.close()

    async def longpoll() -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            answers["longpoll"]["connect error"] += 1
            return
        body = spec["body"].encode()
        writer.write((f"POST /v1/ensure?longpoll=600 HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
                      f"{spec['token']}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        got = await until_stop(reader.read(200))
        answers["longpoll"]["waiting at the end" if got is None else
                            (got.split(b"\r\n")[0][:40].decode("latin-1") if isinstance(got, bytes) and got
                             else "EOF" if isinstance(got, bytes) else type(got).__name__)] += 1
        writer.close()

    firsts = [asyncio.Event() for _ in range(spec["idle"])]
    tasks = [asyncio.ensure_future(idle(f)) for f in firsts]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
    tasks += [asyncio.ensure_future(longpoll()) for _ in range(spec["longpolls"])]
    tasks += [asyncio.ensure_future(flood()) for _ in range(spec["flooders"])]
    await asyncio.sleep(spec["settle"])
    stats["flood_bytes_before_probes"] = stats["flood_bytes"]
    print("READY " + json.dumps(dict(stats)), flush=True)
    loop = asyncio.get_running_loop()
    await asyncio.wait_for(loop.run_in_executor(None, sys.stdin.readline), spec["max_seconds"])
    stats["open_idle_at_stop"] = sum(1 for t in tasks[:spec["idle"]] if not t.done())
    stop.set()
    await asyncio.wait(tasks, timeout=0.5)
    for t in tasks:
        t.cancel()
    return {**dict(stats), "answers": {k: dict(v) for k, v in answers.items()}}


def attack_main(spec: dict) -> None:
    print("JSON " + json.dumps(asyncio.run(_attack(spec))), flush=True)


class CloneLock:
    """The benchmark holds the clone lock exclusive: long-polls wait on it."""

    def __init__(self, root: str):
        self.path = os.path.join(root, "clone.lock")
        self.fd = None

    def hold(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def probe(port: int, payload: bytes, n: int) -> dict:
    lat, bad, failures, ok = [], collections.Counter(), 0, 0
    for _ in range(n):
        try:
            r = raw_request(port, payload, PROBE_TIMEOUT)
            lat.append(r["ms"])
            ok += r["status"] == 200
            if r["status"] != 200:
                bad[str(r["status"])] += 1
        except OSError as exc:
            lat.append(PROBE_TIMEOUT * 1000)
            bad[type(exc).__name__] += 1
            failures += 1
            if failures >= 3:
                bad["gave up after 3 timeouts"] += 1
                break
        time.sleep(0.02)
    lat.sort()
    return {"p50_ms": round(statistics.median(lat), 2), "max_ms": round(lat[-1], 2), "n": n, "ok": ok,
            "over_bar": sum(1 for x in lat if x > BAR_ATTACK_MS), "not_200": dict(bad)}


def measure_attack(run: Running, args, lock: CloneLock) -> dict:
    mem_before = memory_mib(run.proc.pid)
    spec = {"port": run.ports.api, "idle": args.idle, "flooders": args.flooders,
            "longpolls": args.longpolls if run.variant.longpoll else 0, "token": run.token,
            "body": run.variant.ready_body, "flood_lines": 4, "flood_interval": 0.01, "settle": args.attack_hold,
            "max_seconds": 120}
    lock.hold()
    helper = subprocess.Popen([PY, os.path.abspath(__file__), "--_attack", json.dumps(spec)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = helper.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"attack helper: {line}{helper.stdout.read()[-2000:]}")
        at_ready = json.loads(line[6:])
        health = probe(run.ports.api, f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{run.ports.api}\r\n\r\n".encode(),
                       args.probes)
        ready = probe(run.ports.api, run.ready_request(), args.probes)
        mem = memory_mib(run.proc.pid)
        nthreads = threads(run.proc.pid)
        helper.stdin.write("stop\n")
        helper.stdin.flush()
        out = helper.stdout.read()
        helper.wait(30)
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()
        lock.release()
    lines = [x for x in out.splitlines() if x.startswith("JSON ")]
    final = json.loads(lines[0][5:]) if lines else {"error": out[-1000:]}
    return {"healthz": health, "ready": ready, "memory_before": mem_before, "memory": mem, "threads": nthreads,
            "at_ready": at_ready, "attacker": final,
            "meets_bar": health["max_ms"] <= BAR_ATTACK_MS and ready["max_ms"] <= BAR_ATTACK_MS
            and not health["not_200"] and not ready["not_200"] and mem["hwm_mib"] < BAR_RSS_MIB}


# =============================================================== 2b. keep-alive flood (serve only)

def measure_keepalive_flood(run: Running, args) -> dict:
    """Issue 27's flood: unauthenticated keep-alive clients (wrk, two processes: GET /healthz,
    and GET /v1/status without a token, a 401) against a serve of CHECKOUTCACHE_MAX_CONNECTIONS
    slots, more clients than slots. Ready answers on fresh connections are timed before the
    flood (quiet) and during it, on the same server: how many came within PROBE_TIMEOUT, p50, max."""
    port = run.ports.api
    quiet = probe(port, run.ready_request(), args.probes)
    seconds = args.flood_seconds
    results: dict = {}

    def flood(name: str, path: str) -> None:
        try:
            results[name] = wrk(port, path, "GET", "", {}, seconds, run.ports.work,
                                connections=max(1, args.keepalive_flooders // 2), name=f"flood-{name}")
        except Exception as exc:  # a flood that could not run is a result too
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}

    floods = [threading.Thread(target=flood, args=("healthz", "/healthz")),
              threading.Thread(target=flood, args=("status_401", "/v1/status"))]
    for thread in floods:
        thread.start()
    time.sleep(min(1.0, seconds / 4))  # the flood holds its connections before the first probe
    during = probe(port, run.ready_request(), args.probes)
    during["probes_done_before_flood_ended"] = all(thread.is_alive() for thread in floods)
    for thread in floods:
        thread.join()
    return {"slots": args.slots, "flooders": args.keepalive_flooders, "quiet": quiet, "during": during,
            "flood": results, "ready_answered": f"{during['ok']}/{during['n']}",
            "meets_bar": not during["not_200"] and during["max_ms"] <= BAR_ATTACK_MS}


def keepalive_flood_main(args, env: dict, token: str, work: str, info: dict) -> dict:
    """Only the keep-alive flood, against `serve` of this checkout and, with --baseline-tree,
    of another tree (e.g. main before a change), one after the other in one run."""
    serve_root = os.path.join(work, "serve-root")
    subprocess.run([PY, "-m", "checkoutcache", "--root", serve_root, "ensure", info["repo"], info["commit"],
                    "--wait", "60"], check=True, capture_output=True, env=env)
    limited = {"CHECKOUTCACHE_MAX_CONNECTIONS": str(args.slots)}
    stacks = [attrs_replace(serve_variant(serve_root, info["repo"], info["commit"]), env=limited)]
    if args.baseline_tree:
        base = serve_variant(serve_root, info["repo"], info["commit"])
        path = os.pathsep.join((HERE, os.path.abspath(args.baseline_tree)))
        stacks.append(attrs_replace(base, name="serve@baseline", env={**limited, "PYTHONPATH": path},
                                    notes=f"checkoutcache serve from {args.baseline_tree}"))
    out = {}
    for variant in stacks:
        run = Running(variant, env, token, work)
        try:
            out[variant.name] = r = measure_keepalive_flood(run, args)
            print(f"{variant.name:16s} quiet ready p50 {r['quiet']['p50_ms']} max {r['quiet']['max_ms']} ms; "
                  f"during the flood: {r['ready_answered']} ready answers, p50 {r['during']['p50_ms']} max "
                  f"{r['during']['max_ms']} ms, failures {r['during']['not_200']}; flood "
                  + ", ".join(f"{k} {v.get('rps')}/s" for k, v in r["flood"].items()), flush=True)
        finally:
            run.stop()
    return out


def attrs_replace(variant: Variant, **changes) -> Variant:
    import dataclasses

    return dataclasses.replace(variant, **changes)


# =============================================================== 3. battery

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"


def battery_cases(run: Running) -> list[tuple[str, object]]:
    host = f"Host: 127.0.0.1:{run.ports.api}\r\n"
    auth = f"Authorization: Bearer {run.token}\r\n"

    def post(headers: str, body: bytes = b"", path: str = "/v1/ensure") -> bytes:
        return f"POST {path} HTTP/1.1\r\n{host}{auth}{headers}\r\n".encode() + body

    # Framing cases go to /healthz, whose handler never reads the body: what
    # follows the body is the server's business alone (RFC 9112 6.1: a message with
    # both Transfer-Encoding and Content-Length must be refused, or answered and
    # its connection closed).

    deep = b"[" * 60000
    big_body = (SMUGGLED * 2000)[:200000]
    return [
        ("ok_get_healthz", f"GET /healthz HTTP/1.1\r\n{host}\r\n".encode()),
        ("pipelined_two_gets", (f"GET /healthz HTTP/1.1\r\n{host}\r\n" * 2).encode()),
        ("cl_superscript_two", post("Content-Length: \u00b2\r\n".encode("utf-8").decode("latin-1")) + SMUGGLED),
        ("cl_5000_digits", post("Content-Length: " + "9" * 5000 + "\r\n") + SMUGGLED),
        ("cl_plus_sign", post("Content-Length: +2\r\n", b"{}") + SMUGGLED),
        ("cl_negative", post("Content-Length: -1\r\n") + SMUGGLED),
        ("cl_two_conflicting", post("Content-Length: 2\r\nContent-Length: 39\r\n", b"{}") + SMUGGLED),
        ("cl_list_conflicting", post("Content-Length: 2, 39\r\n", b"{}") + SMUGGLED),
        ("te_chunked_and_cl", post(f"Transfer-Encoding: chunked\r\nContent-Length: {5 + len(SMUGGLED)}\r\n",
                                   b"0\r\n\r\n" + SMUGGLED, "/healthz")),
        ("te_unknown", post("Transfer-Encoding: xchunked\r\n", b"2\r\n{}\r\n0\r\n\r\n", "/healthz") + SMUGGLED),
        ("te_bad_chunk_size", post("Transfer-Encoding: chunked\r\n", b"zz\r\n{}\r\n0\r\n\r\n", "/healthz")
         + SMUGGLED),
        ("chunked_refused_by_app", post("Transfer-Encoding: chunked\r\n", b"2\r\n{}\r\n0\r\n\r\n") + SMUGGLED),
        ("body_over_limit_unread", post(f"Content-Length: {len(big_body)}\r\n", big_body)),
        ("deep_json_60000", post(f"Content-Length: {len(deep)}\r\n", deep)),
        ("expect_100_large", post("Content-Length: 10000000\r\nExpect: 100-continue\r\n")),
        ("no_token", f"POST /v1/ensure HTTP/1.1\r\n{host}Content-Length: 2\r\n\r\n{{}}".encode()),
        ("headers_200", f"GET /healthz HTTP/1.1\r\n{host}".encode()
         + b"".join(b"X-H%d: v\r\n" % i for i in range(200)) + b"\r\n"),
        ("header_100kb", f"GET /healthz HTTP/1.1\r\n{host}X-Big: {'a' * 100000}\r\n\r\n".encode()),
        ("headers_600kb_total", f"GET /healthz HTTP/1.1\r\n{host}".encode()
         + b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 8000) for i in range(75)) + b"\r\n"),
        ("bad_version_9_9", f"GET /healthz HTTP/9.9\r\n{host}\r\n".encode()),
        ("bad_version_word", f"GET /healthz FOO/1.1\r\n{host}\r\n".encode()),
        ("request_line_100kb", f"GET /{'a' * 100000} HTTP/1.1\r\n{host}\r\n".encode()),
        ("http09_line", b"GET /healthz\r\n\r\n"),
        ("tls_hello_on_plain", bytes.fromhex("16030100a5010000a10303") + os.urandom(32) + b"\x00" * 40),
        ("space_before_colon", f"GET /healthz HTTP/1.1\r\n{host}Transfer-Encoding : chunked\r\n\r\n".encode()),
        ("obs_fold", f"GET /healthz HTTP/1.1\r\n{host}X-A: a\r\n b\r\n\r\n".encode()),
        ("nul_in_header", f"GET /healthz HTTP/1.1\r\n{host}X-A: a\x00b\r\n\r\n".encode()),
        ("bare_lf", f"GET /healthz HTTP/1.1\n{host.strip()}\n\n".encode()),
        ("no_host_http11", b"GET /healthz HTTP/1.1\r\n\r\n"),
        ("absolute_uri", f"GET http://evil.example/healthz HTTP/1.1\r\n{host}\r\n".encode()),
        ("method_garbage", f"G@T /healthz HTTP/1.1\r\n{host}\r\n".encode()),
        ("slowloris_1_byte_per_200ms", ("slow", f"GET /healthz HTTP/1.1\r\n{host}X-Slow: ".encode(), 0.2)),
        ("idle_no_bytes", ("slow", b"", 0)),
        ("header_stall", ("slow", f"GET /healthz HTTP/1.1\r\n{host}".encode(), 0)),
        ("idle_after_one_request", ("after", f"GET /healthz HTTP/1.1\r\n{host}\r\n".encode(), 0)),
        ("body_stall", ("slow", post("Content-Length: 50\r\n", b"{\"a\":"), 0)),
    ]


def run_case(port: int, payload, cap: float) -> dict:
    started = time.monotonic()
    data, closed, error, sent_all = b"", False, None, True
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            if isinstance(payload, tuple):  # ("slow", prefix, byte interval) or ("after", request, 0)
                mode, prefix, interval = payload
                s.sendall(prefix)
                s.setblocking(False)
                deadline = time.monotonic() + cap
                while time.monotonic() < deadline:
                    try:
                        chunk = s.recv(65536)
                        if not chunk:
                            closed = True
                            break
                        data += chunk
                        if mode == "slow":
                            break  # an answer: the server gave up on us
                    except BlockingIOError:
                        pass
                    if mode == "slow" and interval:
                        try:
                            s.send(b"a")
                        except OSError:
                            closed = True
                            break
                    time.sleep(interval or 0.05)
                if mode == "slow" and data and not closed:
                    s.settimeout(1.0)
                    try:
                        closed = s.recv(65536) == b""
                    except (OSError, TimeoutError):
                        pass
            else:
                try:
                    s.sendall(payload)
                except OSError as exc:
                    sent_all, error = False, type(exc).__name__
                s.settimeout(1.5)
                while time.monotonic() - started < cap:
                    try:
                        chunk = s.recv(65536)
                    except (TimeoutError, socket.timeout):
                        break
                    if not chunk:
                        closed = True
                        break
                    data += chunk
    except OSError as exc:
        error = type(exc).__name__
        closed = True
    got = parse_responses(data)
    first = got[0] if got else {}
    return {"status": first.get("status"), "status_line": first.get("status_line"),
            "content_type": first.get("content_type"), "body": (first.get("body") or "")[:100],
            "responses": len(got), "statuses": [r.get("status") for r in got],
            "closed": closed, "seconds": round(time.monotonic() - started, 2), "error": error,
            "sent_all": sent_all,
            "smuggled": b"/smuggled" in data or any("smuggled" in (r.get("body") or "") for r in got),
            "html": any("html" in (r.get("content_type") or "") or "<html" in (r.get("body") or "").lower()
                        for r in got)}


def measure_battery(run: Running, args) -> dict:
    results: dict[str, dict] = {}
    cases = battery_cases(run)

    def one(name, payload):
        cap = args.slow_cap if isinstance(payload, tuple) else 4.0
        results[name] = run_case(run.ports.api, payload, cap)

    workers = [threading.Thread(target=one, args=c) for c in cases]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    alive = raw_request(run.ports.api, f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{run.ports.api}\r\n\r\n".encode(), 5)
    return {"cases": {n: results[n] for n, _ in cases}, "alive_after": alive["status"] == 200}


# =============================================================== listeners and SIGTERM

def check_listeners(run: Running) -> dict:
    out = {}
    if run.variant.uds:
        st = os.stat(run.ports.uds)
        out["uds_mode"] = oct(st.st_mode & 0o777)
        out["uds_ready_status"] = unix_request(run.ports.uds, run.ready_request())
    if run.variant.health_port:
        h = run.ports.health
        out["health_port_healthz"] = raw_request(h, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 5)["status"]
        out["health_port_metrics"] = raw_request(h, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 5)["status"]
        out["health_port_api"] = raw_request(h, run.ready_request(), 5)["status"]
    return out


def measure_sigterm(run: Running, args, lock: CloneLock) -> dict:
    """Two long-polls waiting on the clone lock and one idle keep-alive connection, then SIGTERM."""
    result: dict = {"longpolls": []}
    lock.hold()
    socks = []
    try:
        if run.variant.longpoll:
            for _ in range(2):
                s = socket.create_connection(("127.0.0.1", run.ports.api), timeout=args.drain + 10)
                s.sendall(run.ready_request(query="?longpoll=600"))
                socks.append(s)
        keep = socket.create_connection(("127.0.0.1", run.ports.api), timeout=args.drain + 10)
        keep.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{run.ports.api}\r\n\r\n".encode())
        keep.recv(65536)
        time.sleep(0.5)
        t0 = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        box: dict = {}

        def read(name, s):
            data = b""
            try:
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                    if name != "keepalive" and parse_responses(data) and b"\r\n\r\n" in data:
                        head, _, body = data.partition(b"\r\n\r\n")
                        m = re.search(rb"content-length:\s*(\d+)", head, re.I)
                        if m and len(body) >= int(m.group(1)):
                            break
            except OSError as exc:
                box[name] = {"error": type(exc).__name__, "seconds": round(time.monotonic() - t0, 2)}
                return
            got = parse_responses(data)
            box[name] = {"status": got[0].get("status") if got else None, "seconds": round(time.monotonic() - t0, 2),
                         "retry_after": "retry-after" in data.split(b"\r\n\r\n")[0].decode("latin-1").lower()}

        readers = [threading.Thread(target=read, args=(f"longpoll{i}", s)) for i, s in enumerate(socks)]
        readers.append(threading.Thread(target=read, args=("keepalive", keep)))
        for t in readers:
            t.daemon = True
            t.start()
        time.sleep(0.3)
        try:
            socket.create_connection(("127.0.0.1", run.ports.api), timeout=1).close()
            result["new_connection_after_term"] = "accepted"
        except OSError as exc:
            result["new_connection_after_term"] = type(exc).__name__
        deadline = t0 + args.drain + 2
        while time.monotonic() < deadline and run.proc.poll() is None:
            time.sleep(0.05)
        result["exit_s"] = round(time.monotonic() - t0, 2) if run.proc.poll() is not None else None
        result["exit_code"] = run.proc.poll()
        if run.proc.poll() is None:
            result["killed_after_s"] = round(time.monotonic() - t0, 2)
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()
        for t in readers:
            t.join(2)
        result["longpolls"] = [box.get(f"longpoll{i}", {"status": "no answer"}) for i in range(len(socks))]
        result["idle_keepalive"] = box.get("keepalive")
        m = re.findall(r"EMBED (.*)", run.tail())
        if m:
            result["embed"] = json.loads(m[-1])
    finally:
        for s in socks:
            s.close()
        lock.release()
    return result


# =============================================================== the run

def setup(work: str) -> dict:
    """A checkout (a repository made with git) and its marker, as the store keeps them."""
    root = os.path.join(work, "root")
    checkout = os.path.join(root, "checkout")
    os.makedirs(checkout)
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.com",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@example.com"}

    def git(*a):
        return subprocess.run(["git", *a], cwd=checkout, check=True, capture_output=True, text=True,
                              env=env).stdout.strip()

    git("init", "-q", "-b", "main")
    for i in range(12):
        with open(os.path.join(checkout, f"file{i}.txt"), "w") as handle:
            handle.write(f"content {i}\n" * 50)
    git("add", ".")
    git("commit", "-q", "-m", "one")
    commit = git("rev-parse", "HEAD")
    top = sorted(n for n in os.listdir(checkout) if n != ".git")[:8]
    with open(os.path.join(root, "marker.json"), "w") as handle:
        json.dump({"commit": commit, "top": top}, handle)
    return {"root": root, "repo": checkout, "commit": commit}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in MODULES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    try:
        out["wrk"] = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split("\n")[0][:40]
    except OSError:
        out["wrk"] = None
    return out


def summarize(name: str, rows: list[dict]) -> dict:
    loads = [r["load"] for r in rows if "load" in r]

    def med(kind, key):
        vals = [x[kind][key] for x in loads if kind in x]
        return round(statistics.median(vals), 2) if vals else None

    s = {"name": name, "hello_rps": med("hello", "rps"), "hello_p99_ms": med("hello", "p99_ms"),
         "ready_rps": med("ready", "rps"), "ready_p50_ms": med("ready", "p50_ms"),
         "ready_p99_ms": med("ready", "p99_ms"), "ready_us_per_req": med("ready", "server_cpu_us_per_req"),
         "other_cores": med("ready", "other_cores"),
         "load_errors": sum(x[k]["errors"] for x in loads for k in x)}
    s["ready_vs_hello"] = round(s["ready_rps"] / s["hello_rps"], 2) if s["hello_rps"] and s["ready_rps"] else None
    # The bar's other half (serve's ready answers >= half of the minimal app's on the same
    # server) is for serve: `budget_for_serve_rps` is that half.
    s["budget_for_serve_rps"] = round(s["ready_rps"] * BAR_READY_VS_HELLO) if s["ready_rps"] else None
    s["meets_load_bar"] = bool(s["ready_p99_ms"] is not None and s["ready_p99_ms"] <= BAR_P99_MS
                               and not s["load_errors"])
    return s


def print_tables(results: dict) -> None:
    print("\n## Load: 64 keep-alive connections (wrk -t1), median over rounds\n")
    print("| stack | /hello rps | ready rps | ready/hello | ready p50 ms | ready p99 ms | server us/req | "
          "others' cores | "
          "errors | p99 bar | serve needs rps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for s in results["summary"]:
        print(f"| {s['name']} | {s['hello_rps']} | {s['ready_rps']} | {s['ready_vs_hello']} | {s['ready_p50_ms']} | "
              f"{s['ready_p99_ms']} | {s['ready_us_per_req']} | {s['other_cores']} | {s['load_errors']} | "
              f"{'met' if s['meets_load_bar'] else 'MISSED'} | {s['budget_for_serve_rps']} |")
    print("\n## Attack: idle + header-flooding connections + waiting long-polls; probes on fresh connections\n")
    print("| stack | /healthz p50/max ms | ready p50/max ms | not 200 | RSS / HWM MiB (procs) | threads | "
          "idle closed by server | flood MiB sent | flood answers | long-polls | bar |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |")
    for name, a in results["attack"].items():
        if "error" in a:
            print(f"| {name} | error: {a['error'][:80]} |")
            continue
        att = a["attacker"]
        print(f"| {name} | {a['healthz']['p50_ms']}/{a['healthz']['max_ms']} | {a['ready']['p50_ms']}/"
              f"{a['ready']['max_ms']} | {a['healthz']['not_200'] or ''}{a['ready']['not_200'] or ''} | "
              f"{a['memory']['rss_mib']} / {a['memory']['hwm_mib']} ({a['memory']['processes']}) | {a['threads']} | "
              f"{att.get('idle_closed_by_server', 0)} | {att.get('flood_bytes_before_probes', 0) / 2**20:.0f} | "
              f"{att.get('answers', {}).get('flood')} | "
              f"{att.get('answers', {}).get('longpoll')} | {'met' if a['meets_bar'] else 'MISSED'} |")
    print("\n## Battery: first status (content type), c = connection closed, S = a smuggled request answered\n")
    names = list(results["battery"])
    print("| case | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    cases = next(iter(results["battery"].values()))["cases"] if results["battery"] else {}
    for case in cases:
        cells = []
        for n in names:
            r = results["battery"][n]["cases"].get(case, {})
            ct = (r.get("content_type") or "").split(";")[0].replace("application/", "").replace("text/", "t/")
            cell = f"{r.get('status') or '-'}"
            if ct:
                cell += f" {ct}"
            if r.get("responses", 0) > 1:
                cell += f" x{r['responses']}"
            if r.get("closed"):
                cell += f" c{r['seconds']:g}s" if case.startswith(("slow", "idle", "header_stall", "body_stall"))\
                    else " c"
            if r.get("smuggled"):
                cell += " S"
            if r.get("html"):
                cell += " HTML"
            cells.append(cell)
        print(f"| {case} | " + " | ".join(cells) + " |")
    print("\n## SIGTERM with 2 long-polls waiting and an idle keep-alive connection\n")
    for name, t in results["sigterm"].items():
        print(f"- {name}: {json.dumps(t)}")
    for name, lst in results["listeners"].items():
        if lst:
            print(f"- listeners {name}: {json.dumps(lst)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--_attack":
        attack_main(json.loads(argv[1]))
        return 0
    if len(argv) == 2 and argv[0] == "--_embed":
        return embed_main(json.loads(argv[1]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round, 2 s loads, short caps (about two minutes)")
    ap.add_argument("--seconds", type=float, default=8.0, help="each load measurement (default 8)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved load rounds (default 3)")
    ap.add_argument("--only", default=None, help="comma-separated substrings of stack names")
    ap.add_argument("--idle", type=int, default=1000, help="idle connections in the attack (default 1000)")
    ap.add_argument("--flooders", type=int, default=20, help="header-flooding connections (default 20)")
    ap.add_argument("--longpolls", type=int, default=64, help="waiting long-polls in the attack (default 64)")
    ap.add_argument("--probes", type=int, default=20, help="timed requests of each kind in the attack")
    ap.add_argument("--attack-hold", type=float, default=10.0,
                    help="seconds the attack runs before the probes (default 10)")
    ap.add_argument("--header-timeout", type=float, default=5.0, help="servers' header read timeout (s)")
    ap.add_argument("--drain", type=float, default=5.0, help="servers' graceful shutdown bound (s)")
    ap.add_argument("--with-serve", action="store_true", help="also today's `checkoutcache serve` (serve_variant)")
    ap.add_argument("--keepalive-flood", action="store_true",
                    help="only issue 27's keep-alive flood against `checkoutcache serve` (see --baseline-tree)")
    ap.add_argument("--baseline-tree", default=None,
                    help="with --keepalive-flood: also serve from this source tree (e.g. /work/main), same run")
    ap.add_argument("--slots", type=int, default=16, help="CHECKOUTCACHE_MAX_CONNECTIONS in the keep-alive flood")
    ap.add_argument("--keepalive-flooders", type=int, default=20,
                    help="unauthenticated keep-alive connections in the keep-alive flood (default 20)")
    ap.add_argument("--flood-seconds", type=float, default=12.0, help="how long the keep-alive flood runs")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds, args.probes, args.attack_hold = 2.0, 1, 10, 1.0
        args.header_timeout, args.drain = 3.0, 2.0
    args.warmup, args.slow_cap = 1.0, args.header_timeout + 1.5
    needed = ("granian", "uvloop") if args.keepalive_flood else MODULES  # serve's own stack only
    missing = [m for m in needed if __import__("importlib").util.find_spec(m) is None]
    if missing or not shutil.which("wrk"):
        print(f"missing: {', '.join(missing + ([] if shutil.which('wrk') else ['wrk']))}\n"
              f"    pip install granian uvicorn httptools h11 hypercorn uvloop; apt-get install wrk", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="serve-stacks-")
    token = secrets.token_urlsafe(24)
    try:
        info = setup(work)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (HERE, PROJECT, os.environ.get("PYTHONPATH"))
                                                           if p),
               "SERVE_STACKS_ROOT": info["root"], "SERVE_STACKS_TOKEN": token, "CHECKOUTCACHE_API_TOKEN": token,
               "SERVE_STACKS_BODY_DEADLINE": str(args.header_timeout)}
        if args.keepalive_flood:
            results = {"keepalive_flood": keepalive_flood_main(args, env, token, work, info),
                       "config": {"slots": args.slots, "flooders": args.keepalive_flooders,
                                  "flood_seconds": args.flood_seconds, "probes": args.probes,
                                  "probe_timeout_s": PROBE_TIMEOUT, "bar_ms": BAR_ATTACK_MS}}
            if args.json_out:
                with open(args.json_out, "w") as handle:
                    json.dump(results, handle, indent=1, default=str)
            return 0
        stacks = variants(args)
        if args.with_serve:
            serve_root = os.path.join(work, "serve-root")
            subprocess.run([PY, "-m", "checkoutcache", "--root", serve_root, "ensure", info["repo"], info["commit"],
                            "--wait", "60"], check=True, capture_output=True, env=env)
            stacks.append(serve_variant(serve_root, info["repo"], info["commit"]))
        if args.only:
            stacks = [v for v in stacks if any(s in v.name for s in args.only.split(","))]
        lock = CloneLock(info["root"])
        vers = versions()
        print(f"{os.cpu_count()} cores; {json.dumps(vers)}; load avg {open('/proc/loadavg').read().split()[:3]}",
              flush=True)
        rows: dict[str, list] = {v.name: [] for v in stacks}
        results: dict = {"attack": {}, "battery": {}, "sigterm": {}, "listeners": {}, "startup_s": {}}
        for r in range(args.rounds):
            order = stacks[r % len(stacks):] + stacks[:r % len(stacks)]
            for v in order:
                run = Running(v, env, token, work)
                try:
                    row = {"round": r, "load": measure_load(run, args)}
                    rows[v.name].append(row)
                    rd = row["load"]["ready"]
                    print(f"round {r} {v.name:20s} hello {row['load'].get('hello', {}).get('rps')}/s, ready "
                          f"{rd['rps']}/s p50 {rd['p50_ms']} p99 {rd['p99_ms']} ms, errors {rd['errors']}",
                          flush=True)
                    if r == 0:  # the rest once per stack
                        results["startup_s"][v.name] = round(run.startup_s, 2)
                        results["listeners"][v.name] = check_listeners(run)
                        try:
                            results["attack"][v.name] = a = measure_attack(run, args, lock)
                            print(f"  attack: healthz max {a['healthz']['max_ms']} ms, ready max "
                                  f"{a['ready']['max_ms']} ms, HWM {a['memory']['hwm_mib']} MiB", flush=True)
                        except Exception as exc:  # a stack that falls over is a result too
                            results["attack"][v.name] = {"error": f"{type(exc).__name__}: {exc}"}
                            print(f"  attack: {exc}", flush=True)
                        if run.proc.poll() is not None:
                            run.stop()
                            run = Running(v, env, token, work)
                        results["battery"][v.name] = measure_battery(run, args)
                        print(f"  battery done (alive after: {results['battery'][v.name]['alive_after']})",
                              flush=True)
                        results["sigterm"][v.name] = measure_sigterm(run, args, lock)
                finally:
                    run.stop()
        results["summary"] = [summarize(v.name, rows[v.name]) for v in stacks]
        results["rounds"] = rows
        results["notes"] = {v.name: v.notes for v in stacks}
        results["config"] = {"connections": CONNECTIONS, "seconds": args.seconds, "rounds": args.rounds,
                             "idle": args.idle, "flooders": args.flooders, "longpolls": args.longpolls,
                             "header_timeout_s": args.header_timeout, "drain_s": args.drain, "versions": vers,
                             "bars": {"ready_p99_ms": BAR_P99_MS, "ready_vs_hello": BAR_READY_VS_HELLO,
                                      "attack_ms": BAR_ATTACK_MS, "rss_mib": BAR_RSS_MIB}}
        print_tables(results)
        if args.json_out:
            with open(args.json_out, "w") as handle:
                json.dump(results, handle, indent=1, default=str)
            print(f"\nwrote {args.json_out}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
