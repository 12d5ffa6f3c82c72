"""gc: trim the store to its limits without ever removing what a review uses.

One run, under locks/gc.lock (taken without waiting: two crons never
overlap, the second reports that it skipped):

1. finish interrupted deletions (leftovers.py: everything in trash/ goes: whatever a tree
   holds, read-only directories, any depth or name; what cannot be removed,
   e.g. a mount point, is reported with its cause under "unremovable", kept in
   state/unremovable.json for `status`, retried by every later run, and never
   stops the rest of the run);
2. (leftovers.py) reap scratch whose owner is dead (store/scratch.py), drop records of
   dead clones (keeping their count of worker deaths in state/<name>.deaths.json), and
   move aside checkouts a killed worker renamed but never marked, or damaged ones no
   command holds (store/checkouts.py); spares a killed gc was making go to trash/;
3. repair last uses in the future (a clock that jumped back, a restored
   backup): the marker's mtime is set to now under its exclusive lock, taken
   without waiting (a holder's own touch repairs it anyway);
   plan eviction (eviction.py, pure, where a future last use counts as now) from the inventory, then for each planned
   checkout: take its marker's exclusive lock without waiting, re-check its
   last use against the grace window, rename it into trash/, release, delete.
   A checkout held by an exec or touched meanwhile is skipped, not waited on.
   Workspaces (workspace_upkeep.py, before the plan): dead ones are reaped where
   gc may delete them, and the bytes of live ones count against max-bytes (their
   source checkouts stay held meanwhile; each measured by a bounded walk, whose
   count past a bound is a lower bound the report says);
   Spares (spare_upkeep.py): an evicted tree is kept as a spare instead of deleted when
   it was evicted for max-checkouts or max-age and space is not short; spares count
   against max-bytes and min-free and are the first thing deleted (oldest first) when
   space is short, before any checkout is planned; past max-spares the oldest go;
4. mirror maintenance (mirror_upkeep.py) under the mirror lock (bounded wait, skipped if
   busy): spares' refs kept, keep-refs of commits with neither a checkout, a live clone nor
   a borrower dropped, stale git leftovers removed, a repack at most every
   mirror_gc_interval (due until done), and the Git LFS objects no kept commit references
   deleted; then records of what is over are forgotten (forget.py: deaths, failures a day
   past their retry time, finished commits' locks and logs), what could not be removed is
   recorded, and a shallow mirror's background history is followed (history.py);
5. between 3 and 4, drop whole repositories with nothing in them (no
   checkout, hold, clone, borrower, or failure within its back-off) unused past repo_max_idle, or past the
   grace window while min-free is still unmet (eviction.plan_repo_drops, pure;
   evict.drop_repository re-checks under the repository's locks), and finish
   such removals a killed gc left at the start of the run. Unmet limits are
   logged at WARNING and reported with what an operator needs (unmet_entries).

gc never holds a lock a ready answer waits on for longer than one rename.
With dry_run nothing is changed: the report (report.py) says what a real run would do.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import shutil
import time
from collections.abc import Iterator

import attrs

from checkoutcache.config import Config
from checkoutcache.store import holds, locks, records, tree
from checkoutcache.store.checkouts import GONE, Removal, move_checkout_aside, move_held_checkout_aside
from checkoutcache.store.create import root_error
from checkoutcache.store.inventory import FRESH_SIZES, NO_SIZES, RepoInfo, inventory
from checkoutcache.store.sizes import disk_usage
from checkoutcache.store.layout import LAYOUT_VERSION, RepoPaths, RootPaths, commit_of
from checkoutcache.store.ready import layout_version_of
from checkoutcache.store.liveness import in_use_beneath, paths_in_use
from checkoutcache.store.spares import drop_unfinished, evict_to_spare
from checkoutcache.testhooks import checkpoint
from checkoutcache.units import iso
from checkoutcache.upkeep.forget import (
    forget_finished_commits,
    forget_old_deaths,
    forget_old_failures,
    forget_stale_journals,
    forget_unreachable,
)
from checkoutcache.upkeep.history import follow_history
from checkoutcache.upkeep.evict import (
    borrowed_keys_of,
    drop_repository,
    note_last_use,
    remove_dropped_leftovers,
    repo_entry,
)
from checkoutcache.upkeep.eviction import (
    MIN_FREE,
    Disk,
    Entry,
    Limits,
    RepoKept,
    Unmet,
    free_targets,
    idle_seconds,
    plan_eviction,
    plan_repo_drops,
    unmet_after,
)
from checkoutcache.upkeep.leftovers import delete, empty_trash, record_unremovable, remove_moved, tidy
from checkoutcache.upkeep.limits import record_limits
from checkoutcache.upkeep.mirror_upkeep import maintain_mirror
from checkoutcache.upkeep.report import REPOSITORY, USED_MEANWHILE, GcReport, KeptOver, Removed
from checkoutcache.upkeep.spare_upkeep import drop_spares_first, drop_spares_past_max, spare_record
from checkoutcache.upkeep.workspace_upkeep import bounded_pins, workspace_upkeep

log = logging.getLogger(__name__)


def disk_of(path: str) -> Disk:
    usage = shutil.disk_usage(path)
    return Disk(total=usage.total, free=usage.free)


@contextlib.contextmanager
def going_on(report: GcReport, paths: RepoPaths, root_paths: RootPaths) -> Iterator[None]:
    """One repository's step that fails on the file system (a mount point that will not
    move, a read-only state directory) is reported, and the run goes on with the rest."""
    try:
        yield
    except OSError as exc:
        where = os.path.relpath(exc.filename, root_paths.root) if isinstance(exc.filename, str) else paths.key
        report.unremovable.append({"repo": paths.key, "path": where, "entry": None,
                                   "error": errno.errorcode.get(exc.errno or 0, type(exc).__name__)})


def repair_future_last_use(paths: RepoPaths, name: str, now: float, report: GcReport) -> None:
    """Set a marker's mtime that lies in the future back to now, under its exclusive lock, never waiting."""
    marker = paths.ready_marker(name)
    if report.dry_run:
        return
    exclusive = locks.checkout_exclusive(marker)
    if exclusive is None:
        return  # held: the holder's own touch sets it to now
    with exclusive:
        try:
            was = tree.lstat(marker).st_mtime
            if was > time.time():
                tree.utime(marker, (now, now))
                report.clock_repaired.append({"repo": paths.key, "commit": commit_of(name), "name": name,
                                              "was": iso(was)})
        except OSError:
            pass


