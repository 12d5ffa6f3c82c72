"""What gc forgets: records of things that are over, each under the lock its writer takes,
so nothing a live process relies on goes.

- a dead clone's record, its count of worker deaths kept (state/<name>.deaths.json);
- deaths records of commits nobody asked for in DEATHS_MEMORY;
- unreachable/<key>.failed.json a day after its retry time;
- serve journals whose serve is gone;
- the clone lock and log of commits with no checkout, clone, failure or deaths record.

Called by gc (gc.py) with its report, whose dry_run makes every one of them a no-op.
"""

from __future__ import annotations

import stat
import time
from typing import Protocol

from checkoutcache.store import locks, records, tree
from checkoutcache.store.layout import RepoPaths, RootPaths, commit_of
from checkoutcache.store.records import read_failure


class GcRun(Protocol):
    """What these need of gc's report (gc.GcReport): whether the run is a dry run."""

    dry_run: bool


DEATHS_MEMORY = 86400.0  # a commit nobody asked for a day after its last worker died starts counting anew


def drop_dead_clone_record(paths: RepoPaths, name: str) -> None:
    """Remove a dead clone's record, keeping its count of worker deaths (state/<name>.deaths.json),
    so that a worker that always dies still ends in WORKER_DIED. Caller holds the clone lock."""
    record = records.read_json(paths.clone_record(name), records.CLONE)
    if record is not None:
        try:
            deaths = max(0, int(record.get("deaths", 0)))
        except (TypeError, ValueError):
            deaths = 0
        # Written first: killed in between, both say the same.
        records.write_json(paths.deaths_record(name), {"commit": commit_of(name), "deaths": deaths,
                                                       "at": time.time()})
    records.remove_quietly(paths.clone_record(name))


def forget_old_deaths(paths: RepoPaths, report: GcRun) -> None:
    """Deaths records of commits nobody asked for in DEATHS_MEMORY go (under the clone lock)."""
    if report.dry_run:
        return
    for name in paths.deaths_record_names():
        def old(name: str = name) -> bool:
            at = (records.read_json(paths.deaths_record(name), records.DEATHS) or {}).get("at", 0)
            return not isinstance(at, (int, float)) or time.time() - at > DEATHS_MEMORY

        if old():
            with locks.rechecked(locks.clone_of(paths, name), old) as clone_lock:
                if clone_lock is not None:
                    records.remove_quietly(paths.deaths_record(name))


def forget_unreachable(root_paths: RootPaths, report: GcRun, now: float) -> None:
    """Records of repositories never reached go a day after their retry time (nobody asked since)."""
    if report.dry_run:
        return
    try:
        found = root_paths.unreachable_records()
    except OSError:  # unreachable/ a symlink: never listed through
        return
    for _key, path in found:
        failure = read_failure(path)
        if failure is None or now - failure.retry_at > DEATHS_MEMORY:
            records.remove_quietly(path)


STALE_JOURNAL_AGE = 86400.0


def forget_stale_journals(root_paths: RootPaths, report: GcRun, now: float) -> None:
    """A serve's journal left behind: by a serve killed (SIGKILL, OOM), or written anew by a
    worker that outlived its serve (O_APPEND|O_CREAT). A running serve holds its journal's
    lock for its whole life, so one whose lock is free is removed, however recent (its age
    proves nothing: serves of equal pids in other containers share this directory), and
    removed while we hold that lock. An older version's <pid>.journal has no lock: it goes
    once untouched for a day."""
    if report.dry_run:
        return
    try:
        journals = root_paths.serve_journals()
    except OSError:  # serve/ a symlink: never listed through
        return
    for path in journals:
        try:
            if not RootPaths.journal_has_owner_lock(path):
                if now - tree.lstat(path).st_mtime > STALE_JOURNAL_AGE:
                    records.remove_quietly(path)
                continue
            if stat.S_ISLNK(tree.lstat(path).st_mode):
                records.remove_quietly(path)  # never a journal: nothing to lock through it
                continue
            held = locks.abandoned_journal(path)
            if held is not None:
                with held:
                    records.remove_quietly(path)
        except OSError:
            continue


def forget_finished_commits(paths: RepoPaths, report: GcRun) -> None:
    """Drop the clone lock file and log of commits with no checkout, clone or failure.

    The lock file is unlinked while we hold it; every acquirer re-checks that the
    path still names the inode it locked (store/locks.py), so nobody is left
    holding a lock on a file that no longer exists.
    """
    if report.dry_run:
        return
    for name in paths.clone_lock_names():
        def finished(name: str = name) -> bool:
            return not tree.lexists(paths.checkout(name)) and not tree.lexists(paths.failure_record(name)) \
                and not tree.lexists(paths.deaths_record(name))

        if not finished():
            continue
        with locks.rechecked(locks.existing_clone_of(paths, name), finished) as clone_lock:
            if clone_lock is None:
                continue  # a clone is running (or the file just went, or it is needed again)
            drop_dead_clone_record(paths, name)
            if tree.lexists(paths.deaths_record(name)):
                continue  # a dead clone's record just became a deaths record: keep its lock and log
            records.remove_quietly(paths.clone_log(name))
            records.remove_quietly(paths.previous_clone_log(name))
            records.remove_quietly(paths.size_record(name))
            records.remove_quietly(paths.clone_lock(name))
