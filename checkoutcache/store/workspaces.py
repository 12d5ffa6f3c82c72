"""Workspaces on disk: a review's own writable trees, who owns each, and how dead
ones are reaped (DESIGN invariant 16: "a review that must write gets a workspace
of its own"; invariant 3's owner-lock rule, applied to them).

The directory (CHECKOUTCACHE_WORKSPACES; layout.WorkspacePaths draws it) is the
review's, not the store's: in the one-writer topology the review cannot write
the root, so its workspaces live on a volume it owns, which the writer's gc may
see read-only. Rules:

- An entry named `ws-<pid>-<nonce>` is made under `.making-<pid>-<nonce>`: its
  owner takes owner.lock inside it and writes owner.json, and only then renames
  it into place. So every `ws-*` had its lock held from before it appeared, and
  a free lock means its owner is dead (SIGKILL included: flock dies with it).
- The lock is the authority. pid and start time in owner.json are evidence for
  a person and for `workspace remove` (which signals a keeper it can prove is
  the one recorded), never a reason to delete.
- A dead workspace is reaped by whoever takes its free lock and may delete it:
  the uid that owns it (its next workspace call) or root, or gc running as that
  uid. The reaper keeps the lock while it renames the entry to
  `.trash-<pid>-<nonce>` (one rename: a workspace is whole or gone), then
  deletes it. A `.making-*` whose lock is free and that is older than
  MAKING_AGE is a maker killed before its rename; `.trash-*` is anyone's to
  finish deleting.
- Nothing here writes the cache root: a workspace is made from a ready
  checkout (cache-level code, workspaces.py) that is only read.
"""

from __future__ import annotations

import os
import stat
import time

import attrs

from checkoutcache.store import locks, records
from checkoutcache.store.checkouts import Removal, remove_tree
from checkoutcache.store.create import make_dirs
from checkoutcache.store.layout import WORKSPACE_NAME, WorkspacePaths, entries
from checkoutcache.store.liveness import own_identity, pid_namespace
from checkoutcache.store.modes import make_dir

# Far longer than the few system calls between a maker's mkdir and its rename.
MAKING_AGE = 3600.0

WORKSPACE_RECORD = records.schema(
    {"pid": records.count, "start_time": records.finite, "root": records.text, "key": records.key,
     "commit": records.sha, "name": records.text, "created_at": records.finite},
    {"pidns": records.text, "uid": records.count, "repo": records.text, "source": records.text,
     "owner_pid": records.count, "owner_start_time": records.finite, "keeper": records.one_of(True, False),
     "bytes": records.count})


@attrs.frozen
class WorkspaceFacts:
    name: str
    path: str  # the workspace's directory (ws-<pid>-<nonce>)
    tree: str  # its work tree, the path a caller was given
    alive: bool  # its owner.lock is held (or unreadable: never reaped on a guess)
    uid: int | None  # the uid that owns the entry
    record: dict  # owner.json, {} when unreadable


def workspace_facts(paths: WorkspacePaths, problems: list[dict] | None = None) -> list[WorkspaceFacts]:
    """Every published workspace (no lock kept: a snapshot). The directory is the review's:
    an owner.lock or owner.json that cannot be read, or is not a regular file (a FIFO it
    made, whose plain open would block for ever), leaves that workspace alive as far as we
    know (never reaped on a guess), read no further, and noted in problems."""
    found = []
    for name in entries(paths.base):
        if not WORKSPACE_NAME.fullmatch(name):
            continue
        path = paths.workspace(name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode):
            continue  # a symlink or file by a workspace's name: no workspace, never followed
        try:
            record = records.read_json(paths.owner_json(path), WORKSPACE_RECORD) or {}
            alive = locks.is_locked(paths.owner_lock(path))
        except OSError as exc:
            record, alive = {}, True
            note_problem(problems, exc, "its owner files cannot be read: left as it is")
        found.append(WorkspaceFacts(name=name, path=path, tree=paths.tree(path), alive=alive, uid=info.st_uid,
                                    record=record))
    return found


def note_problem(problems: list[dict] | None, exc: OSError, why: str) -> None:
    """One entry of a workspaces directory that cost itself only (gc's and status's problems)."""
    if problems is not None:
        problems.append({"path": str(exc.filename), "error": records.errno_name(exc),
                         "why": f"{why} ({exc.strerror or exc})"[:200]})


@attrs.define
class Made:
    """A workspace being made: its directory under its .making- name, and its held owner lock."""

    paths: WorkspacePaths
    path: str
    final: str
    owner_lock: locks.Lock

    @property
    def tree(self) -> str:
        return self.paths.tree(self.path)


