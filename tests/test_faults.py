"""The fault suite (pytest -m faults): crashes at every step, a full disk, a
damaged store, hostile repositories, permissions and load. Each test injects
one fault and checks that the store recovers by itself. tests/FAULTS.md maps
every fault to its test."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import stat
import subprocess
import sys
import threading
import time

import pytest

from checkoutcache import Cache
from checkoutcache.store.layout import READY_MARKER

from .helpers import (
    SHORT_BACKOFF,
    Upstream,
    assert_checkout_matches,
    content_snapshot,
    git,
    make_idle,
    settled,
    marker,
    only_repo,
    pid_alive,
    run_cli,
    wait_ready,
    wait_until,
    walk,
)

pytestmark = pytest.mark.faults

WORKER_STEPS = ["after-scratch", "before-fetch", "during-fetch", "after-fetch", "before-checkout",
                "during-checkout", "after-checkout", "after-rename"]


def snapshot(path: str) -> dict:
    """Every file's content and mode under a checkout, the marker excepted (its mtime is the last use)."""
    return content_snapshot(path, ignore=(READY_MARKER,))


def kills(log) -> list[tuple[str, int]]:
    """The (step, pid) lines processes wrote to the kill log just before killing themselves."""
    if not os.path.exists(log):
        return []
    return [(step, int(pid)) for step, pid in (line.split() for line in open(log).read().splitlines())]


def assert_died_at(log, step: str, at_least: int = 1) -> list[int]:
    """The kill log proves processes died at that step (and at no other), and none of them is alive."""
    seen = kills(log)
    assert len(seen) >= at_least, f"no process was killed at {step}: {seen}"
    assert {s for s, _ in seen} == {step}, seen
    for _, pid in seen:
        wait_until(lambda: not pid_alive(pid), 10, f"killed pid {pid} to be gone")
    return [pid for _, pid in seen]


def assert_recovered(root: str, upstream: Upstream, sha: str, bystander: str, before: dict) -> None:
    """The next ensure serves a correct checkout; one gc leaves no scratch; no lock blocks; others untouched."""
    answer = wait_ready(root, upstream.path, sha)
    assert_checkout_matches(answer["path"], upstream.path, sha)
    code, report, _ = run_cli("gc", root=root)
    assert code == 0 and report["skipped"] is None
    store = only_repo(root)
    assert os.listdir(store.scratch_dir) == []
    assert os.listdir(store.trash_dir) == []
    assert before, "the bystander snapshot is not empty"
    assert snapshot(bystander) == before
    assert_checkout_matches(bystander, upstream.path, upstream.shas[0])
    assert run_cli("verify", root=root)[0] == 0


@pytest.fixture
def store_with_bystander(root, upstream):
    """A store holding one checkout (shas[0]) that no fault may touch."""
    bystander = wait_ready(root, upstream.path, upstream.shas[0])["path"]
    settled(root)  # its history complete: nothing of it runs beside the fault (its trash slot, its scratch)
    return upstream, bystander, snapshot(bystander)


# Quick runs (-m "not slow") keep one step before the fetch, the one after it, and the last one.
QUICK_STEPS = ("before-fetch", "after-fetch", "after-rename")


@pytest.mark.parametrize("step", [step if step in QUICK_STEPS else pytest.param(step, marks=pytest.mark.slow)
                                  for step in WORKER_STEPS])
def test_worker_killed_at_each_step(root, store_with_bystander, step, kill_log):
    upstream, bystander, before = store_with_bystander
    sha = upstream.commit({"new.txt": "a commit the mirror lacks"})  # so every fetch step runs
    # Each death makes the commit absent and the waiter starts the next clone; after three deaths
    # in a row the commit fails with WORKER_DIED and backs off instead of looping. A wait long
    # enough for three deaths makes the outcome deterministic: every step is reached again by the
    # next worker, except after-fetch (the commit is in the mirror by then: the next worker
    # skips the fetch and publishes).
    code, answer, _ = run_cli("ensure", upstream.path, sha, "--wait", "60", root=root,
                              env={"CHECKOUTCACHE_TEST_KILL_AT": step, **SHORT_BACKOFF})
    store = only_repo(root)
    if step == "after-fetch":
        assert code == 0 and answer["state"] == "ready", answer
        assert len(assert_died_at(kill_log, step)) == 1
    else:
        assert code == 1 and answer["error"] == "WORKER_DIED", answer
        assert len(set(assert_died_at(kill_log, step, at_least=3))) == 3, "three workers, each killed at the step"
        assert not os.path.exists(store.ready_marker(sha)), "no worker killed before its marker published it"
    wait_until(lambda: past_back_off(store.failure_record(sha)), 10, "the back-off to pass")
    assert_recovered(root, upstream, sha, bystander, before)


