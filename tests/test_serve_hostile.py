"""The sidecar treats every request as hostile: authentication, Origin and
Host checks, bounds on bodies, headers, connections and holds, a policy on
repositories and scopes, gc that can only tighten, and no file at --unix PATH
or in /tmp touched. Each test drives a real `serve` process, with raw sockets
where a client library would refuse to send the bad request."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time

import pytest

from checkoutcache.store.layout import RootPaths

from checkoutcache.client import HoldFailed

from .helpers import SCOPED, TOKEN, Serve, assert_checkout_matches, free_port, run_cli, settled


@pytest.fixture
def serve(root, tmp_path):
    running = Serve(root, tmp_path, "--allow-local")
    yield running
    running.stop()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def body_of(response: bytes) -> dict:
    return json.loads(response.partition(b"\r\n\r\n")[2])


def request(path: str, body: bytes = b"", headers: dict | None = None, method: str = "POST",
            host: str = "127.0.0.1") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def test_tcp_needs_a_token_and_refuses_browsers_and_other_hosts(serve, root, upstream):
    sha = upstream.shas[0]
    body = json.dumps({"repo": upstream.path, "commit": sha}).encode()
    host = f"127.0.0.1:{serve.port}"
    for headers, code, error in [
        ({}, 401, "UNAUTHORIZED"),
        ({"Authorization": "Bearer wrong-token-wrong-token"}, 401, "UNAUTHORIZED"),
        # A cross-origin browser POST: text/plain needs no preflight, so the page's request arrives.
        ({"Authorization": f"Bearer {TOKEN}", "Origin": "http://evil.example", "Content-Type": "text/plain"},
         403, "FORBIDDEN_ORIGIN"),
    ]:
        answer = serve.raw(request("/v1/ensure", body, {**headers, "Content-Length": len(body)}, host=host))
        assert status_of(answer) == code and body_of(answer)["error"] == error, answer
    rebinding = serve.raw(request("/v1/ensure", body, {"Authorization": f"Bearer {TOKEN}",
                                                       "Content-Length": len(body)}, host="evil.example:80"))
    assert status_of(rebinding) == 403 and body_of(rebinding)["error"] == "FORBIDDEN_ORIGIN"
    unauthorized = serve.raw(request("/v1/ensure", body, {"Content-Length": len(body)}, host=host))
    assert b"www-authenticate: bearer" in unauthorized.lower()
    assert RootPaths(root).repo_keys() == [], "nothing was done for a refused request"
    assert serve.client(token=None).health()["ok"] is True  # /healthz needs no token
    assert serve.client().ensure(upstream.path, sha, wait=60).state == "ready"


def test_serve_refuses_tcp_without_a_token(root, tmp_path):
    code, answer, _ = run_cli("serve", "--listen", f"127.0.0.1:{free_port()}", root=root,
                              env={"CHECKOUTCACHE_API_TOKEN": ""})
    assert code == 2 and "needs a bearer token" in answer["message"]


def test_content_length_tricks_are_bad_input_and_bodies_are_bounded(serve):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    host = f"127.0.0.1:{serve.port}"
    for length in ("-1", "12abc", "1, 2"):  # refused by the HTTP server itself: 400, no body, closed
        answer = serve.raw(request("/v1/ensure", b"{}", {**auth, "Content-Length": length}, host=host))
        assert status_of(answer) == 400, answer
    chunked = serve.raw(request("/v1/ensure", b"2\r\n{}\r\n0\r\n\r\n", {**auth, "Transfer-Encoding": "chunked"},
                                host=host))
    assert status_of(chunked) == 400 and body_of(chunked)["error"] == "BAD_ARGUMENT"
    before = serve.vm_hwm_kib()
    # A client that streams 200 MB: refused by its header, never read.
    with socket.create_connection(("127.0.0.1", serve.port), timeout=10) as sock:
        sock.sendall(request("/v1/ensure", b"", {**auth, "Content-Length": str(200 << 20)}, host=host))
        sent = 0
        try:
            while sent < 200 << 20:
                sock.sendall(b"x" * (1 << 20))
                sent += 1 << 20
        except OSError:
            pass
        answer = b""
        try:
            answer = sock.recv(65536)
        except OSError:
            pass
    assert sent < 200 << 20, "the server kept reading the oversized body"
    assert answer == b"" or status_of(answer) == 413
    assert serve.vm_hwm_kib() - before < 20 * 1024, "serve's memory grew with the body"
    large = serve.raw(request("/v1/ensure", b"", {**auth, "Content-Length": str(1 << 20)}, host=host))
    assert status_of(large) == 413 and body_of(large)["error"] == "PAYLOAD_TOO_LARGE"


def test_gc_over_the_api_cannot_lower_the_grace_window(serve, upstream):
    client = serve.client()
    assert client.ensure(upstream.path, upstream.shas[0], wait=60).state == "ready"
    settled(serve.root)  # the worker's tidying after its answer (its scratch) is not the checkout's to keep
    for grace in ("0", 0, "1ms"):
        report = client.gc(max_checkouts=0, grace=grace)
        assert report.removed == [] and [k["why"] for k in report.kept_over_limit] == ["grace"]
    for bad in ("NaN", "inf", "-1", 1e309):
        status = serve.raw(request("/v1/gc", json.dumps({"grace": bad}).encode().replace(b"Infinity", b"1e999"),
                                   {"Authorization": f"Bearer {TOKEN}",
                                    "Content-Length": len(json.dumps({"grace": bad}).replace("Infinity",
                                                                                             "1e999"))},
                                   host=f"127.0.0.1:{serve.port}"))
        assert status_of(status) == 400, (bad, status)
    assert client.ensure(upstream.path, upstream.shas[0]).state == "ready"


def test_holds_are_bounded_and_health_survives(root, tmp_path, upstream):
    running = Serve(root, tmp_path, "--allow-local", "--max-holds", "6", "--max-holds-per-token", "4")
    try:
        client, scoped = running.client(), running.client(token=SCOPED)
        sha = upstream.shas[0]
        assert client.ensure(upstream.path, sha, wait=60).state == "ready"
        holds = [client.hold(upstream.path, sha) for _ in range(4)]
        assert all(h.held for h in holds) and len(holds) == 4
        with pytest.raises(HoldFailed) as over:
            client.hold(upstream.path, sha)
        assert over.value.answer.error == "TOO_MANY_HOLDS"
        others = [scoped.hold(upstream.path, sha, scope="team-a", wait=60) for _ in range(2)]
        assert all(h.held for h in others) and len(others) == 2
        with pytest.raises(HoldFailed) as over:
            scoped.hold(upstream.path, sha, scope="team-a")
        assert over.value.answer.error == "TOO_MANY_HOLDS"  # 6 in all
        assert client.health()["ok"] and client.ensure(upstream.path, sha).state == "ready"
        # A hold is its owner's: another token cannot release it.
        assert scoped.release(holds[0].hold_id).error == "UNKNOWN_HOLD"
        for held in holds + others:
            held.release()
        assert client.hold(upstream.path, sha).held
    finally:
        running.stop()


def test_concurrent_health_probes_never_flap(serve):
    results = []

    def probe() -> None:
        with serve.client(token=None) as client:
            results.append(client.health()["ok"])

    threads = [threading.Thread(target=probe) for _ in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 24 and set(results) == {True}


def test_odd_paths_never_grow_the_metrics(serve):
    host = f"127.0.0.1:{serve.port}"
    with socket.create_connection(("127.0.0.1", serve.port), timeout=10) as sock:
        for number in range(1500):
            sock.sendall(request(f"/v1/odd-{number}", b"", {"Authorization": f"Bearer {TOKEN}"}, "GET", host))
        time.sleep(0.2)
    metrics = serve.client().metrics()
    assert "odd-" not in metrics and len(metrics) < 60_000
    assert 'endpoint="other"' in metrics


@pytest.mark.slow
def test_api_policy_on_local_paths_scopes_and_status(root, tmp_path, upstream, served_upstream):
    running = Serve(root, tmp_path)  # the defaults: no local paths through the API
    try:
        client, scoped = running.client(), running.client(token=SCOPED)
        sha = upstream.shas[0]
        for repo in (upstream.path, "file://" + upstream.path, "relative/path", "~/repo", "./repo"):
            answer = client.ensure(repo, sha)
            assert answer.error == "FORBIDDEN_REPOSITORY", (repo, answer)
        served, url = served_upstream
        assert scoped.ensure(url, served.shas[0], scope="team-b").error == "FORBIDDEN_SCOPE"
        assert scoped.ensure(url, served.shas[0], scope="team-a", wait=60).state == "ready"
        assert client.ensure(url, served.shas[0], wait=60).state == "ready"  # the default scope
        assert [r.scope for r in scoped.status().repos] == ["team-a"]
        assert sorted(r.scope for r in client.status().repos) == ["default", "team-a"]
    finally:
        running.stop()
    patterned = Serve(root, tmp_path, "--allow-repo", "git://127.0.0.1:*/allowed-*")
    try:
        answer = patterned.client().ensure(url, served.shas[0])
        assert answer.error == "FORBIDDEN_REPOSITORY" and "matches no allowed pattern" in answer.message
    finally:
        patterned.stop()


def test_unix_socket_mode_and_a_regular_file_at_its_path(root, tmp_path, upstream):
    path = str(tmp_path / "cc.sock")
    victim = tmp_path / "not-a-socket"
    victim.write_text("precious")
    code, answer, _ = run_cli("serve", "--unix", str(victim), root=root)
    assert code == 2 and "is not a socket" in answer["message"] and victim.read_text() == "precious"
    old = os.umask(0)
    try:
        running = Serve(root, tmp_path, "--allow-local", unix=path, tokens="")
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        assert running.client(token=None).ensure(upstream.path, upstream.shas[0], wait=60).state == "ready"
    finally:
        running.stop()
    assert not os.path.exists(path)


def test_the_journal_lives_under_the_root_and_no_symlink_is_followed(root, tmp_path, upstream):
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    running = Serve(root, tmp_path, "--allow-local")
    try:
        [journal] = RootPaths(root).serve_journals()
        assert os.path.dirname(journal) == RootPaths(root).serve_dir
        os.unlink(journal)  # a group member replaces it with a symlink
        os.symlink(victim, journal)
        answer = running.client().ensure(upstream.path, upstream.shas[0], wait=60)
        assert answer.state == "ready"
        assert_checkout_matches(answer.path, upstream.path, upstream.shas[0])
        assert victim.read_text() == "untouched\n"
    finally:
        running.stop()


@pytest.mark.slow
def test_a_slow_sender_is_dropped(serve):
    with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as sock:
        started = time.monotonic()

        def drip() -> None:
            try:
                for byte in b"POST /v1/ensure HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 60:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.5)
            except OSError:
                pass  # dropped

        sender = threading.Thread(target=drip, daemon=True)
        sender.start()
        try:
            closed = sock.recv(65536) == b""  # the server closes the connection on its deadline
        except ConnectionResetError:
            closed = True
        elapsed = time.monotonic() - started
    assert closed and elapsed < 18, f"the server kept a one-byte-a-half-second sender {elapsed:.1f}s"
    assert serve.client().health()["ok"]


def test_a_forward_jump_of_the_clock_cannot_make_serve_evict_what_it_just_served(root, tmp_path, upstream):
    running = Serve(root, tmp_path, "--allow-local")
    try:
        client = running.client()
        sha = upstream.shas[0]
        answer = client.ensure(upstream.path, sha, wait=60)
        assert answer.state == "ready"
        # The wall clock jumps two hours forward: by its marker, the use looks two hours old.
        marker = RootPaths(root).repo(RootPaths(root).repo_keys()[0]).ready_marker(sha)
        then = time.time() - 7200
        os.utime(marker, (then, then))
        report = client.gc(max_checkouts=0)
        assert report.removed == [] and [k["why"] for k in report.kept_over_limit] == ["grace"]
        assert os.path.isdir(answer.path)
    finally:
        running.stop()
    # What is not protected: a gc of another process (cron) knows only the marker's wall-clock time.
    code, report, _ = run_cli("gc", "--max-checkouts", "0", root=root)
    assert code == 0 and [r["reason"] for r in report["removed"] if r["name"] == sha] == ["lru"]


def test_a_scoped_token_may_not_run_gc_over_every_scope(root, tmp_path, served_upstream):
    served, url = served_upstream
    code, _, _ = run_cli("ensure", url, served.shas[0], "--scope", "team-b", "--wait", "60", root=root)
    assert code == 0
    running = Serve(root, tmp_path, "--grace", "0s")
    try:
        scoped = running.client(token=SCOPED)  # scope team-a only
        for request in ({"max_checkouts": 0}, {"dry_run": True}):
            status, body = running.request("POST", "/v1/gc", request, token=SCOPED)
            assert status == 403 and body["error"] == "FORBIDDEN_SCOPE", body
        assert scoped.status().repos == []
        report = running.client().gc(max_checkouts=0)  # a token of every scope may
        assert [r["reason"] for r in report.removed] == ["lru"]
    finally:
        running.stop()
