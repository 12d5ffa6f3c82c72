"""Stale git lock files in a mirror: found and removed from what is on disk.

Every function here must be called with the repository's mirror lock held
(locks/mirror.lock): git's own lock files are not enough, since two fetches
into one mirror race on shallow.lock/HEAD.lock, and under our lock no writer
of ours can own a git lock file. Invariant 5 (nothing done to the mirror
breaks a checkout) is kept by the keep-refs (backend.py).
"""

from __future__ import annotations

import os
import time

# A git lock file younger than this may belong to a git process that is still
# running outside our lock discipline (an operator's own `git` in the mirror);
# one older than this under our held mirror lock is a leftover of a killed process.
STALE_GIT_LOCK_AGE = 5.0
_LOCK_DIRS = ("", "refs", "objects/info", "objects/pack", "logs")


def git_lock_files(mirror: str) -> list[str]:
    """Every git *.lock file in the mirror (relative paths)."""
    found = []
    for top in _LOCK_DIRS:
        start = os.path.join(mirror, top) if top else mirror
        walker = os.walk(start) if top == "refs" else [(start, [], _files(start))]
        for directory, _dirs, files in walker:
            found += [os.path.relpath(os.path.join(directory, name), mirror) for name in files
                      if name.endswith(".lock")]
    return found


def remove_stale_git_locks(mirror: str, now: float | None = None, min_age: float = STALE_GIT_LOCK_AGE) -> list[str]:
    """Delete git *.lock files left in the mirror by killed git processes.

    min_age spares a very young lock that an operator's own git may hold; a
    write that then fails with lock files present clears them all (min_age=0)
    and retries.
    """
    now = time.time() if now is None else now
    removed = []
    for relative in git_lock_files(mirror):
        path = os.path.join(mirror, relative)
        try:
            if now - os.lstat(path).st_mtime >= min_age:
                os.unlink(path)
                removed.append(relative)
        except FileNotFoundError:
            pass
    return removed


def _files(directory: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(directory) if e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return []
