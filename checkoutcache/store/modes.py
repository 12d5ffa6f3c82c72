"""The modes of what the store creates (DESIGN invariants 14 and 16): set by the
store itself, whatever the creating process's umask, and decided by how the root
is shared (CHECKOUTCACHE_SHARING):

- `writer` (the default, one writer): only the writer's uid (the sidecar, and
  cron's gc as the same uid) writes the store; review containers read it
  through a read-only mount and ask the writer for what needs a write.
  Directories are 0755 and files 0644: nothing the store holds, a published
  checkout's content least of all, is writable by any uid but the writer's, so
  the tree answered `ready` is the tree that was checked out.
- `group` (trusted peers): several uids in one group all write the store (a
  sidecar and review containers that trust each other). Directories are 2775
  (setgid: what is made inside belongs to the root's group) and files 0664, so
  a peer can lock, record and delete what another made; every member can then
  change what every other member is answered with (docs/security.md).

Either way nothing is world-writable. A file is created, then fchmod'ed
through its own descriptor, so a umask of 022 (a container image's default) or
077 cannot leave a peer unable to lock or record.

What git writes (mirrors, checkouts, LFS objects) follows the clone worker's
umask, which the worker sets with `set_store_umask`; mirrors also carry
core.sharedRepository (`git_shared_repository`), which git applies whatever the
umask.

The setting is read from the environment (checkoutcache/sharing.py), not passed
down, because every writer of the store must agree on it whatever called it (a
command, a sidecar, a worker it spawned); config.py declares it for the
settings tables and checks it before anything is written.
"""

from __future__ import annotations

import errno
import os
import stat

from checkoutcache.sharing import GROUP, WRITER, sharing
from checkoutcache.store.layout import NotAFile, refuse_unless_regular

# (directory mode, file mode, umask for git, a writers-only directory's mode) per sharing mode
_MODES = {WRITER: (0o755, 0o644, 0o022, 0o700), GROUP: (0o2775, 0o664, 0o002, 0o2770)}
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def dir_mode() -> int:
    return _MODES[sharing()][0]


def file_mode() -> int:
    return _MODES[sharing()][1]


def private_dir_mode() -> int:
    """The mode of a directory only writers enter (layout.py's private_dirs: locks, holds,
    journals, scratch). flock needs no write access, so any uid that can open a lock file
    can take it and keep it: a reader holding gc.lock, a mirror lock or a dead holder's
    hold would stop the writer or keep a checkout for ever (DESIGN invariant 18). Readers
    cannot even look inside: the one writer alone in the default mode, the group's members
    in the trusted-peers mode."""
    return _MODES[sharing()][3]


def set_store_umask() -> None:
    """For a process that runs git in the store (the clone worker)."""
    os.umask(_MODES[sharing()][2])


def git_shared_repository() -> str:
    """core.sharedRepository for a mirror: group members write it only in the group mode."""
    return "group" if sharing() == GROUP else "umask"


def _own_mode(fd: int, mode: int) -> None:
    """Give a descriptor's file the mode, if it is ours (a peer's file keeps the peer's mode)."""
    info = os.fstat(fd)
    if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != mode:
        os.fchmod(fd, mode)


def open_created(path: str, flags: int, dir_fd: int | None = None) -> int:
    """os.open with O_CREAT, and the store's file mode on a file we created (or own).
    Never blocks on what was there already: O_NONBLOCK, and anything but a regular file
    (a FIFO, a socket someone put at the path) raises layout.NotAFile, untouched."""
    mode = file_mode()
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO with no reader, or a socket: open(2) with O_NONBLOCK
            raise NotAFile(os.fsdecode(path), "a FIFO or a socket") from None
        raise
    refuse_unless_regular(fd, os.fsdecode(path))
    try:
        _own_mode(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dir(path: str | bytes, dir_fd: int | None = None, private: bool = False) -> None:
    """mkdir with the store's directory mode (private: the writers-only one) whatever the umask;
    FileExistsError if it is there."""
    mode = private_dir_mode() if private else dir_mode()
    os.mkdir(path, mode & 0o777, dir_fd=dir_fd)  # never wider than it ends, even for an instant
    fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        _own_mode(fd, mode)
    finally:
        os.close(fd)


def keep_private(fd: int) -> None:
    """An existing writers-only directory (an older version made it with the readers' mode)
    gets its mode, if it is ours. A descriptor a reader opened inside it before stays open:
    its lock ends with it, and no new one can be taken."""
    _own_mode(fd, private_dir_mode())
