"""Checkouts on disk: the one home of how a checkout appears and leaves.

- Publishing (invariant 1): the built tree is renamed to checkouts/<sha> in
  one step, then the ready marker is written, whole, last. `publish` is the
  only code that does either, so no path can forget the order.
- Leaving (invariant 4): a checkout leaves by one rename into trash/, taken
  under its marker's exclusive lock without waiting, so a ready answer or an
  exec holding the shared lock is never pulled from under (the checkout is
  then kept and the caller says why). A checkout without a marker has no
  readers; the caller must hold the commit's clone lock so that no worker is
  about to mark it.
- Anything in trash/ may be deleted by anyone at any time (`empty_trash`).
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from typing import Callable

import attrs

from checkoutcache.errors import CheckoutCacheError
from checkoutcache.store import locks, records
from checkoutcache.store.layout import RepoPaths, entries
from checkoutcache.store.ready import looks_intact, top_names
from checkoutcache.testhooks import checkpoint

HELD = "held"
GONE = "gone"


def write_ready_marker(marker: str, sha: str, top: list[str]) -> None:
    records.write_json(marker, {"commit": sha, "published_at": time.time(), "pid": os.getpid(), "top": top})


def is_published(paths: RepoPaths, sha: str) -> bool:
    """Marked and intact (the ready path's cheap check), without touching it."""
    record = records.read_json(paths.ready_marker(sha))
    return record is not None and looks_intact(paths.checkout(sha), record)


def publish(paths: RepoPaths, tree: str, sha: str) -> bool:
    """Rename the built tree to checkouts/<sha>, then write the ready marker.

    Returns False if another clone had already published (ours is discarded).
    Runs under the commit's clone lock, so a target without a marker can only be
    a dead worker's interrupted publish, and one that fails the integrity check
    was damaged: either is moved aside and replaced, unless a running command
    holds it.
    """
    target = paths.checkout(sha)
    top = top_names(tree)
    if os.path.lexists(target):
        if is_published(paths, sha):
            return False
        moved = move_checkout_aside(paths, sha, "replaced", clone_lock_held=True)
        if moved.kept == HELD:
            raise CheckoutCacheError("CLONE_FAILED", detail="a damaged checkout of this commit is held by a "
                                                            "running command; it is replaced once that ends")
    try:
        os.rename(tree, target)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise
    checkpoint("after-rename")
    write_ready_marker(paths.ready_marker(sha), sha, top)
    return True


@attrs.frozen
class Moved:
    """Where a checkout went (its trash path), or why it stayed (held, gone, or
    the reason the caller's re-check gave)."""

    slot: str | None = None
    kept: str | None = None


def to_trash(paths: RepoPaths, path: str, what: str) -> str | None:
    """Rename anything of this repository's store into a fresh trash slot; None if it is gone."""
    slot = paths.trash_slot(what)
    try:
        os.rename(path, slot)
    except FileNotFoundError:
        return None
    return slot


def move_checkout_aside(paths: RepoPaths, sha: str, why: str,
                        recheck: Callable[[float], str | None] | None = None,
                        clone_lock_held: bool = False) -> Moved:
    """Rename checkouts/<sha> into trash/ under its marker's exclusive lock.

    recheck(last_use) runs under the lock (look, lock, look again) and may
    return a reason to keep the checkout after all. A checkout without a
    marker is moved only by a caller holding the commit's clone lock: anyone
    else might catch a worker between its rename and its marker.
    """
    marker = paths.ready_marker(sha)
    exclusive = locks.checkout_exclusive(marker)
    if exclusive is None:
        if os.path.exists(marker):
            return Moved(kept=HELD)  # a reader or a running command holds it
        if not clone_lock_held:
            return Moved(kept=GONE)
        slot = to_trash(paths, paths.checkout(sha), f"{why}-{sha}")  # unmarked: nobody reads it
        return Moved(slot=slot) if slot else Moved(kept=GONE)
    with exclusive:
        try:
            last_use = os.stat(marker).st_mtime
        except FileNotFoundError:
            return Moved(kept=GONE)
        reason = recheck(last_use) if recheck is not None else None
        if reason is not None:
            return Moved(kept=reason)
        slot = to_trash(paths, paths.checkout(sha), f"{why}-{sha}")
    return Moved(slot=slot) if slot else Moved(kept=GONE)


def remove_tree(path: str) -> None:
    """Delete something renamed into trash/. Never follows a symlink out of it."""
    if os.path.islink(path) or not os.path.isdir(path):
        records.remove_quietly(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def trash_entries(paths: RepoPaths) -> list[str]:
    return [os.path.join(paths.trash_dir, name) for name in entries(paths.trash_dir)]