def past_back_off(record: str) -> bool:
    try:
        return json.load(open(record))["retry_at"] < time.time()
    except FileNotFoundError:
        return True


def test_a_worker_that_keeps_dying_backs_off_instead_of_looping(root, upstream, kill_log):
    # The OOM killer takes every attempt: after three deaths in a row the commit fails and backs off.
    sha = upstream.shas[1]
    env = {"CHECKOUTCACHE_TEST_KILL_AT": "before-checkout", "CHECKOUTCACHE_BACKOFF": "60"}
    code, answer, _ = run_cli("ensure", upstream.path, sha, "--wait", "20", root=root, env=env)
    assert code == 1 and answer["error"] == "WORKER_DIED" and "3 times" in answer["message"]
    assert answer["retry_after"] > 30
    code, again, _ = run_cli("ensure", upstream.path, sha, root=root)  # no new attempt during the back-off
    assert code == 1 and again["error"] == "WORKER_DIED"
    log = open(only_repo(root).clone_log(sha)).read()
    assert log.count("clone of") == 3
    assert len(set(assert_died_at(kill_log, "before-checkout", at_least=3))) == 3


@pytest.mark.slow
def test_a_git_child_killed_by_the_oom_killer_is_a_worker_death(root, upstream, fake_git, tmp_path):
    """Regression: a git child SIGKILLed (what the OOM killer does) failed the clone with
    CLONE_FAILED "(git printed nothing)" and a doubling back-off, as if the commit were bad.
    It is a worker's death: three in a row are WORKER_DIED."""
    sha = upstream.shas[1]
    killed = tmp_path / "killed"
    oom = fake_git(f'case "$*" in *" checkout "*) echo $$ >> {killed}; kill -9 $$;; esac')
    code, answer, _ = run_cli("ensure", upstream.path, sha, "--wait", "30", root=root,
                              env={**oom, "CHECKOUTCACHE_BACKOFF": "60"})
    assert code == 1 and answer["error"] == "WORKER_DIED" and "3 times" in answer["message"], answer
    pids = killed.read_text().split()
    assert len(pids) == 3 and not any(pid_alive(int(pid)) for pid in pids)  # the kills happened
    log = open(only_repo(root).clone_log(sha)).read()
    assert log.count("was killed by SIGKILL") == 3 and "CLONE_FAILED" not in log
    assert os.listdir(only_repo(root).scratch_dir) == []
    # A crash (another signal) is the clone's own failure, said as such.
    crash = fake_git('case "$*" in *" checkout "*) kill -SEGV $$;; esac')
    code, answer, _ = run_cli("ensure", upstream.path, upstream.shas[2], "--wait", "30", root=root, env=crash)
    assert code == 1 and answer["error"] == "CLONE_FAILED" and "SIGSEGV" in answer["message"], answer


@pytest.mark.slow
def test_a_server_flooding_warnings_before_gits_error_still_has_its_error_said(root, upstream, fake_git):
    """Regression: a server's warnings used up the log's cap and the lines kept of git's output,
    and the clone failed with "(git printed nothing)": git's own error lines are kept apart."""
    noisy = fake_git('case "$*" in *" fetch "*) i=0; while [ $i -lt 400 ]; do '
                     'printf "remote: warning: %08000d\\n" $i >&2; i=$((i+1)); done; '
                     'echo "fatal: the server said no (the real cause)" >&2; '
                     'i=0; while [ $i -lt 300 ]; do printf "remote: warning: %08000d\\n" $i >&2; i=$((i+1)); done; '
                     'exit 128;; esac')
    sha = upstream.shas[1]
    code, answer, out = run_cli("ensure", upstream.path, sha, "--wait", "60", root=root, env=noisy)
    assert code == 1 and "the server said no (the real cause)" in answer["message"], answer
    log = open(only_repo(root).clone_log(sha)).read()
    assert os.path.getsize(only_repo(root).clone_log(sha)) > 1 << 20  # the warnings did fill the cap
    assert "fatal: the server said no (the real cause)" in log


