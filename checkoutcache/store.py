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

from . import records
from .errors import CheckoutCacheError
from .layout import LAYOUT_VERSION, ROOT_README, RepoPaths, RootPaths
from .repospec import RepoSpec


def root_error(root: str, exc: OSError) -> CheckoutCacheError:
    why = "the disk is full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    return CheckoutCacheError("ROOT_UNUSABLE", root=root, why=why)


def init_root(root_paths: RootPaths) -> None:
    root = root_paths.root
    try:
        os.makedirs(root_paths.repos_dir, mode=0o755, exist_ok=True)
        os.makedirs(root_paths.locks_dir, mode=0o755, exist_ok=True)
        if not os.path.exists(root_paths.readme):
            tmp = f"{root_paths.readme}.{os.getpid()}.tmp"
            with open(tmp, "w") as handle:
                handle.write(ROOT_README.format(version=LAYOUT_VERSION))
            os.replace(tmp, root_paths.readme)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as exc:
        raise root_error(root, exc) from None


def init_repo_store(root_paths: RootPaths, paths: RepoPaths, spec: RepoSpec) -> None:
    init_root(root_paths)
    try:
        os.makedirs(paths.base, mode=0o755, exist_ok=True)
        if not os.path.exists(paths.repo_json):
            records.write_json(paths.repo_json, {
                "url": spec.url, "scope": spec.scope, "is_local": spec.is_local,
                "layout_version": LAYOUT_VERSION, "created_at": time.time()})
        for directory in paths.all_dirs():
            os.makedirs(directory, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise root_error(root_paths.root, exc) from None


def store_exists(paths: RepoPaths) -> bool:
    return os.path.isfile(paths.repo_json) and os.path.isdir(paths.locks_dir)
