"""A tree's size: measured by walking it, recorded for checkouts in
state/<name>.size.json with the last use it was measured at.

The walk (measure) is the one that trees a review controls get too (a live
workspace, in a volume the review writes while gc walks it), so:

- it goes by descriptors: each directory is opened with
  openat(O_NOFOLLOW | O_DIRECTORY) relative to its parent's descriptor and each
  entry is fstatat'ed (AT_SYMLINK_NOFOLLOW) there; no joined path is ever
  looked up again, so a directory swapped for a symlink at any instant (a
  RENAME_EXCHANGE between our stat and our open) is refused, never followed;
- it never leaves the starting directory's file system: a directory on another
  st_dev, or a mount point mountinfo lists inside the tree (a bind mount of
  the same file system), is neither counted nor entered;
- its memory is bounded whatever the tree holds: entries are read lazily
  (os.scandir on a descriptor), the stack holds one descriptor and one
  iterator per level and at most MAX_DEPTH levels; the identities it keeps
  (directories, and files with more than one link) are capped at REMEMBERED;
- its work is bounded when the caller says so (Bounds: entries examined,
  seconds): past a bound it stops, and the result says the bytes are a lower
  bound (Usage.partial names why: entries, time, depth, unreadable).

Each inode counts once per measurement: a file hard-linked 300 times in the
tree is its blocks once, as the disk holds it, never 300 times (a review's
build can make such links, and 300 links of 1 MiB must not read as 315 MB
against max-bytes). Past REMEMBERED identities a multi-link file counts
st_blocks / st_nlink per link met: its blocks once when all its links are in
the tree, less when some are elsewhere, never more.

Apart from inventory.py (which reads the records for gc and status) so that a
clone worker publishing a checkout records its size without importing the
whole inventory."""

from __future__ import annotations

import errno
import os
import stat
import time

import attrs

from checkoutcache.store import records, tree
from checkoutcache.store.layout import RepoPaths

# Levels of directories open at once (each holds its descriptor and scandir's own, and
# glibc's 32 KiB buffer): deeper ones are counted as directories, not entered ("depth").
MAX_DEPTH = 128
# Identities (st_dev, st_ino) one measurement keeps, at about 150 bytes each.
REMEMBERED = 1 << 16
TIME_CHECK_EVERY = 256  # entries between two looks at the clock

# Why a measurement is a lower bound.
ENTRIES = "entries"  # the entries bound was met: the walk stopped
TIME = "time"  # the time bound was met: the walk stopped
DEPTH = "depth"  # directories deeper than MAX_DEPTH (or past the descriptors we may open) not entered
UNREADABLE = "unreadable"  # a directory or entry we may not read (a review's chmod 700 as another uid)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)  # removed, or no longer a directory, meanwhile


@attrs.frozen
class Bounds:
    """How much one measurement may cost; None: no bound (the writer's own trees)."""

    entries: int | None = None
    seconds: float | None = None


UNBOUNDED = Bounds()
# A live workspace: a tree the review makes as it likes, walked as it changes (a million
# entries are a few seconds of gc's time, in no more memory than an empty one).
WORKSPACE_BOUNDS = Bounds(entries=1_000_000, seconds=20.0)
# All live workspaces of one gc run together: a review can make as many as it likes, and gc
# holds gc.lock while it walks them (eight of a million hard links each were 28 s).
WORKSPACES_BUDGET = Bounds(entries=2_000_000, seconds=40.0)
BUDGET = "budget"  # the run's budget for all workspaces was spent before this one was walked whole


class Budget:
    """What is left of a run's bounds for several measurements: each gets the smaller of its
    own bounds and what is left."""

    def __init__(self, total: Bounds):
        self.total = total
        self.entries_used = 0
        self.started = time.monotonic()

    def next(self, own: Bounds) -> Bounds | None:
        """The bounds of the next measurement; None when the budget is spent."""
        entries = None if self.total.entries is None else self.total.entries - self.entries_used
        seconds = None if self.total.seconds is None else self.total.seconds - (time.monotonic() - self.started)
        if (entries is not None and entries <= 0) or (seconds is not None and seconds <= 0):
            return None
        return Bounds(entries=_smaller(own.entries, entries), seconds=_smaller(own.seconds, seconds))

    def spend(self, usage: "Usage") -> None:
        self.entries_used += usage.entries


def _smaller(a, b):
    return b if a is None else a if b is None else min(a, b)


@attrs.frozen
class Usage:
    bytes: int
    entries: int = 0  # names examined
    partial: tuple[str, ...] = ()  # empty: the whole tree; else bytes is a lower bound, and why

    @property
    def complete(self) -> bool:
        return not self.partial