def evict_checkout(paths: RepoPaths, name: str, grace: float, dry_run: bool,
                   report: GcReport, spare: dict | None = None, held: bool = False) -> tuple[str | None, Removal | None]:
    """Rename one checkout into trash/ and delete it: (why it was kept instead, or None; what deleting freed).
    spare: its spare.json, to keep its tree as a spare instead (store/spares.py; nothing freed).
    held: a reader's hold no longer protects it (eviction.broken_holds): moved without the
    marker's exclusive lock (store/checkouts.py move_held_checkout_aside)."""
    def recheck(last_use: float) -> str | None:
        if time.time() - last_use <= grace:
            return USED_MEANWHILE
        return "dry-run" if dry_run else None

    if held:
        if dry_run:
            return None, None
        moved = move_held_checkout_aside(paths, name, recheck)
        if moved.slot is None:
            return moved.kept or GONE, None
        return None, delete(paths, moved.slot, report)

    if spare is not None and not dry_run:
        moved = evict_to_spare(paths, name, spare, recheck)
        return (None, Removal()) if moved.slot is not None else (moved.kept or GONE, None)
    moved = move_checkout_aside(paths, name, "evicted", recheck)
    if moved.kept == "dry-run":
        return None, None
    if moved.slot is None:
        return moved.kept or GONE, None
    checkpoint("gc-after-evict-rename")
    return None, delete(paths, moved.slot, report)


