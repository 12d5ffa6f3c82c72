"""One handle for the whole store: every path under a root is resolved beneath
it, never through a symlink (DESIGN invariant 12, for the store's own paths).

In the trusted-peers mode (CHECKOUTCACHE_SHARING=group) every member of the
root's group can replace any store directory (`repos/<key>/trash`, `logs/`,
`state/`, `checkouts/`, `repos/<key>` itself, ...) with a symlink. A string
path joined from the root and opened by name would then list, write, rename or
delete wherever the symlink points. So the store's own files and directories
are reached as Go's os.Root and systemd's chase() reach theirs:

- the root is the one path taken by name (the operator chose it); its
  descriptor is the anchor;
- the directory holding an entry is opened from that descriptor one component
  at a time, each `openat(O_NOFOLLOW | O_DIRECTORY)` relative to the one
  before (layout.open_store_dir; missing ones made with `mkdirat`): a
  component swapped for a symlink at any instant is refused, never followed.
  The same walk as store/beneath.py's fallback, without its ctypes (14 ms of
  import on a new commit's path) for paths a few components deep;
- the entry itself is then opened, made, renamed, unlinked or removed relative
  to that directory's descriptor (`O_NOFOLLOW`, `*at` calls), so its last
  component is never followed either; a removal walks descriptors from there
  (checkouts.remove_tree) and never starts from `realpath`.

A symlink (or a file) where a store directory should be raises `NotBeneath`,
an OSError (ELOOP) naming the path: for gc and status it costs that
repository (listed as a problem, left alone, never followed), for `ensure` it
is ROOT_UNUSABLE naming the path. Nothing here moves it aside: whoever planted
it may be a peer at work, and removing it is an operator's call.

Which root a path is under is known from layout.py (every RootPaths registers
its root): callers keep passing the paths layout computes. A path under no
known root (a test's own file, a bundle outside the store) is taken by name,
with the last component still never followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Iterator

from checkoutcache.store.layout import (NotAFile, NotBeneath, entries, open_step, open_store_dir,
                                        refuse_unless_regular, root_of)
from checkoutcache.store.modes import keep_private, make_dir, open_created

__all__ = ["NotAFile", "NotBeneath"]  # raised here too; layout.py owns them (its listings raise NotBeneath)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_dir(path: str, create: bool = False) -> int:
    """A descriptor of a store directory, resolved beneath its root (made, with its
    missing parents, each DIR_MODE, when create is set). The caller closes it."""
    if not create:
        return open_store_dir(path)
    root = root_of(path)
    if root is None:
        _make_by_name(path)
        return os.open(path, _DIR_FLAGS | os.O_NOFOLLOW)
    _make_by_name(root)
    try:
        return open_store_dir(path)
    except FileNotFoundError:
        pass
    current = os.open(root, _DIR_FLAGS)
    done = root
    try:
        for part in path[len(root):].strip("/").split("/"):
            done = f"{done}/{part}"
            try:
                make_dir(part, dir_fd=current)
            except FileExistsError:
                pass  # there already (or made meanwhile): opened below, with the same checks
            following = open_store_dir_at(current, part, root, done)
            os.close(current)
            current = following
        return current
    except BaseException:
        os.close(current)
        raise


def open_store_dir_at(dir_fd: int, part: str, root: str, done: str) -> int:
    if part in ("", ".", ".."):
        raise NotBeneath(done, f"{done[len(root):].strip('/')!r} has a {part or 'empty'!r} component")
    return open_step(dir_fd, part, root, done)


def _make_by_name(directory: str) -> None:
    """The root itself (or a path under no root) is the operator's: made by name, each level DIR_MODE."""
    missing = []
    current = directory
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for made in reversed(missing):
        try:
            make_dir(made)
        except FileExistsError:
            pass


@contextlib.contextmanager
def parent_of(path: str, create: bool = False) -> Iterator[tuple[int, str]]:
    """(descriptor of the directory holding path, path's last name): every *at call on
    the pair reaches the entry without following a symlink on the way."""
    directory, name = os.path.split(path)
    if not name:
        raise IsADirectoryError(errno.EISDIR, "a store entry has a name", path)
    fd = open_dir(directory, create=create)
    try:
        yield fd, name
    except OSError as exc:
        if exc.filename == name:  # an *at call names the entry alone: reports need its whole path
            exc.filename = path
        raise
    finally:
        os.close(fd)


