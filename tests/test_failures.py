"""Failed attempts: unknown commits, back-off then retry, timeouts, killed
workers (the commit turns absent and is cloned again, never "call again")."""

from __future__ import annotations

import json
import os
import time

import pytest

from checkoutcache import Cache

from .helpers import (
    Upstream,
    assert_checkout_matches,
    files_under,
    git,
    only_repo,
    pid_alive,
    run_cli,
    wait_ready,
    wait_until,
)


def failure_record(root: str, sha: str) -> dict:
    with open(only_repo(root).failure_record(sha)) as handle:
        return json.load(handle)


def wait_past_back_off(root: str, sha: str) -> None:
    """Until the commit's recorded failure may be retried (its retry time, by the clock the store uses)."""
    retry_at = failure_record(root, sha)["retry_at"]
    wait_until(lambda: time.time() > retry_at, 60, "the back-off to pass", interval=0.01)


def test_unknown_commit_fails_with_a_code_and_backs_off(root, served_upstream):
    upstream, url = served_upstream
    missing = "0123456789abcdef0123456789abcdef01234567"
    env = {"CHECKOUTCACHE_BACKOFF": "60"}
    code, answer, _ = run_cli("ensure", url, missing, "--wait", "60", root=root, env=env)
    assert code == 1 and answer["state"] == "failed"
    assert answer["error"] == "UNKNOWN_COMMIT" and missing in answer["message"]
    assert answer["next"] and 0 < answer["retry_after"] <= 60
    # Within the back-off: the same answer at once, no new attempt.
    code, again, _ = run_cli("ensure", url, missing, root=root, env=env)
    assert code == 1 and again["error"] == "UNKNOWN_COMMIT"
    log = open(only_repo(root).clone_log(missing)).read()
    assert log.count("clone of") == 1
    assert not os.listdir(only_repo(root).scratch_dir)
    assert not os.path.exists(only_repo(root).checkout(missing))


@pytest.mark.slow
def test_failure_backs_off_then_retries_and_succeeds(root, served_upstream, tmp_path):
    upstream, url = served_upstream
    env = {"CHECKOUTCACHE_BACKOFF": "1", "CHECKOUTCACHE_BACKOFF_MAX": "2"}
    wait_ready(root, url, upstream.shas[0], env=env)
    # A commit not pushed yet fails; once pushed, the retry after the back-off finds it.
    local = Upstream.clone_of(upstream.path, str(tmp_path / "local"))
    new_sha = local.commit({"late.txt": "pushed later"})
    code, answer, _ = run_cli("ensure", url, new_sha, "--wait", "30", root=root, env=env)
    assert code == 1 and answer["error"] == "UNKNOWN_COMMIT"
    assert failure_record(root, new_sha)["attempts"] == 1
    git("push", "-q", upstream.path, "HEAD:refs/heads/later", cwd=local.path)
    wait_past_back_off(root, new_sha)
    answer = wait_ready(root, url, new_sha, env=env)
    assert_checkout_matches(answer["path"], upstream.path, new_sha)
    assert not os.path.exists(only_repo(root).failure_record(new_sha))


@pytest.mark.slow
def test_repeated_failures_back_off_longer(root, served_upstream):
    upstream, url = served_upstream
    missing = "1" * 40
    env = {"CHECKOUTCACHE_BACKOFF": "0.5", "CHECKOUTCACHE_BACKOFF_MAX": "100"}
    wait_ready(root, url, upstream.shas[0], env=env)
    retry = []
    for _ in range(3):
        code, answer, _ = run_cli("ensure", url, missing, "--wait", "30", root=root, env=env)
        assert answer["error"] == "UNKNOWN_COMMIT"
        failed = failure_record(root, missing)
        retry.append(failed["retry_at"] - failed["failed_at"])
        wait_past_back_off(root, missing)
    assert retry == [0.5, 1.0, 2.0]


def test_a_dead_owner_never_answers_cloning(root, upstream, kill_log):
    sha = upstream.shas[0]
    kill = {"CHECKOUTCACHE_TEST_KILL_AT": "before-checkout"}
    code, answer, _ = run_cli("ensure", upstream.path, sha, root=root, env=kill)
    assert code == 75 and answer["state"] == "cloning"
    # The owner really dies at its step (else this test proves nothing): wait until it is gone.
    line = wait_until(lambda: kill_log.exists() and kill_log.read_text(), 30, "the owner to kill itself")
    step, dead = line.split()
    assert step == "before-checkout" and int(dead) == answer["pid"]
    wait_until(lambda: not pid_alive(answer["pid"]), 30, "the killed owner to be gone")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the next answer starts a new clone, never names the dead one
        code, answer, _ = run_cli("ensure", upstream.path, sha, root=root)
        if code == 0:
            break
        assert answer["state"] == "cloning"
        assert answer["pid"] != int(dead), "cloning named the dead owner"
        # The new owner is alive, or it finished (published) between the answer and this look.
        assert pid_alive(answer["pid"]) or run_cli("ensure", upstream.path, sha, root=root)[0] == 0
        time.sleep(0.05)
    assert code == 0
    assert kill_log.read_text().splitlines() == [line.strip()], "only the first owner was killed"


@pytest.mark.slow
def test_clone_over_its_time_limit_fails_with_timeout(root, served_upstream, fake_git):
    upstream, url = served_upstream
    env = {"CHECKOUTCACHE_CLONE_TIMEOUT": "1", "CHECKOUTCACHE_BACKOFF": "60",
           **fake_git('case "$*" in *" fetch "*) sleep 30;; esac')}
    code, answer, _ = run_cli("ensure", url, upstream.shas[0], "--wait", "20", root=root, env=env)
    assert code == 1 and answer["error"] == "TIMEOUT", answer
    assert "1s" in answer["message"]
    store = only_repo(root)
    assert not os.listdir(store.scratch_dir)
    assert not os.path.exists(store.clone_record(upstream.shas[0]))


def test_wait_is_bounded(root, served_upstream, fake_git):
    upstream, url = served_upstream
    env = fake_git('case "$*" in *" fetch "*) sleep 5;; esac')
    started = time.monotonic()
    code, answer, _ = run_cli("ensure", url, upstream.shas[0], "--wait", "0.5", root=root, env=env)
    assert code == 75 and answer["state"] == "cloning"
    assert time.monotonic() - started < 4.5


def test_unreachable_repository_fails_and_writes_nothing(root):
    cache = Cache(root)
    answer = cache.ensure("git://127.0.0.1:1/nothing-here", "a" * 40)
    assert answer.state == "failed" and answer.error == "UNREACHABLE" and answer.exit_code == 1
    assert answer.next and answer.retry_after
    # Only the failure record (answered until its back-off passes), no repository store.
    (record,) = files_under(os.path.join(root, "unreachable"))
    assert sorted(files_under(root)) == [os.path.join(root, "unreachable"), record]
    assert record.endswith(".failed.json")
