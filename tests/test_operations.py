"""What an operator needs on day two (issue #29), each against a live `serve`
and real repositories: metrics true when scraped, HEAD /metrics, access lines
that say what a request was about, quiet probes, the startup line, tokens
rotated in a mounted Secret without a restart, and the writer's limits shown
by `status` anywhere."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from checkoutcache.serve.policy import Grant, parse_tokens, ApiPolicy
from checkoutcache.errors import CheckoutCacheError

from .helpers import TOKEN, Serve, free_port, run_cli, settled, wait_ready, wait_until

NEW_TOKEN = "tok-" + "n" * 28
OLD_TOKEN = "tok-" + "o" * 28


def sample(metrics: str, series: str) -> float | None:
    """The value of one exposed series (its name with labels as exposed), None when absent."""
    for line in metrics.splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    return None


def scrape(running: Serve) -> str:
    status, text = running.request("GET", "/metrics")
    assert status == 200
    return text


# ------------------------------------------------------------ metrics true when scraped

@pytest.mark.slow
def test_the_stores_gauges_are_current_at_each_scrape(root, tmp_path, upstream):
    """Regression: checkouts and free disk changed only when gc ran (every 5 minutes): a
    scrape showed 0 checkouts while some existed."""
    running = Serve(root, tmp_path, "--allow-local", "--gc-interval", "0")
    try:
        assert sample(scrape(running), "checkoutcache_checkouts") == 0
        for sha in upstream.shas[:2]:
            wait_ready(root, upstream.path, sha)  # by the CLI: serve hears nothing of it
        wait_until(lambda: sample(scrape(running), "checkoutcache_checkouts") == 2, 20,
                   "a scrape to count the CLI's checkouts")
        metrics = scrape(running)
        assert sample(metrics, "checkoutcache_clones_running") == 0
        assert sample(metrics, "checkoutcache_checkouts_bytes") > 0
        assert sample(metrics, "checkoutcache_disk_free_bytes") > 0
        assert sample(metrics, "checkoutcache_ready") == 1
        assert sample(metrics, 'checkoutcache_gc_runs_total{result="ok"}') is None  # no gc ran
    finally:
        running.stop()


@pytest.mark.slow
def test_the_oldest_running_clone_is_a_metric(root, tmp_path, upstream, fake_git):
    running = Serve(root, tmp_path, "--allow-local", "--gc-interval", "0", "--stop-timeout", "2s",
                    env=fake_git('case "$*" in *" checkout "*) sleep 30;; esac'))
    try:
        status, answer = running.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": upstream.shas[1]})
        assert answer["state"] == "cloning"
        wait_until(lambda: (sample(scrape(running), "checkoutcache_oldest_clone_seconds") or 0) >= 2, 30,
                   "the running clone to be two seconds old")
        metrics = scrape(running)
        assert sample(metrics, "checkoutcache_clones_running") == 1
        assert sample(metrics, "checkoutcache_clone_timeout_seconds") == 600
    finally:
        running.stop()


def test_head_metrics_is_answered_as_get_without_a_body(root, tmp_path):
    """Regression: HEAD /metrics answered 405."""
    running = Serve(root, tmp_path, "--gc-interval", "0")
    try:
        with socket.create_connection(("127.0.0.1", running.port), timeout=10) as sock:
            head = (f"HEAD /metrics HTTP/1.1\r\nHost: 127.0.0.1:{running.port}\r\n"
                    f"Authorization: Bearer {TOKEN}\r\n\r\n").encode()
            get = head.replace(b"HEAD /metrics", b"GET /healthz")
            sock.sendall(head + get)  # the GET right behind: a body sent for HEAD would be read as its answer
            data = b""
            while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b"}\n"):
                chunk = sock.recv(65536)
                assert chunk, data
                data += chunk
        first, second = data.split(b"HTTP/1.1 ")[1:]
        assert first.startswith(b"200") and first.endswith(b"\r\n\r\n"), first  # no body
        assert b"text/plain" in first
        assert second.startswith(b"200") and b'"ok": true' in second
    finally:
        running.stop()


@pytest.mark.slow
def test_unmet_limits_and_clones_failed_by_code_are_metrics(root, tmp_path, upstream):
    running = Serve(root, tmp_path, "--allow-local", "--gc-interval", "0", "--max-checkouts", "0",
                    "--log-format", "json")
    try:
        assert running.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": upstream.shas[0],
                                                      "wait": 60})[1]["state"] == "ready"
        assert sample(scrape(running), 'checkoutcache_limit_unmet{limit="max-checkouts"}') == 0
        status, report = running.request("POST", "/v1/gc", {})
        assert [u["limit"] for u in report["unmet"]] == ["max-checkouts"]  # the grace window keeps it
        # An unmet limit is a WARNING line (it was INFO: nothing an operator would see).
        (gc_line,) = wait_until(lambda: [line for line in running.json_lines() if line.get("event") == "gc"], 10,
                                "gc's log line")
        assert gc_line["level"] == "WARNING" and gc_line["unmet"] == ["max-checkouts"], gc_line
        metrics = scrape(running)
        assert sample(metrics, 'checkoutcache_limit_unmet{limit="max-checkouts"}') == 1
        assert sample(metrics, 'checkoutcache_limit_unmet{limit="min-free"}') == 0
        status, failed = running.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": "1" * 40,
                                                                "wait": 60})
        assert failed["error"] == "UNKNOWN_COMMIT"
        wait_until(lambda: sample(scrape(running),
                                  'checkoutcache_clones_total{error="UNKNOWN_COMMIT",outcome="failed"}') == 1,
                   30, "the failed clone to be counted by its code")
        metrics = scrape(running)
        assert sample(metrics, 'checkoutcache_request_duration_seconds_count{endpoint="/v1/ensure",kind="failed"}') \
            == 1
    finally:
        running.stop()


# ------------------------------------------------------------ logs that answer questions

@pytest.mark.slow
def test_access_lines_say_what_a_request_was_about(root, tmp_path, upstream):
    """Regression: an access line said method, endpoint and status only, and a 503
    UNREACHABLE line had no error field (docs/http-api.md said it had)."""
    running = Serve(root, tmp_path, "--allow-local", "--gc-interval", "0", "--log-format", "json")
    try:
        running.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": upstream.shas[0], "wait": 60})
        port = free_port()
        unreachable = f"https://someone:pw-xyzzy-secret@127.0.0.1:{port}/x.git"
        status, answer = running.request("POST", "/v1/ensure", {"repo": unreachable, "commit": "a" * 40})
        assert (status, answer["error"]) == (503, "UNREACHABLE")
        status, answer = running.request("POST", "/v1/ensure", {"repo": unreachable + "?private_token=qs-xyzzy",
                                                                "commit": "a" * 40})
        assert status == 400

        def ensure_lines() -> list[dict] | None:
            found = [l for l in running.json_lines() if l.get("endpoint") == "/v1/ensure"]
            return found if len(found) == 3 else None

        ready, failed, refused = wait_until(ensure_lines, 10, "three access lines")
        assert (failed["status"], failed.get("error")) == (503, "UNREACHABLE")
        assert refused["repo"] == f"https://127.0.0.1:{port}/x.git" and refused["error"] == answer["error"]
        assert (ready["repo"], ready["commit"], ready["state"]) == (upstream.path, upstream.shas[0], "ready")
        assert "error" not in ready
        assert (failed["status"], failed["state"], failed["error"]) == (503, "failed", "UNREACHABLE")
        assert failed["repo"] == f"https://127.0.0.1:{port}/x.git"
        assert failed["commit"] == "a" * 40
        assert "xyzzy" not in running.log()
    finally:
        running.stop()


@pytest.mark.slow
def test_probes_and_scrapes_are_debug_lines_and_the_start_says_version_and_limits(root, tmp_path):
    """Regression: every probe and scrape was an INFO access line (a kubelet and
    Prometheus wrote one every few seconds), and the startup line said neither the
    version nor the limits."""
    at_info = Serve(root, tmp_path, "--gc-interval", "0", "--log-format", "json", "--max-checkouts", "7",
                    "--min-free", "5%")
    try:
        for path in ("/healthz", "/readyz", "/metrics", "/v1/status"):
            assert at_info.request("GET", path)[0] == 200
        wait_until(lambda: any(l.get("endpoint") == "/v1/status" for l in at_info.json_lines()), 10, "the status line")
        lines = at_info.json_lines()
        assert not [l for l in lines if l.get("endpoint") in ("/healthz", "/readyz", "/metrics")]
        (start,) = [l for l in lines if l.get("event") == "serving"]
        import checkoutcache.serve.server as server

        assert start["version"] == server.served_version() and start["version"] in start["message"]
        assert start["limits"]["max_checkouts"] == 7 and start["limits"]["min_free"] == "5%"
        assert start["limits"]["grace"] == 900 and start["limits"]["clone_timeout"] == 600
    finally:
        at_info.stop()
    at_debug = Serve(root, tmp_path, "--gc-interval", "0", "--log-format", "json", "--log-level", "debug")
    try:
        assert at_debug.request("GET", "/healthz")[0] == 200
        probe = wait_until(lambda: [l for l in at_debug.json_lines() if l.get("endpoint") == "/healthz"], 10,
                           "the probe's debug line")
        assert probe[0]["level"] == "DEBUG"
    finally:
        at_debug.stop()


# ------------------------------------------------------------ rotation without a restart

class MountedSecret:
    """A Secret volume as the kubelet writes it: <dir>/<key> -> ..data/<key>, ..data -> a
    timestamped directory; an update writes a new directory, points ..data_tmp at it and
    renames ..data_tmp over ..data (one atomic swap), then removes the old directory."""

    def __init__(self, base, key: str, content: str):
        self.base, self.key, self.generation = base, key, 0
        base.mkdir()
        self._write(content)
        os.symlink(os.path.join("..data", key), base / key)

    def _write(self, content: str) -> None:
        self.generation += 1
        directory = self.base / f"..2026_12_01_00_00_{self.generation:02d}.{os.getpid()}"
        directory.mkdir()
        (directory / self.key).write_text(content)
        os.symlink(directory.name, self.base / "..data_tmp")
        os.rename(self.base / "..data_tmp", self.base / "..data")

    def update(self, content: str) -> None:
        old = os.readlink(self.base / "..data")
        self._write(content)
        (self.base / old / self.key).unlink()
        (self.base / old).rmdir()

    @property
    def path(self) -> str:
        return str(self.base / self.key)


def authorized(running: Serve, token: str) -> bool:
    status, _ = running.request("GET", "/v1/status", token=token)
    assert status in (200, 401)
    return status == 200


@pytest.mark.slow
def test_a_token_rotated_in_a_mounted_secret_takes_effect_without_a_restart(root, tmp_path):
    """Regression: tokens were read once at start; a rotation needed a restart (which
    drops every hold)."""
    secret = MountedSecret(tmp_path / "secret", "tokens", f"{OLD_TOKEN}\n")
    running = Serve(root, tmp_path, "--gc-interval", "0", "--log-format", "json", "--token-file", secret.path,
                    "--token-overlap", "3s")
    try:
        assert authorized(running, OLD_TOKEN) and not authorized(running, NEW_TOKEN)
        secret.update(f"{NEW_TOKEN}\n")
        wait_until(lambda: authorized(running, NEW_TOKEN), 20, "the new token to be accepted")
        swapped = time.monotonic()
        assert authorized(running, OLD_TOKEN), "the old token is valid for the overlap"
        wait_until(lambda: not authorized(running, OLD_TOKEN), 30, "the old token to retire")
        assert time.monotonic() - swapped > 1.5  # it lasted (most of) the overlap, not until the next look
        assert authorized(running, NEW_TOKEN)
        (reloaded,) = wait_until(lambda: [l for l in running.json_lines() if l.get("event") == "tokens_reloaded"], 10,
                                 "the reload's log line")
        assert reloaded["trigger"] == "change" and len(reloaded["retiring"]) == 1
        assert OLD_TOKEN not in running.log() and NEW_TOKEN not in running.log()
        # A file that holds no token changes nothing: the tokens in force stay.
        secret.update("# being rewritten\n")
        wait_until(lambda: any(l.get("event") == "tokens_reload_failed" for l in running.json_lines()), 20,
                   "the empty file to be refused")
        assert authorized(running, NEW_TOKEN)
        assert sample(scrape_with(running, NEW_TOKEN), 'checkoutcache_token_reloads_total{result="failed"}') == 1
    finally:
        assert running.stop() == 0


@pytest.mark.slow
def test_clients_that_read_the_mounted_secret_move_to_a_rotated_token_without_a_restart(root, tmp_path, upstream):
    """Regression: the typed client and the CLI's hand-off read the token once (from the
    environment): once the overlap ended, a long-running client got 401 until restarted."""
    from checkoutcache.client import Client

    secret = MountedSecret(tmp_path / "secret", "tokens", f"{OLD_TOKEN}\n")
    running = Serve(root, tmp_path, "--gc-interval", "0", "--token-file", secret.path, "--token-overlap", "1s")
    try:
        env = {"CHECKOUTCACHE_API_URL": f"http://127.0.0.1:{running.port}", "CHECKOUTCACHE_API_TOKEN_FILE": secret.path}
        client = Client.from_env(env)
        assert client.status().totals is not None
        secret.update(f"{NEW_TOKEN}\n")
        wait_until(lambda: not authorized(running, OLD_TOKEN), 30, "the old token to retire")
        report = client.status()  # the same Client, a new token: no 401
        assert report.totals is not None
        # What the CLI sends a writer (handoff.py) is read at each request the same way.
        from checkoutcache.handoff import api_token

        assert api_token({"CHECKOUTCACHE_API_TOKEN_FILE": secret.path}) == NEW_TOKEN
        secret.update(f"# rotated\n{OLD_TOKEN} team-a\n")
        assert api_token({"CHECKOUTCACHE_API_TOKEN_FILE": secret.path}) == OLD_TOKEN
    finally:
        assert running.stop() == 0


def scrape_with(running: Serve, token: str) -> str:
    status, text = running.request("GET", "/metrics", token=token)
    assert status == 200
    return text


@pytest.mark.slow
def test_sighup_reloads_the_tokens_and_no_longer_kills_serve(root, tmp_path):
    """Regression: SIGHUP killed serve (exit 129), dropping its holds. The file is changed
    so that its size, inode and mtime stay the same: only the signal can make serve see it."""
    tokens = tmp_path / "tokens-file"
    tokens.write_text(f"{OLD_TOKEN}\n")
    before = os.stat(tokens)
    running = Serve(root, tmp_path, "--gc-interval", "0", "--log-format", "json", "--token-file", str(tokens))
    try:
        assert authorized(running, OLD_TOKEN)
        with open(tokens, "r+") as handle:  # in place: the same inode and size
            handle.write(f"{NEW_TOKEN}\n")
        os.utime(tokens, ns=(before.st_atime_ns, before.st_mtime_ns))
        time.sleep(2.5)  # two looks of the watch: it sees no change
        assert not authorized(running, NEW_TOKEN)
        running.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: authorized(running, NEW_TOKEN), 20, "SIGHUP to reload the tokens")
        assert running.proc.poll() is None
        (reloaded,) = wait_until(lambda: [l for l in running.json_lines() if l.get("event") == "tokens_reloaded"], 10,
                                 "the reload's log line")
        assert reloaded["trigger"] == "sighup"
        assert authorized(running, OLD_TOKEN)  # within the default overlap (10m)
    finally:
        assert running.stop() == 0


def test_rotation_keeps_a_dropped_token_for_the_overlap_only():
    (old, old_grant), = parse_tokens(OLD_TOKEN + " team-a", "t")
    (new, new_grant), = parse_tokens(NEW_TOKEN, "t")
    policy = ApiPolicy(tokens=((old, old_grant),))
    rotated = policy.rotated(((new, new_grant),), now=100.0, overlap=60.0)
    assert rotated.tokens == ((new, new_grant),) and rotated.retiring == ((old, old_grant, 160.0),)
    assert rotated.authenticate(f"Bearer {old}", True, now=120.0) is old_grant  # its scopes kept
    with pytest.raises(CheckoutCacheError):
        rotated.authenticate(f"Bearer {old}", True, now=160.0)
    assert isinstance(old_grant, Grant) and old_grant.scopes == frozenset({"team-a"})
    # A second rotation keeps the first one's deadline; a token brought back is current again.
    again = rotated.rotated(((new, new_grant),), now=130.0, overlap=60.0)
    assert again.retiring == ((old, old_grant, 160.0),)
    assert rotated.rotated(((old, old_grant),), now=130.0, overlap=60.0).retiring == ((new, new_grant, 190.0),)
    assert again.rotated(((new, new_grant),), now=161.0, overlap=60.0).retiring == ()
    expired = ApiPolicy(tokens=((new, new_grant),), retiring=((old, old_grant, time.monotonic() - 1),))
    with pytest.raises(CheckoutCacheError):
        expired.authenticate(f"Bearer {old}", True)


# ------------------------------------------------------------ the writer's limits, shown by any reader

def tree_state(root: str) -> list[tuple]:
    found = []
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            info = os.lstat(os.path.join(directory, name))
            found.append((os.path.relpath(os.path.join(directory, name), root), info.st_mtime_ns, info.st_size))
    return sorted(found)


@pytest.mark.slow
def test_status_in_a_reader_shows_the_limits_the_writer_enforces(root, tmp_path, upstream):
    """Regression: limits lived only in the writer's environment, so `status` in a review
    container (none set) showed null limits and judged protection by its own grace window."""
    running = Serve(root, tmp_path, "--allow-local", "--gc-interval", "0", "--max-checkouts", "7",
                    "--max-bytes", "5G", "--min-free", "10%", "--grace", "20m")
    try:
        running.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": upstream.shas[0], "wait": 60})
        settled(root)  # the worker's own tidying after its publish is not the reader's write
        before = tree_state(root)
        code, status, _ = run_cli("status", root=root)  # a reader: no limits in its environment
        assert code == 0
        assert tree_state(root) == before, "status wrote to the root"
        totals = status["totals"]
        assert (totals["max_checkouts"], totals["max_bytes"], totals["min_free"]) == (7, 5 << 30, "10%")
        assert totals["grace_seconds"] == 1200 and totals["clone_timeout_seconds"] == 600
        assert totals["limits_from"]["from"] == "serve" and totals["limits_from"]["pid"] == running.proc.pid
        (checkout,) = status["repos"][0]["checkouts"]
        assert checkout["protected"] == "grace"
    finally:
        running.stop()
    # A gc run by hand records the limits it enforced.
    code, report, _ = run_cli("gc", "--max-checkouts", "3", root=root)
    assert code == 0
    code, status, _ = run_cli("status", root=root)
    assert status["totals"]["max_checkouts"] == 3 and status["totals"]["limits_from"]["from"] == "gc"
    assert status["totals"]["max_bytes"] is None
    # A dry run enforces nothing: the record stays.
    run_cli("gc", "--dry-run", "--max-checkouts", "1", root=root)
    assert run_cli("status", root=root)[1]["totals"]["max_checkouts"] == 3


def test_a_malformed_limits_record_leaves_the_callers_own(root, upstream):
    from checkoutcache.store.layout import RootPaths

    wait_ready(root, upstream.path, upstream.shas[0])
    with open(RootPaths(root).limits_record, "w") as handle:
        json.dump({"limits": {"max_checkouts": "lots", "grace": -5, "min_free": "9000%", "max_bytes": 10},
                   "writer": "gc", "at": 1.0}, handle)
    code, status, _ = run_cli("status", root=root, env={"CHECKOUTCACHE_MAX_CHECKOUTS": "4"})
    totals = status["totals"]
    assert code == 0 and totals["max_checkouts"] == 4 and totals["grace_seconds"] == 900
    assert totals["min_free"] is None and totals["max_bytes"] == 10


def test_a_scrape_storm_reads_the_store_once_per_period():
    import threading

    from checkoutcache.serve import metrics

    calls, clock = [], [100.0]

    def figures() -> dict:
        calls.append(clock[0])
        time.sleep(0.05)  # concurrent scrapes arrive while it runs
        return {"checkoutcache_checkouts": len(calls)}

    collector = metrics.FiguresCollector(figures, clock=lambda: clock[0])
    scrapes = [threading.Thread(target=lambda: list(collector.collect())) for _ in range(8)]
    for scrape_thread in scrapes:
        scrape_thread.start()
    for scrape_thread in scrapes:
        scrape_thread.join(10)
    assert calls == [100.0]
    clock[0] += metrics.FIGURES_FOR - 0.01
    assert collector.current() == {"checkoutcache_checkouts": 1}
    clock[0] += 0.02  # the period over: the next scrape reads the store again
    assert collector.current() == {"checkoutcache_checkouts": 2} and len(calls) == 2
    (family,) = collector.collect()
    assert family.name == "checkoutcache_checkouts" and family.samples[0].value == 2


@pytest.mark.parametrize("event,error,level", [("failed", "DISK_FULL", "WARNING"), ("died", None, "WARNING"),
                                               ("failed", "UNKNOWN_COMMIT", "INFO"), ("published", None, "INFO")])
def test_clone_events_an_operator_must_act_on_are_warnings(tmp_path, caplog, event, error, level):
    """Regression: `clone_failed DISK_FULL` was an INFO line like every other clone event."""
    import logging

    from checkoutcache.cache import Cache
    from checkoutcache.config import Config, ServeSettings
    from checkoutcache.serve.service import Service

    service = Service(Cache(str(tmp_path / "cache")), Config(), ServeSettings(), str(tmp_path / "journal"))
    with caplog.at_level(logging.INFO, logger="checkoutcache.events"):
        service.count_journal_event({"event": event, "commit": "a" * 40, **({"error": error} if error else {})})
    (record,) = [r for r in caplog.records if r.name == "checkoutcache.events"]
    assert record.levelname == level and record.getMessage() == f"clone_{event} {'a' * 40}"
