"""Scratch directories: where clones are made, and how dead ones are reaped.

Invariant 3. A clone's scratch is scratch/.clone-<pid>-<nonce>: a fresh name
for every clone, so two owners with equal pids (two PID namespaces on one
volume) never share or collide on one. Its owner creates it under
locks/scratch.lock, takes owner.lock inside it for its whole life, and records
its pid, process start time and PID namespace in owner.json before releasing
scratch.lock. The reaper, under the same scratch.lock, removes a scratch
directory only when owner.lock is free: the lock is the authority. Pid and
start time add evidence only in the owner's own namespace. A live clone is
never touched, however old, by whoever asks. Removal is a rename into trash/
(instant, atomic) followed by deletion.
"""

from __future__ import annotations

import os
import time

import attrs

from checkoutcache.store import locks, records, tree
from checkoutcache.store.checkouts import remove_tree, to_trash
from checkoutcache.store.layout import RepoPaths, entries
from checkoutcache.store.liveness import (
    is_alive,
    own_identity,
    pid_namespace,
    same_pid_namespace,
)


@attrs.define
class Scratch:
    path: str
    owner_lock: locks.Lock

    @property
    def tree(self) -> str:
        return RepoPaths.scratch_tree(self.path)

    def discard(self) -> None:
        """Remove our own scratch. Safe without scratch.lock: nobody else touches a live owner's."""
        remove_tree(self.path)
        self.owner_lock.release()


def create_scratch(paths: RepoPaths, commit: str) -> Scratch:
    pid, start_time = own_identity()
    with locks.scratch_change(paths):
        path = paths.scratch_dir_for(pid, os.urandom(6).hex())
        tree.mkdir(path)
        owner_lock = locks.try_lock(paths.scratch_owner_lock(path))
        if owner_lock is None:  # pragma: no cover - a fresh directory's lock cannot be held
            raise RuntimeError(f"fresh scratch lock {path} is held")
        records.write_json(paths.scratch_owner_json(path),
                           {"pid": pid, "start_time": start_time, "pidns": pid_namespace(), "commit": commit,
                            "created_at": time.time()})
    return Scratch(path, owner_lock)


@attrs.frozen
class ScratchFacts:
    name: str
    pid: int | None
    commit: str | None
    owner_alive: bool
    lock_held: bool

    @property
    def dead(self) -> bool:
        return not self.lock_held and not self.owner_alive


def scratch_facts(paths: RepoPaths) -> list[ScratchFacts]:
    """A snapshot of every scratch directory and whether its owner lives (no lock taken).
    One a peer made unreadable counts as live: it is never reaped on a guess."""
    facts = []
    for name in entries(paths.scratch_dir):
        pid = RepoPaths.scratch_pid(name)
        path = paths.scratch_entry(name)
        try:
            owner = records.read_json(RepoPaths.scratch_owner_json(path), records.OWNER) or {}
            held = locks.is_locked(RepoPaths.scratch_owner_lock(path))
        except OSError:
            owner, held = {}, True
        facts.append(ScratchFacts(name=name, pid=pid, commit=owner.get("commit"),
                                  owner_alive=_owner_alive(pid, owner, path), lock_held=held))
    return facts


def _owner_alive(pid: int | None, owner: dict, path: str) -> bool:
    if pid is None:
        return False  # not a name we create: nobody owns it
    if not same_pid_namespace(owner.get("pidns")):
        return False  # pid evidence means nothing here; only the owner lock counts
    if owner.get("pid") == pid and "start_time" in owner:
        return is_alive(pid, owner["start_time"])
    # No owner record: its owner died between mkdir and writing it (both happen
    # under scratch.lock, which we hold). Treat it as dead.
    return False


def reap_dead_scratch(paths: RepoPaths, dry_run: bool = False) -> list[tuple[str, str]]:
    """Move every dead owner's scratch to trash/; return (name, trash path) of each."""
    reaped = []
    if not tree.is_dir(paths.scratch_dir):
        return reaped
    with locks.scratch_change(paths):
        for fact in scratch_facts(paths):
            if not fact.dead:
                continue
            if dry_run:
                reaped.append((fact.name, ""))
                continue
            slot = to_trash(paths, paths.scratch_entry(fact.name), "scratch")
            if slot is not None:
                reaped.append((fact.name, slot))
    return reaped
