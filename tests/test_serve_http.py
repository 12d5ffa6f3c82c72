"""serve on a well-kept HTTP server (issue #20): malformed requests, floods,
refused bodies, tokens, holds, listeners, the journal, logs, settings, metrics
and the client, each against a live `serve`, with raw sockets where a client
library would refuse to send the request."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from checkoutcache.client import Client, GcResult, HoldFailed, Status
from checkoutcache.config import Config, PublishSettings, ServeSettings, options_table
from checkoutcache.store.layout import RootPaths

from .helpers import SCOPED, TOKEN, Serve, free_port, run_cli, wait_ready, wait_until

README = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()


@pytest.fixture
def serve(root, tmp_path):
    running = Serve(root, tmp_path, "--allow-local", "--log-format", "json")
    yield running
    running.stop()


def raw(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send bytes as they are; everything the server sends until it closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (socket.timeout, ConnectionResetError):
            pass
        return b"".join(chunks)


def responses(data: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each HTTP response in a byte stream (Content-Length framed)."""
    found = []
    while data.startswith(b"HTTP/1."):
        head, _, rest = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        found.append((int(head.split(b" ", 2)[1]), rest[:length]))
        data = rest[length:]
    return found


def post(port: int, path: str, body: bytes, token: str | None = TOKEN, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}Content-Length: {len(body)}\r\n{extra}"
            f"\r\n").encode() + body


def journal_lines(running: Serve) -> list[dict]:
    lines = []
    for line in running.log().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass
    return lines


# ------------------------------------------------------------ the parser is the server's

@pytest.mark.slow
def test_malformed_requests_are_answered_never_as_a_crash_or_html(serve, upstream):
    """Regression: `Content-Length: ²`, a 5,000-digit length, 60,000-deep JSON and a lone surrogate
    answered 503 INTERNAL_ERROR; too many or too long headers an HTML 431; a bad HTTP version, an
    over-long request line and an HTTP/0.9 line nothing at all; each wrote a traceback to the log."""
    port = serve.port
    host = f"Host: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
    cases = {
        "superscript length": f"POST /v1/ensure HTTP/1.1\r\n{host}Content-Length: \u00b2\r\n\r\n{{}}".encode(),
        "5000-digit length": f"POST /v1/ensure HTTP/1.1\r\n{host}Content-Length: {'9' * 5000}\r\n\r\n".encode(),
        "200 headers": f"GET /healthz HTTP/1.1\r\n{host}".encode() + b"".join(b"X-%d: y\r\n" % n for n in range(200))
        + b"\r\n",
        "long headers": f"GET /healthz HTTP/1.1\r\n{host}X-Big: {'a' * 200_000}\r\n\r\n".encode(),
        "bad version": f"GET /healthz HTTP/9.9\r\n{host}\r\n".encode(),
        "HTTP/0.9": b"GET /healthz\r\n",
        "long request line": f"GET /{'a' * 100_000} HTTP/1.1\r\n{host}\r\n".encode(),
    }
    for name, data in cases.items():
        answer = raw(port, data)
        assert answer.startswith(b"HTTP/1.1 4"), (name, answer[:200])  # 400, 413, 414, 431
        assert b"<html" not in answer.lower() and b"<!doctype" not in answer.lower(), (name, answer[:300])
    deep = ("[" * 32_000 + "]" * 32_000).encode()  # as deep as 64 KiB holds
    surrogate = b'{"repo": "/x\\ud800y", "commit": "' + upstream.shas[0].encode() + b'"}'
    for name, body in (("deep JSON", b'{"repo": ' + deep + b'}'), ("lone surrogate", surrogate)):
        (status, data), = responses(raw(port, post(port, "/v1/ensure", body)))
        assert status == 400 and json.loads(data)["error"] == "BAD_ARGUMENT", (name, data)
    # Unauthenticated nonsense too: never a traceback in serve's log.
    raw(port, post(port, "/v1/ensure", b"{nonsense", token=None))
    assert serve.client().health()["ok"]
    assert "Traceback" not in serve.log()


