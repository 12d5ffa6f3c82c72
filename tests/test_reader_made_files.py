"""What a review makes in a directory it may write never stops the writer (issue 33, "A FIFO
in the workspaces volume wedges the writer"; DESIGN invariant 18).

A review owns its workspaces volume; the writer's gc, status and the review's own next
workspace call read it. A FIFO where owner.lock or owner.json should be made every plain
open(2) of it wait for ever: gc held gc.lock for good, every status request left a thread
blocked, and with hold expiry and the tokens file's watch on gc's thread, holds outlived
their ttl and a revoked token stayed valid. Each test here failed so before the fix."""

from __future__ import annotations

import os
import subprocess

import pytest

from .helpers.cli import run_cli, wait_ready
from .helpers.serve import TOKEN, Serve
from .helpers.waiting import wait_until

pytestmark = pytest.mark.faults

# Far beyond what a gc of one checkout takes; a wedged open() never returns at all.
ANSWER_WITHIN = 60


def plant(workspaces, kind: str) -> str:
    """A workspace-looking entry whose owner.lock or owner.json is a FIFO (what `mkfifo` in a
    review's own volume makes); its path."""
    entry = workspaces / "ws-1-000000000000"
    entry.mkdir(parents=True)
    if kind == "owner.json":
        (entry / "owner.lock").write_text("")
    os.mkfifo(entry / kind)
    return str(entry)


def cli(*args: str, root: str, env: dict) -> tuple[int, dict | None, str]:
    try:
        return run_cli(*args, root=root, env=env, timeout=ANSWER_WITHIN)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`checkoutcache {' '.join(args)}` did not answer within {ANSWER_WITHIN}s: it waits on the FIFO")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["owner.lock", "owner.json"])
def test_a_fifo_in_the_workspaces_volume_never_wedges_gc_status_or_workspace_calls(root, upstream, tmp_path, kind):
    workspaces = tmp_path / "workspaces"
    env = {"CHECKOUTCACHE_WORKSPACES": str(workspaces)}
    sha = upstream.shas[-1]
    wait_ready(root, upstream.path, sha, env=env)
    planted = plant(workspaces, kind)

    code, report, err = cli("gc", "--json", root=root, env=env)
    assert code == 0 and report["skipped"] is None, err
    if kind == "owner.lock":
        # Never locked, never reaped on a guess: skipped and counted.
        assert os.path.exists(planted)
        assert [p["error"] for p in report["problems"] if p["path"].startswith(planted)] == ["NOT_A_FILE"], report
    else:
        # Its lock is free (a dead owner's): reaped, the FIFO never read.
        assert not os.path.exists(planted), report
    # The next gc is not "skipped: another gc is running" (gc.lock was never kept).
    code, again, err = cli("gc", "--json", root=root, env=env)
    assert code == 0 and again["skipped"] is None, err

    code, status, err = cli("status", "--json", root=root, env=env)
    assert code == 0, err
    # The same uid's next workspace call reaps its own dead ones first: it must not hang either.
    code, _, err = cli("exec", "--writable", upstream.path, sha, "--", "true", root=root, env=env)
    assert code == 0, err


@pytest.mark.slow
def test_serve_answers_status_workspaces_and_gc_beside_a_planted_fifo(root, upstream, tmp_path):
    workspaces = tmp_path / "workspaces"
    sha = upstream.shas[-1]
    wait_ready(root, upstream.path, sha, env={"CHECKOUTCACHE_WORKSPACES": str(workspaces)})
    plant(workspaces, "owner.lock")
    serve = Serve(root, tmp_path, "--allow-local", env={"CHECKOUTCACHE_WORKSPACES": str(workspaces)})
    try:
        # Before the fix each of these left a thread blocked in open(): after 16 nothing answered.
        for _ in range(20):
            status, body = serve.request("GET", "/v1/status")
            assert status == 200, body
            status, body = serve.request("GET", "/v1/workspaces")
            assert status == 200, body
        status, report = serve.request("POST", "/v1/gc", {})
        assert status == 200 and report["skipped"] is None, report
        assert "NOT_A_FILE" in {p["error"] for p in report["problems"]}, report
        status, body = serve.request("POST", "/v1/ensure", {"repo": upstream.path, "commit": sha})
        assert status == 200 and body["state"] == "ready", body
        assert serve.request("GET", "/metrics")[0] == 200
    finally:
        serve.stop()


