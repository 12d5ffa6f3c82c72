"""Every removal honours holds: a checkout held by a running command (an
`exec`, or Cache.hold) is never removed or replaced under it, however damaged,
by gc, by `verify --remove-broken`, or by a clone of the same commit. Once the
hold ends, the next removal goes ahead and the next ensure makes it whole."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from checkoutcache import Cache

from .helpers import (
    SHORT_BACKOFF,
    settled,
    assert_checkout_matches,
    make_idle,
    only_repo,
    run_cli,
    store_snapshot,
    wait_ready,
    wait_until,
)

pytestmark = pytest.mark.faults



class Exec:
    """`checkoutcache exec REPO COMMIT -- CMD`, CMD running until the test ends it (bounded: 60 s)."""

    def __init__(self, root: str, repo: str, sha: str, tmp_path):
        self.started, self.release = tmp_path / f"started-{sha}", tmp_path / f"release-{sha}"
        command = f"touch {self.started}; i=0; while [ ! -e {self.release} ] && [ $i -lt 1200 ]; " \
                  "do sleep 0.05; i=$((i+1)); done; git rev-parse HEAD"
        self.proc = subprocess.Popen([sys.executable, "-m", "checkoutcache", "--root", root, "exec", repo, sha,
                                      "--", "sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        wait_until(lambda: self.started.exists() or self.proc.poll() is not None, 60, "the exec'd command to start")
        assert self.proc.poll() is None, self.proc.communicate()

    def running(self) -> bool:
        return self.proc.poll() is None

    def end(self) -> tuple[int, str]:
        self.release.touch()
        out, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, out + err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def execs():
    started: list[Exec] = []
    yield started
    for running in started:
        running.kill()


def empty_top_level(path: str) -> None:
    """`rm -rf checkout/*` (and dot files): every top-level entry but .git goes."""
    for name in os.listdir(path):
        if name != ".git":
            full = os.path.join(path, name)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.unlink(full)


def gc(root: str, *args: str) -> dict:
    code, report, out = run_cli("gc", *args, root=root)
    assert code == 0 and report["skipped"] is None, out
    return report


@pytest.mark.slow
def test_gc_never_removes_a_damaged_checkout_an_exec_holds(root, upstream, tmp_path, execs):
    sha = upstream.shas[1]
    path = wait_ready(root, upstream.path, sha)["path"]
    settled(root)  # the first clone's history ends: no trash of its own beside gc's
    held = Exec(root, upstream.path, sha, tmp_path)
    execs.append(held)
    empty_top_level(path)
    make_idle(path, 10 * 24 * 3600)
    # The tightest limits: nothing protects it but the hold.
    report = gc(root, "--max-checkouts", "0", "--grace", "0", "--max-age", "1s")
    assert [r for r in report["removed"] if r["name"] == sha] == [], report
    assert os.path.isdir(path) and os.path.isdir(os.path.join(path, ".git"))
    assert os.listdir(only_repo(root).trash_dir) == []
    assert held.running(), "the command was still running during gc"

    code, out = held.end()
    assert code == 0 and sha in out, out
    report = gc(root)
    assert [(r["reason"], r["name"]) for r in report["removed"] if r["name"] == sha] == [("damaged", sha)], report
    assert not os.path.lexists(path)
    answer = wait_ready(root, upstream.path, sha)
    assert answer["path"] == path
    assert_checkout_matches(path, upstream.path, sha)


@pytest.mark.slow
def test_verify_remove_broken_keeps_a_broken_checkout_an_exec_holds(root, upstream, tmp_path, execs):
    sha = upstream.shas[2]
    path = wait_ready(root, upstream.path, sha)["path"]
    settled(root)  # the first clone's history ends: no trash of its own
    held = Exec(root, upstream.path, sha, tmp_path)
    execs.append(held)
    deep = os.path.join(path, "src", "deep", "nested", "file.txt")
    with open(deep, "w") as handle:
        handle.write("changed by a review\n")

    code, report, out = run_cli("verify", "--remove-broken", root=root)
    assert code == 1 and report["broken"] == 1, out
    (result,) = report["checkouts"]
    assert result["commit"] == sha and result["ok"] is False and result["held"] is True, result
    assert result["removed"] is False and result["kept"] == "held", result
    with open(deep) as handle:
        assert handle.read() == "changed by a review\n", "the held checkout is left as it is"
    assert os.listdir(only_repo(root).trash_dir) == []
    assert held.running()

    code, out = held.end()
    assert code == 0 and sha in out, out
    code, report, out = run_cli("verify", "--remove-broken", root=root)
    assert code == 1, out
    (result,) = report["checkouts"]
    assert result["ok"] is False and result["removed"] is True and "kept" not in result, result
    assert not os.path.lexists(path)
    assert run_cli("verify", root=root)[0] == 0
    answer = wait_ready(root, upstream.path, sha)
    assert_checkout_matches(answer["path"], upstream.path, sha)


def past_back_off(record: str) -> bool:
    try:
        with open(record) as handle:
            return json.load(handle)["retry_at"] < time.time()
    except FileNotFoundError:
        return True


def test_a_clone_never_replaces_a_damaged_checkout_that_is_held(root, upstream):
    sha = upstream.shas[1]
    path = wait_ready(root, upstream.path, sha)["path"]
    hold = Cache(root).hold(upstream.path, sha)
    try:
        assert hold.held and hold.answer.path == path
        empty_top_level(path)
        inode = os.stat(path).st_ino
        before = store_snapshot(path)
        # Not served (damaged), so a clone starts; its worker must not move the held checkout aside.
        code, answer, out = run_cli("ensure", upstream.path, sha, "--wait", "60", root=root, env=SHORT_BACKOFF)
        assert code == 1 and answer["state"] == "failed" and answer["error"] == "CLONE_FAILED", out
        assert answer["message"] and answer["next"] and answer["retry_after"] >= 1, answer
        assert "held" in answer["message"], answer
        assert os.stat(path).st_ino == inode
        assert store_snapshot(path) == before, "nothing under the held path changed"
        store = only_repo(root)
        assert os.listdir(store.scratch_dir) == [], "the refused clone left no scratch"
    finally:
        hold.release()
    wait_until(lambda: past_back_off(only_repo(root).failure_record(sha)), 10, "the back-off to pass")
    answer = wait_ready(root, upstream.path, sha, env=SHORT_BACKOFF)
    assert answer["path"] == path
    assert_checkout_matches(path, upstream.path, sha)
    assert os.stat(path).st_ino != inode, "re-made, not the damaged one"


def test_a_killed_exec_wrapper_leaves_its_command_holding_the_checkout(root, upstream, tmp_path):
    """The command inherits the hold: SIGKILL of `checkoutcache exec` (the OOM killer,
    a pipeline's kill -9) never leaves a running command in a checkout gc may evict."""
    sha = upstream.shas[0]
    path = wait_ready(root, upstream.path, sha)["path"]
    running = Exec(root, upstream.path, sha, tmp_path)  # returns once the command runs
    try:
        running.proc.kill()  # the wrapper, not its command
        running.proc.wait(10)
        make_idle(path, 3600)
        code, report, _ = run_cli("gc", "--max-checkouts", "0", "--grace", "0", root=root)
        assert code == 0 and [k["why"] for k in report["kept_over_limit"]] == ["held"], report
        assert os.path.isdir(path)
    finally:
        running.release.touch()
    wait_until(lambda: run_cli("gc", "--max-checkouts", "0", "--grace", "0", root=root)[1]["removed"], 20,
               "the checkout to go once the command ended")
