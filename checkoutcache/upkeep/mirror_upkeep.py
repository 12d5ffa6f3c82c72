"""Mirror maintenance, gc's step 4 (gc.py) for one repository: its mirror.git and lfs/,
under its mirror lock (a bounded wait, locks.MIRROR_WAIT_FOR_GC: while a clone is fetching
the mirror is skipped and said so, never waited on):

- keep refs/spares/<sha> for exactly the commits of the repository's spares (their history
  stays; LFS objects go by keep-refs alone), set before any keep-ref is dropped;
- drop keep-refs of commits with neither a checkout (whole or sparse: one keep-ref serves
  every checkout of a commit) nor a live clone, re-checked under the commit's clone lock; a
  (key, commit) that a published checkout (submodules) or a live workspace borrows objects
  from keeps its ref whatever this store holds; and refs/bases/<sha> of bases no existing
  checkout's merge-base record names (nor a running search looks for);
- remove stale git lock files and pack leftovers; a stale `.keep` (a killed fetch's) removed
  there makes the repack due; partial LFS downloads an hour old go too;
- drop refs/bundles/* of a seeded mirror once it has fetched from upstream;
- repack/prune at most every mirror_gc_interval so objects no checkout needs go away (a
  repack stays due in state/mirror-gc.json when refs were dropped by an earlier run, until
  it is done), and only when the new pack fits with the reserve still free (min-free, else
  REPACK_RESERVE of the disk): a repack never leaves the disk fuller, a failed one's output
  goes;
- when refs were dropped, delete from lfs/ the Git LFS objects no kept commit references
  (the commits of the remaining checkouts and of running clones, whose keep-refs their
  workers made under this same lock before downloading); a prune that cannot tell what is
  used deletes nothing and stays due.

Each run appends one entry per repository to GcReport.mirrors (report.py). With dry_run
only the keep-refs that would go are counted; nothing is changed.
"""

from __future__ import annotations

import os
import shutil

from checkoutcache.config import Config
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.git import mirror
from checkoutcache.git.backend import BUNDLE_REFS
from checkoutcache.git.transport import pick_backend
from checkoutcache.store import locks, records, tree
from checkoutcache.store.layout import RepoPaths, commit_of
from checkoutcache.store.sizes import disk_usage
from checkoutcache.testhooks import checkpoint
from checkoutcache.units import format_bytes
from checkoutcache.upkeep.report import GcReport


def names_of_commit(paths: RepoPaths, sha: str) -> set[str]:
    """The names of every checkout of the commit the store knows of: published, being made,
    or only locked (the whole tree's name always)."""
    known = set(paths.checkout_names()) | set(paths.clone_lock_names()) | set(paths.clone_record_names())
    return {name for name in known if commit_of(name) == sha} | {sha}


def sync_spare_refs(paths: RepoPaths, backend, spared: frozenset[str], keep_fds: tuple[int, ...]) -> None:
    """refs/spares/<sha> for exactly the commits of this repository's spares (under the mirror
    lock, before keep-refs are dropped: an evicted checkout's history stays without a gap)."""
    if not getattr(backend, "supports_spares", False):
        return
    have = set(backend.spare_refs(paths.mirror))
    backend.set_spare_refs(paths.mirror, sorted(spared - have), sorted(have - spared), keep_fds)


