"""Paths that come from a repository, a request or a peer, resolved beneath a
directory without following a symlink in any component (DESIGN invariant 12).

A submodule path, an LFS path or a sparse cone is a string someone else wrote:
it is handled as bytes, split into components, and opened one directory at a
time relative to a directory descriptor: `openat2(RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS)` where the kernel has it (Linux 5.6+), an `O_NOFOLLOW`
walk of `openat` otherwise; missing directories are made with `mkdirat`
relative to their parent's descriptor. A component that is a symlink, a file,
`..`, `.`, empty, or holds a NUL stops the walk with `Escape`, which says
which component and why: the caller fails that commit, and nothing is ever
created, changed or read outside the directory.

What the caller gets is a descriptor of the directory itself; `fd_path(fd)`
names it for a child process that inherits the descriptor (git -C
/proc/self/fd/N), so no string path is resolved again after the check.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

from checkoutcache.store.layout import names_a_symlink
from checkoutcache.store.modes import make_dir

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# openat2(2): the syscall number is 437 on every architecture that has it.
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x02, 0x04, 0x08
MAX_COMPONENTS = 256


class Escape(Exception):
    """A path that would leave its directory or pass through a symlink: why, in one line."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _syscall = _LIBC.syscall
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _syscall = None
# None: not known yet; False: the kernel (or a seccomp filter) refuses openat2.
_openat2_works: bool | None = None if platform.system() == "Linux" and _syscall is not None else False


def use_openat2(enabled: bool | None) -> None:
    """Tests: force the O_NOFOLLOW walk (False) or go back to probing (None)."""
    global _openat2_works
    _openat2_works = enabled


def components(rel: bytes) -> list[bytes]:
    """The components of a relative path, or Escape: never absolute, never `..`, `.`, empty or NUL."""
    if not isinstance(rel, bytes):
        raise TypeError("paths from a repository are bytes")
    if rel.startswith(b"/"):
        raise Escape(f"{shown(rel)} is an absolute path")
    if b"\0" in rel:
        raise Escape(f"{shown(rel)} holds a NUL byte")
    parts = rel.split(b"/")
    if len(parts) > MAX_COMPONENTS:
        raise Escape(f"{shown(rel)} has more than {MAX_COMPONENTS} components")
    for part in parts:
        if part in (b"", b".", b".."):
            raise Escape(f"{shown(rel)} has a {part.decode() or 'empty'!r} component")
    return parts


def shown(rel: bytes) -> str:
    """A path for a message: bytes that are not UTF-8 shown as \\xNN."""
    return repr(rel.decode("utf-8", "backslashreplace")[:200])


def _openat2(dir_fd: int, rel: bytes) -> int:
    how = _OpenHow(_DIR_FLAGS, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    fd = _syscall(_SYS_OPENAT2, ctypes.c_int(dir_fd), ctypes.c_char_p(rel), ctypes.byref(how),
                  ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(fd)


def _step(dir_fd: int, part: bytes, rel: bytes, create: bool) -> int:
    """Open one component below dir_fd as a directory, never through a symlink."""
    try:
        return _open_component(dir_fd, part, rel)
    except FileNotFoundError:
        if not create:
            raise
    try:
        make_dir(part, dir_fd=dir_fd)
    except FileExistsError:
        pass  # made meanwhile: opened below, with the same checks
    return _open_component(dir_fd, part, rel)


def _open_component(dir_fd: int, part: bytes, rel: bytes) -> int:
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        if names_a_symlink(dir_fd, part):
            raise Escape(f"{shown(rel)} passes through a symlink ({shown(part)})") from None
        raise Escape(f"{shown(rel)} passes through {shown(part)}, which is not a directory") from None


def open_dir_beneath(dir_fd: int, rel: bytes, create: bool = False) -> int:
    """A descriptor of the directory rel names below dir_fd (made, with its missing
    parents, when create is set). Escape for a path that leaves dir_fd or passes
    through a symlink or a file; FileNotFoundError when it is missing and create is
    not set. The caller closes the descriptor."""
    global _openat2_works
    parts = components(rel)
    if _openat2_works is not False:
        try:
            fd = _openat2(dir_fd, rel)
            _openat2_works = True
            return fd
        except OSError as exc:
            if exc.errno in (errno.ENOSYS, errno.EPERM, errno.EINVAL) and _openat2_works is None:
                _openat2_works = False  # no openat2 here (old kernel, seccomp): walk
            elif exc.errno == errno.ENOENT and create:
                pass  # made below, one component at a time
            elif exc.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
                pass  # the walk below says which component
            else:
                raise
    current = os.dup(dir_fd)
    try:
        for part in parts:
            following = _step(current, part, rel, create)
            os.close(current)
            current = following
        return current
    except BaseException:
        os.close(current)
        raise


def fd_path(fd: int) -> str:
    """The directory a descriptor holds, as a path a child that inherits fd resolves
    (pass_fds): no component is looked up again by name."""
    return f"/proc/self/fd/{fd}"