def begin(paths: WorkspacePaths, record: dict) -> Made:
    """A fresh .making- directory with its owner lock held and owner.json written (the
    fields of record plus our identity). OSError if the directory cannot be written."""
    make_dirs(paths.base)
    pid, start_time = own_identity()
    nonce = os.urandom(6).hex()
    path = paths.making(pid, nonce)
    make_dir(path)
    owner_lock = locks.try_lock(paths.owner_lock(path))
    if owner_lock is None:  # pragma: no cover - nobody else knows this fresh name
        raise RuntimeError(f"the fresh workspace lock in {path} is held")
    try:
        records.write_json(paths.owner_json(path), {**record, "pid": pid, "start_time": start_time,
                                                    "pidns": pid_namespace(), "uid": os.geteuid(),
                                                    "created_at": time.time()})
    except BaseException:
        discard(paths, path, owner_lock)
        raise
    return Made(paths, path, paths.workspace(f"ws-{pid}-{nonce}"), owner_lock)


def publish(made: Made) -> str:
    """Rename the made workspace into place (its lock travels with the inode); its tree's path."""
    os.rename(made.path, made.final)
    made.path = made.final
    return made.tree


def discard(paths: WorkspacePaths, path: str, owner_lock: locks.Lock | None) -> Removal:
    """Remove a workspace whose lock we hold: renamed aside first (whole or gone), then deleted;
    the lock is released last."""
    try:
        slot = paths.trash_slot()
        try:
            os.rename(path, slot)
        except FileNotFoundError:
            return Removal()
        return remove_tree(slot)
    finally:
        if owner_lock is not None:
            owner_lock.release()


@attrs.frozen
class Reaped:
    name: str
    bytes: int
    commit: str | None
    left: list  # what could not be deleted (store.checkouts.Unremovable)


@attrs.frozen
class NotReaped:
    name: str
    uid: int | None
    why: str


def may_delete(uid: int | None) -> bool:
    """Only the uid that owns a workspace (or root) deletes it: another uid could rename it
    but not empty it, and would leave a half-deleted tree nobody can finish."""
    euid = os.geteuid()
    return euid == 0 or uid == euid


def reap_dead(paths: WorkspacePaths, now: float | None = None,
              problems: list[dict] | None = None) -> tuple[list[Reaped], list[NotReaped]]:
    """Reap every dead workspace this process may delete; list the dead ones it may not.
    An owner.lock that is not a regular file (layout.NotAFile) or cannot be opened is never
    waited on: that entry is skipped and noted in problems."""
    now = time.time() if now is None else now
    reaped: list[Reaped] = []
    left: list[NotReaped] = []
    for name in entries(paths.base):
        path = paths.workspace(name)
        is_trash = name.startswith(paths.TRASH_PREFIX)
        is_making = name.startswith(paths.MAKING_PREFIX)
        if not (WORKSPACE_NAME.fullmatch(name) or is_trash or is_making):
            continue  # not ours: never touched
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode):
            continue  # a symlink or file by such a name: nothing of ours, never followed
        if not may_delete(info.st_uid):
            try:
                dead = WORKSPACE_NAME.fullmatch(name) and not locks.is_locked(paths.owner_lock(path))
            except OSError as exc:
                note_problem(problems, exc, "its owner.lock cannot be locked: left as it is")
                continue
            if dead:
                left.append(NotReaped(name, info.st_uid, f"dead; only uid {info.st_uid} (its owner) or root may "
                                                           f"delete it: its next workspace call does"))
            continue
        if is_trash:
            removal = remove_tree(path)
            reaped.append(Reaped(name, removal.freed, None, removal.unremovable))
            continue
        if is_making and now - info.st_mtime < MAKING_AGE:
            continue
        try:
            lock = locks.try_lock(paths.owner_lock(path), create=False)
        except OSError as exc:
            note_problem(problems, exc, "its owner.lock cannot be locked: left as it is")
            continue  # a lock we may not even open (or a FIFO): never reaped on a guess
        if lock is None and os.path.lexists(paths.owner_lock(path)):
            continue  # its owner lives
        record = {}
        try:
            record = records.read_json(paths.owner_json(path), WORKSPACE_RECORD) or {}
        except OSError as exc:
            note_problem(problems, exc, "its owner.json cannot be read")
        try:
            removal = discard(paths, path, lock)
        except OSError as exc:  # a read-only view of the directory (the writer's gc in the pod)
            left.append(NotReaped(name, info.st_uid, f"dead; cannot be deleted here: {exc.strerror}"))
            continue
        reaped.append(Reaped(name, removal.freed, record.get("commit"), removal.unremovable))
    return reaped, left


def find(paths: WorkspacePaths, given: str) -> str | None:
    """The workspace directory a caller names by its tree's path (what it was given) or
    its own; None if it names none in this directory. Only names are compared: nothing
    the caller passes is opened."""
    given = os.path.abspath(given)
    for candidate in (given, os.path.dirname(given)):
        if os.path.dirname(candidate) == paths.base and WORKSPACE_NAME.fullmatch(os.path.basename(candidate)) \
                and (candidate == given or os.path.basename(given) == WorkspacePaths.TREE):
            return candidate if os.path.isdir(candidate) else None
    return None
