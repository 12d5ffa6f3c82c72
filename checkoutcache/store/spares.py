"""Spares: evicted trees kept to be updated in place into a later commit's checkout.

A spare is never served and never a checkout. It comes to be in one way only:
gc evicts a checkout (store/checkouts.py move_checkout_aside, under the
marker's exclusive lock, after the same re-check as an eviction to trash/) and,
instead of trash/, renames it into spares/.new-<nonce>/tree beside its
spare.json, then renames that to spares/<name>.<nonce>. Only gc makes spares,
under gc.lock, so a .new-* entry is always a killed gc's and the next gc
trashes it. A reader that held the checkout's path before the eviction saw it
leave exactly as with an eviction to trash/: the tree is not in checkouts/.

It leaves in one of two ways: gc deletes it (to trash/, first of all when space
is short, or past CHECKOUTCACHE_MAX_SPARES), or a clone worker takes it by one
rename into its own scratch (scratch/.clone-*/spare). Two workers racing for
one spare: one rename wins, the other finds it gone and tries the next. From
the rename on, the spare is that worker's scratch, reaped with it when its
owner dies (invariant 3's owner lock rule): an interrupted update is never
served, never left behind.

Nothing in a spare's tree is trusted (clone/tree.py proves the updated tree
exact); spare.json, written by gc, says only which tree it was, the
identity of the index git wrote when that checkout was published, and what
its ready marker recorded of how its files were written (LFS, cone,
submodules, and the conversion digest of git/backend.py checkout_conversion:
a spare is only updated into a commit whose checkout would write alike).
"""

from __future__ import annotations

import time
from typing import Callable

import attrs

from checkoutcache.store import records, tree
from checkoutcache.store.checkouts import Moved, move_checkout_aside, to_trash
from checkoutcache.store.layout import RepoPaths, commit_of
from checkoutcache.testhooks import checkpoint


@attrs.frozen
class Spare:
    entry: str  # its name in spares/
    name: str  # the checkout it was (store/layout.py checkout_name)
    path: str
    record: dict = attrs.field(eq=False)

    @property
    def sha(self) -> str:
        return commit_of(self.name)

    @property
    def cone_digest(self) -> str:
        return self.name.partition("-")[2]

    @property
    def bytes(self) -> int:
        return int(self.record.get("bytes", 0))

    @property
    def spared_at(self) -> float:
        return float(self.record.get("spared_at", 0.0))


def list_spares(paths: RepoPaths) -> list[Spare]:
    """The finished spares of a repository, oldest first; one without a valid record is
    listed with an empty one (gc drops it: a worker never takes it)."""
    found = []
    for entry, name in paths.spare_entries():
        path = paths.spare_entry(entry)
        try:
            record = records.read_json(RepoPaths.spare_record(path), records.SPARE) or {}
        except OSError:
            record = {}
        found.append(Spare(entry, name, path, record))
    return sorted(found, key=lambda s: (s.spared_at, s.entry))


def spare_record_for(paths: RepoPaths, name: str, marker: dict, submodules_setting: str) -> dict | None:
    """What spare.json will say of checkout <name>; None when it cannot be a spare (no
    index identity was recorded when it was published: it is deleted as before)."""
    size = records.read_json(paths.size_record(name), records.SIZE) or {}
    if not size.get("index"):
        return None
    record = {"commit": commit_of(name), "name": name, "bytes": int(size.get("bytes", 0)),
              "index": list(size["index"]), "spared_at": time.time(),
              "submodules_setting": submodules_setting}
    for field in ("lfs", "submodules", "sparse", "conversion"):
        if marker.get(field) is not None:
            record[field] = marker[field]
    return record


def evict_to_spare(paths: RepoPaths, name: str, record: dict,
                   recheck: Callable[[float], str | None]) -> Moved:
    """gc's eviction of checkouts/<name> into spares/ (the same lock and re-check as
    into trash/). Its slot is the finished spare's path."""
    tree.make_dirs(paths.spares_dir)  # each directory resolved beneath the root, never through a symlink
    making = paths.spare_in_making()
    tree.mkdir(making)
    records.write_json(RepoPaths.spare_record(making), record)

    def into(checkout: str) -> str | None:
        try:
            tree.rename(checkout, RepoPaths.spare_tree(making))
        except FileNotFoundError:
            return None
        return making

    try:
        moved = move_checkout_aside(paths, name, "evicted", recheck, into=into)
    except BaseException:
        to_trash(paths, making, "spare")
        raise
    if moved.slot is None:
        to_trash(paths, making, "spare")
        return moved
    checkpoint("gc-after-spare-rename")
    final = paths.spare_slot(name)
    tree.rename(making, final)
    return Moved(slot=final)


def drop_spare(paths: RepoPaths, spare: Spare) -> str | None:
    """Rename a spare into trash/ (None: a worker took it meanwhile)."""
    return to_trash(paths, spare.path, "spare")


def drop_unfinished(paths: RepoPaths) -> list[str]:
    """Trash the spares a killed gc was making (only gc makes them: call under gc.lock)."""
    return [slot for slot in (to_trash(paths, path, "spare") for path in paths.spares_in_making()) if slot]


def take_spare(paths: RepoPaths, spare: Spare, scratch: str) -> str | None:
    """Rename a spare into our scratch (it is ours from now on); None if another took it."""
    target = RepoPaths.scratch_spare(scratch)
    try:
        tree.rename(spare.path, target)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return target