def note_held(info: RepoInfo, now: float, dry_run: bool, workspaces: set[str] = frozenset(),
              workspaces_since: dict[str, float] | None = None) -> dict[str, float]:
    """Since when each held checkout of a repository has been held, as gc's runs saw it
    (state/held.json, gc's own): a checkout seen held keeps its first sighting, one seen free
    leaves the record. {name: since}. A record that cannot be read starts anew. workspaces:
    the live workspaces pinning this repository, whose first sightings go the same way (into
    workspaces_since)."""
    paths = info.paths
    try:
        record = records.read_json(paths.held_record, records.HELD) or {}
    except OSError:
        record = {}
    before, pinned = record.get("since", {}), record.get("workspaces") if isinstance(record.get("workspaces"), dict) else {}
    held = {c.name for c in info.checkouts if c.ready and c.held and not c.unreadable}
    since = {name: float(before[name]) if records.finite(before.get(name)) else now for name in held}
    pins = {name: float(pinned[name]) if records.finite(pinned.get(name)) else now for name in workspaces}
    if workspaces_since is not None:
        workspaces_since.update(pins)
    if not dry_run and (since != before or pins != pinned):
        try:
            if since or pins:
                records.write_json(paths.held_record, {"since": since, **({"workspaces": pins} if pins else {})})
            else:
                records.remove_quietly(paths.held_record)
        except OSError:
            pass  # the age is then counted anew: the count bound still holds
    return since


def our_keys(root_paths: RootPaths, report: GcReport) -> list[str]:
    """The repository stores this version may change: one a newer version wrote (its layout
    version above ours) is not even measured (its size records stay as they are), and said:
    a rollback must not corrupt it."""
    keys = []
    for key in root_paths.repo_keys():
        paths = root_paths.repo(key)
        found = layout_version_of(paths.repo_json)
        if found is not None and found > LAYOUT_VERSION:
            report.problems.append({"path": os.path.relpath(paths.repo_json, root_paths.root), "error": "NEWER_LAYOUT",
                                    "why": f"written by a newer checkoutcache (layout version {found}; this one "
                                           f"knows up to {LAYOUT_VERSION}): left as it is"})
            continue
        keys.append(key)
    return keys


