#!/usr/bin/env python3
"""The sidecar's HTTP stack: today's `checkoutcache serve` (standard library
ThreadingHTTPServer, hardened) beside uvicorn (httptools + uvloop) serving a raw
ASGI app or Starlette, in one run, on ready answers of POST /v1/ensure.

    python benchmarks/serve_stacks.py --quick                    # under 2 minutes
    python benchmarks/serve_stacks.py --seconds 10 --rounds 3 --json-out stacks.json

Bar (the sidecar API issue): >= 5000 ready answers/s and p99 <= 20 ms with 64
concurrent keep-alive clients on a 2-core machine.

Self-contained: a repository made with git, its own root, each server on
127.0.0.1 on a free port, started and stopped here, variants interleaved
round by round. Every variant does the same work per request: Origin and Host
checks, the bearer token (the policy's constant-time compare), JSON body,
Service.ensure (policy checks, Cache.ensure, the answers counter), the request
histogram, a JSON answer. The ASGI apps run ensure inline on the event loop
(a ready answer does not block). Load: wrk (-t1, keep-alive) when installed
(`apt-get install wrk`), else a Python asyncio load generator in its own
process. Children import checkoutcache from this checkout.

Needs the `bench` extra: pip install -e '.[bench]'
(uvicorn, httptools, uvloop, starlette).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT = os.path.dirname(HERE)
PY = sys.executable
BAR_RPS, BAR_P99_MS = 5000, 20.0
UVICORN_OPTS = ["--http", "httptools", "--loop", "uvloop", "--no-access-log", "--log-level", "warning",
                "--timeout-keep-alive", "5", "--limit-concurrency", "256", "--backlog", "2048"]
BENCH_MODULES = ("uvicorn", "httptools", "uvloop", "starlette")
MAX_BODY = 64 * 1024


# --------------------------------------------------------------- the ASGI apps
# Run inside uvicorn (`serve_stacks:raw_app`, `serve_stacks:starlette_app --factory`),
# configured by SERVE_STACKS_* in the environment.

class _Backend:
    """One Service per process, and the same admission checks as serve/http.py."""

    def __init__(self):
        from checkoutcache.cache import Cache
        from checkoutcache.config import Config
        from checkoutcache.serve.http import allowed_hosts
        from checkoutcache.serve.policy import ApiPolicy, parse_tokens
        from checkoutcache.serve.service import Service
        from checkoutcache.store.create import init_root, make_dirs

        root = os.environ["SERVE_STACKS_ROOT"]
        config = Config.from_env()
        cache = Cache(root, config=config)
        init_root(cache.paths)
        make_dirs(cache.paths.serve_dir)
        policy = ApiPolicy(tokens=parse_tokens(os.environ["SERVE_STACKS_TOKEN"], "SERVE_STACKS_TOKEN"),
                           allow_local=True)
        self.service = Service(cache, config, 0.0, cache.paths.serve_journal(os.getpid()), policy)
        self.hosts = allowed_hosts("127.0.0.1", int(os.environ["SERVE_STACKS_PORT"]))

    def ensure(self, headers: dict[bytes, bytes], body: bytes) -> tuple[int, bytes, list]:
        """(status, JSON body, extra headers): what serve/http.py answers to POST /v1/ensure."""
        from checkoutcache.answers import Answer
        from checkoutcache.errors import CheckoutCacheError
        from checkoutcache.serve.service import http_status

        extra = []
        try:
            if b"origin" in headers:
                raise CheckoutCacheError("FORBIDDEN_ORIGIN", why="an Origin header")
            host = headers.get(b"host", b"").decode("latin-1").lower()
            if host not in self.hosts:
                raise CheckoutCacheError("FORBIDDEN_ORIGIN", why=f"Host {host[:80]!r}")
            authorization = headers.get(b"authorization")
            grant = self.service.policy.authenticate(authorization.decode("latin-1") if authorization else None,
                                                     True)
            params = {}
            if body:
                try:
                    params = json.loads(body)
                except ValueError:
                    raise CheckoutCacheError("BAD_ARGUMENT", what="the request body is not JSON") from None
                if not isinstance(params, dict):
                    raise CheckoutCacheError("BAD_ARGUMENT", what="the request body must be a JSON object")
            answer = self.service.ensure(params, grant)
            if answer.retry_after:
                extra.append((b"retry-after", str(answer.retry_after).encode()))
            status, data = http_status(answer), answer.to_json()
        except CheckoutCacheError as exc:
            answer = Answer.from_error(exc)
            status, data = http_status(answer), answer.to_json()
            if exc.code == "UNAUTHORIZED":
                extra.append((b"www-authenticate", b'Bearer realm="checkoutcache"'))
        return status, (json.dumps(data, sort_keys=True) + "\n").encode(), extra

    def observe(self, path: str, started: float) -> None:
        self.service.metrics.requests.labels(path).observe(time.monotonic() - started)


_backend: _Backend | None = None


def backend() -> _Backend:
    global _backend
    if _backend is None:
        _backend = _Backend()
    return _backend


async def raw_app(scope, receive, send) -> None:
    """A bare ASGI callable: one route, the body streamed with a 64 KiB cap."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                backend()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    started = time.monotonic()
    b = backend()
    headers = dict(scope["headers"])  # ASGI header names are lower case
    extra: list = []
    if scope["path"] != "/v1/ensure" or scope["method"] != "POST":
        status, data = 404, b'{"error": "NOT_FOUND"}\n'
    else:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                break
            chunks.append(chunk)
            more = message.get("more_body", False)
        if size > MAX_BODY:
            status, data, extra = 413, b'{"error": "PAYLOAD_TOO_LARGE"}\n', [(b"connection", b"close")]
        else:
            status, data, extra = b.ensure(headers, b"".join(chunks))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())] + extra})
    await send({"type": "http.response.body", "body": data})
    b.observe("/v1/ensure" if scope["path"] == "/v1/ensure" else "other", started)


