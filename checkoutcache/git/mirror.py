"""What killed or failed git processes leave in a mirror, found and removed from
what is on disk: lock files (`*.lock`), temporary packs (`tmp_pack_*`,
`tmp_idx_*`, `.tmp-*` of a repack), temporary loose objects (`tmp_obj_*`) and
partial fetches' quarantines (`objects/tmp_objdir-checkoutcache-*`), and
`pack-*.keep` files (git writes one while a fetch's pack is not yet
referenced, and removes it after; a fetch killed in between leaves it, and
that pack then survives every gc: once its `.keep` is removed a repack is
due, which drops it), and the partial downloads git-lfs keeps in
lfs/incomplete/.

A `.keep` names its owner: git's fetch-pack writes "fetch-pack <pid> on
<host>" (receive-pack "receive-pack <pid> on <host>") when it asks index-pack
to keep the pack, and removes the file once the refs point into the pack. So
a `.keep` is judged by its owner where we can see it (keep_owner): one of this
host whose process is gone (no such pid, a zombie, or a process that started
after the `.keep` was written, or one that is not git) is stale at once,
whatever its age: a gc right after the kill reclaims it. One whose owner is a
live git process here is never removed, however old (an operator's long fetch
outside our locks). One of another host, or naming nobody, falls back to the
age rule below. What cannot be seen: a git in another PID namespace under the
same host name that does not take our mirror lock (a container of one pod
writing the mirror by hand); every fetch of ours holds the mirror lock, so it
never has a `.keep` while we hold it.

Every function here must be called with the repository's mirror lock held
(locks/mirror.lock): git's own lock files are not enough, since two fetches
into one mirror race on shallow.lock/HEAD.lock, and under our lock no writer
of ours can own any of these files. Invariant 5 (nothing done to the mirror
breaks a checkout) is kept by the keep-refs (backend.py).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import time
from typing import Callable

from checkoutcache.store import records, tree
from checkoutcache.store.layout import QUARANTINE_PREFIX, RepoPaths
from checkoutcache.store.liveness import process_start_time

# A leftover younger than this may belong to a git process that is still
# running outside our lock discipline (an operator's own `git` in the mirror);
# one older than this under our held mirror lock is a killed process's.
STALE_GIT_LOCK_AGE = 5.0
_LOCK_DIRS = ("", "refs", "objects/info", "objects/pack", "logs")
_PACK_LEFTOVER = re.compile(r"^(tmp_pack_|tmp_idx_|tmp_rev_|\.tmp-).*|^pack-[0-9a-f]{40,64}\.keep$")


def git_lock_files(mirror: str) -> list[str]:
    """Every git *.lock file in the mirror (relative paths)."""
    found = []
    for top in _LOCK_DIRS:
        start = os.path.join(mirror, top) if top else mirror
        walker = os.walk(start) if top == "refs" else [(start, [], _files(start))]
        for directory, _dirs, files in walker:
            found += [os.path.relpath(os.path.join(directory, name), mirror) for name in files
                      if name.endswith(".lock")]
    return found


def pack_leftovers(mirror: str) -> list[str]:
    """Temporary packs and stale .keep files in objects/pack, and temporary loose
    objects (objects/tmp_obj_*, objects/xx/tmp_obj_*), as relative paths."""
    found = [os.path.join("objects", "pack", name) for name in _files(os.path.join(mirror, "objects", "pack"))
             if _PACK_LEFTOVER.match(name)]
    for directory in ["", *(f"{n:02x}" for n in range(256))]:
        found += [os.path.join("objects", directory, name)
                  for name in _files(os.path.join(mirror, "objects", directory)) if name.startswith("tmp_obj_")]
    return found


LIVE, GONE = "live", "gone"
# What git writes in a .keep it will remove itself (fetch-pack.c, receive-pack.c).
_KEEP_OWNER = re.compile(rb"^(?:fetch-pack|receive-pack|index-pack) ([0-9]{1,10}) on (.+)$")
_KEEP_READ = 512
# /proc's start time is whole-second boot time plus ticks (at most a second early) against
# the .keep's mtime: a process that started later than this after it was written is not its owner.
_START_SLACK = 2.0


def keep_owner(path: str, written_at: float) -> str | None:
    """Whether the process a `.keep` names still owns it: LIVE (a git process of this host
    that started before the file was written), GONE (one of this host that is not), or None
    (another host, or no owner named: only its age tells). Opened beneath the root without
    following a link or blocking (a FIFO planted there is no owner of anything)."""
    try:
        fd = tree.open_file(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, _KEEP_READ)
    except OSError:
        return None
    finally:
        os.close(fd)
    found = _KEEP_OWNER.match(text.strip())
    if found is None or os.fsdecode(found.group(2)).strip() != socket.gethostname():
        return None
    pid = int(found.group(1))
    started = process_start_time(pid)
    if started is None or started > written_at + _START_SLACK or not _is_git(pid):
        return GONE
    return LIVE


def _is_git(pid: int) -> bool:
    """Whether the process runs git (`git`, or one of its `git-*` helpers by their names)."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as handle:
            return handle.read().strip().startswith(b"git")
    except OSError:
        return False