def run_gc(root_paths: RootPaths, config: Config, dry_run: bool = False,
           used_within_grace: frozenset[tuple[str, str]] = frozenset(), record_as: str | None = None) -> GcReport:
    """used_within_grace: (repository key, checkout name) pairs the caller knows were used
    within the grace window by a clock that cannot jump (serve's monotonic record
    of its own ready answers); they count as used now, whatever the markers say.
    record_as: the writer (gc, serve) whose limits these are, recorded in the root for
    status (upkeep/limits.py); None for a one-off run with limits not in force (a
    tightened gc over the API)."""
    report = GcReport(dry_run=dry_run)
    checkpoint("gc-start")
    forget_unreachable(root_paths, report, time.time())  # there may be no repository store at all
    forget_stale_journals(root_paths, report, time.time())
    if not tree.is_dir(root_paths.repos_dir):
        if tree.lexists(root_paths.repos_dir):  # a symlink (or a file): never followed
            raise root_error(root_paths.root, tree.NotBeneath(root_paths.repos_dir, "'repos' is not a directory"))
        return report
    try:
        tree.make_private_dir(root_paths.locks_dir)
        gc_lock = locks.gc_run(root_paths)
    except OSError as exc:  # no room even for the lock file, or a root we may not write
        raise root_error(root_paths.root, exc) from None
    if gc_lock is None:
        report.skipped = "another gc is running"
        return report
    with gc_lock:
        if not dry_run:
            tree.keep_private_dirs(root_paths.private_dirs)
        before = disk_of(root_paths.root)
        report.disk_before = attrs.asdict(before)
        if not dry_run:
            for name, removal in remove_dropped_leftovers(root_paths):  # a removal a killed gc left
                report.removed.append(Removed("dropped-leftover", name.split("-")[1], "", removal.freed))
        keys = our_keys(root_paths, report)
        newer = list(report.problems)
        for info in inventory(root_paths, sizes=NO_SIZES, keys=keys):
            if info.refused:
                continue  # a symlink where a store directory should be: left alone (a problem below)
            with going_on(report, info.paths, root_paths):
                empty_trash(info.paths, report)
            with going_on(report, info.paths, root_paths):
                tidy(info, report)
            with going_on(report, info.paths, root_paths):
                for slot in ([] if dry_run else drop_unfinished(info.paths)):  # a killed gc's
                    remove_moved(info.paths, slot, report, Removed("spare", info.paths.key, os.path.basename(slot)))
        workspace_pins: set[tuple[str, str, str]] = set()
        try:
            pinned_bytes = workspace_upkeep(root_paths, config, report, newer, workspace_pins)
        except OSError as exc:  # a workspaces directory this gc may not read: said, never the run's end
            pinned_bytes = 0
            newer.append({"path": str(exc.filename), "error": errno.errorcode.get(exc.errno or 0, "OSError"),
                          "why": "the workspaces directory cannot be read: its bytes are not counted"})
        repos = inventory(root_paths, sizes=FRESH_SIZES, keys=keys)
        report.problems = newer + [problem for info in repos for problem in info.problems]
        if record_as is not None and not dry_run:
            try:
                record_limits(root_paths, config, record_as)
            except OSError as exc:  # status then shows the caller's own limits: said, never fatal
                report.problems.append({"path": os.path.relpath(root_paths.limits_record, root_paths.root),
                                        "error": records.errno_name(exc), "why": "the limits in force could not "
                                                                                 "be recorded"})
        by_key = {info.key: info for info in repos}
        limits = Limits.from_config(config)
        now = time.time()
        pins_of = collections.defaultdict(set)
        for key, _commit, name in workspace_pins:
            pins_of[key].add(name)
        seen_since: dict[str, float] = {}
        held_since = {info.key: note_held(info, now, dry_run, pins_of.get(info.key, set()), seen_since)
                      for info in repos if not info.refused}
        workspace_borrows = bounded_pins({p for p in workspace_pins if p[0] in held_since}, seen_since, config, now)
        # Registered holds (store/holds.py: an exec's, a workspace copy's, serve's /v1/hold, of the
        # writer alone): no bound on readers' locks breaks them.
        writer_holds = holds.registered(root_paths, dry_run=dry_run)
        entries = [Entry(repo=info.key, name=c.name, size=c.size, held=c.held,
                         last_used=now if (info.key, c.name) in used_within_grace else c.last_used,
                         held_since=held_since.get(info.key, {}).get(c.name),
                         writer_hold=(info.key, c.name) in writer_holds)
                   for info in repos for c in info.checkouts if c.ready and c.intact and not c.unreadable]
        for info in repos:
            for c in info.checkouts:
                if c.ready and c.last_used is not None and c.last_used > now:
                    repair_future_last_use(info.paths, c.name, now, report)
        checkout_bytes = sum(e.size for e in entries)
        # Spares go first when space is short: before any checkout, whatever its last use.
        spares, disk, disk_full = drop_spares_first(repos, report, limits, before, checkout_bytes, pinned_bytes)
        spare_bytes = sum(s.bytes for _, s in spares)
        if limits.max_bytes is not None:  # the spares left count against it too
            limits = attrs.evolve(limits, max_bytes=max(0, limits.max_bytes - spare_bytes))
        plan = plan_eviction(entries, limits, disk, now, pinned_bytes)
        # Room to keep evicted trees as spares: none while space is short.
        short = disk_full or any(u.limit in ("max-bytes", "min-free") for u in plan.unmet) or \
            any(e.limit == "min-free" for e in plan.evict)
        room = None if limits.max_bytes is None else \
            limits.max_bytes - pinned_bytes - (checkout_bytes - sum(e.entry.size for e in plan.evict))
        free_room = disk.free - 2 * spare_bytes
        evicted = set()
        in_use = None  # what processes have open, looked up once, when a tree could be spared
        for eviction in plan.evict:
            entry = eviction.entry
            spare = None
            if not short and eviction.limit in ("max-checkouts", "max-age") and (room is None or entry.size <= room) \
                    and 2 * entry.size <= free_room:
                spare = spare_record(by_key[entry.repo], entry.name, config)
            if eviction.broke_hold is not None:
                spare = None  # its holder may still work in it: never anyone's next tree
            if spare is not None:
                # A tree a process still works in (its working directory, an open file, a mapped
                # one) is never made a spare: whatever it writes later would land in the next
                # commit's published tree. Deleted, its writes go nowhere, as without spares.
                in_use = paths_in_use() if in_use is None else in_use
                if in_use_beneath(by_key[entry.repo].paths.checkout(entry.name), in_use):
                    spare = None
            try:
                kept_why, removal = evict_checkout(by_key[entry.repo].paths, entry.name, limits.grace, dry_run,
                                                   report, spare, held=eviction.broke_hold is not None)
            except OSError as exc:  # one checkout that cannot be moved never stops the others
                report.unremovable.append({"repo": entry.repo, "path": os.path.relpath(
                    by_key[entry.repo].paths.checkout(entry.name), root_paths.root),
                    "error": errno.errorcode.get(exc.errno or 0, type(exc).__name__), "entry": entry.name})
                continue
            if kept_why is None:
                evicted.add((entry.repo, entry.name))
                if spare is not None and not dry_run:
                    report.removed.append(Removed(eviction.reason, entry.repo, entry.name, 0, eviction.limit, True))
                    if room is not None:
                        room -= entry.size
                    free_room -= 2 * entry.size
                    continue
                freed = entry.size if removal is None else removal.freed
                report.removed.append(Removed(eviction.reason, entry.repo, entry.name, freed, eviction.limit,
                                              broke_hold=eviction.broke_hold))
                if eviction.broke_hold is not None:
                    log.warning("gc evicted %s of %s though a reader holds it (%s)", entry.name, entry.repo,
                                eviction.broke_hold)
            elif kept_why != GONE:
                report.kept.append(KeptOver(entry.repo, commit_of(entry.name), kept_why, eviction.limit, entry.name))
        report.kept += [KeptOver(k.entry.repo, commit_of(k.entry.name), k.why, k.limit, k.entry.name)
                        for k in plan.kept]
        for eviction in plan.evict:
            if (eviction.entry.repo, eviction.entry.name) in evicted and not dry_run:
                with going_on(report, by_key[eviction.entry.repo].paths, root_paths):
                    note_last_use(by_key[eviction.entry.repo].paths, eviction.entry.last_used)
        freed = sum(r.bytes for r in report.removed if r.reason in ("lru", "age"))
        dropped, repos_kept = drop_repositories(root_paths, limits, before, freed, now, report, keys,
                                                {key for key, _commit in workspace_borrows})
        remaining = [e for e in entries if (e.repo, e.name) not in evicted]
        report.checkouts_after = len(remaining)
        report.bytes_after = sum(e.size for e in remaining)
        spares = drop_spares_past_max(repos, spares, report, config)
        report.spares_after = len(spares)
        report.spare_bytes_after = sum(s.bytes for _, s in spares)
        borrowed = frozenset(pair for info in repos for c in info.checkouts if c.ready for pair in c.borrows) \
            | frozenset(workspace_borrows)
        repos = [info for info in repos if info.key not in dropped]
        for info in repos:
            if info.refused:
                continue
            with going_on(report, info.paths, root_paths):
                maintain_mirror(info.paths, config, report, now, borrowed,
                                frozenset(spare.sha for paths, spare in spares if paths.key == info.key))
            with going_on(report, info.paths, root_paths):
                forget_old_deaths(info.paths, report)
                forget_old_failures(info.paths, report)
                forget_finished_commits(info.paths, report)
            with going_on(report, info.paths, root_paths):
                record_unremovable(info.paths, report, now)
            with going_on(report, info.paths, root_paths):  # after the mirror's upkeep (upkeep/history.py)
                follow_history(info.paths, config, next((m for m in report.mirrors if m["repo"] == info.key), None),
                               dry_run)
        report.disk_after = attrs.asdict(disk_of(root_paths.root))
        report.unmet = unmet_entries(unmet_after(plan.unmet, sum(dropped.values())), report, repos_kept)
        for unmet in report.unmet if not dry_run else []:
            log.warning("gc could not meet %s: %s against %s (%s)", unmet["limit"], unmet["actual"],
                        unmet["target"], unmet["why"])
    return report