def starlette_app():
    """Starlette, one route. Its request.body() has no cap, so the body is streamed with one."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def ensure(request: Request) -> Response:
        started = time.monotonic()
        b = backend()
        try:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY:
                    return Response(b'{"error": "PAYLOAD_TOO_LARGE"}\n', 413, {"connection": "close"},
                                    media_type="application/json")
                chunks.append(chunk)
            headers = {k.encode("latin-1"): v.encode("latin-1") for k, v in request.headers.items()}
            status, data, extra = b.ensure(headers, b"".join(chunks))
            return Response(data, status, {k.decode(): v.decode() for k, v in extra}, media_type="application/json")
        except ClientDisconnect:
            return Response(status_code=400)
        finally:
            b.observe("/v1/ensure", started)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        backend()
        yield

    return Starlette(routes=[Route("/v1/ensure", ensure, methods=["POST"])], lifespan=lifespan)


# --------------------------------------------------------------- load generator

async def _loadgen(port: int, connections: int, seconds: float, request: bytes) -> dict:
    latencies: list[float] = []
    errors = {"connect": 0, "read": 0, "status": 0, "timeout": 0}
    stop_at = time.monotonic() + seconds

    async def client() -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            errors["connect"] += 1
            return
        try:
            while time.monotonic() < stop_at:
                t = time.perf_counter()
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - t)
                if not head.startswith(b"HTTP/1.1 200"):
                    errors["status"] += 1
        except asyncio.TimeoutError:
            errors["timeout"] += 1
        except (OSError, asyncio.IncompleteReadError):
            errors["read"] += 1
        finally:
            writer.close()

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(connections)))
    duration = time.monotonic() - started
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else float("nan")

    return {"requests": len(latencies), "duration_s": duration, "p50_ms": pct(0.50), "p90_ms": pct(0.90),
            "p99_ms": pct(0.99), "max_ms": latencies[-1] * 1000 if latencies else float("nan"),
            **{f"err_{k}": v for k, v in errors.items()}}


WRK_LUA = """
wrk.method = "POST"
wrk.body = %(body)s
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = %(auth)s
done = function(summary, latency, requests)
  io.write(string.format('JSON {"requests":%%d,"duration_s":%%f,"err_connect":%%d,"err_read":%%d,' ..
    '"err_write":%%d,"err_status":%%d,"err_timeout":%%d,"p50_ms":%%.3f,"p90_ms":%%.3f,"p99_ms":%%.3f,' ..
    '"max_ms":%%.3f}\\n',
    summary.requests, summary.duration / 1e6, summary.errors.connect, summary.errors.read,
    summary.errors.write, summary.errors.status, summary.errors.timeout, latency:percentile(50)/1000,
    latency:percentile(90)/1000, latency:percentile(99)/1000, latency.max/1000))