def remove_stale_leftovers(mirror: str, now: float | None = None, min_age: float = STALE_GIT_LOCK_AGE) -> list[str]:
    """Delete lock files, temporary packs and .keep files killed or failed git processes left.

    min_age spares a very young one that an operator's own git may hold; a write
    that then fails with lock files present clears them all (min_age=0) and retries.
    A `.keep` is judged by the owner it names first (keep_owner): a gone one's goes at
    any age, a live one's never, whatever min_age says.
    """
    now = time.time() if now is None else now
    removed = []
    for relative in git_lock_files(mirror) + pack_leftovers(mirror):
        path = os.path.join(mirror, relative)
        try:  # beneath the root: a directory of the mirror swapped for a symlink is refused, never followed
            written_at = tree.lstat(path).st_mtime
            owner = keep_owner(path, written_at) if relative.endswith(".keep") else None
            if owner == LIVE:
                continue
            if owner == GONE or now - written_at >= min_age:
                tree.unlink(path, missing_ok=False)
                removed.append(relative)
        except (FileNotFoundError, NotADirectoryError):
            pass
    # A partial fetch's quarantine (git/quarantine.py) a killed fetch left: under our lock no
    # fetch of ours owns one, and the mirror never read it.
    objects = os.path.join(mirror, "objects")
    for name in _quarantines(objects):
        path = os.path.join(objects, name)
        try:  # beneath the root, as above; rmtree itself never follows a symlink inside
            if now - tree.lstat(path).st_mtime >= min_age:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(os.path.join("objects", name))
        except (FileNotFoundError, NotADirectoryError):
            pass
    return removed


