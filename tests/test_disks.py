"""The cache never fills the disk itself, and every write that meets a full disk
answers DISK_FULL (DESIGN invariant 15): real tmpfs filesystems of a few MiB
(root only: CI runs as root), real repositories, the real CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from .helpers import (
    Upstream,
    assert_checkout_matches,
    git,
    make_idle,
    only_repo,
    pid_alive,
    run_cli,
    settled,
    wait_ready,
    wait_until,
)
from .helpers.disk import fill, free_bytes, small_filesystem
from .helpers.gate import PackTailProxy


def big_history(path: str, commits: int, size: int) -> Upstream:
    upstream = Upstream(path)
    for number in range(commits):
        upstream.commit({"big.bin": os.urandom(size), "README.md": f"{number}\n"})
    return upstream


@pytest.mark.slow
def test_a_repack_on_a_tight_disk_is_skipped_with_its_reason_and_nothing_fills(tmp_path):
    """Regression: gc's mirror repack took the last 5.8 MiB, left a 14 MiB tmp_pack_* behind,
    reviews in their grace window got ENOSPC in their own checkouts, and the next gc answered
    INTERNAL_ERROR."""
    upstream = big_history(str(tmp_path / "up"), 4, 3 << 20)
    with small_filesystem(str(tmp_path / "small"), "40m") as mount:
        root = os.path.join(mount, "cache")
        paths = [wait_ready(root, upstream.path, sha)["path"] for sha in upstream.shas]
        for path in paths[:2]:
            make_idle(path, 3600)
        settled(root)  # the mirror's history is in before the disk fills (it writes and frees as it goes)
        fill(mount, leave=6 << 20)
        before = free_bytes(mount)
        code, report, out = run_cli("gc", "--max-checkouts", "2", "--grace", "5m", "--mirror-gc-interval", "0",
                                    root=root)
        assert code == 0, out
        (entry,) = report["mirrors"]
        assert entry["refs_dropped"] == 2 and entry["repacked"] is False, entry
        assert "not enough free space" in entry["repack_skipped"], entry
        pack_dir = os.path.join(only_repo(root).mirror, "objects", "pack")
        assert not [n for n in os.listdir(pack_dir) if n.startswith(("tmp_", ".tmp-"))]
        assert free_bytes(mount) >= before  # the evictions freed room; nothing took it
        # A review in its grace window can still write in its checkout.
        with open(os.path.join(paths[3], "build-output.txt"), "wb") as handle:
            handle.write(b"x" * (1 << 20))
        code, report, out = run_cli("gc", "--mirror-gc-interval", "0", root=root)
        assert code == 0 and report["mirrors"][0].get("repack_skipped"), out  # still due, still says why
        os.unlink(os.path.join(paths[3], "build-output.txt"))
        assert_checkout_matches(paths[3], upstream.path, upstream.shas[3])


@pytest.mark.slow
def test_a_failed_repack_removes_its_temporary_packs(root, upstream, fake_git):
    paths = [wait_ready(root, upstream.path, sha)["path"] for sha in upstream.shas]
    make_idle(paths[0], 3600)
    # A git gc that writes part of a pack and dies, as ENOSPC or a kill leaves it.
    failing = fake_git('case "$*" in *" gc "*) d="$2/objects/pack"; '
                       'head -c 100000 /dev/zero > "$d/tmp_pack_XYZ"; head -c 100 /dev/zero > "$d/.tmp-1-pack-x.pack"; '
                       'exit 1;; esac')
    code, report, out = run_cli("gc", "--max-checkouts", "2", "--grace", "1m", "--mirror-gc-interval", "0",
                                root=root, env=failing)
    assert code == 0, out
    (entry,) = report["mirrors"]
    assert entry["repacked"] is False and sorted(entry["stale_leftovers"]) == [
        "objects/pack/.tmp-1-pack-x.pack", "objects/pack/tmp_pack_XYZ"], entry
    pack_dir = os.path.join(only_repo(root).mirror, "objects", "pack")
    assert not [n for n in os.listdir(pack_dir) if n.startswith(("tmp_", ".tmp-"))]


@pytest.mark.slow
def test_a_keep_file_a_killed_fetch_left_is_removed_and_its_pack_repacked(root, upstream):
    """Regression: a worker killed with its git right after index-pack leaves pack-*.keep,
    and that pack then survived every gc."""
    paths = [wait_ready(root, upstream.path, sha)["path"] for sha in upstream.shas]
    mirror = only_repo(root).mirror
    git("repack", "-q", cwd=mirror)  # small fetches stay loose: the pack a big fetch would have kept
    pack_dir = os.path.join(mirror, "objects", "pack")
    packs = [n for n in os.listdir(pack_dir) if n.endswith(".pack")]
    keep = os.path.join(pack_dir, packs[0][: -len(".pack")] + ".keep")
    with open(keep, "w") as handle:
        handle.write("fetch-pack 12345 on a-dead-host\n")
    os.utime(keep, (1, 1))  # left long ago
    make_idle(paths[0], 3600)
    code, report, out = run_cli("gc", "--max-checkouts", "2", "--grace", "1m", "--mirror-gc-interval", "0",
                                root=root)
    assert code == 0, out
    (entry,) = report["mirrors"]
    assert os.path.relpath(keep, mirror) in entry["stale_leftovers"] and entry["repacked"] is True, entry
    assert not os.path.exists(keep)
    assert [n for n in os.listdir(pack_dir) if n.endswith(".keep")] == []


def fetches_of(worker: int) -> list[int]:
    """The pids of the git fetches a worker runs (in its private view of the mirror)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if b"fetch" in argv and any(f"checkoutcache-view-{worker}-".encode() in arg for arg in argv):
            found.append(int(pid))
    return found