@pytest.mark.slow
def test_a_refused_requests_body_is_never_read_as_the_next_request(serve):
    """Regression: the body of a request refused with 401 or 403 was parsed as the next request
    on the connection: an inner request passed the Origin and Host checks, and the project's own
    Client failed after one 401 with "HTTP 400 without a JSON body"."""
    port = serve.port
    inner = f"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
    for refused in (post(port, "/v1/ensure", inner, token=None),
                    post(port, "/v1/ensure", inner, extra="Origin: http://evil.example\r\n")):
        answered = responses(raw(port, refused))
        assert [status for status, _ in answered] in ([401], [403]), answered
    wrong = Client(f"http://127.0.0.1:{port}", token="not-the-token-at-all")
    for _ in range(3):  # one client, one connection: every answer is the API's
        assert wrong.ensure("/x", "a" * 40).error == "UNAUTHORIZED"
    wrong.close()


# ------------------------------------------------------------ floods

@pytest.mark.slow
def test_idle_and_header_flooding_connections_cannot_starve_health_or_ready_answers(serve, upstream):
    """Regression: 72 unauthenticated sockets sending one byte each kept /healthz at 503
    SERVER_BUSY, and 24 connections of unfinished header lines pinned 150 MB."""
    client = serve.client()
    sha = upstream.shas[0]
    assert client.ensure(upstream.path, sha, wait=60).state == "ready"
    before = serve.vm_hwm_kib()
    idle, flooding = [], []
    try:
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", serve.port), timeout=10)
            sock.sendall(b"G")
            idle.append(sock)
        for _ in range(24):
            sock = socket.create_connection(("127.0.0.1", serve.port), timeout=10)
            sock.sendall(b"POST /v1/ensure HTTP/1.1\r\n" + b"X-Flood: " + b"a" * 60_000)
            flooding.append(sock)
        for _ in range(20):
            assert client.health()["ok"]
            assert client.ensure(upstream.path, sha).state == "ready"
        assert serve.vm_hwm_kib() - before < 100 * 1024, "the floods pinned memory"
        # The header deadline closes what never finished its request line or headers.
        wait_until(lambda: all(_closed(sock) for sock in idle[:10] + flooding[:5]), 30,
                   "the header deadline to close the floods")
    finally:
        for sock in idle + flooding:
            sock.close()


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(0.01)
    try:
        return sock.recv(65536) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


@pytest.mark.slow
def test_requests_waiting_on_clones_never_take_what_ready_answers_need(root, tmp_path, upstream, fake_git):
    ready_sha, slow_sha = upstream.shas[0], upstream.shas[2]
    wait_ready(root, upstream.path, ready_sha)
    running = Serve(root, tmp_path, "--allow-local", "--max-waiting", "4", "--gc-interval", "0",
                    env=fake_git('case "$*" in *" checkout "*) sleep 5;; esac'))
    try:
        waiting = []
        threads = [threading.Thread(target=lambda: waiting.append(running.request(
            "POST", "/v1/ensure", {"repo": upstream.path, "commit": slow_sha, "wait": 60}))) for _ in range(4)]
        for thread in threads:
            thread.start()
        wait_until(lambda: "checkoutcache_requests_waiting 4.0" in running.request("GET", "/metrics")[1], 30,
                   "four requests to wait on the clone")
        status, busy = running.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": slow_sha, "wait": 60})
        assert status == 503 and busy["error"] == "SERVER_BUSY", busy
        client = running.client()
        for _ in range(50):  # meanwhile, every ready answer comes (none waits behind the clone)
            assert client.ensure(upstream.path, ready_sha).state == "ready"
        assert len(waiting) == 0  # the four were still waiting all along
        for thread in threads:
            thread.join(60)
        assert [body["state"] for _, body in waiting] == ["ready"] * 4
    finally:
        running.stop()


# ------------------------------------------------------------ tokens and holds

