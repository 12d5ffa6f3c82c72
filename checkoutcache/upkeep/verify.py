"""verify: compare published checkouts with their commits, deeply.

The ready path only makes a cheap check (the marker, the top-level names).
verify makes the deep one through the git interface (git/backend.py): HEAD at
the commit, the commit's objects readable through the mirror, and no tracked
file differing from the commit (without taking git's index lock, so a review's
own git commands in the checkout are never disturbed). Untracked files, a
review's build outputs, are not damage. With remove_broken, a broken checkout
that no command holds is moved into trash (store/checkouts.py), so the next
ensure clones it again; a held one is left for its command and reported.
"""

from __future__ import annotations

import os

from checkoutcache.git.backend import GitBackend
from checkoutcache.store import locks, records
from checkoutcache.store.checkouts import move_checkout_aside, remove_tree
from checkoutcache.store.layout import RepoPaths, RootPaths
from checkoutcache.store.ready import looks_intact


def verify_checkout(paths: RepoPaths, sha: str, backend: GitBackend) -> dict:
    path = paths.checkout(sha)
    problems = []
    record = records.read_json(paths.ready_marker(sha), records.MARKER)
    if record is None:
        problems.append("no ready marker")
    elif not looks_intact(path, record):
        problems.append("top-level entries are missing")
    try:
        with open(os.path.join(path, ".git", "HEAD")) as handle:
            head = handle.read().strip()
    except OSError:
        head = ""
    if head != sha:
        problems.append(f"HEAD is {head[:60]!r}, not the commit")
    elif not problems:
        problems += backend.deep_problems(path, sha)
    return {"commit": sha, "path": path, "ok": not problems, "problems": problems,
            "held": locks.checkout_held(paths.ready_marker(sha))}


def marker_identity(paths: RepoPaths, sha: str) -> tuple[int, int] | None:
    try:
        info = os.stat(paths.ready_marker(sha))
    except OSError:
        return None
    return info.st_dev, info.st_ino


def same_marker_as(paths: RepoPaths, sha: str, seen: tuple[int, int] | None):
    """A recheck under the marker's exclusive lock: what is moved is the checkout
    verify judged, not one a clone published meanwhile (a new marker)."""
    def recheck(_last_use: float) -> str | None:
        return None if marker_identity(paths, sha) == seen else "replaced-meanwhile"

    return recheck


def run_verify(root_paths: RootPaths, backend: GitBackend, key: str | None = None, sha: str | None = None,
               remove_broken: bool = False) -> dict:
    results = []
    for repo_key in root_paths.repo_keys():
        if key is not None and repo_key != key:
            continue
        paths = root_paths.repo(repo_key)
        for commit in paths.checkout_shas():
            if sha is not None and commit != sha:
                continue
            seen = marker_identity(paths, commit)
            result = verify_checkout(paths, commit, backend)
            result["repo"] = repo_key
            if not result["ok"] and remove_broken:
                # The clone lock (if free) lets an unmarked leftover go too; a running clone keeps it.
                clone_lock = locks.clone_of(paths, commit)
                try:
                    moved = move_checkout_aside(paths, commit, "broken", same_marker_as(paths, commit, seen),
                                                clone_lock_held=clone_lock is not None)
                finally:
                    if clone_lock is not None:
                        clone_lock.release()
                result["removed"] = moved.slot is not None
                if moved.slot is not None:
                    remove_tree(moved.slot)
                elif moved.kept:
                    result["kept"] = moved.kept
            results.append(result)
    return {"checkouts": results, "broken": sum(1 for r in results if not r["ok"])}