def _quarantines(objects: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(objects) if e.name.startswith(QUARANTINE_PREFIX)
                and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


# ------------------------------------------------------------ LFS partial downloads
# git-lfs keeps a failed download in lfs/incomplete/ to resume it later; a server that
# sends more than a pointer says (or wrong bytes) would fill the disk across retries.
# Every download runs under the mirror lock, so under it a partial one is a finished
# attempt's: the worker removes its own at once, gc those an hour old (a review's own
# `git lfs pull` in a trusted-peers store may still be writing a younger one).
STALE_LFS_PARTIAL_AGE = 3600.0


def remove_lfs_partials(paths: RepoPaths, oids: set[str] | None = None, min_age: float = 0.0,
                        now: float | None = None) -> tuple[int, int]:
    """Delete partial LFS downloads (of these oids; all with None) at least min_age old:
    (how many, bytes). Caller holds the mirror lock."""
    now = time.time() if now is None else now
    removed = freed = 0
    for name in _files(paths.lfs_incomplete):
        if oids is not None and name[:64] not in oids:
            continue
        path = os.path.join(paths.lfs_incomplete, name)
        try:  # beneath the root: lfs/ swapped for a symlink is refused, never followed
            info = tree.lstat(path)
            if now - info.st_mtime < min_age:
                continue
            tree.unlink(path, missing_ok=False)
        except (FileNotFoundError, NotADirectoryError):
            continue
        removed += 1
        freed += info.st_size
    return removed, freed


def remove_stale_leftovers_of(paths: RepoPaths, min_age: float = STALE_GIT_LOCK_AGE) -> list[str]:
    """remove_stale_leftovers of a repository's mirror, by a worker: a pack whose `.keep`
    goes (a killed fetch's) is dropped only by a repack, so the next gc's is due."""
    removed = remove_stale_leftovers(paths.mirror, min_age=min_age)
    if any(name.endswith(".keep") for name in removed):
        note_repack_due(paths)
    return removed


def note_repack_due(paths: RepoPaths) -> None:
    """Make gc's next mirror maintenance repack (state/mirror-gc.json pending). Caller
    holds the mirror lock, as gc does when it writes the same record."""
    stamp = records.read_json(paths.mirror_gc_stamp, records.MIRROR_GC) or {}
    records.write_json(paths.mirror_gc_stamp, {**stamp, "at": stamp.get("at", 0.0), "pending": True})


def _files(directory: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(directory) if e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return []


# ------------------------------------------------------------ partial mirrors
# A partial mirror (CHECKOUTCACHE_FILTER) keeps every object in promisor packs
# (pack-<id>.promisor beside pack-<id>.pack): git's gc drops an object of a
# non-promisor pack that only promisor commits reach (benchmarks/MONOREPO.md A4).
# Every fetch into one is filtered (then git writes its pack as a promisor pack);
# what a bundle's take-in writes is marked here.

def packs_without_promisor(mirror: str) -> list[str]:
    pack_dir = os.path.join(mirror, "objects", "pack")
    return [name[:-len(".pack")] for name in _files(pack_dir)
            if name.startswith("pack-") and name.endswith(".pack")
            and not os.path.exists(os.path.join(pack_dir, name[:-len(".pack")] + ".promisor"))]


def mark_packs_promisor(mirror: str) -> int:
    """Mark every pack of the mirror a promisor pack (an empty .promisor file, as git's own
    are when they list no refs); how many were marked."""
    pack_dir = os.path.join(mirror, "objects", "pack")
    marked = 0
    for base in packs_without_promisor(mirror):
        with open(os.path.join(pack_dir, base + ".promisor"), "w"):
            marked += 1
    return marked


def unmark_promisor_packs(mirror: str) -> None:
    """The fallback when the server ignored the filter on a new mirror's first fetch: its
    packs are complete, so they stop being promisor packs (a full mirror again)."""
    pack_dir = os.path.join(mirror, "objects", "pack")
    for name in _files(pack_dir):
        if name.endswith(".promisor"):
            os.unlink(os.path.join(pack_dir, name))


def has_promisor_packs(objects_dir: str) -> bool:
    """Whether a mirror's objects come (in part) from promisor packs: a partial mirror."""
    return any(name.endswith(".promisor") for name in _files(os.path.join(objects_dir, "pack")))


def install_new_mirror(paths: RepoPaths, backend, workdir: str, filter: str | None = None,
                       fill: Callable[[str], None] | None = None) -> None:
    """The one way a repository's mirror comes to be (a clone's, or `bundle publish`'s):
    made in workdir (the caller's scratch), filled there (bundles taken in), then renamed
    into place in one step, so a process killed on the way leaves no mirror, never half of
    one. A partial one (filter) keeps only promisor packs, whatever the filling wrote."""
    build = RepoPaths.scratch_mirror(workdir)
    backend.init_mirror(build, filter)
    if fill is not None:
        fill(build)
    if filter is not None:
        # A bundle's take-in writes an ordinary pack: as a promisor pack it survives gc
        # (benchmarks/MONOREPO.md A6).
        mark_packs_promisor(build)
    tree.rename(build, paths.mirror)
