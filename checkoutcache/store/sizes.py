"""A checkout's size: measured by walking it (never following a symlink out,
each inode counted once however many links it has), recorded in
state/<name>.size.json with the last use it was measured at.

Apart from inventory.py (which reads the records for gc and status) so that a
clone worker publishing a checkout records its size without importing the
whole inventory."""

from __future__ import annotations

import os
import stat

from checkoutcache.store import records, tree
from checkoutcache.store.layout import RepoPaths


def disk_usage(path: str, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes a directory tree occupies on disk, never following a symlink out.

    Each inode counts once (st_dev, st_ino): a file hard-linked 300 times in the tree is its
    blocks once, as the disk holds it, never 300 times (a review's build can make such links
    in its workspace, and 300 links of 1 MiB must not read as 315 MB against max-bytes). A
    directory met again (a bind mount of a directory inside the tree) is not walked again.
    seen: shared by callers that measure several trees as one (an inode in two of them
    counts once); by default one call is one measurement. Reflinked extents (`cp
    --reflink`) are separate inodes and count in full: st_blocks cannot tell them shared,
    and a write to either unshares them."""
    total = 0
    if os.path.islink(path) and not path.startswith("/proc/self/fd/"):
        # A symlink where a checkout should be: its target is not ours to measure. (A
        # descriptor's own path, as a submodule's directory is named, is a link by nature.)
        return 0
    seen = set() if seen is None else seen
    try:
        top = os.stat(path)
        seen.add((top.st_dev, top.st_ino))
    except OSError:
        return 0
    stack = [path]
    while stack:
        current = stack.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:  # gone, unreadable, or a path too long (a deep tree): never a reason to fail
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            is_dir = stat.S_ISDIR(info.st_mode)
            # Only an inode that can be met twice is remembered: a directory (a bind mount),
            # or a file with more than one link; the memory stays O(directories + links).
            if is_dir or info.st_nlink > 1:
                identity = (info.st_dev, info.st_ino)
                if identity in seen:
                    continue
                seen.add(identity)
            total += info.st_blocks * 512
            if is_dir:
                stack.append(entry.path)
    return total


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
