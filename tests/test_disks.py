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


@pytest.mark.slow
def test_a_keep_pack_a_sigkilled_fetch_left_is_removed_and_repacked(root, daemon):
    """Regression (issue 27): a fetch SIGKILLed after it wrote its pack and `.keep` left a
    pack that survived every gc: a young `.keep` is rightly spared, and when a later gc
    removed it, no repack followed (none was due), so the pack stayed for good."""
    name = "keep-pack-after-a-kill"
    repo = Upstream(os.path.join(daemon.base, name))
    first = repo.commit({"README.md": "one\n"})
    # Over fetch.unpackLimit (100 objects): git keeps the pack as it came (index-pack --keep).
    second = repo.commit({f"data/{n}.txt": os.urandom(3000).hex() for n in range(150)}, message="big")
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
        keeps = wait_until(lambda: [n for n in os.listdir(pack_dir) if n.endswith(".keep")], timeout=60,
                           what="the fetch's pack and .keep")
        (keep,) = keeps
        worker = json.loads(open(store.clone_record(second)).read())["pid"]
        fetches = wait_until(lambda: fetches_of(worker), what="the worker's git fetch")
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: not pid_alive(worker) and not any(pid_alive(p) for p in fetches),
                   what="the worker and its fetch dead")
    finally:
        proxy.close()
    killed_pack = os.path.join(pack_dir, keep[:-len(".keep")] + ".pack")
    assert os.path.exists(os.path.join(pack_dir, keep)) and os.path.exists(killed_pack)
    assert subprocess.run(["git", "-C", store.mirror, "cat-file", "-e", second]).returncode == 0
    # A gc at once: the `.keep` is young (a git outside our locks may still own it): spared.
    os.utime(os.path.join(pack_dir, keep))
    make_idle(kept, 3600)
    code, report, out = run_cli("gc", "--max-checkouts", "0", "--grace", "1m", "--mirror-gc-interval", "0",
                                root=root)
    assert code == 0, out
    assert report["mirrors"][0]["repacked"] is True and os.path.exists(killed_pack), report["mirrors"]
    # Later (the `.keep` an hour old, no fetch holding the mirror lock): removed, and its pack repacked away.
    os.utime(os.path.join(pack_dir, keep), (time.time() - 3600, time.time() - 3600))
    code, report, out = run_cli("gc", "--max-checkouts", "0", "--mirror-gc-interval", "0", root=root)
    assert code == 0, out
    (entry,) = report["mirrors"]
    assert os.path.join("objects", "pack", keep) in entry["stale_leftovers"] and entry["repacked"] is True, entry
    assert not os.path.exists(killed_pack) and not [n for n in os.listdir(pack_dir) if n.endswith(".keep")]
    assert subprocess.run(["git", "-C", store.mirror, "cat-file", "-e", second]).returncode != 0
    assert subprocess.run(["git", "-C", store.mirror, "fsck", "--no-dangling"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_an_ensure_on_a_full_disk_answers_disk_full_and_writes_nothing(tmp_path):
    """Regression: `ensure` on a full disk answered INTERNAL_ERROR (a record write it did not
    guard); a checkout that ran out of disk answered CLONE_FAILED "an object is unreadable"."""
    upstream = big_history(str(tmp_path / "up"), 3, 2 << 20)
    with small_filesystem(str(tmp_path / "small"), "24m") as mount:
        root = os.path.join(mount, "cache")
        first = wait_ready(root, upstream.path, upstream.shas[0])["path"]
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
