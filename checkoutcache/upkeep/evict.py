"""Removing whole repositories and evicting by hand: what gc does past
CHECKOUTCACHE_REPO_MAX_IDLE or an unmet min-free, and what an operator does
with `checkoutcache evict REPO [COMMIT] [--force]`.

The guarantees are gc's (invariant 4), for the operator too: a checkout an
exec or a hold uses and a running clone are never removed, even with
--force; a checkout used within its grace window goes only with --force. A
repository goes whole only when nothing is in it: no checkout, no running
clone, and no other repository's checkout borrowing objects from its mirror
(submodules). Its last use is its checkouts' latest, kept in
state/last-use.json when they are evicted; a failed clone is no use (asks for
commits that do not exist never keep an idle repository), but gc keeps a
repository while one of its failures is within its back-off (dropping it would
forget the back-off: the next ask would clone at once).

A repository is removed by one rename of repos/<key> to
repos/.dropped-<key>-..., taken under its mirror lock (bounded wait: a fetch
keeps it) and every clone lock that exists (tried, never waited on), then
deleted. An asker after the rename finds no store and starts anew; a clone
started in the milliseconds between the look and the rename (a clone lock
we do not hold, held) gets its store renamed back. A removal killed midway
leaves repos/.dropped-*, which the next gc deletes.

Decisions are eviction.py's (pure); this module gathers the facts and applies them.
"""

from __future__ import annotations

import contextlib
import os
import time

import attrs

from checkoutcache.store import locks, records
from checkoutcache.store.checkouts import GONE, HELD, Removal, move_checkout_aside, remove_tree
from checkoutcache.store.inventory import RepoInfo
from checkoutcache.store.layout import RepoPaths, RootPaths, commit_of, entries
from checkoutcache.store.sizes import disk_usage
from checkoutcache.upkeep.eviction import GRACE, RepoEntry, idle_seconds

CHECKOUTS = "checkouts"
CLONING = "cloning"
BORROWED = "borrowed"
MIRROR_BUSY = "mirror-busy"
HISTORY = "history"  # the background history of its mirror is running (clone/history.py)
BACKING_OFF = "backing-off"


def note_last_use(paths: RepoPaths, at: float | None) -> None:
    """Keep the latest last use of an evicted checkout as the repository's own."""
    if at is None:
        return
    record = records.read_json(paths.last_use_record, records.LAST_USE) or {}
    if at > float(record.get("at", 0.0)):
        records.write_json(paths.last_use_record, {"at": at})


def repo_last_use(info: RepoInfo) -> float:
    """The repository's last use: its checkouts' latest, or the latest evicted one's; a store
    that never had any: when it was made (a first clone about to start). A failure is no use
    (asks for commits that do not exist would keep an idle repository for good); while its
    back-off runs it keeps the repository otherwise (backing_off)."""
    paths = info.paths
    uses = [c.last_used for c in info.checkouts if c.last_used is not None]
    record = records.read_json(paths.last_use_record, records.LAST_USE)
    if record is not None:
        uses.append(float(record["at"]))
    if uses:
        return max(uses)
    try:
        return os.lstat(paths.repo_json).st_mtime
    except OSError:
        return 0.0


def repo_busy(info: RepoInfo, borrowed_keys: frozenset[str]) -> str | None:
    """What keeps a repository whole whatever a limit or --force says (None: nothing)."""
    if any(c.held for c in info.checkouts):
        return HELD
    if info.checkouts or entries(info.paths.checkouts_dir):  # published or not yet marked
        return CHECKOUTS
    if any(c.alive for c in info.clones) or any(locks.clone_running(info.paths, n)
                                                for n in info.paths.clone_lock_names()):
        return CLONING
    if info.key in borrowed_keys:
        return BORROWED
    return None


def backing_off(info: RepoInfo, now: float) -> str | None:
    """BACKING_OFF while one of the repository's failures is within its back-off: dropping
    the store would forget it, and the next ask would clone at once instead of answering the
    failure until its retry time. Keeps it from gc alone (an operator's `evict REPO` is the
    way to forget a back-off by hand)."""
    return BACKING_OFF if any(now < failure.retry_at for failure in info.failures.values()) else None


def borrowed_keys_of(repos: list[RepoInfo]) -> frozenset[str]:
    """The keys of mirrors any checkout or running clone borrows objects from (submodules)."""
    return frozenset(key for info in repos for item in (*info.checkouts, *info.clones)
                     for key, _sha in item.borrows)


def repo_entry(info: RepoInfo, borrowed_keys: frozenset[str], with_size: bool = True) -> RepoEntry:
    return RepoEntry(repo=info.key, last_used=repo_last_use(info),
                     size=disk_usage(info.paths.base) if with_size else 0,
                     busy=repo_busy(info, borrowed_keys) or backing_off(info, time.time()))


@contextlib.contextmanager
def _all_clone_locks(paths: RepoPaths):
    """Every existing clone lock of the repository, tried: yields the names held (None if one
    is someone else's: a clone is running)."""
    with contextlib.ExitStack() as stack:
        names = set()
        for name in paths.clone_lock_names():
            held = locks.existing_clone_of(paths, name)
            if held is None:
                if os.path.exists(paths.clone_lock(name)):
                    yield None
                    return
                continue
            stack.enter_context(held)
            names.add(name)
        yield names


@attrs.frozen
class Dropped:
    kept: str | None  # why it stayed (None: removed)
    removal: Removal | None = None


