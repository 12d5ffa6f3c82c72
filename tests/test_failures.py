"""Failed attempts: unknown commits, back-off then retry, timeouts, killed
workers (the commit turns absent and is cloned again, never "call again")."""

from __future__ import annotations

import json
import os
import time

from checkoutcache import Cache

from .conftest import (
    Upstream,
    assert_checkout_matches,
    files_under,
    git,
    run_cli,
    wait_ready,
)


def repo_dir(root: str) -> str:
    (key,) = os.listdir(os.path.join(root, "repos"))
    return os.path.join(root, "repos", key)


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
    log = open(os.path.join(repo_dir(root), "logs", f"{missing}.log")).read()
    assert log.count("clone of") == 1
    assert not os.listdir(os.path.join(repo_dir(root), "scratch"))
    assert not os.path.exists(os.path.join(repo_dir(root), "checkouts", missing))


def test_failure_backs_off_then_retries_and_succeeds(root, served_upstream, tmp_path):
    upstream, url = served_upstream
    env = {"CHECKOUTCACHE_BACKOFF": "1", "CHECKOUTCACHE_BACKOFF_MAX": "2"}
    wait_ready(root, url, upstream.shas[0], env=env)
    # A commit not pushed yet fails; once pushed, the retry after the back-off finds it.
    local = Upstream.__new__(Upstream)
    local.path, local.shas = str(tmp_path / "local"), []
    git("clone", "-q", upstream.path, local.path)
    new_sha = local.commit({"late.txt": "pushed later"})
    code, answer, _ = run_cli("ensure", url, new_sha, "--wait", "30", root=root, env=env)
    assert code == 1 and answer["error"] == "UNKNOWN_COMMIT"
    failed = json.load(open(os.path.join(repo_dir(root), "state", f"{new_sha}.failed.json")))
    assert failed["attempts"] == 1
    git("push", "-q", upstream.path, "HEAD:refs/heads/later", cwd=local.path)
    time.sleep(1.1)
    answer = wait_ready(root, url, new_sha, env=env)
    assert_checkout_matches(answer["path"], upstream.path, new_sha)
    assert not os.path.exists(os.path.join(repo_dir(root), "state", f"{new_sha}.failed.json"))


def test_repeated_failures_back_off_longer(root, served_upstream):
    upstream, url = served_upstream
    missing = "1" * 40
    env = {"CHECKOUTCACHE_BACKOFF": "0.5", "CHECKOUTCACHE_BACKOFF_MAX": "100"}
    wait_ready(root, url, upstream.shas[0], env=env)
    retry = []
    for _ in range(3):
        code, answer, _ = run_cli("ensure", url, missing, "--wait", "30", root=root, env=env)
        assert answer["error"] == "UNKNOWN_COMMIT"
        failed = json.load(open(os.path.join(repo_dir(root), "state", f"{missing}.failed.json")))
        retry.append(failed["retry_at"] - failed["failed_at"])
        time.sleep(retry[-1] + 0.05)
    assert retry == [0.5, 1.0, 2.0]


def test_a_dead_owner_never_answers_cloning(root, upstream):
    sha = upstream.shas[0]
    kill = {"CHECKOUTCACHE_TEST_KILL_AT": "before-checkout"}
    code, answer, _ = run_cli("ensure", upstream.path, sha, root=root, env=kill)
    assert code == 75
    deadline = time.time() + 30
    while time.time() < deadline:  # the owner dies: the next answer starts a new clone
        code, answer, _ = run_cli("ensure", upstream.path, sha, root=root)
        if code == 0:
            break
        assert answer["state"] == "cloning"
        assert os.path.exists(f"/proc/{answer['pid']}"), "cloning must name a live owner"
        time.sleep(0.1)
    assert code == 0


def test_clone_over_its_time_limit_fails_with_timeout(root, served_upstream, fake_git):
    upstream, url = served_upstream
    env = {"CHECKOUTCACHE_CLONE_TIMEOUT": "1", "CHECKOUTCACHE_BACKOFF": "60",
           **fake_git('case "$*" in *" fetch "*) sleep 30;; esac')}
    code, answer, _ = run_cli("ensure", url, upstream.shas[0], "--wait", "20", root=root, env=env)
    assert code == 1 and answer["error"] == "TIMEOUT", answer
    assert "1s" in answer["message"]
    base = repo_dir(root)
    assert not os.listdir(os.path.join(base, "scratch"))
    assert not os.path.exists(os.path.join(base, "state", f"{upstream.shas[0]}.clone.json"))


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
