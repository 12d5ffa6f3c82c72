"""The shared bare mirror of one repository: created once, fetched
incrementally, its objects borrowed by every checkout.

Every function here that writes must be called with the repository's mirror
lock held (locks/mirror.lock): git's own lock files are not enough, since two
fetches into one mirror race on shallow.lock/HEAD.lock. Invariant 5 is kept by
refs/keep/<sha>: a checkout's objects stay reachable for as long as it exists
or is being made, so no repack or prune can break it.
"""

from __future__ import annotations

import os
import shutil
import time

import pygit2

from .layout import RepoPaths

KEEP_PREFIX = "refs/keep/"
MIRROR_CONFIG = {
    "gc.auto": "0",
    "maintenance.auto": "false",
    "core.logAllRefUpdates": "false",
    "fetch.writeCommitGraph": "false",
    "core.fsmonitor": "false",
    "receive.autogc": "false",
}
# A git lock file younger than this may belong to a git process that is still
# running outside our lock discipline (an operator's own `git` in the mirror);
# one older than this under our held mirror lock is a leftover of a killed process.
STALE_GIT_LOCK_AGE = 5.0


def keep_ref(sha: str) -> str:
    return KEEP_PREFIX + sha


def open_existing(mirror: str) -> pygit2.Repository:
    return pygit2.Repository(mirror)


def is_usable(mirror: str) -> bool:
    if not os.path.isfile(os.path.join(mirror, "HEAD")):
        return False
    try:
        open_existing(mirror)
    except (pygit2.GitError, KeyError, ValueError):
        return False
    return True


def open_or_create(paths: RepoPaths, build_dir: str) -> pygit2.Repository:
    """The mirror, created (in build_dir, then renamed into place) if missing.

    A mirror damaged beyond opening is moved to trash and rebuilt: checkouts that
    borrowed from it are then re-made by verify/gc, never served half-broken.
    """
    if os.path.isdir(paths.mirror) and not is_usable(paths.mirror):
        os.rename(paths.mirror, paths.trash_slot("broken-mirror"))
    if not os.path.isdir(paths.mirror):
        shutil.rmtree(build_dir, ignore_errors=True)
        repo = pygit2.init_repository(build_dir, bare=True)
        for key, value in MIRROR_CONFIG.items():
            repo.config[key] = value
        os.rename(build_dir, paths.mirror)
    return pygit2.Repository(paths.mirror)


def remove_stale_git_locks(mirror: str, now: float | None = None) -> list[str]:
    """Delete git *.lock files left in the mirror by killed git processes.

    Safe only with the mirror lock held: every writer we start holds it (git
    children inherit it), so no live writer of ours can own these files.
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
                    if now - os.lstat(path).st_mtime >= STALE_GIT_LOCK_AGE:
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


def has_commit(repo: pygit2.Repository, sha: str) -> bool:
    try:
        obj = repo.get(sha)
    except (ValueError, pygit2.GitError):
        return False
    return obj is not None and obj.type == pygit2.enums.ObjectType.COMMIT


def keep(repo: pygit2.Repository, sha: str) -> None:
    repo.references.create(keep_ref(sha), sha, force=True)


def kept_shas(repo: pygit2.Repository) -> list[str]:
    return [name[len(KEEP_PREFIX):] for name in repo.references if name.startswith(KEEP_PREFIX)]


def drop_keep(repo: pygit2.Repository, sha: str) -> None:
    try:
        repo.references.delete(keep_ref(sha))
    except (KeyError, pygit2.GitError):
        pass