def disk_usage(path: str, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes a tree of the writer's own occupies on disk (measure, unbounded)."""
    return measure(path, seen).bytes


def measure(path: str, seen: set[tuple[int, int]] | None = None, bounds: Bounds = UNBOUNDED) -> Usage:
    """What the directory at path holds on disk (its own blocks not counted). The path is
    resolved beneath its root (store/tree.py), its last component never followed: a
    symlink, or nothing, where the tree should be measures 0.
    seen: shared by callers that measure several trees as one (an inode in two of them
    counts once); by default one call is one measurement. Reflinked extents (`cp
    --reflink`) are separate inodes and count in full: st_blocks cannot tell them shared,
    and a write to either unshares them."""
    try:
        fd = tree.open_dir(path)
    except OSError as exc:
        return Usage(0) if exc.errno in _GONE else Usage(0, partial=(UNREADABLE,))
    try:
        return measure_at(fd, seen, bounds)
    finally:
        os.close(fd)


def measure_at(dir_fd: int, seen: set[tuple[int, int]] | None = None, bounds: Bounds = UNBOUNDED) -> Usage:
    """measure() of the directory dir_fd holds (the caller's descriptor, left open)."""
    seen = set() if seen is None else seen
    top = os.fstat(dir_fd)
    dev = top.st_dev
    if len(seen) < REMEMBERED:
        seen.add((dev, top.st_ino))
    try:
        top_path = tree.fd_name(dir_fd)
    except OSError:
        top_path = b""
    # Mount points inside the tree (read once): where there are some, each directory opened
    # is asked where the kernel says it is now (one readlink), so a rename meanwhile never
    # hides one; where there are none, nothing more is asked.
    mounts = tree.mount_points_under(top_path) if top_path.startswith(b"/") else set()
    deadline = None if bounds.seconds is None else time.monotonic() + bounds.seconds
    limit = bounds.entries
    partial: list[str] = []

    def short(why: str) -> None:
        if why not in partial:
            partial.append(why)

    total = count = 0
    try:
        top_entries = os.scandir(dir_fd)
    except OSError:
        return Usage(0, partial=(UNREADABLE,))
    stack: list[tuple[int, os.ScandirIterator]] = [(dir_fd, top_entries)]  # (descriptor, its entries)
    try:
        while stack:
            fd, found = stack[-1]
            try:
                entry = next(found, None)
            except OSError:  # the listing failed midway (EIO): what was read counts
                short(UNREADABLE)
                entry = None
            if entry is None:
                stack.pop()
                found.close()
                if fd != dir_fd:
                    os.close(fd)
                continue
            count += 1
            if limit is not None and count > limit:
                count -= 1
                short(ENTRIES)
                break
            if deadline is not None and count % TIME_CHECK_EVERY == 0 and time.monotonic() >= deadline:
                short(TIME)
                break
            name = entry.name
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in _GONE:
                    short(UNREADABLE)
                continue
            if not stat.S_ISDIR(info.st_mode):
                # A symlink counts as what it is (its own blocks); what it names is not ours.
                if info.st_nlink > 1:
                    identity = (info.st_dev, info.st_ino)
                    if identity in seen:
                        continue
                    if len(seen) < REMEMBERED:
                        seen.add(identity)
                    else:  # its share: its blocks once if every link of it is in the tree
                        total += info.st_blocks * 512 // info.st_nlink
                        continue
                total += info.st_blocks * 512
                continue
            if info.st_dev != dev:
                continue  # another file system mounted here: not this tree's bytes
            if len(stack) >= MAX_DEPTH:
                short(DEPTH)
                total += info.st_blocks * 512
                continue
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                # ELOOP: swapped for a symlink since our stat, never followed.
                if exc.errno not in _GONE:
                    short(_why_not_opened(exc))
                    total += info.st_blocks * 512
                continue
            try:
                opened = os.fstat(child)
                identity = (opened.st_dev, opened.st_ino)
                # Another file system swapped in meanwhile, a bind mount (same st_dev: what it
                # shows lives elsewhere), or a directory met again (moved during the walk):
                # never entered, never counted twice.
                if opened.st_dev != dev or identity in seen or mounts and tree.fd_name(child) in mounts:
                    os.close(child)
                    continue
                if len(seen) < REMEMBERED:
                    seen.add(identity)
                total += opened.st_blocks * 512
                listing = os.scandir(child)
            except OSError as exc:
                os.close(child)
                short(_why_not_opened(exc))
                continue
            stack.append((child, listing))
    finally:
        for fd, found in stack:
            found.close()
            if fd != dir_fd:
                os.close(fd)
    return Usage(total, count, tuple(partial))


def _why_not_opened(exc: OSError) -> str:
    # Out of descriptors (the process's limit): what lies below is beyond what we may hold open.
    return DEPTH if exc.errno in (errno.EMFILE, errno.ENFILE) else UNREADABLE


def index_identity(git_dir: str) -> list[int] | None:
    """What identifies a work tree's .git/index as the one git wrote (st_ino, st_ctime_ns,
    st_size): any later write of it changes its ctime, which no unprivileged process can set
    back. None when there is no such regular file (.git a symlink, no index)."""
    try:
        fd = os.open(git_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.stat("index", dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode):
        return None
    return [info.st_ino, info.st_ctime_ns, info.st_size]


def record_size(paths: RepoPaths, name: str, index: list[int] | None = None) -> int:
    """Measure a checkout and record its size with the last use it was measured at.
    index: the identity of its index, given only by the worker that publishes it (a spare
    is trusted only with that index); a later measure keeps what the record says."""
    try:
        use = tree.lstat(paths.ready_marker(name)).st_mtime
    except OSError:
        use = None
    size = disk_usage(paths.checkout(name))
    if index is None:
        index = (records.read_json(paths.size_record(name), records.SIZE) or {}).get("index")
    try:
        records.write_json(paths.size_record(name), {"bytes": size, "use_at_measure": use,
                                                     **({"index": index} if index else {})})
    except OSError:
        pass  # a size not recorded is measured again next time
    return size