def test_tokens_are_told_apart_by_what_they_are_not_by_their_order(root, tmp_path, upstream):
    """Regression: tokens from --token-file and CHECKOUTCACHE_API_TOKEN were both named token-1:
    a token limited to team-a released the other's hold, and they shared one quota."""
    running = Serve(root, tmp_path, "--allow-local", "--max-holds-per-token", "1", "--log-format", "json",
                    tokens=f"{SCOPED} default\n",
                    env={"CHECKOUTCACHE_API_TOKEN": TOKEN})
    try:
        everyone, limited = running.client(), running.client(token=SCOPED)
        sha = upstream.shas[0]
        held = everyone.hold(upstream.path, sha, wait=60)
        mine = limited.hold(upstream.path, sha)  # its own quota of one: not the other's
        assert held.held and mine.held
        assert limited.release(held.hold_id).error == "UNKNOWN_HOLD"
        assert everyone.release(held.hold_id) is None and limited.release(mine.hold_id) is None
        def token_names() -> set:  # access lines are written in batches: wait for both
            named = {line.get("token") for line in journal_lines(running)
                     if line.get("logger") == "checkoutcache.access"} - {None}
            return named if len(named) >= 2 else set()

        names = wait_until(token_names, 10, "both tokens' access lines")
        assert len(names) == 2 and not any(TOKEN in str(n) or SCOPED in str(n) for n in names)
    finally:
        running.stop()