def drop_repository(root_paths: RootPaths, key: str, borrowed_keys: frozenset[str], dry_run: bool = False,
                    mirror_wait: float = locks.MIRROR_WAIT_FOR_GC, by_hand: bool = False) -> Dropped:
    """Remove one whole repository if nothing is in it (re-checked under its locks); gc's
    drop (not by_hand) also keeps one whose failure is within its back-off."""
    from checkoutcache.store.inventory import NO_SIZES, repo_info

    paths = root_paths.repo(key)
    if not os.path.isdir(paths.base):
        return Dropped(GONE)
    try:
        mirror_lock = locks.mirror_write(paths, timeout=mirror_wait)
    except locks.LockTimeout:
        return Dropped(MIRROR_BUSY)
    except FileNotFoundError:
        return Dropped(GONE)
    with mirror_lock:
        info = repo_info(paths, NO_SIZES)
        busy = repo_busy(info, borrowed_keys) or (None if by_hand else backing_off(info, time.time()))
        if busy is not None:
            return Dropped(busy)
        with _all_clone_locks(paths) as ours:
            if ours is None:
                return Dropped(CLONING)
            if entries(paths.checkouts_dir):  # a clone published between the look and the locks
                return Dropped(CHECKOUTS)
            history = locks.history_of(paths)  # tried, never waited for (locks nest history -> mirror)
            if history is None:
                return Dropped(HISTORY)
            if dry_run:
                history.release()
                return Dropped(None)
            slot = root_paths.dropped_repo_slot(key)
            with history:
                os.rename(paths.base, slot)
            moved = RepoPaths(slot)
            # A clone that began between the look and the rename holds a lock we do not: its
            # store goes back where it was (unless an asker made a new one there meanwhile).
            racing = [n for n in moved.clone_lock_names() if n not in ours and locks.clone_running(moved, n)]
            if racing and not os.path.lexists(paths.base):
                os.rename(slot, paths.base)
                return Dropped(CLONING)
    return Dropped(None, remove_tree(slot))


def remove_dropped_leftovers(root_paths: RootPaths) -> list[tuple[str, Removal]]:
    """Repositories a killed removal left renamed aside: deleted now."""
    return [(os.path.basename(path), remove_tree(path)) for path in root_paths.dropped_repos()]


# ------------------------------------------------------------------ by hand

@attrs.frozen
class EvictOne:
    name: str
    bytes: int = 0
    kept: str | None = None  # held, cloning, grace (None: removed)


def evict_checkouts(paths: RepoPaths, names: list[str], grace: float, force: bool,
                    now: float) -> list[EvictOne]:
    """Evict these checkouts by hand: never a held one or one being made; one used within
    the grace window only with force."""
    from checkoutcache.store.inventory import NO_SIZES, checkout_info

    done = []
    for name in names:
        if locks.clone_running(paths, name):
            done.append(EvictOne(name, kept=CLONING))
            continue
        info = checkout_info(paths, name, NO_SIZES)
        size = disk_usage(paths.checkout(name))

        def recheck(last_use: float) -> str | None:
            if not force and idle_seconds(last_use, time.time()) <= grace:
                return GRACE
            return None

        moved = move_checkout_aside(paths, name, "evicted", recheck)
        if moved.slot is None:
            if moved.kept != GONE:
                done.append(EvictOne(name, kept=moved.kept or HELD))
            continue
        note_last_use(paths, info.last_used)
        removal = remove_tree(moved.slot)
        done.append(EvictOne(name, bytes=removal.freed or size))
    return done


def run_evict(root_paths: RootPaths, key: str, sha: str | None, grace: float, force: bool) -> dict:
    """`checkoutcache evict`: the commit's checkouts (every cone), or the whole repository."""
    from checkoutcache.store.inventory import NO_SIZES, inventory, repo_info

    paths = root_paths.repo(key)
    now = time.time()
    answer: dict = {"key": key, "commit": sha, "force": force, "removed": [], "kept": [],
                    "repository_removed": False, "bytes_freed": 0}
    if not os.path.isdir(paths.base):
        answer["note"] = "the store holds nothing of this repository"
        return answer
    names = [n for n in paths.checkout_names() if sha is None or commit_of(n) == sha]
    for item in evict_checkouts(paths, names, grace, force, now):
        if item.kept is None:
            answer["removed"].append({"name": item.name, "bytes": item.bytes})
        else:
            answer["kept"].append({"name": item.name, "why": item.kept})
    # A clone running for the commit (or any, for the whole repository) is never stopped.
    answer["kept"] += [{"name": n, "why": CLONING} for n in paths.clone_lock_names()
                       if (sha is None or commit_of(n) == sha) and locks.clone_running(paths, n)
                       and n not in {k["name"] for k in answer["kept"]}]
    if sha is None and not answer["kept"]:
        borrowed = borrowed_keys_of([info for info in inventory(root_paths, sizes=NO_SIZES) if info.key != key])
        size = disk_usage(paths.base)
        dropped = drop_repository(root_paths, key, borrowed, mirror_wait=30.0, by_hand=True)
        if dropped.kept is None:
            answer["repository_removed"] = True
            answer["removed"].append({"name": "(repository)", "bytes": dropped.removal.freed if dropped.removal
                                      else size})
        elif dropped.kept != GONE:
            answer["kept"].append({"name": "(repository)", "why": dropped.kept})
    elif sha is None:
        info = repo_info(paths, NO_SIZES)
        answer["kept_repository"] = repo_busy(info, frozenset()) or "checkouts"
    answer["bytes_freed"] = sum(r["bytes"] for r in answer["removed"])
    return answer
