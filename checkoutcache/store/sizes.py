"""A checkout's size: measured by walking it (never following a symlink out),
recorded in state/<name>.size.json with the last use it was measured at.

Apart from inventory.py (which reads the records for gc and status) so that a
clone worker publishing a checkout records its size without importing the
whole inventory."""

from __future__ import annotations

import os

from checkoutcache.store import records, tree
from checkoutcache.store.layout import RepoPaths


def disk_usage(path: str) -> int:
    """Bytes a directory tree occupies on disk, never following a symlink out."""
    total = 0
    if os.path.islink(path):
        return 0  # a symlink where a checkout should be: its target is not ours to measure
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
            total += info.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return total



def record_size(paths: RepoPaths, name: str) -> int:
    """Measure a checkout and record its size with the last use it was measured at."""
    try:
        use = tree.lstat(paths.ready_marker(name)).st_mtime
    except OSError:
        use = None
    size = disk_usage(paths.checkout(name))
    try:
        records.write_json(paths.size_record(name), {"bytes": size, "use_at_measure": use})
    except OSError:
        pass  # a size not recorded is measured again next time
    return size
