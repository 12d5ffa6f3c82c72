"""Spares in a gc run: which go, oldest first, and what an evicted checkout's spare
record would say (store/spares.py owns a spare's files; clone/tree.py a worker's taking one).

- An evicted tree is kept as a spare instead of deleted (gc.py, as it evicts) when the
  eviction was for max-checkouts or max-age and broke no reader's hold, CHECKOUTCACHE_MAX_SPARES
  is above 0, space is not short, the tree fits in the room left, and no process gc can see
  works in it (/proc: a later write of its would land in the next commit's tree).
- Spares count against max-bytes and min-free and are the first thing deleted, before any
  checkout is planned (drop_spares_first): when either is short, when a clone's last attempt
  failed with DISK_FULL, or when they hold more than half the disk's free space; a spare
  whose record cannot be read goes at once.
- Past max-spares the oldest go (drop_spares_past_max), once the evictions made theirs.
- Spares a killed gc was making go to trash/ at the next run's start (gc.py,
  store/spares.py drop_unfinished).

A spare a worker took meanwhile is skipped, never waited on; each one deleted is a
Removed("spare") whose limit says why. With dry_run nothing is deleted: the report says
which would go.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from checkoutcache.config import Config
from checkoutcache.store.inventory import RepoInfo
from checkoutcache.store.layout import RepoPaths
from checkoutcache.store.spares import Spare, drop_spare, list_spares, spare_record_for
from checkoutcache.upkeep.eviction import Disk, Limits
from checkoutcache.upkeep.leftovers import delete
from checkoutcache.upkeep.report import GcReport, Removed


def drop_spares(spares: list[tuple[RepoPaths, Spare]], report: GcReport, why: str,
                enough: Callable[[int], bool]) -> int:
    """Delete spares, oldest first, until enough(bytes freed so far) or none is left (they go
    first whenever space is short); what they freed. Removes them from the list."""
    freed = 0
    while spares and not enough(freed):
        paths, spare = spares.pop(0)
        size = spare.bytes
        if not report.dry_run:
            slot = drop_spare(paths, spare)
            if slot is None:
                continue  # a worker took it meanwhile
            size = delete(paths, slot, report).freed or spare.bytes
        freed += size
        report.removed.append(Removed("spare", paths.key, spare.name, size, why))
    return freed


def spare_record(info: RepoInfo, name: str, config: Config) -> dict | None:
    """What an evicted checkout's spare.json would say; None when it is not kept as one."""
    if config.max_spares <= 0:
        return None
    marker = next((c.marker for c in info.checkouts if c.name == name), {})
    return spare_record_for(info.paths, name, marker, info.meta.get("submodules", "recursive"))


def spares_of(info, report: GcReport | None) -> list:
    """A repository's spares; none for a refused store, and a spares/ that is a symlink is a
    problem of that repository (listed in report, once, never followed), never the run's end."""
    if info.refused:
        return []
    try:
        return list_spares(info.paths)
    except OSError as exc:
        if report is None:
            return []
        report.problems.append({"path": os.path.relpath(info.paths.spares_dir, info.paths.root),
                                "error": errno.errorcode.get(exc.errno or 0, "OSError"),
                                "why": f"spares/ cannot be listed ({exc.strerror or exc}): its spares are left alone"})
        return []


def drop_spares_first(repos: list[RepoInfo], report: GcReport, limits: Limits, before: Disk,
                      checkout_bytes: int, pinned_bytes: int) -> tuple[list[tuple[RepoPaths, Spare]], Disk, bool]:
    """Delete the spares space wants gone before any checkout is planned: (the spares left,
    oldest first; the disk as their deletion left it; whether a clone's last attempt failed
    with DISK_FULL). checkout_bytes, pinned_bytes: what checkouts and live workspaces hold."""
    # Spares go first when space is short: before any checkout, whatever its last use.
    spares = [(info.paths, spare) for info in repos for spare in spares_of(info, report)]
    spares.sort(key=lambda pair: pair[1].spared_at)
    drop_spares([p for p in spares if not p[1].record], report, "unreadable", lambda _freed: False)
    spares = [p for p in spares if p[1].record]
    if limits.max_bytes is not None:
        over = checkout_bytes + pinned_bytes + sum(s.bytes for _, s in spares) - limits.max_bytes
        drop_spares(spares, report, "max-bytes", lambda freed: freed >= over)
    disk = before
    if limits.min_free is not None:
        low = limits.min_free.bytes_of(before.total)
        high = low + limits.free_headroom.bytes_of(before.total)
        if before.free < low:
            freed_for_disk = drop_spares(spares, report, "min-free", lambda freed: before.free + freed >= high)
            disk = Disk(total=before.total, free=before.free + freed_for_disk)
    # A clone that failed for want of space says space is short, min-free set or not.
    disk_full = any(f.code == "DISK_FULL" for info in repos for f in info.failures.values())
    if disk_full:
        drop_spares(spares, report, "disk-full", lambda _freed: False)
    # Spares never hold more than half of what the disk has free: a spare only saves time,
    # and its bytes are better free when a fresh tree of its size would not fit beside it.
    drop_spares(spares, report, "free-space",
                lambda _freed: 2 * sum(s.bytes for _, s in spares) <= disk.free)
    return spares, disk, disk_full


def drop_spares_past_max(repos: list[RepoInfo], spares: list[tuple[RepoPaths, Spare]], report: GcReport,
                         config: Config) -> list[tuple[RepoPaths, Spare]]:
    """Delete the oldest spares past max-spares, once the evictions made theirs; the spares left."""
    # At most max_spares: the oldest go (spares just made are listed afresh with their real names).
    spares = sorted(((info.paths, spare) for info in repos for spare in spares_of(info, None)
                     if spare.record), key=lambda pair: pair[1].spared_at) if not report.dry_run else spares
    excess = len(spares) - config.max_spares
    if excess > 0:
        drop_spares(spares, report, "max-spares", lambda _freed: len(spares) <= config.max_spares)
    return spares