@pytest.mark.slow
def test_holds_expire_and_tokens_rotate_while_the_scheduled_gc_is_stuck(root, upstream, tmp_path):
    sha = upstream.shas[-1]
    workspaces = tmp_path / "workspaces"
    wait_ready(root, upstream.path, sha, env={"CHECKOUTCACHE_WORKSPACES": str(workspaces)})
    # What stuck gc for good before the fix (its open of the FIFO), and, now that gc no longer
    # waits on that, the test hook that stalls it at its start (it logs before it sleeps).
    plant(workspaces, "owner.lock")
    kill_log = tmp_path / "stalls"
    serve = Serve(root, tmp_path, "--allow-local", "--gc-interval", "1s",
                  env={"CHECKOUTCACHE_TEST_STALL_AT": "gc-start", "CHECKOUTCACHE_TEST_KILL_LOG": str(kill_log),
                       "CHECKOUTCACHE_API_TOKEN_OVERLAP": "0", "CHECKOUTCACHE_GC_DEADLINE": "2s",
                       "CHECKOUTCACHE_WORKSPACES": str(workspaces)})
    try:
        wait_until(lambda: kill_log.exists() and kill_log.read_text().startswith("gc-start "), 30,
                   "the scheduled gc to stall")
        status, held = serve.request("POST", "/v1/hold", {"repo": upstream.path, "commit": sha, "ttl": 2})
        assert status == 200 and held["hold"], held
        marker = os.path.join(held["path"], ".git", "checkoutcache-ready")

        def released() -> bool:
            import fcntl

            with open(marker, "rb") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    return False

        assert not released(), "the hold holds the marker's shared lock"
        wait_until(released, 30, "the hold's ttl to end it while gc is stuck")
        status, body = serve.request("POST", "/v1/release", {"hold": held["hold"]})
        assert status == 404 and body["error"] == "UNKNOWN_HOLD", body

        fresh = "tok-" + "c" * 28
        token_file = tmp_path / f"tokens-{serve.port}"
        token_file.write_text(f"{fresh}\n")
        wait_until(lambda: serve.request("GET", "/v1/status", token=fresh)[0] == 200, 30,
                   "the rotated token to be in force while gc is stuck")
        assert serve.request("GET", "/v1/status", token=TOKEN)[0] == 401, "the revoked token is refused"

        status, ready = serve.request("GET", "/readyz", token=None)
        assert status == 503 and ready["checks"]["scheduled_gc_running_seconds"] > 2, ready
        assert serve.request("GET", "/healthz", token=None)[0] == 200  # the process itself still answers
        assert len(kill_log.read_text().splitlines()) == 1, "one stuck run: the schedule waits for it"
    finally:
        serve.proc.kill()
        serve.proc.wait(30)


@pytest.mark.slow
def test_a_symlinked_gitattributes_naming_a_fifo_never_wedges_the_pygit2_worker(root, tmp_path):
    """A pull request commits `.gitattributes -> /workspaces/<its own>/fifo` and the review makes
    the FIFO: the pygit2 transport read the checkout's attributes files through the work tree,
    so its worker sat in open() until the clone timeout, attempt after attempt (git itself
    reads no symlinked attributes file). Now the blobs are read from the commit."""
    from .helpers.repos import Upstream

    fifo = tmp_path / "review-volume" / "fifo"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    upstream = Upstream(str(tmp_path / "upstream"))
    sha = upstream.commit({"a.txt": "a\n"}, symlinks={".gitattributes": str(fifo)})
    env = {"CHECKOUTCACHE_TRANSPORT": "pygit2", "CHECKOUTCACHE_CLONE_TIMEOUT": "600"}
    code, answer, err = cli("ensure", upstream.path, sha, "--wait", "30", "--json", root=root, env=env)
    assert code == 0 and answer["state"] == "ready", (code, answer, err)
    # What the attributes look-up must still see: a regular file naming the LFS filter.
    os.unlink(os.path.join(upstream.path, ".gitattributes"))
    lfs = upstream.commit({".gitattributes": "*.bin filter=lfs diff=lfs merge=lfs -text\n",
                           "x.bin": "version https://git-lfs.github.com/spec/v1\noid sha256:"
                                    + "0" * 64 + "\nsize 3\n"})
    code, answer, err = cli("ensure", upstream.path, lfs, "--wait", "30", "--json", root=root,
                            env={**env, "CHECKOUTCACHE_LFS": "off"})
    assert code == 0 and answer["state"] == "ready" and answer["lfs"] == "off", (code, answer, err)


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_verify_never_waits_on_or_follows_a_checkouts_head(root, upstream, tmp_path, kind):
    """Trusted-peers mode: a peer may write a checkout, and `verify` (an operator's, often as
    root) read its .git/HEAD with a plain open(): a FIFO there hung it for ever, a symlink showed
    the first 60 characters of whatever file it named in the problem line."""
    sha = upstream.shas[-1]
    path = wait_ready(root, upstream.path, sha)["path"]
    head = os.path.join(path, ".git", "HEAD")
    os.unlink(head)
    secret = tmp_path / "secret"
    secret.write_text("a secret line of another user's file\n")
    os.mkfifo(head) if kind == "fifo" else os.symlink(secret, head)
    code, report, out = cli("verify", upstream.path, sha, "--json", root=root, env={})
    assert code == 1, out
    (checked,) = report["checkouts"]
    assert not checked["ok"] and checked["problems"] == ["HEAD is '', not the commit"], checked
    assert "secret" not in out
