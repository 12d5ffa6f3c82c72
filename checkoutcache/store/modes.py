"""The modes of what the store creates (DESIGN invariant 14): set by the store
itself, whatever the creating process's umask.

Several uids in one group share a root (a sidecar and review containers), so
every directory the store makes is DIR_MODE (group read/write/search, setgid:
what is made inside belongs to the root's group) and every file FILE_MODE
(group read/write): a file is created, then fchmod'ed through its own
descriptor, so a umask of 022 (a container image's default) or 077 cannot
leave a peer unable to lock or record. Nothing is world-writable.

What git writes (mirrors, checkouts, LFS objects) follows the clone worker's
umask, which the worker sets to SHARED_UMASK; mirrors also say
core.sharedRepository=group, which git applies whatever the umask.
"""

from __future__ import annotations

import os
import stat

from checkoutcache.store.layout import DIR_MODE, FILE_MODE

SHARED_UMASK = 0o002
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def set_shared_umask() -> None:
    """For a process that runs git in the store (the clone worker)."""
    os.umask(SHARED_UMASK)


def _own_mode(fd: int, mode: int) -> None:
    """Give a descriptor's file the mode, if it is ours (a peer's file keeps the peer's mode)."""
    info = os.fstat(fd)
    if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != mode:
        os.fchmod(fd, mode)


def open_created(path: str, flags: int, dir_fd: int | None = None) -> int:
    """os.open with O_CREAT, and FILE_MODE on a file we created (or own)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
    try:
        _own_mode(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dir(path: str | bytes, dir_fd: int | None = None) -> None:
    """mkdir with DIR_MODE whatever the umask; FileExistsError if it is there."""
    os.mkdir(path, DIR_MODE, dir_fd=dir_fd)
    fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        _own_mode(fd, DIR_MODE)
    finally:
        os.close(fd)
