"""serve: the sidecar's HTTP API, health, metrics, holds, load and shutdown,
against a real serve process and real repositories."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from checkoutcache.store.layout import RootPaths
from checkoutcache.store.locks import is_locked

from .helpers import (
    TOKEN,
    Serve,
    assert_checkout_matches,
    make_idle,
    marker,
    only_repo,
    run_cli,
    settled,
    wait_ready,
    wait_until,
)


def Server(root: str, tmp_path, *extra: str, **kw) -> Serve:
    """These tests serve the test's own repositories, which the API's defaults refuse."""
    return Serve(root, tmp_path, "--allow-local", *extra, **kw)


@pytest.fixture
def server(root, tmp_path):
    running = Server(root, tmp_path, "--gc-interval", "0")
    yield running
    running.stop()


def test_ensure_over_http_answers_like_the_cli(server, root, upstream):
    sha = upstream.shas[1]
    status, first = server.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": sha})
    assert (status, first["state"]) == (202, "cloning")  # no wait: the clone has only just started
    status, ready = server.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": sha, "wait": 60})
    assert status == 200 and ready["state"] == "ready"
    assert_checkout_matches(ready["path"], upstream.path, sha)
    settled(root)  # its history may arrive between the answers compared below (shallow, then complete)
    status, ready = server.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": sha})
    assert status == 200 and ready["history"] == "complete"
    # Same store, same answer, side by side with the CLI.
    code, cli_answer, _ = run_cli("ensure", upstream.path, sha, root=root)
    assert code == 0 and cli_answer == ready
    status, by_get = server.request("GET", f"/v1/ensure?repo={upstream.path}&commit={sha}")
    assert status == 200 and by_get == ready


def test_bad_input_and_failures_over_http(server, upstream):
    status, body = server.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": "main"})
    assert status == 400 and body["error"] == "BAD_COMMIT" and body["next"]
    status, body = server.request("POST", "/v1/ensure", {"repo": "ext::sh", "commit": "a" * 40})
    assert status == 400 and body["error"] == "UNSAFE_TRANSPORT"
    status, body = server.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": "1" * 40, "wait": 30})
    assert status == 503 and body["error"] == "UNKNOWN_COMMIT" and body["retry_after"] > 0
    conn = server.connection()
    conn.request("POST", "/v1/ensure", body=b"{not json", headers={"Content-Type": "application/json",
                                                                  "Authorization": f"Bearer {TOKEN}"})
    response = conn.getresponse()
    assert response.status == 400 and json.loads(response.read())["error"] == "BAD_ARGUMENT"
    assert server.request("GET", "/v1/nothing")[0] == 404


def test_health_status_gc_and_metrics(server, upstream):
    status, health = server.request("GET", "/healthz")
    assert status == 200 and health["ok"]
    status, ready = server.request("GET", "/readyz")
    assert status == 200 and ready["ok"] and ready["checks"]["locks_work"] and ready["checks"]["root_writable"]
    server.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": upstream.shas[0], "wait": 60})
    server.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": upstream.shas[0]})
    settled(server.root)  # the clone's tidying and its history end before gc and the counts
    status, report = server.request("GET", "/v1/status")
    assert status == 200 and report["totals"]["checkouts"] == 1
    # The API may tighten the limits but never lower the grace window (the operator's 15m).
    status, gc = server.request("POST", "/v1/gc", {"max_checkouts": 0, "grace": "0"})
    assert status == 200 and gc["removed"] == [] and [k["why"] for k in gc["kept_over_limit"]] == ["grace"]
    status, bad = server.request("POST", "/v1/gc", {"max_checkouts": "lots"})
    assert status == 400 and bad["error"] == "BAD_ARGUMENT"
    # The journal follower reads the clones' journal periodically: wait for it to count the clone.
    published = 'checkoutcache_clones_total{error="",outcome="published"} 1.0'

    def counted() -> str | None:
        status, metrics = server.request("GET", "/metrics")
        return metrics if status == 200 and published in metrics else None

    metrics = wait_until(counted, 30, "the journal follower to count the clone")
    assert 'checkoutcache_answers_total{error="",state="ready"} 2.0' in metrics
    assert 'checkoutcache_clones_total{error="",outcome="published"} 1.0' in metrics
    assert "checkoutcache_clone_duration_seconds_bucket" in metrics
    assert 'checkoutcache_gc_runs_total{result="ok"} 1.0' in metrics
    # Latency by the answer's kind: the first answer waited on its clone, the second was ready at once.
    assert 'checkoutcache_request_duration_seconds_count{endpoint="/v1/ensure",kind="waited"} 1.0' in metrics
    assert 'checkoutcache_request_duration_seconds_count{endpoint="/v1/ensure",kind="ready"} 1.0' in metrics
    assert "process_resident_memory_bytes " in metrics and "process_open_fds " in metrics
    assert 'checkoutcache_build_info{version=' in metrics


def test_hold_and_release_protect_a_checkout_from_gc(server, root, upstream):
    sha = upstream.shas[2]
    status, held = server.request("POST", "/v1/hold", {"repo": upstream.path, "commit": sha, "wait": 60})
    assert status == 200 and held["hold"] and held["state"] == "ready"
    code, report, _ = run_cli("gc", "--max-checkouts", "0", "--grace", "0", root=root)
    assert [k["why"] for k in report["kept_over_limit"]] == ["held"] and os.path.isdir(held["path"])
    status, released = server.request("POST", "/v1/release", {"hold": held["hold"]})
    assert status == 200 and released["released"]
    assert server.request("POST", "/v1/release", {"hold": held["hold"]})[0] == 404
    code, report, _ = run_cli("gc", "--max-checkouts", "0", "--grace", "0", root=root)
    assert [r["reason"] for r in report["removed"]] == ["lru"] and not os.path.exists(held["path"])


@pytest.mark.slow
def test_a_hold_expires_after_its_ttl(server, root, upstream):
    status, held = server.request("POST", "/v1/hold", {"repo": upstream.path, "commit": upstream.shas[0],
                                                        "wait": 60, "ttl": 1})
    assert status == 200
    assert is_locked(marker(held["path"])), "held"  # (a 1 s ttl: too short to run a gc reliably first)
    wait_until(lambda: not is_locked(marker(held["path"])), 30, "the hold to expire and its lock to be free")
    code, report, _ = run_cli("gc", "--max-checkouts", "0", "--grace", "0", root=root)
    assert [r["reason"] for r in report["removed"]] == ["lru"]


@pytest.mark.slow
def test_sixty_four_concurrent_clients_while_a_slow_clone_runs(root, tmp_path, upstream, fake_git):
    ready_sha, slow_sha = upstream.shas[0], upstream.shas[2]
    wait_ready(root, upstream.path, ready_sha)
    running = Server(root, tmp_path, "--gc-interval", "0",
                     env=fake_git('case "$*" in *" checkout "*) sleep 4;; esac'))
    try:
        status, slow = running.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": slow_sha})
        assert slow["state"] == "cloning"
        results: list[tuple[int, float]] = []
        lock = threading.Lock()

        def client() -> None:
            conn = running.connection()
            for _ in range(10):
                started = time.monotonic()
                code, body = running.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": ready_sha},
                                             conn=conn)
                with lock:
                    results.append((code, time.monotonic() - started))
            conn.close()

        threads = [threading.Thread(target=client) for _ in range(64)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(results) == 640 and all(code == 200 for code, _ in results)
        assert max(seconds for _, seconds in results) < 3.5, "a slow clone must not block ready answers"
        status, still = running.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": slow_sha})
        assert still["state"] == "cloning"
    finally:
        running.stop()


@pytest.mark.slow
def test_sigterm_answers_waiting_requests_at_once_and_lets_the_clone_finish(root, tmp_path, upstream, fake_git):
    running = Server(root, tmp_path, "--gc-interval", "0", env=fake_git('case "$*" in *" checkout "*) sleep 3;; esac'))
    answers = []
    waiter = threading.Thread(target=lambda: answers.append(running.request(
        "POST", "/v1/ensure", {"repo": upstream.path, "commit": upstream.shas[1], "wait": 60})))
    waiter.start()
    # The request waits on the clone once its clone runs (for up to 60 s).
    wait_until(lambda: RootPaths(root).repo_keys() and is_locked(only_repo(root).clone_lock(upstream.shas[1])),
               30, "the clone to start")
    assert running.stop() == 0
    waiter.join(10)
    assert answers and answers[0][0] == 503 and answers[0][1]["error"] == "SHUTTING_DOWN", answers
    answer = wait_ready(root, upstream.path, upstream.shas[1])  # serve waited for the clone to publish
    assert_checkout_matches(answer["path"], upstream.path, upstream.shas[1])


def test_serve_on_a_unix_socket(root, tmp_path, upstream):
    sock = str(tmp_path / "cc.sock")
    running = Server(root, tmp_path, "--gc-interval", "0", unix=sock)
    try:
        status, ready = running.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": upstream.shas[0],
                                                                "wait": 60})
        assert status == 200 and ready["state"] == "ready"
        assert oct(os.stat(sock).st_mode & 0o777) == "0o660"
    finally:
        running.stop()
    assert not os.path.exists(sock)


@pytest.mark.slow
def test_scheduled_gc_runs(root, tmp_path, upstream):
    path = wait_ready(root, upstream.path, upstream.shas[0])["path"]
    make_idle(path, 3600)
    running = Server(root, tmp_path, "--gc-interval", "1", "--max-checkouts", "0", "--grace", "1m")
    try:
        wait_until(lambda: not os.path.exists(path), 15, "the scheduled gc to evict the idle checkout")
        metrics = wait_until(lambda: (m := running.request("GET", "/metrics")[1]) and
                             'checkoutcache_evictions_total{reason="lru"} 1.0' in m and m, 15,
                             "the eviction to be counted")
        assert 'checkoutcache_checkouts 0.0' in metrics
    finally:
        running.stop()


@pytest.mark.parametrize("listen", ["0.0.0.0:8787", "10.1.2.3:80", "example.com:80", "127.0.0.1:99999", "nope",
                                    "127.0.0.1:0"])
def test_serve_refuses_non_loopback_or_bad_addresses(root, listen):
    code, answer, _ = run_cli("serve", "--listen", listen, root=root, timeout=30)
    assert code == 2 and answer["error"] == "BAD_ARGUMENT"
