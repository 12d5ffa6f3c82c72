"""What gc forgets: records of things that are over, each under the lock its writer takes,
so nothing a live process relies on goes.

- a dead clone's record, its count of worker deaths kept (state/<name>.deaths.json);
- deaths records of commits nobody asked for in DEATHS_MEMORY;
- a commit's failure record (state/<name>.failed.json), with its clone log and lock, and
  unreachable/<key>.failed.json, a day after their retry time (never during a back-off);
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
    """What these need of gc's report (report.GcReport): whether the run is a dry run."""

    dry_run: bool


DEATHS_MEMORY = 86400.0  # a commit nobody asked for a day after its last worker died starts counting anew


def drop_dead_clone_record(paths: RepoPaths, name: str) -> None:
    """Remove a dead clone's record, keeping its count of worker deaths (state/<name>.deaths.json),
    so that a worker that always dies still ends in WORKER_DIED. Caller holds the clone lock."""
    from checkoutcache.clone.coordinator import was_queued

    record = records.read_json(paths.clone_record(name), records.CLONE)
    if record is not None:
        try:
            deaths = max(0, int(record.get("deaths", 0)))
        except (TypeError, ValueError):
            deaths = 0
        # A clone serve only queued (and then died) ran no worker: its deaths so far, not one more
        # (the deaths record counts one death for the owner it stands for).
        deaths -= 1 if was_queued(record) else 0
        if deaths >= 0:  # written first: killed in between, both say the same
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
            forget_commit_files(paths, name)


def forget_commit_files(paths: RepoPaths, name: str) -> None:
    """What is left of a commit nothing is in any more (no checkout, failure or deaths record):
    its dead clone's record, logs, size record and clone lock file. Caller holds the clone lock."""
    drop_dead_clone_record(paths, name)
    if any(tree.lexists(path) for path in (paths.checkout(name), paths.failure_record(name),
                                           paths.deaths_record(name))):
        return  # a checkout, a failure, or a dead clone's record just became a deaths record: kept
    records.remove_quietly(paths.clone_log(name))
    records.remove_quietly(paths.previous_clone_log(name))
    records.remove_quietly(paths.size_record(name))
    records.remove_quietly(paths.clone_lock(name))


def failure_forgettable(path: str, now: float) -> bool:
    """Whether a commit's failure record has been over for DEATHS_MEMORY: its retry time (the
    end of its back-off) passed a day ago. Never during the back-off, so forgetting it never
    changes an answer there; after it, the next ask starts a clone anyway, and what is lost
    is the count of attempts (the next failure backs off from the start, as for a commit
    nobody asked for in a day). A record that does not fit its schema is no back-off to an
    asker: it goes once as old by its mtime. One that cannot be read stays."""
    try:
        failure = read_failure(path)
        if failure is not None:
            return now - failure.retry_at > DEATHS_MEMORY
        return now - tree.lstat(path).st_mtime > DEATHS_MEMORY
    except OSError:
        return False


def forget_old_failures(paths: RepoPaths, report: GcRun) -> None:
    """Failure records (state/<name>.failed.json) a day past their retry time go, with the
    commit's clone log and clone lock (forget_commit_files), under the clone lock: a starter
    reads the record under that lock, so it sees the record whole or not at all. Without
    this, each commit that does not exist leaves three files for good, which every status,
    scrape and gc reads."""
    if report.dry_run:
        return
    for name in paths.failure_record_names():
        def old(name: str = name) -> bool:
            return failure_forgettable(paths.failure_record(name), time.time())

        if not old():
            continue
        with locks.rechecked(locks.clone_of(paths, name), old) as clone_lock:
            if clone_lock is None:
                continue  # a clone is running, or the commit failed anew meanwhile
            records.remove_quietly(paths.failure_record(name))
            forget_commit_files(paths, name)
