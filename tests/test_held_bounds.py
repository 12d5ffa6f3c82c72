"""No caller keeps checkouts from eviction beyond a bound the operator sets (issue 33,
"A tokenless reader pins every checkout"; DESIGN invariant 18).

A review needs no token and no write access to take the marker's shared flock: one that
locks every checkout it sees and keeps the descriptors made every checkout "held", so
max-checkouts, max-bytes and min-free stayed unmet until the disk filled. Now a reader's
hold protects a checkout only while it is among CHECKOUTCACHE_MAX_HELD most recently used
held ones and held for less than CHECKOUTCACHE_MAX_HOLD_AGE (as gc's runs saw it); serve's
own holds have their own bounds and keep their protection; a workspace's objects stay
while it lives, whatever happens to its source checkout."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

import pytest

from .helpers import Serve, assert_checkout_matches, git, make_idle, marker, run_cli, settled, wait_ready, wait_until

pytestmark = pytest.mark.slow

PIN = r"""
import fcntl, sys, time
held = []
for path in sys.argv[1:]:
    fd = open(path, "rb")
    fcntl.flock(fd, fcntl.LOCK_SH)
    held.append(fd)
print("pinned", flush=True)
time.sleep(3600)
"""


def pin(markers: list[str]) -> subprocess.Popen:
    """A process that takes every marker's shared lock and keeps it (what any reader may do)."""
    proc = subprocess.Popen([sys.executable, "-c", PIN, *markers], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "pinned"
    return proc


def checkouts(root: str, upstream, shas: list[str]) -> list[str]:
    paths = [wait_ready(root, upstream.path, sha)["path"] for sha in shas]
    settled(root)
    for age, path in enumerate(reversed(paths)):  # the first asked is the least recently used
        make_idle(path, 3600 + 60 * age)
    return paths


def gc(root: str, **env) -> dict:
    code, report, out = run_cli("gc", "--json", "--max-checkouts", "0", root=root,
                                env={"CHECKOUTCACHE_MAX_SPARES": "0", **env})
    assert code == 0, out
    return report


def test_a_reader_pinning_every_checkout_keeps_at_most_max_held(root, upstream):
    paths = checkouts(root, upstream, upstream.shas[:3])
    pinner = pin([marker(p) for p in paths])
    try:
        report = gc(root, CHECKOUTCACHE_MAX_HELD="1")
        broken = sorted(r["name"] for r in report["removed"] if r["broke_hold"] == "held-over-count")
        kept = [k["name"] for k in report["kept_over_limit"] if k["why"] == "held"]
        # The most recently used held one stays; the two older ones go though they are held.
        assert broken == sorted(upstream.shas[:2]) and kept == [upstream.shas[2]], report
        assert not os.path.exists(paths[0]) and not os.path.exists(paths[1]) and os.path.isdir(paths[2])
        assert report["unmet"] and report["unmet"][0]["kept"] == {"held": 1}, report["unmet"]
        assert pinner.poll() is None, "the pinning process still runs: only its protection ended"
        # An evicted checkout is cloned again on the next ask, whole.
        again = wait_ready(root, upstream.path, upstream.shas[0])["path"]
        assert_checkout_matches(again, upstream.path, upstream.shas[0])
    finally:
        pinner.kill()
        pinner.wait()


def test_a_reader_hold_older_than_max_hold_age_no_longer_protects(root, upstream):
    paths = checkouts(root, upstream, upstream.shas[:2])
    pinner = pin([marker(p) for p in paths])
    try:
        first = gc(root, CHECKOUTCACHE_MAX_HOLD_AGE="0s")  # seen held once: its age starts
        assert sorted(k["name"] for k in first["kept_over_limit"] if k["why"] == "held") == sorted(upstream.shas[:2])
        second = gc(root, CHECKOUTCACHE_MAX_HOLD_AGE="0s")  # held at both looks: older than the bound
        assert sorted(r["name"] for r in second["removed"] if r["broke_hold"] == "held-too-long") == \
            sorted(upstream.shas[:2]), second
        assert not any(os.path.exists(p) for p in paths)
    finally:
        pinner.kill()
        pinner.wait()
    # Released: nothing is remembered as held any more.
    paths = checkouts(root, upstream, upstream.shas[:1])
    report = gc(root)
    assert [r["name"] for r in report["removed"] if r["reason"] == "lru"] == [upstream.shas[0]]


def test_an_exec_within_the_bounds_and_serves_own_holds_keep_their_protection(root, upstream, tmp_path):
    paths = checkouts(root, upstream, upstream.shas[:3])
    serve = Serve(root, tmp_path, "--allow-local", "--gc-interval", "0", env={"CHECKOUTCACHE_MAX_HELD": "0",
                                                                              "CHECKOUTCACHE_MAX_SPARES": "0"})
    pinner = pin([marker(paths[0])])
    try:
        status, held = serve.request("POST", "/v1/hold", {"repo": upstream.path, "commit": upstream.shas[1]})
        assert status == 200 and held["hold"], held
        make_idle(paths[1], 7200)
        status, report = serve.request("POST", "/v1/gc", {"max_checkouts": 0})
        assert status == 200, report
        # serve's own hold is not a reader's: kept; the reader's lock (max-held 0) is not.
        assert [k["name"] for k in report["kept_over_limit"] if k["why"] == "held"] == [upstream.shas[1]], report
        assert [r["name"] for r in report["removed"] if r["broke_hold"]] == [upstream.shas[0]], report
        assert os.path.isdir(paths[1]) and not os.path.exists(paths[0])
    finally:
        pinner.kill()
        pinner.wait()
        serve.stop()
    # With the default bounds, a running exec keeps its checkout whatever the limits.
    exec_proc = subprocess.Popen([sys.executable, "-m", "checkoutcache", "--root", root, "exec", upstream.path,
                                  upstream.shas[2], "--", "sh", "-c", "echo running; sleep 600"],
                                 stdout=subprocess.PIPE, text=True)
    try:
        assert exec_proc.stdout.readline().strip() == "running"
        make_idle(paths[2], 7200)
        report = gc(root)
        assert upstream.shas[2] in [k["name"] for k in report["kept_over_limit"] if k["why"] == "held"], report
        assert os.path.isdir(paths[2])
    finally:
        exec_proc.kill()
        exec_proc.wait()


def test_a_workspace_keeps_its_objects_when_its_sources_hold_is_broken(root, upstream, tmp_path):
    sha, other = upstream.shas[-1], upstream.shas[0]
    source, newer = checkouts(root, upstream, [sha, other])
    workspace = subprocess.Popen([sys.executable, "-m", "checkoutcache", "--root", root, "workspace", "create",
                                  "--path", "--owner-pid", str(os.getpid()), upstream.path, sha],
                                 stdout=subprocess.PIPE, text=True)
    made = workspace.stdout.readline().strip()
    assert os.path.isdir(made), made
    pinner = pin([marker(newer)])  # a more recently used checkout, locked by a reader
    try:
        make_idle(source, 7200)
        # One reader's lock kept (the more recent one): the workspace's source goes, its pin stays.
        report = gc(root, CHECKOUTCACHE_MAX_HELD="1", CHECKOUTCACHE_MIRROR_GC_INTERVAL="0s")
        assert [r["name"] for r in report["removed"] if r["broke_hold"]] == [sha], report
        assert not os.path.exists(source)
        # The mirror kept the commit for the workspace (its keep-ref, through the repack).
        (key,) = os.listdir(os.path.join(root, "repos"))
        mirror = os.path.join(root, "repos", key, "mirror.git")
        assert f"refs/keep/{sha}" in git("for-each-ref", "--format=%(refname)", "refs/keep/", cwd=mirror).split()
        assert git("rev-parse", "HEAD", cwd=made) == sha
        assert git("status", "--porcelain", cwd=made) == ""
        git("fsck", "--connectivity-only", cwd=made)
    finally:
        workspace.kill()
        workspace.wait()
        pinner.kill()
        pinner.wait()


def test_a_running_exec_keeps_its_checkout_however_many_readers_lock_others(root, upstream):
    """Review finding: an exec was one more shared lock to the bound on readers' locks: a review
    that locked 16 more recently used checkouts made gc evict the exec's tree under its command.
    An exec's hold is registered (store/holds.py) and no bound on readers breaks it."""
    paths = checkouts(root, upstream, upstream.shas[:3])
    exec_proc = subprocess.Popen([sys.executable, "-m", "checkoutcache", "--root", root, "exec", upstream.path,
                                  upstream.shas[0], "--", "sh", "-c", "echo running; sleep 600"],
                                 stdout=subprocess.PIPE, text=True, start_new_session=True)
    pinner = pin([marker(p) for p in paths[1:]])  # more recently used, and locked by a reader
    try:
        assert exec_proc.stdout.readline().strip() == "running"
        make_idle(paths[0], 7200)  # the exec's is the least recently used of all
        report = gc(root, CHECKOUTCACHE_MAX_HELD="0", CHECKOUTCACHE_MAX_HOLD_AGE="0s")
        assert [k["name"] for k in report["kept_over_limit"] if k["why"] == "held"] == [upstream.shas[0]], report
        assert sorted(r["name"] for r in report["removed"] if r["broke_hold"]) == sorted(upstream.shas[1:]), report
        assert os.path.isdir(paths[0]) and exec_proc.poll() is None
    finally:
        os.killpg(exec_proc.pid, signal.SIGKILL)  # the wrapper and its command: nothing released
        exec_proc.wait()
        pinner.kill()
        pinner.wait()
    assert exec_proc.returncode == -signal.SIGKILL
    # The exec gone, its registration is a dead holder's: gc removes it, and the checkout may go.
    report = gc(root)
    assert [r["name"] for r in report["removed"] if r["reason"] == "lru"] == [upstream.shas[0]], report
    assert os.listdir(os.path.join(root, "holds")) == []


def test_a_ready_answer_that_a_forced_move_overtakes_is_not_ready(root, upstream):
    """Review finding: a reader's ready answer took the marker's shared lock, handed the use to
    the writer, and answered ready; gc past the bounds moved the checkout meanwhile (it no longer
    waits for the exclusive lock), and the path answered was gone."""
    from checkoutcache.store import checkouts as store_checkouts
    from checkoutcache.store.layout import RootPaths
    from checkoutcache.store.ready import ready_record

    (path,) = checkouts(root, upstream, upstream.shas[:1])
    key = os.path.basename(os.path.dirname(os.path.dirname(path)))
    repo_paths = RootPaths(root).repo(key)

    def gc_moves_it_meanwhile() -> bool:  # what the writer's gc did while the use was handed over
        moved = store_checkouts.move_held_checkout_aside(repo_paths, upstream.shas[0], lambda _last_use: None)
        assert moved.slot is not None
        return True

    # In this process (the writer's uid) the use would be recorded by the touch: make it a reader's.
    import checkoutcache.store.ready as ready

    real = ready.record_use
    ready.record_use = lambda fd: False
    try:
        assert ready_record(marker(path), on_unrecorded=gc_moves_it_meanwhile) is None
        assert ready_record(marker(path), on_unrecorded=lambda: True) is None  # gone now: no marker there
    finally:
        ready.record_use = real


def assert_pins_nothing(root: str, key: str, workspaces, fake) -> None:
    """fake (a workspace-looking entry in workspaces/) held by its owner lock: two gc runs with
    a repository idle limit of 1 s drop the repository all the same."""
    holder = subprocess.Popen([sys.executable, "-c", PIN.replace("LOCK_SH", "LOCK_EX"), str(fake / "owner.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "pinned"
        env = {"CHECKOUTCACHE_WORKSPACES": str(workspaces), "CHECKOUTCACHE_REPO_MAX_IDLE": "1s",
               "CHECKOUTCACHE_GRACE": "1s"}
        first = gc(root, **env)
        assert first["workspaces"]["live"] == 1, first["workspaces"]
        second = gc(root, **env)
        assert [r["reason"] for r in first["removed"] + second["removed"]].count("repository") == 1, (first, second)
        assert not os.path.exists(os.path.join(root, "repos", key))
    finally:
        holder.kill()
        holder.wait()


def fake_owner(fake, root: str, key: str, sha: str) -> None:
    """An owner.json naming the repository and commit, and an owner.lock, as a review can write them."""
    import json

    (fake / "owner.json").write_text(json.dumps({"pid": 1, "start_time": 1.0, "root": root, "key": key, "commit": sha,
                                                 "name": sha, "created_at": 1.0}))
    (fake / "owner.lock").write_text("")


def test_a_fake_workspace_pins_nothing(root, upstream, tmp_path):
    """Review finding: a review made `ws-<pid>-<nonce>/owner.json` naming any repository and
    commit of the store and held its owner.lock: gc kept that repository (past its idle limit)
    and its commit's objects for as long as the lock was held. A workspace pins only what its
    git really borrows (its alternates), within the bounds on readers' locks."""
    sha = upstream.shas[0]
    (path,) = checkouts(root, upstream, [sha])
    key = os.path.basename(os.path.dirname(os.path.dirname(path)))
    workspaces = tmp_path / "workspaces"
    fake = workspaces / "ws-1-0123456789ab"
    (fake / "tree" / ".git").mkdir(parents=True)
    fake_owner(fake, root, key, sha)
    assert_pins_nothing(root, key, workspaces, fake)


def test_a_workspace_tree_that_is_a_symlink_is_never_read_through(root, upstream, tmp_path):
    """Second review of issue 33 (finding 5): gc checked a live workspace's alternates by a path
    whose components it followed: a review's `tree` made a symlink to another directory (one
    holding alternates that name the store's mirror) was read through, and its word pinned the
    repository. Every component beneath the workspace is opened without following a link: the
    symlinked tree borrows nothing, and the repository goes at its idle limit."""
    sha = upstream.shas[0]
    (path,) = checkouts(root, upstream, [sha])
    key = os.path.basename(os.path.dirname(os.path.dirname(path)))
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / ".git" / "objects" / "info").mkdir(parents=True)
    (elsewhere / ".git" / "objects" / "info" / "alternates").write_text(
        os.path.join(root, "repos", key, "mirror.git", "objects") + "\n")
    workspaces = tmp_path / "workspaces"
    fake = workspaces / "ws-1-0123456789ab"
    fake.mkdir(parents=True)
    os.symlink(elsewhere, fake / "tree")
    fake_owner(fake, root, key, sha)
    assert_pins_nothing(root, key, workspaces, fake)