def maintain_mirror(paths: RepoPaths, config: Config, report: GcReport, now: float,
                    borrowed: frozenset[tuple[str, str]] = frozenset(), spared: frozenset[str] = frozenset()) -> None:
    """borrowed: (key, commit) pairs published checkouts of any repository borrow
    objects from (submodules): their keep-refs stay whatever this store holds.
    spared: the commits of this repository's spares (their history stays: refs/spares/)."""
    backend = pick_backend(config.transport)
    if not backend.is_usable(paths.mirror):
        return
    entry = {"repo": paths.key, "refs_dropped": 0, "stale_locks": [], "repacked": False}
    try:
        mirror_lock = locks.mirror_write(paths, timeout=locks.MIRROR_WAIT_FOR_GC)
    except locks.LockTimeout:
        entry["skipped"] = "a clone is fetching"
        report.mirrors.append(entry)
        return
    with mirror_lock:
        if not report.dry_run:
            sync_spare_refs(paths, backend, spared, (mirror_lock.fileno(),))
        for sha in backend.kept(paths.mirror):
            def unused(sha: str = sha) -> bool:
                # Every checkout of the commit counts, whole or sparse: one keep-ref serves them all.
                names = names_of_commit(paths, sha)
                return not any(tree.lexists(paths.checkout(n)) for n in names) and \
                    not any(locks.clone_running(paths, n) for n in names if n != sha) and \
                    (paths.key, sha) not in borrowed

            if not unused():
                continue
            # A worker making it holds the clone lock: its keep-ref protects what it reads.
            with locks.rechecked(locks.clone_of(paths, sha), unused) as clone_lock:
                if clone_lock is None:
                    continue
                if not report.dry_run:
                    backend.drop_keep(paths.mirror, sha)
                entry["refs_dropped"] += 1
        entry["refs_dropped"] += drop_unused_base_refs(paths, backend, report.dry_run, (mirror_lock.fileno(),))
        if report.dry_run:
            report.mirrors.append(entry)
            return
        removed = mirror.remove_stale_leftovers(paths.mirror)
        entry["stale_locks"] = [name for name in removed if name.endswith(".lock")]
        entry["stale_leftovers"] = [name for name in removed if not name.endswith(".lock")]
        remove_lfs_partials(paths, entry)
        if drop_bundle_refs(paths, backend):
            entry["refs_dropped"] += 1
            entry["bundle_refs_dropped"] = True
        stamp = records.read_json(paths.mirror_gc_stamp, records.MIRROR_GC) or {}
        lfs_pending = False
        if os.path.isdir(paths.lfs_objects) and (entry["refs_dropped"] or stamp.get("lfs_pending")):
            lfs_pending = not prune_lfs(paths, backend, entry)
        # A pack a killed fetch kept (its .keep just removed) goes only with a repack: one is due.
        pending = bool(entry["refs_dropped"] or stamp.get("pending") or freed_kept_packs(entry["stale_leftovers"]))
        due = now - float(stamp.get("at", 0.0)) >= config.mirror_gc_interval
        lfs_flag = {"lfs_pending": True} if lfs_pending else {}  # an LFS prune still to do
        if not pending and lfs_pending != bool(stamp.get("lfs_pending")):
            records.write_json(paths.mirror_gc_stamp, {"at": stamp.get("at", 0.0), "pending": False, **lfs_flag})
        if pending and not due:
            records.write_json(paths.mirror_gc_stamp, {"at": stamp.get("at", 0.0), "pending": True, **lfs_flag})
        elif pending:
            short = short_of_space_for_repack(paths, config)
            repacked = None
            if short is not None:
                entry["repack_skipped"] = short
            else:
                repacked = backend.repack(paths.mirror, (mirror_lock.fileno(),), config.clone_timeout,
                                          started=lambda: checkpoint("gc-during-repack"))
                if repacked is None:
                    entry["repack_skipped"] = f"the {backend.name} transport cannot repack"
                elif not repacked:  # what it wrote before failing goes: a repack never leaves the disk fuller
                    entry["stale_leftovers"] += mirror.remove_stale_leftovers(paths.mirror, min_age=0.0)
            entry["repacked"] = bool(repacked)
            records.write_json(paths.mirror_gc_stamp, {"at": now if repacked else stamp.get("at", 0.0),
                                                       "pending": not repacked, **lfs_flag})
    report.mirrors.append(entry)


def drop_unused_base_refs(paths: RepoPaths, backend, dry_run: bool, keep_fds: tuple[int, ...]) -> int:
    """refs/bases/<sha> (kept by `ensure --base`, clone/history.py) of the bases no merge-base
    record of a checkout names any more, nor a running search looks for; how many (with dry_run:
    would go). Caller holds the mirror lock, under which a search writes its ref."""
    if not getattr(backend, "supports_shallow", False):
        return 0
    from checkoutcache.clone.history import bases_in_use
    from checkoutcache.git.backend import BASE_PREFIX

    unused = sorted(set(backend.refs_named(paths.mirror, BASE_PREFIX)) -
                    {f"{BASE_PREFIX}{base}" for base in bases_in_use(paths)})
    if unused and not dry_run:
        backend.drop_refs(paths.mirror, unused, keep_fds)
    return len(unused)


