"""Creating a root and a repository store on first use.

Nothing is created before a request has passed validation and, for a
repository never seen before, the first contact (invariant 9: bad input and
unreachable repositories write nothing). repo.json is written whole before the
rest of the store, so a store directory without it is an interrupted creation
that gc may remove.
"""

from __future__ import annotations

import errno
import os
import time

from checkoutcache.errors import CheckoutCacheError, disk_full, is_disk_full
from checkoutcache.repospec import RepoSpec
from checkoutcache.store import records, tree
from checkoutcache.store.ready import layout_version_of
from checkoutcache.store.layout import (
    LAYOUT_VERSION,
    ROOT_README,
    RepoPaths,
    RootPaths,
    existing_key,
)


def make_dirs(path: str) -> None:
    """Like os.makedirs, but every level it creates gets DIR_MODE whatever the umask
    (os.makedirs gives the intermediate ones 0777 minus the umask: world-writable under umask 0),
    and below a root every level is made and entered without following a symlink (store/tree.py)."""
    tree.make_dirs(path)


def root_error(root: str, exc: OSError) -> CheckoutCacheError:
    if is_disk_full(exc):
        return disk_full(exc)
    where = f"{exc.filename}: " if isinstance(exc.filename, str) else ""
    return CheckoutCacheError("ROOT_UNUSABLE", root=root, why=f"{where}{exc.strerror or exc}")


def existing_root_problem(root_paths: RootPaths, write: bool) -> CheckoutCacheError | None:
    """Why gc or status cannot work on this root (ROOT_UNUSABLE), or None: it must already be
    a directory (a misspelled root is a mistake to report, never an empty store to skip) that
    this user can read (and, for write, change)."""
    root = root_paths.root
    if not os.path.lexists(root):
        return CheckoutCacheError("ROOT_UNUSABLE", root=root, why="there is no such directory (nothing was ever "
                                                                  "cached there: check --root or CHECKOUTCACHE_ROOT)")
    if not os.path.isdir(root):
        return CheckoutCacheError("ROOT_UNUSABLE", root=root, why="it is not a directory")
    wanted = os.R_OK | os.X_OK | (os.W_OK if write else 0)
    if not os.access(root, wanted):
        return CheckoutCacheError("ROOT_UNUSABLE", root=root, why=f"this user may not {'change' if write else 'read'} "
                                                                  f"it")
    return None


def init_root(root_paths: RootPaths) -> None:
    root = root_paths.root
    try:
        make_dirs(root_paths.repos_dir)
        tree.make_private_dir(root_paths.locks_dir)
        if not tree.lexists(root_paths.readme):
            tmp = f"{root_paths.readme}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
            fd = tree.open_file(tmp, os.O_WRONLY | os.O_TRUNC | os.O_EXCL, create=True)
            with os.fdopen(fd, "w") as handle:
                handle.write(ROOT_README.format(version=LAYOUT_VERSION))
            tree.rename(tmp, root_paths.readme)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as exc:
        raise root_error(root, exc) from None


def init_repo_store(root_paths: RootPaths, paths: RepoPaths, spec: RepoSpec) -> None:
    init_root(root_paths)
    try:
        make_dirs(paths.base)
        if not tree.lexists(paths.repo_json):
            records.write_json(paths.repo_json, {
                "url": spec.url, "scope": spec.scope, "is_local": spec.is_local,
                "layout_version": LAYOUT_VERSION, "created_at": time.time(), "lfs": spec.lfs,
                "submodules": spec.submodules})
        for directory in paths.all_dirs():
            if directory in paths.private_dirs:
                tree.make_private_dir(directory)
            else:
                make_dirs(directory)
    except OSError as exc:
        raise root_error(root_paths.root, exc) from None


def refuse_newer_layout(paths: RepoPaths, url: str) -> None:
    """NEWER_LAYOUT when the repository's store was written by a newer version: this one
    writes nothing there (a rollback must not corrupt what a newer version made)."""
    found = layout_version_of(paths.repo_json)
    if found is not None and found > LAYOUT_VERSION:
        raise CheckoutCacheError("NEWER_LAYOUT", repo=url, found=found, known=LAYOUT_VERSION)


def store_exists(paths: RepoPaths) -> bool:
    """The store was made; tree.NotBeneath (an OSError) when repos/<key> or one of its
    directories is a symlink or a file: such a store is refused, never used through it."""
    refused = tree.refusal(paths.base)
    if refused is not None:
        raise refused
    return tree.is_file(paths.repo_json) and tree.is_dir(paths.locks_dir)

def store_key(root_paths: RootPaths, spec: RepoSpec) -> RepoSpec:
    """The spec with the key of the store to use (store/layout.py existing_key)."""
    key = existing_key(root_paths, spec.key, spec.legacy_key)
    return spec if key == spec.key else spec._replace(key=key, legacy_key=None)