def test_concurrent_holds_never_answer_internal_error(serve, upstream):
    """Regression: concurrent holds occasionally answered INTERNAL_ERROR ("dictionary changed size
    during iteration": the quota was counted over the holds while another thread added one)."""
    sha = upstream.shas[0]
    assert serve.client().ensure(upstream.path, sha, wait=60).state == "ready"
    errors, done = [], []

    def churn() -> None:
        with serve.client() as client:
            for _ in range(15):
                try:
                    held = client.hold(upstream.path, sha)
                    held.release()
                    done.append(1)
                except HoldFailed as exc:
                    errors.append(exc.answer.error)

    threads = [threading.Thread(target=churn) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(done) + len(errors) == 16 * 15 and len(done) > 0
    assert set(errors) <= {"TOO_MANY_HOLDS"}, errors


# ------------------------------------------------------------ listeners

@pytest.mark.slow
def test_a_wildcard_listener_serves_real_clients(root, tmp_path, upstream):
    """Regression: `--listen 0.0.0.0:P --allow-remote` refused every real client with 403: only a
    literal `Host: 0.0.0.0:P` passed."""
    port = free_port()
    running = Serve(root, tmp_path, "--allow-local", "--allow-remote", listen=f"0.0.0.0:{port}")
    try:
        client = Client(f"http://127.0.0.1:{port}", token=TOKEN)
        assert client.ensure(upstream.path, upstream.shas[0], wait=60).state == "ready"
        assert client.status().totals.checkouts == 1
        answered = responses(raw(port, f"GET /healthz HTTP/1.1\r\nHost: sidecar.internal:{port}\r\nOrigin: "
                                       f"http://evil.example\r\n\r\n".encode()))
        assert answered[0][0] == 403  # a browser's page is still refused
    finally:
        running.stop()


@pytest.mark.slow
def test_the_health_port_serves_probes_and_metrics_and_nothing_else(root, tmp_path, upstream):
    """A kubelet cannot reach /healthz on a loopback listener or a socket: --health-listen serves
    /healthz, /readyz and /metrics (no token) on its own port, the API stays on the socket."""
    health = free_port()
    sock = str(tmp_path / "cc.sock")
    running = Serve(root, tmp_path, "--allow-local", "--health-listen", f"0.0.0.0:{health}", unix=sock, tokens="")
    try:
        probe = Client(f"http://127.0.0.1:{health}")
        assert probe.health()["ok"] and probe.ready()["ok"]
        assert "checkoutcache_build_info" in probe.metrics()
        status, body = responses(raw(health, post(health, "/v1/ensure", b"{}", token=None)))[0]
        assert status == 404 and json.loads(body)["error"] == "NOT_FOUND"
        assert running.client(token=None).ensure(upstream.path, upstream.shas[0], wait=60).state == "ready"
    finally:
        running.stop()


@pytest.mark.slow
def test_readiness_says_when_scheduled_gc_keeps_failing(root, tmp_path):
    """#19: a gc that fails on every interval (here a full disk at its start) made no probe fail:
    /readyz is 503 after three failures in a row, and says why; /healthz stays 200 (alive)."""
    running = Serve(root, tmp_path, "--gc-interval", "1", env={"CHECKOUTCACHE_TEST_ENOSPC_AT": "gc-start"})
    try:
        client = running.client(token=None)
        ready = wait_until(lambda: (r := client.ready()) and not r["ok"] and r, 60, "readiness to fail")
        assert ready["checks"]["scheduled_gc_failures"] >= 3 and "No space left" in ready["checks"]["scheduled_gc_error"]
        assert client.health()["ok"]
        assert "scheduled gc failed" in running.log()
    finally:
        running.stop()


# ------------------------------------------------------------ the journal

def test_a_malformed_journal_line_never_stops_the_metrics(serve, upstream):
    """Regression: one malformed journal line silently killed the follower thread: no clone was
    counted after it."""
    journal = RootPaths(serve.root).serve_journal(serve.proc.pid)
    with open(journal, "a") as handle:
        for line in ('{"event": "failed", "error": ["unhashable"]}', "[1, 2]", '{"event": 7}', "\xff not json",
                     '{"event": "seeded", "outcome": {}, "reason": []}'):
            handle.write(line + "\n")
    assert serve.client().ensure(upstream.path, upstream.shas[0], wait=60).state == "ready"
    wait_until(lambda: 'checkoutcache_clones_total{error="",outcome="published"} 1.0' in serve.client().metrics(), 30,
               "the follower to count the clone after the bad lines")


# ------------------------------------------------------------ credentials in argv

@pytest.mark.slow
def test_a_raw_at_in_a_url_password_leaves_nothing_of_it_in_argv(root, tmp_path):
    """Regression: `https://bot:se@cret-part@host/repo` left `cret-part@host` in the CLI's retitled
    argv (userinfo was cut at the first '@')."""
    tarpit = socket.socket()
    tarpit.bind(("127.0.0.1", 0))
    tarpit.listen(8)  # accepts nothing: the probe waits its timeout
    url = f"https://bot:se@cret-xyzzy@127.0.0.1:{tarpit.getsockname()[1]}/repo"
    cli = subprocess.Popen([sys.executable, "-m", "checkoutcache", "--root", root, "ensure", url, "a" * 40],
                           env=dict(os.environ, CHECKOUTCACHE_PROBE_TIMEOUT="5s"), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        seen = []
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and cli.poll() is None:
            try:
                seen.append(open(f"/proc/{cli.pid}/cmdline", "rb").read())
            except OSError:
                break
            time.sleep(0.05)
        assert len(seen) > 5, "the CLI was not sampled while it ran"
        retitled = [cmd for cmd in seen if b"ensure" in cmd and b"-m\0checkoutcache" not in cmd]
        assert retitled and not any(b"cret-xyzzy" in cmd for cmd in retitled), retitled[-1:]
    finally:
        cli.wait(30)
        tarpit.close()


# ------------------------------------------------------------ logs, settings, metrics

@pytest.mark.slow
def test_access_refusals_clones_and_gc_are_logged_as_json_without_secrets(serve, upstream):
    client = serve.client()
    assert client.ensure(upstream.path, upstream.shas[0], wait=60).state == "ready"
    raw(serve.port, post(serve.port, "/v1/status", b"", token="wrong-token-wrong-token"))
    client.gc()
    wait_until(lambda: any(l.get("event") == "clone_published" for l in journal_lines(serve)), 30,
               "the clone's publication to be logged")
    wait_until(lambda: any(l.get("endpoint") == "/v1/gc" for l in journal_lines(serve)), 10, "gc's access line")
    lines = journal_lines(serve)
    access = [l for l in lines if l.get("logger") == "checkoutcache.access"]
    assert {(l["endpoint"], l["status"]) for l in access} >= {("/v1/ensure", 200), ("/v1/status", 401),
                                                               ("/v1/gc", 200)}
    refused = [l for l in access if l.get("refused") == "token"]
    assert refused and refused[0]["error"] == "UNAUTHORIZED"
    assert all(isinstance(l["ms"], (int, float)) for l in access)
    events = {l.get("event") for l in lines}
    assert {"serving", "clone_started", "clone_published", "gc"} <= events, events
    published = next(l for l in lines if l.get("event") == "clone_published")
    assert published["repo"] == upstream.path and published["commit"] == upstream.shas[0]
    assert TOKEN not in serve.log() and "wrong-token-wrong-token" not in serve.log()


@pytest.mark.slow
def test_every_setting_is_an_option_with_its_environment_twin_and_the_readme_says_so(root, tmp_path):
    """Regression: the README's settings table named six options no command accepted, and
    CHECKOUTCACHE_LISTEN was read only by the container's entrypoint."""
    import attrs

    for command, classes in ((["ensure"], (Config,)), (["gc"], (Config,)), (["status"], (Config,)),
                             (["exec"], (Config,)), (["verify"], (Config,)), (["serve"], (ServeSettings, Config)),
                             (["bundle", "publish"], (PublishSettings, Config))):
        done = subprocess.run([sys.executable, "-m", "checkoutcache", *command, "--help"], capture_output=True,
                              text=True, env={**os.environ, "COLUMNS": "300"})
        for cls in classes:
            for field in attrs.fields(cls):
                assert f"--{field.name.replace('_', '-')}" in done.stdout, (command, field.name)
                assert field.metadata["env"] in done.stdout, (command, field.metadata["env"])
    assert options_table(Config) in README and options_table(ServeSettings) in README
    assert options_table(PublishSettings) in README
    # serve reads its listen address from the environment itself.
    port = free_port()
    running = Serve(root, tmp_path, "--allow-local", listen=None, env={"CHECKOUTCACHE_LISTEN": f"127.0.0.1:{port}"})
    try:
        assert Client(f"http://127.0.0.1:{port}", token=TOKEN).health()["ok"]
    finally:
        running.stop()
    code, answer, _ = run_cli("serve", root=root, env={"CHECKOUTCACHE_MAX_WAITING": "lots",
                                                       "CHECKOUTCACHE_API_TOKEN": TOKEN})
    assert code == 2 and answer["message"].startswith("CHECKOUTCACHE_MAX_WAITING: "), answer


def test_the_stores_gauges_are_filled_at_start(root, tmp_path, upstream):
    """Regression: gauges read 0 until the first gc, so a free-disk alert fired at every restart."""
    wait_ready(root, upstream.path, upstream.shas[0])
    running = Serve(root, tmp_path, "--allow-local", "--gc-interval", "0")
    try:
        def filled() -> str | None:
            metrics = running.client().metrics()
            return metrics if "checkoutcache_checkouts 1.0" in metrics else None

        metrics = wait_until(filled, 20, "the gauges to be filled")
        free = float(next(line.split()[1] for line in metrics.splitlines()
                          if line.startswith("checkoutcache_disk_free_bytes ")))
        assert free > 0
        assert 'checkoutcache_gc_runs_total' not in metrics or 'result="ok"} 1' not in metrics  # no gc ran
    finally:
        running.stop()


# ------------------------------------------------------------ the client

def test_the_client_takes_durations_raises_when_not_held_and_types_its_answers(serve, upstream):
    """Regression: `Client.ensure(wait="15m")` raised ValueError; `with client.hold(...)` ran its
    block when the hold failed; status and gc were untyped dicts; there was no py.typed."""
    client = serve.client()
    assert client.ensure(upstream.path, upstream.shas[0], wait="15m").state == "ready"
    with pytest.raises(HoldFailed) as failed:
        with client.hold(upstream.path, "1" * 40, wait="1s"):
            raise AssertionError("the block ran without a hold")
    assert failed.value.answer.state in ("failed", "cloning")
    with client.hold(upstream.path, upstream.shas[0], ttl="10m") as held:
        assert held.held and os.path.isdir(held.answer.path)
    status = client.status()
    assert isinstance(status, Status) and status.totals.checkouts >= 1
    assert status.repos[0].checkouts[0].commit in upstream.shas
    result = client.gc(dry_run=True)
    assert isinstance(result, GcResult) and result.dry_run is True
    import checkoutcache

    assert os.path.isfile(os.path.join(os.path.dirname(checkoutcache.__file__), "py.typed"))