@pytest.mark.slow
def test_a_git_that_crashes_on_a_10000_deep_tree_says_so(root, daemon):
    """Regression: a 10,000-deep tree failed with "(git printed nothing)": git crashes on it
    (SIGSEGV) after the server's warnings about it; the answer says which git and how."""
    path = os.path.join(daemon.base, f"deep-{os.urandom(3).hex()}")
    git("init", "-q", "-b", "main", path)
    deep = "/".join(["d"] * 10000) + "/f.txt"
    fast_import = (f"commit refs/heads/main\ncommitter t <t@x> 0 +0000\ndata 2\nx\nM 100644 inline {deep}\n"
                   f"data 3\nhi\n\n")
    subprocess.run(["git", "-C", path, "fast-import", "--quiet"], input=fast_import.encode(), check=True)
    sha = git("rev-parse", "main", cwd=path)
    code, answer, out = run_cli("ensure", daemon.url(os.path.basename(path)), sha, "--wait", "120", root=root)
    assert code == 1 and answer["error"] == "CLONE_FAILED", out
    assert "git printed nothing" not in answer["message"], answer
    assert "was killed by SIG" in answer["message"] or "fatal:" in answer["message"] or "error:" in answer[
        "message"], answer


@pytest.mark.slow
def test_gc_killed_between_rename_and_delete(root, store_with_bystander, kill_log):
    upstream, bystander, before = store_with_bystander
    victim = wait_ready(root, upstream.path, upstream.shas[1])["path"]
    make_idle(victim, 3600)
    os.utime(marker(bystander))
    code, _, _ = run_cli("gc", "--max-checkouts", "1", "--grace", "10m", "--max-spares", "0", root=root,
                         env={"CHECKOUTCACHE_TEST_KILL_AT": "gc-after-evict-rename"})
    assert code == -9 and not os.path.exists(victim)
    assert len(assert_died_at(kill_log, "gc-after-evict-rename")) == 1
    assert len(os.listdir(only_repo(root).trash_dir)) == 1, "killed between the rename and the delete"
    assert_recovered(root, upstream, upstream.shas[1], bystander, before)


@pytest.mark.slow
def test_gc_killed_during_a_mirror_repack(root, store_with_bystander, kill_log):
    upstream, bystander, before = store_with_bystander
    victim = wait_ready(root, upstream.path, upstream.shas[2])["path"]
    make_idle(victim, 3600)
    code, _, _ = run_cli("gc", "--max-checkouts", "1", "--grace", "10m", root=root,
                         env={"CHECKOUTCACHE_TEST_KILL_AT": "gc-during-repack"})
    assert code == -9
    assert len(assert_died_at(kill_log, "gc-during-repack")) == 1
    # The orphaned git gc still holds the mirror lock it inherited: a clone waits for it, then proceeds.
    assert_recovered(root, upstream, upstream.shas[2], bystander, before)
    assert git("fsck", "--connectivity-only", cwd=only_repo(root).mirror) == ""


def workers_of(store, sha: str) -> list[int]:
    """The pids of the commit's clone attempts, oldest first, from its clone log ("clone of SHA ... by pid N")."""
    lines = []
    for log in (store.previous_clone_log(sha), store.clone_log(sha)):
        if os.path.exists(log):
            lines += open(log).read().splitlines()
    return [int(match.group(1)) for match in
            (re.search(rf"clone of {sha}\b.* by pid (\d+)", line) for line in lines) if match]


def clones_alive(root: str) -> bool:
    code, status, out = run_cli("status", root=root)
    assert code == 0, out
    return any(clone["alive"] for repo in status["repos"] for clone in repo["clones"])


RANDOM_ROUNDS = 40


