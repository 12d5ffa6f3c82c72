"""verify: compare published checkouts with their commits, deeply.

The ready path only makes a cheap check (the marker, the top-level names).
verify makes the deep one through the git interface (git/backend.py): HEAD at
the commit, the commit's objects readable through the mirror, git's status
clean (without taking git's index lock, so a review's own git commands in the
checkout are never disturbed), and, on the git CLI, every tracked path byte for
byte what a fresh checkout of the commit writes (git/written.py: the commit's
own attributes, our checkout config, LFS content or pointers as the marker
says; status alone trusts a file whose stat its index holds). It writes nothing
in the store: a reader with a read-only mount may run it (its scratch is the
system's temporary directory). Untracked files, a review's build outputs, are
not damage. With remove_broken, a broken checkout
that no command holds is moved into trash (store/checkouts.py), so the next
ensure clones it again; a held one is left for its command and reported.
"""

from __future__ import annotations

import os

from checkoutcache.git.backend import GitBackend
from checkoutcache.store import locks, records, tree
from checkoutcache.store.checkouts import move_checkout_aside, remove_tree
from checkoutcache.store.layout import RepoPaths, RootPaths, commit_of
from checkoutcache.store.ready import looks_intact


def verify_checkout(paths: RepoPaths, name: str, backend: GitBackend) -> dict:
    path = paths.checkout(name)
    sha = commit_of(name)
    problems = []
    record = records.read_json(paths.ready_marker(name), records.MARKER)
    if record is None:
        problems.append("no ready marker")
    elif not looks_intact(path, record):
        problems.append("top-level entries are missing")
    try:  # beneath the root, never blocking on or following what a peer put there (a FIFO, a link)
        with os.fdopen(tree.open_file(os.path.join(path, ".git", "HEAD"), os.O_RDONLY), "rb") as handle:
            head = handle.read(128).decode(errors="replace").strip()
    except OSError:
        head = ""
    if head != sha:
        problems.append(f"HEAD is {head[:60]!r}, not the commit")
    elif not problems:
        problems += backend.deep_problems(path, sha)
        if not problems and getattr(backend, "name", None) == "cli":
            # What git's status cannot see (it trusts a file whose stat its index holds): the
            # bytes, as a fresh checkout of the commit would write them with its attributes.
            from checkoutcache.git.written import differences

            problems += differences(backend.git, path, paths.mirror_objects, sha,
                                    tuple(record.get("sparse") or ()), lfs_filter_of(record))
    return {"commit": sha, "name": name, "path": path, "ok": not problems, "problems": problems,
            "held": locks.checkout_held(paths.ready_marker(name))}


def lfs_filter_of(marker: dict) -> bool:
    """Whether the checkout's top-level tree went through git-lfs's smudge (its LFS files hold
    their content): recorded since issue 33; before, an answer of content said so."""
    recorded = marker.get("lfs_filter")
    return recorded if recorded is not None else marker.get("lfs") == "content"


def marker_identity(paths: RepoPaths, name: str) -> tuple[int, int] | None:
    try:
        info = tree.lstat(paths.ready_marker(name))  # beneath the root, never through a symlink
    except OSError:
        return None
    return info.st_dev, info.st_ino


def same_marker_as(paths: RepoPaths, name: str, seen: tuple[int, int] | None):
    """A recheck under the marker's exclusive lock: what is moved is the checkout
    verify judged, not one a clone published meanwhile (a new marker)."""
    def recheck(_last_use: float) -> str | None:
        return None if marker_identity(paths, name) == seen else "replaced-meanwhile"

    return recheck


def run_verify(root_paths: RootPaths, backend: GitBackend, key: str | None = None, sha: str | None = None,
               remove_broken: bool = False) -> dict:
    results = []
    for repo_key in root_paths.repo_keys():
        if key is not None and repo_key != key:
            continue
        paths = root_paths.repo(repo_key)
        for name in paths.checkout_names():
            if sha is not None and commit_of(name) != sha:
                continue
            seen = marker_identity(paths, name)
            result = verify_checkout(paths, name, backend)
            result["repo"] = repo_key
            if not result["ok"] and remove_broken:
                # The clone lock (if free) lets an unmarked leftover go too; a running clone keeps it.
                clone_lock = locks.clone_of(paths, name)
                try:
                    moved = move_checkout_aside(paths, name, "broken", same_marker_as(paths, name, seen),
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
