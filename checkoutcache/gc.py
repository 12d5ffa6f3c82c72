"""gc: trim the store to its limits without ever removing what a review uses.

One run, under locks/gc.lock (taken without waiting: two crons never
overlap, the second reports that it skipped):

1. finish interrupted deletions (everything in trash/ goes);
2. reap scratch whose owner is dead (scratch.py), drop records of dead clones,
   and move aside checkouts a killed worker renamed but never marked;
3. plan eviction (eviction.py, pure) from the inventory, then for each planned
   checkout: take its marker's exclusive lock without waiting, re-check its
   last use against the grace window, rename it into trash/, release, delete.
   A checkout held by an exec or touched meanwhile is skipped, not waited on;
4. mirror maintenance under the mirror lock (bounded wait, skipped if busy):
   drop keep-refs of commits with neither a checkout nor a live clone,
   remove stale git lock files, and repack/prune at most every
   mirror_gc_interval so objects no checkout needs go away.

gc never holds a lock a ready answer waits on for longer than one rename.
With dry_run nothing is changed: the report says what a real run would do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import attrs

from . import locks, mirror, records
from .config import Config
from .eviction import Disk, Entry, Limits, plan_eviction
from .gitbackend import pick_backend
from .gitenv import git_env
from .inventory import RepoInfo, disk_usage, inventory
from .layout import RepoPaths, RootPaths, entries
from .scratch import reap_dead_scratch
from .store import make_dirs
from .verify import move_aside
from .testhooks import checkpoint

MIRROR_LOCK_WAIT = 5.0
MIRROR_GC_STAMP = "mirror-gc.json"


@attrs.frozen
class Removed:
    reason: str  # lru, age, dead-scratch, trash, unpublished, damaged
    repo: str
    name: str
    bytes: int = 0
    limit: str | None = None


@attrs.frozen
class KeptOver:
    repo: str
    commit: str
    why: str  # grace, held, used-meanwhile
    limit: str


@attrs.define
class GcReport:
    dry_run: bool
    skipped: str | None = None
    removed: list[Removed] = attrs.Factory(list)
    kept: list[KeptOver] = attrs.Factory(list)
    unmet: list[dict] = attrs.Factory(list)
    mirrors: list[dict] = attrs.Factory(list)
    disk_before: dict | None = None
    disk_after: dict | None = None

    @property
    def bytes_freed(self) -> int:
        return sum(r.bytes for r in self.removed)

    def to_json(self) -> dict:
        return {
            "dry_run": self.dry_run, "skipped": self.skipped,
            "removed": [attrs.asdict(r) for r in self.removed],
            "kept_over_limit": [attrs.asdict(k) for k in self.kept],
            "unmet": self.unmet, "mirrors": self.mirrors, "bytes_freed": self.bytes_freed,
            "disk_before": self.disk_before, "disk_after": self.disk_after,
        }


def disk_of(path: str) -> Disk:
    usage = shutil.disk_usage(path)
    return Disk(total=usage.total, free=usage.free)


def empty_trash(paths: RepoPaths, report: GcReport) -> None:
    for name in entries(paths.trash_dir):
        path = os.path.join(paths.trash_dir, name)
        size = disk_usage(path) if os.path.isdir(path) and not os.path.islink(path) else 0
        if not report.dry_run:
            remove_tree(path)
        report.removed.append(Removed("trash", paths.key, name, size))


def remove_tree(path: str) -> None:
    """Delete a tree in trash/. shutil.rmtree never follows a symlink out of it."""
    if os.path.islink(path) or not os.path.isdir(path):
        records.remove_quietly(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


STRAY_TMP_AGE = 3600.0  # far longer than any record write takes


def tidy(info: RepoInfo, report: GcReport) -> None:
    """Leftovers of dead processes: scratch, clone records, temp files, unmarked or damaged checkouts."""
    paths = info.paths
    for directory in (paths.state_dir, paths.base):
        for entry in os.scandir(directory) if os.path.isdir(directory) else []:
            if entry.name.startswith(".") and entry.name.endswith(records.TMP_SUFFIX) and \
                    time.time() - entry.stat(follow_symlinks=False).st_mtime > STRAY_TMP_AGE and not report.dry_run:
                records.remove_quietly(entry.path)
    for name, slot in reap_dead_scratch(paths, dry_run=report.dry_run):
        size = 0 if report.dry_run else disk_usage(slot)
        if not report.dry_run:
            remove_tree(slot)
        report.removed.append(Removed("dead-scratch", paths.key, name, size))
    for clone in info.clones:
        if not clone.alive and not report.dry_run:
            records.remove_quietly(paths.clone_record(clone.sha))
    for checkout in info.checkouts:
        if checkout.ready:
            # Damaged (top-level entries gone): never served again; removed unless an exec holds it.
            if not checkout.intact:
                slot = None if report.dry_run else move_aside(paths, checkout.sha, "damaged")
                if slot is not None:
                    remove_tree(slot)
                if report.dry_run or slot is not None:
                    report.removed.append(Removed("damaged", paths.key, checkout.sha, checkout.size))
            continue
        # No marker: a worker renamed it but died before the marker, or is about to
        # write it. Only a free clone lock (no live worker) makes it a leftover.
        clone_lock = locks.try_lock(paths.clone_lock(checkout.sha))
        if clone_lock is None:
            continue
        with clone_lock:
            if os.path.exists(paths.ready_marker(checkout.sha)):
                continue
            if not report.dry_run:
                slot = paths.trash_slot(f"unpublished-{checkout.sha}")
                try:
                    os.rename(checkout.path, slot)
                except FileNotFoundError:
                    continue
                remove_tree(slot)
            report.removed.append(Removed("unpublished", paths.key, checkout.sha, checkout.size))


def forget_finished_commits(paths: RepoPaths, report: GcReport) -> None:
    """Drop the clone lock file and log of commits with no checkout, clone or failure.

    The lock file is unlinked while we hold it; every acquirer re-checks that the
    path still names the inode it locked (locks.py), so nobody is left holding a
    lock on a file that no longer exists.
    """
    if report.dry_run:
        return
    for name in entries(paths.locks_dir):
        if not (name.startswith("clone-") and name.endswith(".lock")):
            continue
        sha = name[len("clone-"):-len(".lock")]
        if os.path.lexists(paths.checkout(sha)) or os.path.exists(paths.failure_record(sha)):
            continue
        clone_lock = locks.try_lock(paths.clone_lock(sha), create=False)
        if clone_lock is None:
            continue  # a clone is running (or the file just went)
        with clone_lock:
            if os.path.lexists(paths.checkout(sha)) or os.path.exists(paths.failure_record(sha)):
                continue
            records.remove_quietly(paths.clone_record(sha))
            records.remove_quietly(paths.clone_log(sha))
            records.remove_quietly(paths.clone_lock(sha))


def evict_checkout(paths: RepoPaths, sha: str, grace: float, dry_run: bool) -> str | None:
    """Rename one checkout into trash/; returns why it was kept instead, or None."""
    marker = paths.ready_marker(sha)
    exclusive = locks.try_lock(marker, shared=False, create=False)
    if exclusive is None:
        return "held"
    with exclusive:
        try:
            last_used = os.stat(marker).st_mtime
        except FileNotFoundError:
            return "gone"
        if time.time() - last_used <= grace:
            return "used-meanwhile"
        if dry_run:
            return None
        slot = paths.trash_slot(f"evicted-{sha}")
        os.rename(paths.checkout(sha), slot)
    checkpoint("gc-after-evict-rename")
    remove_tree(slot)
    return None


def maintain_mirror(paths: RepoPaths, config: Config, report: GcReport, now: float) -> None:
    if not pick_backend(config.transport).is_usable(paths.mirror):
        return
    entry = {"repo": paths.key, "refs_dropped": 0, "stale_locks": [], "repacked": False}
    try:
        mirror_lock = locks.lock(paths.mirror_lock, timeout=MIRROR_LOCK_WAIT)
    except locks.LockTimeout:
        entry["skipped"] = "a clone is fetching"
        report.mirrors.append(entry)
        return
    with mirror_lock:
        repo = mirror.open_existing(paths.mirror)
        for sha in mirror.kept_shas(repo):
            if os.path.lexists(paths.checkout(sha)):
                continue
            clone_lock = locks.try_lock(paths.clone_lock(sha))
            if clone_lock is None:
                continue  # a worker is making it: its keep-ref protects what it reads
            with clone_lock:
                if not os.path.lexists(paths.checkout(sha)):
                    if not report.dry_run:
                        mirror.drop_keep(repo, sha)
                    entry["refs_dropped"] += 1
        if not report.dry_run:
            entry["stale_locks"] = mirror.remove_stale_git_locks(paths.mirror)
        stamp = os.path.join(paths.state_dir, MIRROR_GC_STAMP)
        last = (records.read_json(stamp) or {}).get("at", 0.0)
        due = now - last >= config.mirror_gc_interval
        git = shutil.which("git")
        if git and due and entry["refs_dropped"] and not report.dry_run:
            # git inherits the mirror lock: if gc dies during the repack, the lock stays
            # held until git finishes, so no fetch ever meets a half-repacked mirror.
            repack = subprocess.Popen([git, "-C", paths.mirror, "gc", "--prune=now", "--quiet"], env=git_env(),
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      pass_fds=(mirror_lock.fileno(),))
            checkpoint("gc-during-repack")
            try:
                code = repack.wait(timeout=config.clone_timeout)
            except subprocess.TimeoutExpired:
                repack.kill()
                code = repack.wait()
            entry["repacked"] = code == 0
            if code == 0:
                records.write_json(stamp, {"at": now})
    report.mirrors.append(entry)


def run_gc(root_paths: RootPaths, config: Config, dry_run: bool = False) -> GcReport:
    report = GcReport(dry_run=dry_run)
    if not os.path.isdir(root_paths.repos_dir):
        return report
    make_dirs(root_paths.locks_dir)
    gc_lock = locks.try_lock(root_paths.gc_lock)
    if gc_lock is None:
        report.skipped = "another gc is running"
        return report
    with gc_lock:
        before = disk_of(root_paths.root)
        report.disk_before = attrs.asdict(before)
        for info in inventory(root_paths, with_sizes=False):
            empty_trash(info.paths, report)
            tidy(info, report)
        repos = inventory(root_paths)
        by_key = {info.key: info for info in repos}
        entries = [Entry(repo=info.key, sha=c.sha, last_used=c.last_used, size=c.size, held=c.held)
                   for info in repos for c in info.checkouts if c.ready and c.intact]
        limits = Limits.from_config(config)
        now = time.time()
        plan = plan_eviction(entries, limits, before, now)
        for eviction in plan.evict:
            entry = eviction.entry
            kept_why = evict_checkout(by_key[entry.repo].paths, entry.sha, limits.grace, dry_run)
            if kept_why is None:
                report.removed.append(Removed(eviction.reason, entry.repo, entry.sha, entry.size, eviction.limit))
            elif kept_why != "gone":
                report.kept.append(KeptOver(entry.repo, entry.sha, kept_why, eviction.limit))
        report.kept += [KeptOver(k.entry.repo, k.entry.sha, k.why, k.limit) for k in plan.kept]
        report.unmet = [attrs.asdict(u) for u in plan.unmet]
        for info in repos:
            maintain_mirror(info.paths, config, report, now)
            forget_finished_commits(info.paths, report)
        report.disk_after = attrs.asdict(disk_of(root_paths.root))
    return report