@pytest.mark.slow
def test_random_kills_of_clones_and_gcs(root, tmp_path, kill_log):
    """Many clones and gcs, SIGKILLed at random steps and random instants, then everything still works.

    The schedule is a seeded number of rounds (never as many as fit in some seconds). A commit whose
    workers the schedule killed three times in a row rightly fails with WORKER_DIED (that is the
    back-off against a worker that keeps dying): it is accepted only when the kill log holds the
    pids of that commit's last three workers, and after its back-off the commit must be served."""
    upstream = Upstream(str(tmp_path / "many"))
    for number in range(8):
        upstream.commit({f"f{number}.txt": f"{number}\n" * 100, "README.md": f"{number}\n"})
    rng = random.Random(1234)
    steps = WORKER_STEPS + ["gc-after-evict-rename", "gc-during-repack", None, None]
    procs = []
    for _ in range(RANDOM_ROUNDS):
        step = rng.choice(steps)
        env = dict(os.environ, **SHORT_BACKOFF, **({"CHECKOUTCACHE_TEST_KILL_AT": step} if step else {}))
        if rng.random() < 0.3:
            args = ["gc", "--max-checkouts", "2", "--grace", "0"]
        else:
            args = ["ensure", upstream.path, rng.choice(upstream.shas), "--wait", str(rng.choice([0, 0.5, 2]))]
        proc = subprocess.Popen([sys.executable, "-m", "checkoutcache", "--root", root, *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        if rng.random() < 0.3:  # and sometimes the caller itself dies at a random instant
            time.sleep(rng.uniform(0, 0.3))
            proc.kill()
        time.sleep(rng.uniform(0, 0.2))
    for proc in procs:
        proc.wait(60)
    # The workers the schedule started run on after their callers (each finishes or is killed at its step).
    wait_until(lambda: not clones_alive(root), 120, "the schedule's clone workers to end")
    killed = kills(kill_log)
    assert {step for step, _ in killed} & set(WORKER_STEPS), f"no worker was killed: {killed}"
    for _, pid in killed:
        wait_until(lambda: not pid_alive(pid), 10, f"killed pid {pid} to be gone")
    killed_pids = {pid for step, pid in killed if step in WORKER_STEPS}
    store = only_repo(root)
    wait_until(lambda: all(past_back_off(store.failure_record(sha)) for sha in upstream.shas), 10,
               "the (short) back-off of any run of deaths to pass")
    for sha in upstream.shas:
        code, answer, out = run_cli("ensure", upstream.path, sha, "--wait", "120", root=root, env=SHORT_BACKOFF)
        if code == 1 and answer and answer["error"] == "WORKER_DIED":
            last_three = workers_of(store, sha)[-3:]
            assert len(last_three) == 3 and set(last_three) <= killed_pids, \
                f"WORKER_DIED for {sha} without three kills of its workers in a row: {last_three}, {killed}"
            wait_until(lambda: past_back_off(store.failure_record(sha)), 10, "the back-off to pass")
            code, answer, out = run_cli("ensure", upstream.path, sha, "--wait", "120", root=root)
        assert code == 0, (code, answer, out)
        assert_checkout_matches(answer["path"], upstream.path, sha)
    code, report, _ = run_cli("gc", root=root)
    assert code == 0
    store = only_repo(root)
    assert os.listdir(store.scratch_dir) == [] and os.listdir(store.trash_dir) == []
    assert run_cli("verify", root=root)[0] == 0
    assert git("fsck", "--connectivity-only", cwd=store.mirror) == ""


# ---------------------------------------------------------------- a full disk

def can_mount_tmpfs(path: str) -> bool:
    if os.geteuid() != 0:
        return False
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", path],
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_disk_full_fails_cleanly_and_gc_makes_room(tmp_path):
    upstream = Upstream(str(tmp_path / "up"))
    for number in range(3):
        upstream.commit({"big.bin": os.urandom(1 << 20), "README.md": f"{number}\n"})
    mount = str(tmp_path / "small")
    real = can_mount_tmpfs(mount)
    root = os.path.join(mount, "cache")
    env = {"CHECKOUTCACHE_BACKOFF": "0.1", "CHECKOUTCACHE_BACKOFF_MAX": "0.1"}
    try:
        first = wait_ready(root, upstream.path, upstream.shas[0], env=env)["path"]
        second = wait_ready(root, upstream.path, upstream.shas[1], env=env)["path"]
        if real:  # fill the filesystem until the next commit's objects fit, but not its checkout too
            free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
            with open(os.path.join(mount, "balloon"), "wb") as balloon:
                balloon.write(b"\0" * max(0, free - (1536 << 10)))
            fault = {}
        else:
            fault = {"CHECKOUTCACHE_TEST_ENOSPC_AT": "before-checkout"}
        code, answer, _ = run_cli("ensure", upstream.path, upstream.shas[2], "--wait", "30", root=root,
                                  env={**env, **fault})
        assert code == 1 and answer["error"] == "DISK_FULL", answer
        store = only_repo(root)
        assert os.listdir(store.scratch_dir) == []
        assert_checkout_matches(first, upstream.path, upstream.shas[0])
        assert_checkout_matches(second, upstream.path, upstream.shas[1])
        git("fsck", "--connectivity-only", "--no-dangling", cwd=store.mirror)  # whatever the disk let in, sound
        for path in (first, second):
            make_idle(path, 3600)
        code, report, _ = run_cli("gc", "--max-checkouts", "0", "--grace", "1m", root=root)
        assert code == 0 and report["bytes_freed"] >= 2 << 20
        wait_until(lambda: past_back_off(store.failure_record(upstream.shas[2])), 10, "the back-off to pass")
        answer = wait_ready(root, upstream.path, upstream.shas[2])
        assert_checkout_matches(answer["path"], upstream.path, upstream.shas[2])
    finally:
        if real:
            subprocess.run(["umount", "-l", mount])


# ---------------------------------------------------------------- a damaged store

@pytest.mark.slow
def test_stale_git_locks_from_a_killed_fetch_do_not_block_the_next(root, store_with_bystander):
    upstream, bystander, before = store_with_bystander
    mirror = only_repo(root).mirror
    sha = upstream.commit({"after-crash.txt": "x"})
    for name in ("shallow.lock", "HEAD.lock", "packed-refs.lock", f"refs/keep/{sha}.lock"):
        os.makedirs(os.path.dirname(os.path.join(mirror, name)), exist_ok=True)
        open(os.path.join(mirror, name), "w").close()  # fresh, as a just-killed git leaves them
    assert_recovered(root, upstream, sha, bystander, before)
    assert not os.path.exists(os.path.join(mirror, f"refs/keep/{sha}.lock"))


@pytest.mark.parametrize("damage", ["missing HEAD", "truncated pack", "mirror deleted"])
@pytest.mark.slow
def test_a_damaged_mirror_is_rebuilt_and_checkouts_keep_working(root, store_with_bystander, damage):
    upstream, bystander, before = store_with_bystander
    mirror = only_repo(root).mirror
    if damage == "missing HEAD":
        os.unlink(os.path.join(mirror, "HEAD"))
    elif damage == "mirror deleted":
        subprocess.run(["rm", "-rf", mirror], check=True)
    else:
        git("repack", "-a", "-d", "-q", cwd=mirror)
        (pack,) = [f for f in os.listdir(os.path.join(mirror, "objects", "pack")) if f.endswith(".pack")]
        pack = os.path.join(mirror, "objects", "pack", pack)
        with open(pack, "r+b") as handle:
            handle.truncate(os.path.getsize(pack) // 3)
    sha = upstream.commit({"after-damage.txt": "y"})
    answer = wait_ready(root, upstream.path, sha)
    assert_checkout_matches(answer["path"], upstream.path, sha)
    # The checkout that borrowed from the old mirror still works: its objects were fetched back.
    assert_checkout_matches(bystander, upstream.path, upstream.shas[0])
    assert snapshot(bystander) == before
    assert run_cli("verify", root=root)[0] == 0


@pytest.mark.slow
def test_a_mirror_missing_a_blob_never_publishes_a_checkout_without_that_file(root, store_with_bystander):
    """Regression: `git checkout` exits 0 when it cannot read a blob (it only prints an
    error), so a checkout lacking that file was published as ready."""
    upstream, bystander, before = store_with_bystander
    first = upstream.commit({"shared.txt": "a blob two commits share\n" * 50})
    wait_ready(root, upstream.path, first)
    mirror = only_repo(root).mirror
    packs = os.path.join(mirror, "objects", "pack")
    for name in sorted(os.listdir(packs)):  # every object loose, so one can be lost alone
        if name.endswith(".pack"):
            data = open(os.path.join(packs, name), "rb").read()
            for other in [f for f in os.listdir(packs) if f.startswith(name[:-len(".pack")])]:
                os.unlink(os.path.join(packs, other))
            subprocess.run(["git", "-C", mirror, "unpack-objects", "-q"], input=data, check=True)
    blob = git("rev-parse", f"{first}:shared.txt", cwd=upstream.path)
    os.unlink(os.path.join(mirror, "objects", blob[:2], blob[2:]))
    second = upstream.commit({"other.txt": "y"})  # the upstream takes the mirror to have the shared blob
    answer = wait_ready(root, upstream.path, second)
    assert_checkout_matches(answer["path"], upstream.path, second)
    assert snapshot(bystander) == before


def test_a_checkout_emptied_by_rm_is_not_served_and_is_remade(root, store_with_bystander):
    upstream, bystander, before = store_with_bystander
    path = wait_ready(root, upstream.path, upstream.shas[1])["path"]
    subprocess.run(f"rm -rf {path}/*", shell=True, check=True)  # .git and the marker survive the glob
    status = run_cli("status", root=root)[1]
    (damaged,) = [c for c in status["repos"][0]["checkouts"] if c["commit"] == upstream.shas[1]]
    assert damaged["intact"] is False
    assert Cache(root).ensure(upstream.path, upstream.shas[1]).state == "cloning"  # not served: re-made
    answer = wait_ready(root, upstream.path, upstream.shas[1])
    assert_checkout_matches(answer["path"], upstream.path, upstream.shas[1])
    assert snapshot(bystander) == before


def test_a_checkout_that_lost_its_marker_is_not_served_and_gc_removes_it(root, upstream):
    sha = upstream.shas[1]
    path = wait_ready(root, upstream.path, sha)["path"]
    os.unlink(marker(path))
    # Not served: the answer starts a clone (no wait, so it cannot be the re-made checkout yet).
    assert Cache(root).ensure(upstream.path, sha).state == "cloning"
    answer = wait_ready(root, upstream.path, sha)
    assert_checkout_matches(answer["path"], upstream.path, sha)
    # Lost again, with no clone running: gc removes it as unpublished.
    settled(root)  # (a worker lives on a moment after its answer, holding the clone lock)
    os.unlink(marker(path))
    report = run_cli("gc", root=root)[1]
    assert [r["name"] for r in report["removed"] if r["reason"] == "unpublished"] == [sha], report
    # Besides, at most the checkout the re-make moved aside, if its worker had not deleted it yet.
    assert {r["reason"] for r in report["removed"]} <= {"unpublished", "trash"}, report
    assert not os.path.exists(path)
    answer = wait_ready(root, upstream.path, sha)
    assert_checkout_matches(answer["path"], upstream.path, sha)


@pytest.mark.slow
def test_verify_finds_a_deep_damage_and_removes_it(root, store_with_bystander):
    upstream, bystander, before = store_with_bystander
    path = wait_ready(root, upstream.path, upstream.shas[2])["path"]
    os.unlink(os.path.join(path, "src", "deep", "nested", "file.txt"))
    code, report, _ = run_cli("verify", root=root)
    assert code == 1 and report["broken"] == 1
    (broken,) = [c for c in report["checkouts"] if not c["ok"]]
    assert broken["commit"] == upstream.shas[2] and "differ" in broken["problems"][0]
    code, report, _ = run_cli("verify", upstream.path, upstream.shas[2], "--remove-broken", root=root)
    assert code == 1 and report["checkouts"][0]["removed"] is True
    assert run_cli("verify", root=root)[0] == 0
    answer = wait_ready(root, upstream.path, upstream.shas[2])
    assert_checkout_matches(answer["path"], upstream.path, upstream.shas[2])
    assert snapshot(bystander) == before


def test_untracked_build_outputs_are_not_damage(root, upstream):
    path = wait_ready(root, upstream.path, upstream.shas[0])["path"]
    os.makedirs(os.path.join(path, "build"))
    open(os.path.join(path, "build", "out.o"), "w").close()
    assert Cache(root).ensure(upstream.path, upstream.shas[0]).state == "ready"
    assert run_cli("verify", root=root)[0] == 0


def test_locks_unsupported_is_a_clear_error_at_once(root, upstream, monkeypatch):
    import errno

    from checkoutcache.store import locks

    def no_locks(*_args, **_kwargs):
        raise OSError(errno.ENOLCK, "No locks available")  # as flock(2) answers on such a filesystem

    monkeypatch.setattr(locks, "flock", no_locks)
    started = time.monotonic()
    answer = Cache(root).ensure(upstream.path, upstream.shas[0], wait=30)
    assert answer.error == "ROOT_UNUSABLE" and "lock" in answer.message
    assert time.monotonic() - started < 10


# ---------------------------------------------------------------- hostile repositories

def test_symlinks_pointing_outside_stay_links_and_gc_never_follows_them(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("must survive")
    upstream = Upstream(str(tmp_path / "evil"))
    sha = upstream.commit({"README.md": "x"}, symlinks={"escape": str(outside), "up": "../../../../..",
                                                       "abs-file": str(outside / "precious.txt")})
    path = wait_ready(root, upstream.path, sha)["path"]
    assert_checkout_matches(path, upstream.path, sha)
    assert os.path.islink(os.path.join(path, "escape"))
    assert sorted(os.listdir(outside)) == ["precious.txt"]
    make_idle(path, 3600)
    report = run_cli("gc", "--max-checkouts", "0", "--grace", "1m", root=root)[1]
    assert [r["reason"] for r in report["removed"]] == ["lru"]
    assert (outside / "precious.txt").read_text() == "must survive"


def test_a_tree_with_a_dot_git_entry_is_refused_and_writes_nothing_outside(root, tmp_path):
    upstream = Upstream(str(tmp_path / "trick"))
    upstream.commit({"README.md": "x"})
    hook = tmp_path / "pwned"
    blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=upstream.path, check=True, text=True,
                          input=f"#!/bin/sh\ntouch {hook}\n", capture_output=True).stdout.strip()
    hooks = git("mktree", cwd=upstream.path) if False else subprocess.run(
        ["git", "mktree"], cwd=upstream.path, input=f"100755 blob {blob}\tpost-checkout\n", text=True,
        capture_output=True, check=True).stdout.strip()
    dotgit = subprocess.run(["git", "mktree"], cwd=upstream.path, input=f"040000 tree {hooks}\thooks\n",
                            text=True, capture_output=True, check=True).stdout.strip()
    top = subprocess.run(["git", "mktree", "--missing"], cwd=upstream.path,
                         input=f"040000 tree {dotgit}\t.git\n", text=True, capture_output=True,
                         check=True).stdout.strip()
    sha = git("commit-tree", top, "-m", "evil", cwd=upstream.path)
    git("update-ref", "refs/heads/evil", sha, cwd=upstream.path)
    code, answer, _ = run_cli("ensure", upstream.path, sha, "--wait", "30", root=root)
    assert code == 1 and answer["state"] == "failed"
    assert not hook.exists()
    store = only_repo(root)
    assert os.listdir(store.scratch_dir) == []
    assert not os.path.exists(store.checkout(sha))


@pytest.mark.slow
def test_a_large_file_is_checked_out_whole(root, tmp_path):
    upstream = Upstream(str(tmp_path / "large"))
    data = os.urandom(24 << 20)
    sha = upstream.commit({"large.bin": data})
    path = wait_ready(root, upstream.path, sha, timeout=120)["path"]
    assert os.path.getsize(os.path.join(path, "large.bin")) == len(data)
    assert_checkout_matches(path, upstream.path, sha)


# ---------------------------------------------------------------- permissions

def test_nothing_is_world_writable_even_with_umask_zero(root, upstream):
    done = subprocess.run(["sh", "-c", f"umask 000 && {sys.executable} -m checkoutcache --root {root} "
                                       f"ensure {upstream.path} {upstream.shas[0]} --wait 60"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    loose = []
    entries = list(walk(root))
    assert len(entries) > 10, "the store was walked"
    for entry in entries:
        if not entry.is_link and entry.info.st_mode & stat.S_IWOTH:
            loose.append(entry.path)
    assert loose == []


# ---------------------------------------------------------------- load

class AskGate:
    """Askers pass through together; the driver shuts the gate to act while no ask is in flight."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._shut = False

    @contextlib.contextmanager
    def ask(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._shut)
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def shut(self):
        with self._cond:
            self._shut = True
            self._cond.wait_for(lambda: self._inside == 0)
        try:
            yield
        finally:
            with self._cond:
                self._shut = False
                self._cond.notify_all()


ASKERS = 8
LOAD_GRACE = 3600  # seconds: no answer can be checked this late, however loaded the machine
EVICTIONS = 12  # checkouts gc evicts while askers ask, at least
RECLONES = 4  # asks that found their commit evicted and had it cloned again, at least
MAX_ROUNDS = 60  # a bound on the driver's rounds, should the events above never come (then it fails)


@pytest.mark.slow
def test_many_askers_under_tight_gc_never_get_a_missing_path(root, tmp_path, monkeypatch):
    """Askers (CLI processes) ask for six commits while gc runs back to back at a limit of one, and
    between rounds a driver makes every checkout look unused for two windows, so gc evicts them
    while the askers ask for them again: each answer's use races gc's eviction. Whatever wins, an
    answered path is used inside its grace window (an hour: it cannot end during the test, whatever
    the load), so it must be there and hold its commit. The driver ages markers only while no ask
    is in flight (an ask's use is never undone by the test), and goes on until gc has evicted
    EVICTIONS checkouts and asks have met evicted commits RECLONES times: events, not time."""
    upstream = Upstream(str(tmp_path / "load"))
    tree = {f"src/part_{i % 10}/file_{i}.txt": f"{i}\n" * 20 for i in range(200)}  # deleting takes a while
    for number in range(6):
        upstream.commit({**tree, f"f{number}.txt": "x" * 1000, "README.md": f"{number}\n"})
    journal = tmp_path / "clones.jsonl"
    monkeypatch.setenv("CHECKOUTCACHE_CLONE_JOURNAL", str(journal))
    gate = AskGate()
    done = threading.Event()
    problems: list[str] = []
    checked: list[str] = []  # one entry per answer whose path was checked inside its window
    gc_reports: list[dict] = []

    def asker(index: int) -> None:
        rng = random.Random(index)
        while not done.is_set():
            with gate.ask():
                number = rng.randrange(len(upstream.shas))
                code, answer, out = run_cli("ensure", upstream.path, upstream.shas[number], "--wait", "300",
                                            root=root)
                if code != 0:
                    problems.append(f"exit {code}: {out[-500:]}")
                    continue
                time.sleep(rng.uniform(0, 0.25))  # the review works: gc has time to evict under it
                try:
                    with open(os.path.join(answer["path"], "README.md")) as handle:
                        content = handle.read()
                except OSError as exc:
                    problems.append(f"{answer['path']} vanished inside the grace window: {exc}")
                    continue
                if content != f"{number}\n":
                    problems.append(f"{answer['path']} holds README {content!r}, not commit {number}'s")
                checked.append(answer["path"])

    def gc_loop() -> None:
        while not done.is_set():
            code, report, out = run_cli("gc", "--max-checkouts", "1", "--grace", str(LOAD_GRACE), root=root)
            if code != 0:
                problems.append(f"gc exited {code}: {out[-500:]}")
                return
            gc_reports.append(report)

    def evictions() -> int:
        return sum(1 for report in gc_reports for r in report["removed"] if r["reason"] == "lru")

    def reclones() -> int:
        published = [json.loads(line)["commit"] for line in open(journal) if '"published"' in line] \
            if journal.exists() else []
        return len(published) - len(set(published))

    threads = [threading.Thread(target=asker, args=(i,)) for i in range(ASKERS)]
    threads.append(threading.Thread(target=gc_loop))
    for thread in threads:
        thread.start()
    rounds = 0
    try:
        wait_until(lambda: len(checked) >= ASKERS or problems, 300, "the first answers")
        store = only_repo(root)
        while (evictions() < EVICTIONS or reclones() < RECLONES) and rounds < MAX_ROUNDS and not problems:
            rounds += 1
            with gate.shut():  # no ask in flight: aging a marker undoes nobody's use
                for name in store.checkout_names():
                    try:
                        make_idle(store.checkout(name), 2 * LOAD_GRACE)
                    except FileNotFoundError:
                        pass  # gc evicted it meanwhile
            # Let asks and gc race: a gc run that starts after the aging ends, and asks meanwhile.
            runs, asks = len(gc_reports), len(checked)
            wait_until(lambda: (len(gc_reports) >= runs + 2 and len(checked) >= asks + ASKERS) or problems, 300,
                       "a gc run and asks after the aging")
    finally:
        done.set()
        for thread in threads:
            thread.join(600)
    assert problems == []
    assert all(not thread.is_alive() for thread in threads)
    assert evictions() >= EVICTIONS, f"gc evicted {evictions()} checkouts in {rounds} rounds"
    assert reclones() >= RECLONES, f"asks met evicted commits {reclones()} times in {rounds} rounds"
    assert len(checked) >= ASKERS, "answers were checked"


@pytest.mark.slow
def test_worker_deaths_are_still_counted_after_gc(root, upstream):
    """gc tidies a dead clone's record away but keeps its count of deaths: a commit whose worker is
    always killed still ends in WORKER_DIED instead of restarting three times per gc interval."""
    sha = upstream.shas[1]
    env = {"CHECKOUTCACHE_TEST_KILL_AT": "after-scratch"}

    def start_and_let_die() -> None:
        code, answer, _ = run_cli("ensure", upstream.path, sha, root=root, env=env)
        assert code == 75 and answer["state"] == "cloning", answer
        deadline = time.monotonic() + 20
        while any(c["alive"] for r in run_cli("status", root=root)[1]["repos"] for c in r["clones"]):
            assert time.monotonic() < deadline, "the worker did not die"
            time.sleep(0.05)

    start_and_let_die()
    start_and_let_die()
    code, _, _ = run_cli("gc", root=root)
    assert code == 0
    assert not os.path.exists(only_repo(root).clone_record(sha))  # tidied
    start_and_let_die()
    code, answer, _ = run_cli("ensure", upstream.path, sha, root=root, env=env)
    assert code == 1 and answer["error"] == "WORKER_DIED" and "3 times" in answer["message"], answer
    log = open(only_repo(root).clone_log(sha)).read()
    assert log.count("clone of") == 3