def freed_kept_packs(leftovers: list[str]) -> list[str]:
    """The `.keep` files among removed leftovers: packs a killed fetch kept, that only a
    repack drops (their objects are unreachable, or duplicated in another pack)."""
    return [name for name in leftovers if name.endswith(".keep")]


# What a repack keeps free for the reviews' own writes when no min-free is set.
REPACK_RESERVE = 0.05


def short_of_space_for_repack(paths: RepoPaths, config: Config) -> str | None:
    """Why a repack must wait (None: it fits). git writes the new pack, about the size of
    the mirror's objects, before it deletes the old ones: that must fit with the reserve
    (min-free, else 5% of the disk) still free, or reviews meet ENOSPC in their checkouts."""
    usage = shutil.disk_usage(paths.mirror)
    need = disk_usage(paths.mirror_objects)
    reserve = config.min_free.bytes_of(usage.total) if config.min_free else int(usage.total * REPACK_RESERVE)
    if usage.free - need >= reserve:
        return None
    return (f"not enough free space: a repack needs about {format_bytes(need)} with {format_bytes(reserve)} kept "
            f"free, and {format_bytes(usage.free)} is free (it stays due)")


def drop_bundle_refs(paths: RepoPaths, backend) -> bool:
    """refs/bundles/* serve a seeded mirror's first upstream fetch (git offers them as
    haves); once the mirror has fetched from upstream they are only weight (checkouts
    keep what they use with keep-refs), so they go, and the next repack drops what
    only they held. True when some were dropped. Caller holds the mirror lock."""
    seed = records.read_json(paths.seed_record, records.SEED) or {}
    upstream = seed.get("upstream") if isinstance(seed.get("upstream"), dict) else {}
    if not seed.get("seeded") or not upstream.get("fetches") or seed.get("bundle_refs_dropped"):
        return False
    backend.drop_refs_under(paths.mirror, BUNDLE_REFS)
    records.write_json(paths.seed_record, {**seed, "bundle_refs_dropped": True})
    return True


def remove_lfs_partials(paths: RepoPaths, entry: dict) -> None:
    """Partial LFS downloads a killed worker left (a worker removes its own after a failed
    fetch). Caller holds the mirror lock, which every download of ours runs under."""
    count, freed = mirror.remove_lfs_partials(paths, min_age=mirror.STALE_LFS_PARTIAL_AGE)
    if count:
        entry["lfs_partials_removed"] = count
        entry["lfs_partial_bytes_freed"] = freed


def prune_lfs(paths: RepoPaths, backend, entry: dict) -> bool:
    """Delete from lfs/ every LFS object no commit kept in the mirror references.
    Caller holds the mirror lock: every clone's commit is kept (refs/keep/) before its
    worker downloads under that lock, so a running clone's objects are always in use.
    False when it could not tell what is used (then nothing is deleted, and a later
    run tries again)."""
    unsupported = backend.lfs_unsupported()
    if unsupported is not None:
        entry["lfs_skipped"] = unsupported
        return False
    used: set[str] = set()
    try:
        for sha in sorted(set(backend.kept(paths.mirror)) | {commit_of(n) for n in paths.checkout_names()}):
            used.update(backend.lfs_objects(paths.mirror, sha))
    except CheckoutCacheError as exc:
        entry["lfs_skipped"] = exc.detail or exc.code
        return False
    removed = freed = 0
    for oid in paths.lfs_object_oids():
        if oid in used:
            continue
        path = paths.lfs_object(oid)
        try:
            size = tree.lstat(path).st_size
            tree.unlink(path, missing_ok=False)
        except (FileNotFoundError, NotADirectoryError):
            continue
        removed += 1
        freed += size
    entry["lfs_objects_removed"] = removed
    entry["lfs_bytes_freed"] = freed
    return True