def big_second_commit(daemon, name: str) -> tuple[Upstream, str, str]:
    """A served repository whose second commit is over fetch.unpackLimit (100 objects): git
    keeps its pack as it came (index-pack --keep), with a `.keep` until the refs point into it."""
    repo = Upstream(os.path.join(daemon.base, name))
    first = repo.commit({"README.md": "one\n"})
    second = repo.commit({f"data/{n}.txt": os.urandom(3000).hex() for n in range(150)}, message="big")
    return repo, first, second


def kept_packs(pack_dir: str) -> list[str]:
    """The `.keep` files whose pack and index are in place (index-pack writes the `.keep` first)."""
    return [n for n in os.listdir(pack_dir) if n.endswith(".keep")
            and all(os.path.exists(os.path.join(pack_dir, n[:-len(".keep")] + ext)) for ext in (".pack", ".idx"))]


def assert_reclaimed(store, pack_dir: str, keep: str, sha: str, entry: dict) -> None:
    """The `.keep` was removed by this gc, its pack repacked away, the commit gone, the mirror whole."""
    assert os.path.join("objects", "pack", keep) in entry["stale_leftovers"] and entry["repacked"] is True, entry
    assert not os.path.exists(os.path.join(pack_dir, keep[:-len(".keep")] + ".pack"))
    assert not [n for n in os.listdir(pack_dir) if n.endswith(".keep")]
    assert subprocess.run(["git", "-C", store.mirror, "cat-file", "-e", sha]).returncode != 0
    assert subprocess.run(["git", "-C", store.mirror, "fsck", "--no-dangling"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_a_keep_pack_a_sigkilled_fetch_left_is_removed_and_repacked(root, daemon):
    """Regression (issues 27 and 33): a worker SIGKILLed with its fetch after the fetch wrote
    its pack and `.keep` left a pack that survived `gc --max-checkouts 0`: a `.keep` younger
    than 5 s was spared as maybe a live git's. It names its owner ("fetch-pack <pid> on
    <host>"): a gone owner's goes at once."""
    name = "keep-pack-after-a-kill"
    _repo, first, second = big_second_commit(daemon, name)
    proxy = PackTailProxy(daemon.port)
    try:
        url = proxy.url(name)
        kept = wait_ready(root, url, first)["path"]
        settled(root)  # the history complete: the next commit is fetched into the mirror itself
        store = only_repo(root)
        pack_dir = os.path.join(store.mirror, "objects", "pack")
        proxy.hold_tails()  # the next response's end is held back
        code, answer, out = run_cli("ensure", url, second, root=root)
        assert code == 75 and answer["state"] == "cloning", out
        (keep,) = wait_until(lambda: kept_packs(pack_dir), timeout=60, what="the fetch's pack and .keep")
        worker = json.loads(open(store.clone_record(second)).read())["pid"]
        fetches = wait_until(lambda: fetches_of(worker), what="the worker's git fetch")
        assert any(f"fetch-pack {pid} on ".encode() in open(os.path.join(pack_dir, keep), "rb").read()
                   for pid in fetches), "the .keep names the fetch about to be killed"
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: not pid_alive(worker) and not any(pid_alive(p) for p in fetches),
                   what="the worker and its fetch dead")
    finally:
        proxy.close()
    assert os.path.exists(os.path.join(pack_dir, keep[:-len(".keep")] + ".pack"))
    assert subprocess.run(["git", "-C", store.mirror, "cat-file", "-e", second]).returncode == 0
    # A gc at once (the `.keep` a moment old): its owner is gone, so it goes, and its pack with the repack.
    make_idle(kept, 3600)
    code, report, out = run_cli("gc", "--max-checkouts", "0", "--grace", "1m", "--mirror-gc-interval", "0",
                                root=root)
    assert code == 0, out
    (entry,) = report["mirrors"]
    assert entry["refs_dropped"] == 1, entry
    assert_reclaimed(store, pack_dir, keep, second, entry)


@pytest.mark.slow
def test_a_git_fetch_sigkilled_right_after_its_keep_appears_leaves_nothing_the_next_gc_keeps(root, daemon):
    """Regression (issue 33): a real `git fetch` into the mirror (an operator's, outside our
    locks) SIGKILLed right after its `.keep` appeared: `gc --max-checkouts 0` at once dropped
    the refs and repacked, and the pack stayed (the `.keep` was under 5 s old)."""
    name = "keep-pack-of-a-killed-git-fetch"
    _repo, first, second = big_second_commit(daemon, name)
    kept = wait_ready(root, daemon.url(name), first)["path"]
    store = only_repo(root)
    pack_dir = os.path.join(store.mirror, "objects", "pack")
    proxy = PackTailProxy(daemon.port)
    try:
        proxy.hold_tails()
        fetch = subprocess.Popen(["git", "-C", store.mirror, "fetch", "-q", proxy.url(name),
                                  "+refs/heads/main:refs/heads/by-hand"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (keep,) = wait_until(lambda: kept_packs(pack_dir), timeout=60, what="the fetch's pack and .keep")
        assert f"fetch-pack {fetch.pid} on ".encode() in open(os.path.join(pack_dir, keep), "rb").read()
        fetch.kill()
        assert fetch.wait() == -signal.SIGKILL
    finally:
        proxy.close()
    assert subprocess.run(["git", "-C", store.mirror, "cat-file", "-e", second]).returncode == 0
    make_idle(kept, 3600)
    code, report, out = run_cli("gc", "--max-checkouts", "0", "--grace", "1m", "--mirror-gc-interval", "0",
                                root=root)
    assert code == 0, out
    (entry,) = report["mirrors"]
    assert_reclaimed(store, pack_dir, keep, second, entry)


@pytest.mark.slow
def test_the_keep_of_a_live_git_fetch_is_never_removed_however_old(root, daemon):
    """A `.keep` whose owner still runs (an operator's fetch waiting on a slow server) stays,
    past the 5 s that spared a young one and through a repack: removed, its pack would go
    with the repack and the fetch would then point its refs at objects that are gone."""
    from checkoutcache.git.mirror import STALE_GIT_LOCK_AGE

    name = "keep-pack-of-a-live-git-fetch"
    _repo, first, second = big_second_commit(daemon, name)
    kept = wait_ready(root, daemon.url(name), first)["path"]
    store = only_repo(root)
    pack_dir = os.path.join(store.mirror, "objects", "pack")
    proxy = PackTailProxy(daemon.port)
    try:
        proxy.hold_tails()
        fetch = subprocess.Popen(["git", "-C", store.mirror, "fetch", "-q", proxy.url(name),
                                  "+refs/heads/main:refs/heads/by-hand"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (keep,) = wait_until(lambda: kept_packs(pack_dir), timeout=60, what="the fetch's pack and .keep")
        path = os.path.join(pack_dir, keep)
        wait_until(lambda: time.time() - os.lstat(path).st_mtime > STALE_GIT_LOCK_AGE + 1, timeout=30,
                   what="the .keep older than the age that spared a young one")
        make_idle(kept, 3600)
        code, report, out = run_cli("gc", "--max-checkouts", "0", "--grace", "1m", "--mirror-gc-interval", "0",
                                    root=root)
        assert code == 0, out
        (entry,) = report["mirrors"]
        assert entry["repacked"] is True and os.path.join("objects", "pack", keep) not in entry["stale_leftovers"]
        assert fetch.poll() is None and os.path.exists(path)
        assert os.path.exists(path[:-len(".keep")] + ".pack")
        proxy.release_tails()
        assert fetch.wait(timeout=60) == 0
    finally:
        proxy.close()
    assert not os.path.exists(path), "git removes its own .keep once its refs point into the pack"
    assert git("rev-parse", "refs/heads/by-hand", cwd=store.mirror).strip() == second
    assert subprocess.run(["git", "-C", store.mirror, "fsck", "--no-dangling"], capture_output=True).returncode == 0


def test_a_keep_is_judged_by_the_owner_it_names(tmp_path):
    """keep_owner: a live git process of this host that started before the `.keep` owns it;
    a dead pid, a pid a later process took, or a process that is not git does not; another
    host's, an unnamed one and a FIFO tell nothing (the age rule decides), and a FIFO never
    blocks the look."""
    import socket

    from checkoutcache.git.mirror import GONE, LIVE, keep_owner

    host = socket.gethostname()
    keep = str(tmp_path / "pack-1.keep")

    def named(text: str, written_at: float | None = None) -> str | None:
        with open(keep, "w") as handle:
            handle.write(text)
        at = time.time() if written_at is None else written_at
        os.utime(keep, (at, at))
        return keep_owner(keep, at)

    live_git = subprocess.Popen(["git", "cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        wait_until(lambda: open(f"/proc/{live_git.pid}/comm").read().startswith("git"), what="git running")
        assert named(f"fetch-pack {live_git.pid} on {host}\n") == LIVE
        assert named(f"receive-pack {live_git.pid} on {host}\n") == LIVE
        # Written an hour before that process began: its pid was another's then.
        assert named(f"fetch-pack {live_git.pid} on {host}\n", time.time() - 3600) == GONE
        assert named(f"fetch-pack {live_git.pid} on another-host\n") is None
    finally:
        live_git.kill()
        live_git.wait()
    assert named(f"fetch-pack {live_git.pid} on {host}\n") == GONE  # dead (reaped)
    assert named(f"fetch-pack {os.getpid()} on {host}\n") == GONE  # alive, but not git
    assert named("") is None and named("kept by hand\n") is None
    os.unlink(keep)
    os.mkfifo(keep)
    assert keep_owner(keep, time.time()) is None


@pytest.mark.slow
def test_an_ensure_on_a_full_disk_answers_disk_full_and_writes_nothing(tmp_path):
    """Regression: `ensure` on a full disk answered INTERNAL_ERROR (a record write it did not
    guard); a checkout that ran out of disk answered CLONE_FAILED "an object is unreadable"."""
    upstream = big_history(str(tmp_path / "up"), 3, 2 << 20)
    with small_filesystem(str(tmp_path / "small"), "24m") as mount:
        root = os.path.join(mount, "cache")
        first = wait_ready(root, upstream.path, upstream.shas[0])["path"]
        settled(root)
        store = only_repo(root)
        # The mirror has every commit (the checkout is what no longer fits).
        git("fetch", "-q", upstream.path, "+refs/heads/*:refs/heads/*", cwd=store.mirror)
        fill(mount, leave=512 << 10)
        code, answer, out = run_cli("ensure", upstream.path, upstream.shas[1], "--wait", "60", root=root)
        assert code == 1 and answer["error"] == "DISK_FULL", out
        assert "gc" in answer["next"]
        assert os.listdir(store.scratch_dir) == [] and os.listdir(store.checkouts_dir) == [upstream.shas[0]]
        # Nothing left at all: the balloon takes every byte, and an ask still answers (a record it cannot write).
        fill(mount, leave=0)
        subprocess.run(["sh", "-c", f"cat /dev/zero > {mount}/last 2>/dev/null"])  # the last blocks too
        code, answer, out = run_cli("ensure", upstream.path, upstream.shas[2], "--wait", "10", root=root)
        assert code == 1 and answer["error"] == "DISK_FULL", out
        code, report, out = run_cli("gc", root=root)
        assert code == 0, out
        assert_checkout_matches(first, upstream.path, upstream.shas[0])


@pytest.mark.slow
def test_a_full_disk_is_reclaimed_by_gc_alone(tmp_path):
    """Regression (issue 27): a mirror of a repository with no checkout left, on a full disk:
    gc said `not enough free space: a repack needs ...`, min-free stayed unmet, and nothing
    but an operator's `rm` could reclaim it. gc now drops the whole repository (nothing in
    it, unused past the grace window while min-free is unmet); one in use stays."""
    upstream = big_history(str(tmp_path / "up"), 4, 3 << 20)
    other = big_history(str(tmp_path / "other"), 1, 1 << 20)
    with small_filesystem(str(tmp_path / "small"), "40m") as mount:
        root = os.path.join(mount, "cache")
        last = wait_ready(root, upstream.path, upstream.shas[-1])["path"]
        kept = wait_ready(root, other.path, other.shas[0])["path"]  # used now: stays
        settled(root)  # the mirrors' histories are in before the disk fills
        big_key = last.split(os.sep)[-3]
        make_idle(last, 3600)
        fill(mount, leave=1 << 20)
        env = {"CHECKOUTCACHE_MIN_FREE": "8m", "CHECKOUTCACHE_FREE_HEADROOM": "1m"}
        code, report, out = run_cli("gc", "--grace", "1m", "--mirror-gc-interval", "0", root=root, env=env)
        assert code == 0, out
        assert [(r["reason"], r["repo"], r["limit"]) for r in report["removed"]] == [
            ("lru", big_key, "min-free"), ("repository", big_key, "min-free")], json.dumps(report["unmet"])
        assert report["unmet"] == [], report["unmet"]
        assert free_bytes(mount) >= 8 << 20
        assert not os.path.exists(os.path.join(root, "repos", big_key))
        assert_checkout_matches(kept, other.path, other.shas[0])
        # Asked again, it is cloned anew.
        os.unlink(os.path.join(mount, "balloon"))
        again = wait_ready(root, upstream.path, upstream.shas[0])["path"]
        assert_checkout_matches(again, upstream.path, upstream.shas[0])


def test_a_keep_file_a_worker_removes_makes_gcs_repack_due(root, upstream):
    """A worker's fetch clears a killed fetch's `.keep` first (under the mirror lock): the
    pack it kept goes only with a repack, so the next gc's is due though no ref was dropped."""
    wait_ready(root, upstream.path, upstream.shas[0])
    store = only_repo(root)
    git("repack", "-q", cwd=store.mirror)
    pack_dir = os.path.join(store.mirror, "objects", "pack")
    pack = next(n for n in os.listdir(pack_dir) if n.endswith(".pack"))
    keep = os.path.join(pack_dir, pack[:-len(".pack")] + ".keep")
    with open(keep, "w") as handle:
        handle.write("fetch-pack 12345 on a-dead-host\n")
    os.utime(keep, (1, 1))
    wait_ready(root, upstream.path, upstream.shas[1])  # its fetch clears the stale .keep
    assert not os.path.exists(keep)
    assert json.loads(open(store.mirror_gc_stamp).read())["pending"] is True
    code, report, out = run_cli("gc", "--mirror-gc-interval", "0", root=root)
    assert code == 0 and report["mirrors"][0]["refs_dropped"] == 0 and report["mirrors"][0]["repacked"] is True, out