def open_file(path: str, flags: int, create: bool = False) -> int:
    """os.open of a lock, record or log beneath the root, the last component never followed;
    create: O_CREAT, with the store's file mode (modes.open_created).

    Never blocks (DESIGN invariant 18): whoever may write the directory (a review in its own
    workspaces volume, a peer in the group mode) can put a FIFO where a lock or record should
    be, and a plain open(2) of it waits for a writer for ever. So O_NONBLOCK, then fstat:
    anything but a regular file raises NotAFile, closed, never read, written or locked. (On
    a regular file O_NONBLOCK changes nothing.)"""
    with parent_of(path) as (fd, name):
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        if create:
            return open_created(name, flags, dir_fd=fd)  # its own NotAFile check
        try:
            handle = os.open(name, flags, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # O_WRONLY on a FIFO with no reader, or a socket
                raise NotAFile(path, "a FIFO or a socket") from None
            raise
        refuse_unless_regular(handle, path)
        return handle


# The sorted names in a store directory (none if it does not exist); NotBeneath when it is a
# symlink: nothing is ever listed through one. One home: layout.entries.
listdir = entries


def lstat(path: str) -> os.stat_result:
    with parent_of(path) as (fd, name):
        return os.stat(name, dir_fd=fd, follow_symlinks=False)


def lexists(path: str) -> bool:
    """Whether the entry exists (a symlink counts; it is never followed). False also when a
    directory on the way is missing; NotBeneath when one is a symlink."""
    try:
        lstat(path)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False


def is_file(path: str) -> bool:
    try:
        return stat.S_ISREG(lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def is_dir(path: str) -> bool:
    """A real directory (a symlink to one is not)."""
    try:
        return stat.S_ISDIR(lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def make_dirs(path: str) -> None:
    """The directory and its missing parents, each DIR_MODE, beneath the root."""
    os.close(open_dir(path, create=True))


def make_private_dir(path: str) -> None:
    """A writers-only directory (modes.private_dir_mode) and its missing parents (DIR_MODE),
    beneath the root; made with its mode, or given it if an older version made it wider."""
    with parent_of(path, create=True) as (fd, name):
        try:
            make_dir(name, dir_fd=fd, private=True)
        except FileExistsError:
            pass
        made = open_step(fd, name, root_of(path) or "/", path)
    try:
        keep_private(made)
    finally:
        os.close(made)


def keep_private_dirs(directories: tuple[str, ...] | list[str]) -> None:
    """The writers-only directories that exist get their mode (modes.private_dir_mode): an
    older version made them readable, and a reader could take the locks inside. One that
    cannot be reached (a symlink, a peer's) is left as it is: gc and status report it."""
    for directory in directories:
        try:
            if is_dir(directory):
                make_private_dir(directory)
        except OSError:
            continue


def mkdir(path: str) -> None:
    """One new directory (DIR_MODE); FileExistsError if it is there."""
    with parent_of(path) as (fd, name):
        make_dir(name, dir_fd=fd)


def rename(src: str, dst: str) -> None:
    """os.replace of two store entries, each resolved beneath its root."""
    with parent_of(src) as (src_fd, src_name), parent_of(dst) as (dst_fd, dst_name):
        try:
            os.replace(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        except OSError as exc:  # both names whole (a report says which entry would not move)
            exc.filename, exc.filename2 = src, dst
            raise


def unlink(path: str, missing_ok: bool = True) -> None:
    try:
        with parent_of(path) as (fd, name):
            os.unlink(name, dir_fd=fd)
    except (FileNotFoundError, NotADirectoryError):
        if not missing_ok:
            raise


def utime(path: str, times: tuple[float, float] | None = None) -> None:
    """Set an entry's times (never through a symlink: on the link itself, which is harmless)."""
    with parent_of(path) as (fd, name):
        os.utime(name, times, dir_fd=fd, follow_symlinks=False)


def fd_name(fd: int) -> bytes:
    """Where the kernel says a descriptor's directory is now (for mountinfo, and for
    messages): never used to open anything."""
    return os.fsencode(os.readlink(f"/proc/self/fd/{fd}"))


def mount_points_under(path: bytes) -> set[bytes]:
    """Mount points strictly inside path, as /proc/self/mountinfo names them (a bind mount
    of the same file system shares st_dev with its parent: only this tells it). Read once
    per walk (checkouts.remove_tree, sizes.measure): a walk never enters one."""
    found = set()
    prefix = path.rstrip(b"/") + b"/"
    try:
        with open("/proc/self/mountinfo", "rb") as handle:
            for line in handle:
                fields = line.split(b" ")
                if len(fields) > 4:
                    point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])
                    if point.startswith(prefix):
                        found.add(point)
    except OSError:
        pass
    return found


# What a repository's store holds that is a directory: gc lists, writes or deletes in each
# (mirror.git: stale git lock files; lfs/objects: unused LFS objects; spares: evicted trees
# gc keeps and a worker takes). mirror.git/refs: git writes there by name (a fetch's refs, gc's
# keep-refs), so one swapped for a symlink would be written through.
STORE_DIRS = ("checkouts", "scratch", "trash", "state", "logs", "locks", "mirror.git", "mirror.git/objects",
              "mirror.git/refs", "lfs", "lfs/objects", "lfs/incomplete", "spares")


def refusal(repo_base: str) -> NotBeneath | None:
    """Why a repository's store may not be used (repos/<key> or one of its directories is a
    symlink, or a file), or None. The per-repository gate of gc, status and ensure; every
    later operation is resolved beneath the root again, so one planted after this look is
    refused there."""
    for path in (repo_base, *(os.path.join(repo_base, d) for d in STORE_DIRS)):
        try:
            info = lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except NotBeneath as exc:
            return exc
        if stat.S_ISLNK(info.st_mode):
            return NotBeneath(path, f"{_shown_rel(path)} is a symlink")
        if not stat.S_ISDIR(info.st_mode):
            return NotBeneath(path, f"{_shown_rel(path)} is not a directory")
    return None


def _shown_rel(path: str) -> str:
    root = root_of(path)
    return repr(path[len(root):].strip("/")) if root is not None else repr(path)