def drop_repositories(root_paths: RootPaths, limits: Limits, disk: Disk, freed: int, now: float,
                      report: GcReport, keys: list[str] | None = None,
                      workspace_keys: set[str] | frozenset[str] = frozenset()) -> tuple[dict[str, int], list[RepoKept]]:
    """Whole repositories with nothing in them, unused past repo_max_idle (or past the grace
    window while min-free is unmet): {key: bytes freed} of those removed, and those min-free
    wanted that had to stay. keys: the repositories of our layout (a newer version's are
    never touched), though every repository's borrows count."""
    everything = inventory(root_paths, sizes=NO_SIZES)
    borrowed = borrowed_keys_of(everything) | set(workspace_keys)  # a live workspace borrows its mirror too
    # A refused store (a symlink where one of its directories should be) is never dropped through.
    repos = [info for info in everything if (keys is None or info.key in keys) and not info.refused]
    targets = free_targets(limits, disk)
    short_of_space = targets is not None and disk.free < targets[0]
    facts = []
    for info in repos:
        with going_on(report, info.paths, root_paths):
            fact = repo_entry(info, borrowed, with_size=False)
            # Its size (a walk of its mirror and LFS objects) only when it may go.
            if fact.busy is None and (short_of_space or limits.repo_max_idle is not None and
                                      idle_seconds(fact.last_used, now) > limits.repo_max_idle):
                fact = attrs.evolve(fact, size=disk_usage(info.paths.base))
            facts.append(fact)
    drops, kept = plan_repo_drops(facts, limits, disk, freed, now)
    dropped: dict[str, int] = {}
    for drop in drops:
        key = drop.entry.repo
        try:
            outcome = drop_repository(root_paths, key, borrowed, dry_run=report.dry_run)
        except OSError as exc:
            report.unremovable.append({"repo": key, "path": os.path.relpath(root_paths.repo(key).base,
                                                                            root_paths.root),
                                       "error": errno.errorcode.get(exc.errno or 0, type(exc).__name__),
                                       "entry": None})
            continue
        if outcome.kept is not None:
            if outcome.kept != GONE:
                kept.append(RepoKept(key, outcome.kept))
            continue
        freed_now = drop.entry.size if outcome.removal is None else outcome.removal.freed
        dropped[key] = freed_now
        report.removed.append(Removed(REPOSITORY, key, "", freed_now, drop.limit))
        for stuck in outcome.removal.unremovable if outcome.removal is not None else []:
            report.unremovable.append({"repo": key, "path": stuck.path, "error": stuck.error, "entry": None})
    return dropped, kept


