"""A checkoutcache store seen from the tests: every path comes from
checkoutcache.store.layout (never a string join), snapshots, and the check
that a checkout equals its commit."""

from __future__ import annotations

import hashlib
import os
import time

from checkoutcache.store.layout import READY_MARKER, RepoPaths, RootPaths

from .repos import git
from .tree import walk


def only_repo(root: str) -> RepoPaths:
    """The paths of the one repository store under root (fails if there is not exactly one)."""
    root_paths = RootPaths(root)
    keys = root_paths.repo_keys()
    assert len(keys) == 1, keys
    return root_paths.repo(keys[0])


def writers_only(root: str, relative: str) -> bool:
    """Whether a path (relative to root) lies in a writers-only directory (store/layout.py
    private_dirs), which no reader may enter."""
    paths = RootPaths(root)
    private = [*paths.private_dirs, *(d for key in paths.repo_keys() for d in paths.repo(key).private_dirs)]
    full = os.path.join(root, relative)
    return any(full == d or full.startswith(d + "/") for d in private)


def marker(checkout: str) -> str:
    """The ready marker of a checkout directory."""
    return RepoPaths.ready_marker_in(checkout)


def make_idle(checkout: str, seconds: float) -> None:
    """Make a checkout look last used `seconds` ago (its marker's mtime is the last use)."""
    then = time.time() - seconds
    os.utime(marker(checkout), (then, then))


def store_snapshot(root: str) -> dict[str, tuple[int, int, int]]:
    """Size, mtime and mode of every entry under root: any write shows."""
    return {entry.path: (entry.info.st_size, entry.info.st_mtime_ns, entry.info.st_mode) for entry in walk(root)}


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def checkout_tree(checkout: str) -> dict[str, tuple[str, str]]:
    """The work tree as git would list it: path -> (mode, blob id); .git excluded."""
    actual = {}
    for entry in walk(checkout, skip_top=(".git",)):
        if entry.is_link:
            actual[entry.rel] = ("120000", blob_id(os.readlink(entry.path).encode()))
        elif entry.is_file:
            with open(entry.path, "rb") as handle:
                data = handle.read()
            actual[entry.rel] = ("100755" if entry.info.st_mode & 0o100 else "100644", blob_id(data))
    return actual


def assert_checkout_matches(checkout: str, upstream_path: str, sha: str) -> None:
    """The work tree equals the commit's tree (paths, modes, symlinks, content) and git agrees."""
    listing = git("ls-tree", "-r", "-z", sha, cwd=upstream_path)
    expected = {}
    for item in filter(None, listing.split("\0")):
        meta, path = item.split("\t", 1)
        mode, _type, oid = meta.split()
        expected[path] = (mode, oid)
    assert expected, f"commit {sha} lists no files: nothing would be compared"
    assert checkout_tree(checkout) == expected
    assert os.path.isfile(marker(checkout)), "a checkout answered ready has its marker"
    assert git("--no-optional-locks", "status", "--porcelain", cwd=checkout) == ""  # reads only: no index refresh
    assert git("rev-parse", "HEAD", cwd=checkout) == sha
    assert git("log", "-1", "--format=%H", cwd=checkout) == sha


def shallow_entries(root: str) -> list[str]:
    """The only repository's mirror's shallow boundary (none: its history is complete)."""
    path = only_repo(root).mirror_shallow
    return sorted(open(path).read().split()) if os.path.exists(path) else []


def no_history_running(root: str) -> None:
    """Until no background history (clone/history.py) runs and none is about to: a worker
    starts its mirror's history after its ready answer, so the history's lock alone may be
    free before that history takes it (CI saw a test's own history find the first one
    running, and never start). The worker holds its clone lock until the history holds its
    own: settled() waits for both."""
    settled(root)


def settled(root: str, timeout: float = 120) -> None:
    """Wait until the root's clones have finished their own tidying: a worker answers ready at
    its publish, then records the tree's size and removes its scratch and record (readers
    never wait for that), and after a shallow first answer starts the mirror's history,
    which writes the store until it ends (clone/history.py), so a test that snapshots the
    store after a ready answer waits for both (every clone lock and the history's free)."""
    from checkoutcache.store import locks

    from .waiting import wait_until

    def quiet() -> bool:
        for key in os.listdir(os.path.join(root, "repos")):
            if key.startswith("."):
                continue
            paths = RootPaths(root).repo(key)
            if os.listdir(paths.scratch_dir) or [n for n in os.listdir(paths.state_dir) if n.endswith(".clone.json")]:
                return False
            if any(locks.clone_running(paths, name) for name in paths.clone_lock_names()):
                return False
            if locks.history_running(paths):
                return False
        return True

    wait_until(quiet, timeout, "the clones and the history to finish")


__all__ = ["READY_MARKER", "assert_checkout_matches", "blob_id", "checkout_tree", "make_idle", "marker",
           "only_repo", "settled", "store_snapshot"]
