"""What interrupted runs and dead processes left in a repository's store, and how gc
deletes anything: gc.py's steps 1 and 2, and the deletions of its later steps.

- delete is gc's one way to remove a tree (trash, leftovers, evicted checkouts, spares):
  remove_tree (store/checkouts.py) removes whatever a tree holds, read-only directories,
  any depth or name; what cannot be removed (a mount point) goes to the report's
  `unremovable` with its cause, and nothing here ever stops the run;
- record_unremovable keeps a repository's leftovers in state/unremovable.json for `status`
  (with since when each is stuck); they stay in trash/, so every later run retries them;
- empty_trash finishes interrupted deletions: everything in trash/ goes, but the slots of a
  running history (it removes them itself, and gc would report its removal as gc's);
- tidy removes temp files of record writes older than STRAY_TMP_AGE, scratch whose owner is
  dead (store/scratch.py), records of dead clones (their count of worker deaths kept,
  forget.py), checkouts a killed worker renamed but never marked (only while their clone
  lock is free: no live worker is about to mark them), and damaged ones no command holds
  (re-checked under the marker's exclusive lock: a clone may have replaced them).

What goes is renamed into trash/ first (store/checkouts.py, store/scratch.py), so a gc
killed at any instant leaves only trash for the next run. With dry_run nothing is changed:
the report says what would go.
"""

from __future__ import annotations

import os
import time

import attrs

from checkoutcache.store import locks, records, tree
from checkoutcache.store.checkouts import (
    Removal,
    Unremovable,
    is_published,
    move_checkout_aside,
    remove_tree,
    trash_entries,
)
from checkoutcache.store.inventory import RepoInfo
from checkoutcache.store.layout import RepoPaths, entries
from checkoutcache.store.scratch import reap_dead_scratch
from checkoutcache.store.sizes import disk_usage
from checkoutcache.upkeep.forget import drop_dead_clone_record
from checkoutcache.upkeep.report import GcReport, Removed


STRAY_TMP_AGE = 3600.0  # far longer than any record write takes


def size_of(path: str) -> int:
    try:
        return disk_usage(path) if tree.is_dir(path) else 0  # never measured through a symlink
    except OSError:
        return 0


def note_unremovable(report: GcReport, paths: RepoPaths, path: str, removal: Removal) -> None:
    """Report what a removal left behind, each with its path relative to the root."""
    where = os.path.relpath(path, paths.root)
    for stuck in removal.unremovable:
        report.unremovable.append({"repo": paths.key, "path": os.path.join(where, stuck.path) if stuck.path else where,
                                   "error": stuck.error, "entry": os.path.basename(path)})


def delete(paths: RepoPaths, path: str, report: GcReport) -> Removal:
    """remove_tree, whose leftovers go to the report; nothing here ever stops the run."""
    try:
        removal = remove_tree(path)
    except Exception as exc:  # remove_tree never raises; if it ever did, the rest of the run goes on
        removal = Removal(unremovable=[Unremovable("", type(exc).__name__)])
    note_unremovable(report, paths, path, removal)
    return removal


HISTORY_SLOT = "history."  # store/layout.py trash_slot("history"): the history's own


def empty_trash(paths: RepoPaths, report: GcReport) -> None:
    # A running history removes what it moved to trash itself (clone/history.py: its finished
    # history.git, at once): a gc at the same time would count and report the same tree as its
    # own removal. Its slots wait while its lock is held; a history that died leaves them to gc.
    history_running = None
    for path in trash_entries(paths):
        if os.path.basename(path).startswith(HISTORY_SLOT):
            if history_running is None:
                history_running = locks.history_running(paths)
            if history_running:
                continue
        if report.dry_run:
            report.removed.append(Removed("trash", paths.key, os.path.basename(path), size_of(path)))
            continue
        removal = delete(paths, path, report)
        if removal.complete or removal.freed:
            report.removed.append(Removed("trash", paths.key, os.path.basename(path), removal.freed))


