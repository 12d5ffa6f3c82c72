"""Checkouts on disk: the one home of how a checkout appears and leaves.

- Publishing (invariant 1): the built tree is renamed to checkouts/<name> in
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
import stat
import time
from typing import Callable

import attrs

from checkoutcache.errors import CheckoutCacheError
from checkoutcache.store import locks, records, tree
from checkoutcache.store.layout import RepoPaths, commit_of, entries
from checkoutcache.store.ready import SHARED_LOCK_WAIT, looks_intact, top_names
from checkoutcache.testhooks import checkpoint

HELD = "held"
GONE = "gone"


def write_ready_marker(marker: str, sha: str, top: list[str], extra: dict | None = None) -> None:
    records.write_json(marker, {"commit": sha, "published_at": time.time(), "pid": os.getpid(), "top": top,
                                **(extra or {})})


def is_published(paths: RepoPaths, name: str) -> bool:
    """Marked and intact (the ready path's cheap check), without touching it."""
    record = records.read_json(paths.ready_marker(name), records.MARKER)
    return record is not None and looks_intact(paths.checkout(name), record)


def publish(paths: RepoPaths, built: str, name: str, extra: dict | None = None) -> bool:
    """Rename the built tree to checkouts/<name>, then write the ready marker
    (with extra: what the answer says of the checkout's LFS files).

    Returns False if another clone had already published (ours is discarded).
    Runs under the commit's clone lock, so a target without a marker can only be
    a dead worker's interrupted publish, and one that fails the integrity check
    was damaged: either is moved aside and replaced, unless a running command
    holds it.
    """
    target = paths.checkout(name)
    top = top_names(built)
    if tree.lexists(target):
        if is_published(paths, name):
            return False
        # Askers looking at the damaged checkout take its marker's shared lock for a moment each
        # (ready_record): only a lock held past that is a running command's.
        deadline = time.monotonic() + SHARED_LOCK_WAIT
        moved = move_checkout_aside(paths, name, "replaced", clone_lock_held=True)
        while moved.kept == HELD and time.monotonic() < deadline:
            time.sleep(0.02)
            moved = move_checkout_aside(paths, name, "replaced", clone_lock_held=True)
        if moved.kept == HELD:
            raise CheckoutCacheError("CLONE_FAILED", detail="a damaged checkout of this commit is held by a "
                                                            "running command; it is replaced once that ends")
    try:
        with tree.parent_of(built) as (src_fd, src), tree.parent_of(target) as (dst_fd, dst):
            os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise
    checkpoint("after-rename")
    write_ready_marker(paths.ready_marker(name), commit_of(name), top, extra)
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
        tree.rename(path, slot)
    except FileNotFoundError:
        return None
    return slot


def move_checkout_aside(paths: RepoPaths, name: str, why: str,
                        recheck: Callable[[float], str | None] | None = None,
                        clone_lock_held: bool = False,
                        into: Callable[[str], str | None] | None = None) -> Moved:
    """Rename checkouts/<name> into trash/ under its marker's exclusive lock.

    recheck(last_use) runs under the lock (look, lock, look again) and may
    return a reason to keep the checkout after all. A checkout without a
    marker is moved only by a caller holding the commit's clone lock: anyone
    else might catch a worker between its rename and its marker.
    into(path): where a marked checkout goes instead of trash/ (gc keeping it as a
    spare, store/spares.py): one rename, returning the new place or None if it is gone.
    """
    marker = paths.ready_marker(name)
    exclusive = locks.checkout_exclusive(marker)
    if exclusive is None:
        if tree.lexists(marker):
            return Moved(kept=HELD)  # a reader or a running command holds it
        if not clone_lock_held:
            return Moved(kept=GONE)
        slot = to_trash(paths, paths.checkout(name), f"{why}-{name}")  # unmarked: nobody reads it
        return Moved(slot=slot) if slot else Moved(kept=GONE)
    with exclusive:
        try:
            last_use = tree.lstat(marker).st_mtime
        except (FileNotFoundError, NotADirectoryError):
            return Moved(kept=GONE)
        reason = recheck(last_use) if recheck is not None else None
        if reason is not None:
            return Moved(kept=reason)
        slot = into(paths.checkout(name)) if into is not None else \
            to_trash(paths, paths.checkout(name), f"{why}-{name}")
    return Moved(slot=slot) if slot else Moved(kept=GONE)


def move_held_checkout_aside(paths: RepoPaths, name: str, recheck: Callable[[float], str | None]) -> Moved:
    """Rename checkouts/<name> into trash/ though a reader's lock holds it (gc, past the bounds
    on readers' holds: upkeep/eviction.py), so without the marker's exclusive lock. What that
    lock gave a ready answer (invariant 4) is kept by looking twice: recheck(last_use) just
    before the rename, and the marker's mtime after it; a use recorded between the two
    (a ready answer touches it under its shared lock) puts the checkout back at once."""
    marker = paths.ready_marker(name)
    try:
        before = tree.lstat(marker)
    except (FileNotFoundError, NotADirectoryError):
        return Moved(kept=GONE)
    reason = recheck(before.st_mtime)
    if reason is not None:
        return Moved(kept=reason)
    slot = to_trash(paths, paths.checkout(name), f"held-{name}")
    if not slot:
        return Moved(kept=GONE)
    try:
        after = tree.lstat(RepoPaths.ready_marker_in(slot))
    except OSError:
        after = before
    if after.st_mtime_ns != before.st_mtime_ns:  # used between our look and the rename
        try:
            tree.rename(slot, paths.checkout(name))  # a directory never replaces a non-empty one
            return Moved(kept="used-meanwhile")
        except OSError:
            pass  # another checkout of the commit was published meanwhile: this one goes
    return Moved(slot=slot)


@attrs.frozen
class Unremovable:
    """Something remove_tree could not delete: its path relative to what was
    removed ("" for that itself; bytes that are not UTF-8 shown as \\xNN) and
    the errno name of the cause (EBUSY for a mount point, EPERM for an immutable file)."""

    path: str
    error: str


@attrs.define
class Removal:
    """What remove_tree did: bytes really freed (st_blocks of what it unlinked
    that had no other link) and what it could not remove."""

    freed: int = 0
    unremovable: list[Unremovable] = attrs.Factory(list)

    @property
    def complete(self) -> bool:
        return not self.unremovable


# Directories open at once while removing (one descriptor each); a tree deeper
# than this has its deep part renamed up to the top of the entry, so neither
# descriptors nor path lengths grow with the depth of what a repository holds.
REMOVE_MAX_OPEN = 48
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _shown(rel: bytes) -> str:
    return rel.decode("utf-8", "backslashreplace")


def _freed_by(info: os.stat_result) -> int:
    return info.st_blocks * 512 if stat.S_ISDIR(info.st_mode) or info.st_nlink <= 1 else 0


def _make_writable(dir_fd: int) -> None:
    """u+rwx on a directory we hold open (a review's chmod 0555 must not keep its contents)."""
    mode = os.fstat(dir_fd).st_mode
    if mode & 0o700 != 0o700:
        os.fchmod(dir_fd, stat.S_IMODE(mode) | 0o700)


def _open_dir(name: str, parent_fd: int) -> int:
    """Open a subdirectory without following a symlink; one we may not read is made u+rwx first."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        try:  # chmod through the descriptor: never a path a concurrent rename could redirect
            os.chmod(f"/proc/self/fd/{handle}", stat.S_IMODE(os.fstat(handle).st_mode) | 0o700)
        finally:
            os.close(handle)
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)


def _retrying_writable(operation: Callable[[], None], dir_fd: int) -> None:
    try:
        operation()
    except PermissionError:
        _make_writable(dir_fd)
        operation()


class _Dir:
    __slots__ = ("fd", "name", "rel", "actual", "subdirs", "dev", "blocked")

    def __init__(self, fd: int, name: str, rel: bytes, actual: bytes, dev: int):
        self.fd = fd
        self.name = name  # its name in the directory below it on the stack
        self.rel = rel  # where it was, for reports
        self.actual = actual  # where it is now, relative to the top
        self.subdirs: list[tuple[str, bytes, bytes]] = []  # (name, rel, actual) still to remove
        self.dev = dev
        self.blocked = False  # something inside could not be removed: so can this not


def remove_tree(path: str) -> Removal:
    """Delete something renamed into trash/, whatever it holds; never raises.

    Starts from a descriptor of the directory holding it, resolved beneath the
    root without following a symlink (store/tree.py), never from `realpath`:
    a trash/ (or any directory on the way) swapped for a symlink is refused
    (reported as ELOOP), never followed. Then never follows a symlink, never
    enters another mount, works on directory descriptors (names of any bytes,
    any depth, bounded descriptors), makes read-only directories writable as it
    goes, and goes on past what it cannot remove: that is returned with its
    cause, for the caller to report and retry.
    """
    removal = Removal()
    try:
        with tree.parent_of(path) as (parent_fd, name):
            _remove_named(parent_fd, name, removal)
    except (FileNotFoundError, NotADirectoryError):
        pass  # gone already, or the directory holding it is
    except OSError as exc:
        removal.unremovable.append(Unremovable("", records.errno_name(exc)))
    return removal


def _remove_named(parent_fd: int, name: str, removal: Removal) -> None:
    try:
        info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        try:
            os.unlink(name, dir_fd=parent_fd)  # a symlink itself goes; what it names is never touched
            removal.freed += _freed_by(info)
        except FileNotFoundError:
            pass
        except OSError as exc:
            removal.unremovable.append(Unremovable("", records.errno_name(exc)))
        return
    top_fd = _open_dir(name, parent_fd)
    try:
        # Where the kernel says the opened directory is: only to find mount points
        # inside it in mountinfo, never to open anything by.
        top_path = tree.fd_name(top_fd)
    except BaseException:
        os.close(top_fd)
        raise
    mounts = tree.mount_points_under(top_path)
    top = _Dir(top_fd, name, b"", b"", info.st_dev)
    _remove_dir(top, parent_fd, mounts, top_path, removal)


def _remove_dir(top: _Dir, top_parent_fd: int, mounts: set[bytes], top_path: bytes, removal: Removal) -> None:
    stack = [top]
    try:
        _scan(top, removal)
        while stack:
            current = stack[-1]
            if current.subdirs:
                name, rel, actual = current.subdirs.pop()
                child = _descend(current, name, rel, actual, stack, top, mounts, top_path, removal)
                if child is not None:
                    stack.append(child)
                    _scan(child, removal)
                continue
            stack.pop()
            os.close(current.fd)
            current.fd = -1
            below_fd = stack[-1].fd if stack else top_parent_fd
            if current.blocked:
                if stack:
                    stack[-1].blocked = True
                continue
            _remove_entry(current.name, below_fd, current.rel, True, removal, lambda: _block(stack))
    finally:
        for frame in stack:
            if frame.fd >= 0:
                os.close(frame.fd)


def _block(stack: list[_Dir]) -> None:
    if stack:
        stack[-1].blocked = True


def _descend(current: _Dir, name: str, rel: bytes, actual: bytes, stack: list[_Dir], top: _Dir,
             mounts: set[bytes], top_path: bytes, removal: Removal) -> _Dir | None:
    """Open a subdirectory to empty it; None when it was dealt with otherwise."""
    def blocked() -> None:
        current.blocked = True

    if mounts and top_path + b"/" + actual in mounts:
        _remove_entry(name, current.fd, rel, True, removal, blocked)  # rmdir: EBUSY, reported
        return None
    if len(stack) >= REMOVE_MAX_OPEN:
        # Too deep: rename it up to the top of the entry and take it from there later.
        fresh = f".deep-{os.urandom(6).hex()}"

        def rename_up() -> None:
            os.rename(name, fresh, src_dir_fd=current.fd, dst_dir_fd=top.fd)

        try:
            try:
                rename_up()
            except PermissionError:
                _make_writable(current.fd)
                _make_writable(top.fd)
                rename_up()
        except FileNotFoundError:
            return None
        except OSError as exc:
            removal.unremovable.append(Unremovable(_shown(rel), records.errno_name(exc)))
            current.blocked = True
            return None
        top.subdirs.append((fresh, rel, os.fsencode(fresh)))
        if mounts:  # a mount inside moved with it
            mounts.clear()
            mounts.update(tree.mount_points_under(top_path))
        return None
    try:
        fd = _open_dir(name, current.fd)
    except FileNotFoundError:
        return None
    except NotADirectoryError:  # replaced meanwhile
        _remove_entry(name, current.fd, rel, False, removal, blocked)
        return None
    except OSError as exc:
        removal.unremovable.append(Unremovable(_shown(rel), records.errno_name(exc)))
        current.blocked = True
        return None
    dev = os.fstat(fd).st_dev
    if dev != current.dev:  # another filesystem mounted here: never delete what it holds
        os.close(fd)
        _remove_entry(name, current.fd, rel, True, removal, blocked)
        return None
    return _Dir(fd, name, rel, actual, dev)


def _scan(directory: _Dir, removal: Removal) -> None:
    """Unlink everything in a directory but its subdirectories, which are queued."""
    def blocked() -> None:
        directory.blocked = True

    def listing() -> list[tuple[str, bool]]:
        with os.scandir(directory.fd) as found:
            return [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in found]

    try:
        try:
            names = listing()
        except PermissionError:
            _make_writable(directory.fd)
            names = listing()
    except OSError as exc:
        removal.unremovable.append(Unremovable(_shown(directory.rel), records.errno_name(exc)))
        directory.blocked = True
        return
    for name, is_dir in names:
        rel = (directory.rel + b"/" if directory.rel else b"") + os.fsencode(name)
        if is_dir:
            actual = (directory.actual + b"/" if directory.actual else b"") + os.fsencode(name)
            directory.subdirs.append((name, rel, actual))
        else:
            _remove_entry(name, directory.fd, rel, False, removal, blocked)


def _remove_entry(name: str, dir_fd: int, rel: bytes, is_dir: bool, removal: Removal,
                  blocked: Callable[[], None]) -> None:
    """Unlink (or rmdir) one name in dir_fd, counting what it frees; report what will not go."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if is_dir:
            _retrying_writable(lambda: os.rmdir(name, dir_fd=dir_fd), dir_fd)
        else:
            _retrying_writable(lambda: os.unlink(name, dir_fd=dir_fd), dir_fd)
        removal.freed += _freed_by(info)
    except FileNotFoundError:
        pass
    except IsADirectoryError:  # it became a directory meanwhile: gone next run
        removal.unremovable.append(Unremovable(_shown(rel), "EISDIR"))
        blocked()
    except OSError as exc:
        removal.unremovable.append(Unremovable(_shown(rel), records.errno_name(exc)))
        blocked()


def trash_entries(paths: RepoPaths) -> list[str]:
    """What trash/ holds; tree.NotBeneath when trash/ (or the store) is a symlink: never listed through."""
    return [paths.trash_entry(name) for name in entries(paths.trash_dir)]