def unmet_entries(unmet: list[Unmet], report: GcReport, repos_kept: list[RepoKept]) -> list[dict]:
    """What an operator needs of each unmet limit: by how much, what gc had to keep and why,
    and what to do about it."""
    found = []
    for item in unmet:
        kept = collections.Counter(k.why for k in report.kept if k.limit == item.limit)
        entry = {**attrs.asdict(item), "short": abs(item.target - item.actual), "kept": dict(kept)}
        whys = [f"{count} checkout(s) {why}" for why, count in sorted(kept.items())]
        if item.limit == MIN_FREE:
            entry["repos_kept"] = [{"repo": k.repo, "why": k.why} for k in repos_kept]
            entry["repacks_skipped"] = [m["repo"] for m in report.mirrors if m.get("repack_skipped")]
            whys += [f"{len(repos_kept)} repositor(ies) in use"] if repos_kept else []
            whys += [f"{len(entry['repacks_skipped'])} repack(s) lacking space"] if entry["repacks_skipped"] else []
        entry["why"] = ", ".join(whys) or "nothing more gc may remove"
        entry["next"] = ("what is kept is in use or within its grace window: `checkoutcache evict REPO [COMMIT] "
                         "--force` removes what only the grace window protects; otherwise add disk or lower "
                         "the other limits")
        found.append(entry)
    return found
