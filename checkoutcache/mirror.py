"""The shared bare mirror of one repository: created once (gitbackend),
fetched incrementally, its objects borrowed by every checkout; here, what
maintenance does to it.

Every function here that writes must be called with the repository's mirror
lock held (locks/mirror.lock): git's own lock files are not enough, since two
fetches into one mirror race on shallow.lock/HEAD.lock. Invariant 5 is kept by
refs/keep/<sha>: a checkout's objects stay reachable for as long as it exists
or is being made, so no repack or prune can break it. pygit2 is imported only
by the functions that need it, so a clone worker on the git CLI never loads it.
"""

from __future__ import annotations

import os
import time

KEEP_PREFIX = "refs/keep/"
# A git lock file younger than this may belong to a git process that is still
# running outside our lock discipline (an operator's own `git` in the mirror);
# one older than this under our held mirror lock is a leftover of a killed process.
STALE_GIT_LOCK_AGE = 5.0


def keep_ref(sha: str) -> str:
    return KEEP_PREFIX + sha


def open_existing(mirror: str):
    import pygit2

    return pygit2.Repository(mirror)


def remove_stale_git_locks(mirror: str, now: float | None = None, min_age: float = STALE_GIT_LOCK_AGE) -> list[str]:
    """Delete git *.lock files left in the mirror by killed git processes.

    Safe only with the mirror lock held: every writer we start holds it (git
    children inherit it), so no live writer of ours can own these files.
    min_age spares a very young lock that an operator's own git may hold; a
    fetch that then fails on a lock clears them all (min_age=0) and retries.
    """
    now = time.time() if now is None else now
    removed = []
    for top in ("", "refs", "objects/info", "objects/pack", "logs"):
        start = os.path.join(mirror, top) if top else mirror
        walker = os.walk(start) if top == "refs" else [(start, [], _files(start))]
        for directory, _dirs, files in walker:
            for name in files:
                if not name.endswith(".lock"):
                    continue
                path = os.path.join(directory, name)
                try:
                    if now - os.lstat(path).st_mtime >= min_age:
                        os.unlink(path)
                        removed.append(os.path.relpath(path, mirror))
                except FileNotFoundError:
                    pass
    return removed


def _files(directory: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(directory) if e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def kept_shas(repo) -> list[str]:
    return [name[len(KEEP_PREFIX):] for name in repo.references if name.startswith(KEEP_PREFIX)]


def drop_keep(repo, sha: str) -> None:
    import pygit2

    try:
        repo.references.delete(keep_ref(sha))
    except (KeyError, pygit2.GitError):
        pass