end
"""


def load(gen: str, port: int, seconds: float, connections: int, body: str, token: str, work: str) -> dict:
    """One load run in its own process: its result, and the CPU it used."""
    if gen == "wrk":
        lua = os.path.join(work, "post.lua")
        with open(lua, "w") as handle:
            handle.write(WRK_LUA % {"body": json.dumps(body), "auth": json.dumps(f"Bearer {token}")})
        cmd = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "5s", "-s", lua,
               f"http://127.0.0.1:{port}/v1/ensure"]
    else:
        cmd = [PY, os.path.abspath(__file__), "--_loadgen", json.dumps(
            {"port": port, "connections": connections, "seconds": seconds, "body": body, "token": token})]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _, _, usage = os.wait4(proc.pid, 0)
        out.seek(0)
        text = out.read()
    lines = [line for line in text.splitlines() if line.startswith("JSON ")]
    if not lines:
        raise RuntimeError(f"load generator failed: {text[-2000:]}")
    result = json.loads(lines[0][5:])
    result["loadgen_cpu_s"] = usage.ru_utime + usage.ru_stime
    return result


def loadgen_main(spec: dict) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    body = spec["body"].encode()
    request = (f"POST /v1/ensure HTTP/1.1\r\nHost: 127.0.0.1:{spec['port']}\r\nContent-Type: application/json\r\n"
               f"Authorization: Bearer {spec['token']}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    result = asyncio.run(_loadgen(spec["port"], spec["connections"], spec["seconds"], request))
    print("JSON " + json.dumps(result), flush=True)


# --------------------------------------------------------------- the run

def git(cwd: str, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.com",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@example.com"}
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """CPU of the process and its children (serve's ready path starts none)."""
    total, pids = 0.0, {pid}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(entry) in pids or int(fields[1]) in pids:
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def machine_busy_s() -> float:
    with open("/proc/stat") as handle:
        v = [int(x) for x in handle.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def variants(root: str) -> dict:
    uv = [PY, "-m", "uvicorn", "--app-dir", HERE] + UVICORN_OPTS
    return {
        "serve (stdlib, today)": lambda port: [PY, "-m", "checkoutcache", "--root", root, "serve", "--listen",
                                               f"127.0.0.1:{port}", "--gc-interval", "0", "--allow-local"],
        "uvicorn + raw ASGI": lambda port: uv + ["--port", str(port), "serve_stacks:raw_app"],
        "uvicorn + Starlette": lambda port: uv + ["--factory", "--port", str(port), "serve_stacks:starlette_app"],
    }


def post(port: int, body: str, token: str) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", "/v1/ensure", body, {"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {token}"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def run_one(name, make_cmd, env, args, body, token, work) -> dict:
    port = free_port()
    log = open(os.path.join(work, "server.log"), "a")
    proc = subprocess.Popen(make_cmd(port), cwd=HERE, env={**env, "SERVE_STACKS_PORT": str(port)},
                            stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                status, answer = post(port, body, token)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    with open(os.path.join(work, "server.log")) as handle:
                        raise RuntimeError(f"{name} did not start: {handle.read()[-2000:]}")
                time.sleep(0.1)
        if status != 200 or answer.get("state") != "ready":
            raise RuntimeError(f"{name}: {status} {answer}")
        load(args.gen, port, args.warmup, args.connections, body, token, work)  # warm-up, not counted
        cpu0, busy0, t0 = cpu_seconds(proc.pid), machine_busy_s(), time.monotonic()
        result = load(args.gen, port, args.seconds, args.connections, body, token, work)
        wall = time.monotonic() - t0
        server_cpu = cpu_seconds(proc.pid) - cpu0
        busy = machine_busy_s() - busy0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    result.update(name=name, wall_s=wall, server_cpu_s=server_cpu, rps=result["requests"] / result["duration_s"],
                  server_cores=server_cpu / wall, loadgen_cores=result["loadgen_cpu_s"] / wall,
                  other_cores=max(0.0, busy - server_cpu - result["loadgen_cpu_s"]) / wall,
                  cpu_us_per_req=server_cpu / max(1, result["requests"]) * 1e6,
                  errors=sum(v for k, v in result.items() if k.startswith("err_")))
    return result


def setup(work: str) -> dict:
    repo, root = os.path.join(work, "repo"), os.path.join(work, "root")
    os.makedirs(repo)
    git(repo, "init", "-q", "-b", "main")
    for i in range(20):
        with open(os.path.join(repo, f"file{i}.txt"), "w") as handle:
            handle.write(f"content {i}\n" * 100)
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "one")
    sha = git(repo, "rev-parse", "HEAD")
    subprocess.run([PY, "-m", "checkoutcache", "--root", root, "ensure", repo, sha, "--wait", "60"],
                   check=True, capture_output=True, env=child_env())
    return {"repo": repo, "root": root, "commit": sha}


def child_env() -> dict:
    path = os.pathsep.join(p for p in (PROJECT, HERE, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def missing_modules() -> list[str]:
    import importlib.util

    return [m for m in BENCH_MODULES if importlib.util.find_spec(m) is None]


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--_loadgen":
        loadgen_main(json.loads(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 s per measurement, 2 rounds (about a minute)")
    ap.add_argument("--seconds", type=float, default=10.0, help="each measurement (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--load", dest="gen", choices=("auto", "wrk", "python"), default="auto",
                    help="load generator (auto: wrk if installed)")
    ap.add_argument("--only", default=None, help="comma-separated substrings of variant names")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.rounds = 4.0, 2
    args.warmup = 1.0 if args.quick else 2.0
    if args.gen == "auto":
        args.gen = "wrk" if shutil.which("wrk") else "python"
    missing = missing_modules()
    if missing:
        print(f"missing {', '.join(missing)}: these are benchmark-only dependencies; install them with\n"
              f"    pip install -e '{PROJECT}[bench]'\n(or pip install uvicorn httptools uvloop starlette)",
              file=sys.stderr)
        return 2
    if args.gen == "python":
        print("wrk not found: using the Python load generator (it takes more CPU from the server's cores; "
              "apt-get install wrk for the figures in RESULTS.md)", file=sys.stderr)
    work = tempfile.mkdtemp(prefix="serve-stacks-")
    token = secrets.token_urlsafe(24)
    try:
        info = setup(work)
        body = json.dumps({"repo": info["repo"], "commit": info["commit"]})
        env = {**child_env(), "CHECKOUTCACHE_API_TOKEN": token, "SERVE_STACKS_ROOT": info["root"],
               "SERVE_STACKS_TOKEN": token}
        all_variants = variants(info["root"])
        names = [n for n in all_variants if not args.only or any(s in n for s in args.only.split(","))]
        load_before = loadavg()
        print(f"load average before: {load_before}; {os.cpu_count()} cores; load: {args.gen}, "
              f"{args.connections} connections, {args.seconds:g} s x {args.rounds} rounds", flush=True)
        results = []
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                res = run_one(name, all_variants[name], env, args, body, token, work)
                res["round"] = r
                results.append(res)
                print(f"round {r} {name:22s} {res['rps']:7.0f}/s p50 {res['p50_ms']:6.2f} p99 {res['p99_ms']:7.2f} "
                      f"ms, server {res['cpu_us_per_req']:4.0f} us/req ({res['server_cores']:.2f} cores), "
                      f"load gen {res['loadgen_cores']:.2f}, other {res['other_cores']:.2f}, errors {res['errors']}",
                      flush=True)
        load_after = loadavg()
        summary = []
        print(f"\nmedian over {args.rounds} rounds; bar: >= {BAR_RPS} answers/s and p99 <= {BAR_P99_MS:g} ms "
              f"at {args.connections} clients; load average before {load_before}, after {load_after}\n")
        print("| stack | req/s | p50 ms | p99 ms | server CPU us/req | server cores | other cores | errors | bar |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for name in names:
            rows = [x for x in results if x["name"] == name]
            m = {k: statistics.median(x[k] for x in rows) for k in
                 ("rps", "p50_ms", "p99_ms", "cpu_us_per_req", "server_cores", "other_cores")}
            m["errors"] = sum(x["errors"] for x in rows)
            m["name"] = name
            m["meets_bar"] = m["rps"] >= BAR_RPS and m["p99_ms"] <= BAR_P99_MS and m["errors"] == 0
            summary.append(m)
            why = [] if m["meets_bar"] else (
                ([f"{m['rps'] / BAR_RPS:.0%} of the rate"] if m["rps"] < BAR_RPS else [])
                + ([f"p99 {m['p99_ms'] / BAR_P99_MS:.1f}x"] if m["p99_ms"] > BAR_P99_MS else [])
                + (["errors"] if m["errors"] else []))
            print(f"| {name} | {m['rps']:.0f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {m['cpu_us_per_req']:.0f} | "
                  f"{m['server_cores']:.2f} | {m['other_cores']:.2f} | {m['errors']} | "
                  f"{'met' if m['meets_bar'] else 'missed (' + ', '.join(why) + ')'} |")
        if args.json_out:
            with open(args.json_out, "w") as handle:
                json.dump({"bar": {"rps": BAR_RPS, "p99_ms": BAR_P99_MS, "connections": args.connections},
                           "machine": {"cores": os.cpu_count(), "python": sys.version, "platform": platform.platform(),
                                       "loadavg_before": load_before, "loadavg_after": load_after},
                           "load_generator": args.gen, "seconds": args.seconds, "rounds": args.rounds,
                           "uvicorn_opts": UVICORN_OPTS, "results": results, "summary": summary}, handle, indent=1)
            print(f"\nwrote {args.json_out}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