def remove_moved(paths: RepoPaths, slot: str | None, report: GcReport, removed: Removed) -> None:
    """Delete what was moved to trash (a dry run moved nothing) and report what that freed."""
    if slot is not None:
        removed = attrs.evolve(removed, bytes=delete(paths, slot, report).freed)
    report.removed.append(removed)


def record_unremovable(paths: RepoPaths, report: GcReport, now: float) -> None:
    """Keep this run's leftovers of one repository for `status` (since when each is stuck)."""
    if report.dry_run:
        return
    previous = {(e.get("path"), e.get("error")): e.get("since", now)
                for e in (records.read_json(paths.unremovable_record, records.UNREMOVABLE) or {}).get("entries", [])}
    mine = [dict(e, since=previous.get((e["path"], e["error"]), now))
            for e in report.unremovable if e["repo"] == paths.key]
    if mine:
        records.write_json(paths.unremovable_record, {"checked_at": now, "entries": mine})
    else:
        records.remove_quietly(paths.unremovable_record)


def still_damaged(paths: RepoPaths, name: str):
    """A recheck under the marker's exclusive lock: a clone may have replaced the
    damaged checkout with a whole one since the inventory looked."""
    def recheck(_last_use: float) -> str | None:
        return None if not is_published(paths, name) else "replaced-meanwhile"

    return recheck


def tidy(info: RepoInfo, report: GcReport) -> None:
    """Leftovers of dead processes: scratch, clone records, temp files, unmarked or damaged checkouts."""
    paths = info.paths
    if not report.dry_run:
        tree.keep_private_dirs(paths.private_dirs)
    for directory in (paths.state_dir, paths.base):
        for name in entries(directory):  # listed beneath the root, never through a symlink
            path = os.path.join(directory, name)
            if name.startswith(".") and name.endswith(records.TMP_SUFFIX) and not report.dry_run and \
                    time.time() - tree.lstat(path).st_mtime > STRAY_TMP_AGE:
                records.remove_quietly(path)
    for name, slot in reap_dead_scratch(paths, dry_run=report.dry_run):
        size = 0 if report.dry_run else size_of(slot)
        remove_moved(paths, slot or None, report, Removed("dead-scratch", paths.key, name, size))
    for clone in info.clones:
        if not clone.alive and not report.dry_run:
            def dead(name: str = clone.name) -> bool:
                return tree.lexists(paths.clone_record(name))

            with locks.rechecked(locks.clone_of(paths, clone.name), dead) as clone_lock:
                if clone_lock is not None:  # not alive meanwhile: its record is a dead owner's
                    drop_dead_clone_record(paths, clone.name)
    for checkout in info.checkouts:
        if checkout.ready:
            # Damaged (top-level entries gone): never served again; removed unless a command holds it.
            if not checkout.intact:
                if report.dry_run:
                    report.removed.append(Removed("damaged", paths.key, checkout.name, checkout.size))
                    continue
                moved = move_checkout_aside(paths, checkout.name, "damaged", still_damaged(paths, checkout.name))
                if moved.slot is not None:
                    remove_moved(paths, moved.slot, report,
                                 Removed("damaged", paths.key, checkout.name, checkout.size))
            continue
        # No marker: a worker renamed it but died before the marker, or is about to
        # write it. Only a free clone lock (no live worker) makes it a leftover.
        unmarked = lambda name=checkout.name: not tree.lexists(paths.ready_marker(name))  # noqa: E731
        with locks.rechecked(locks.clone_of(paths, checkout.name), unmarked) as clone_lock:
            if clone_lock is None:
                continue
            slot = None
            if not report.dry_run:
                moved = move_checkout_aside(paths, checkout.name, "unpublished", clone_lock_held=True)
                if moved.slot is None:
                    continue
                slot = moved.slot
            remove_moved(paths, slot, report, Removed("unpublished", paths.key, checkout.name, checkout.size))
