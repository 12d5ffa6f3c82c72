"""Making one commit's checkout from the mirror, in a scratch directory.

The result is a small git repository of its own: its objects are borrowed from
the mirror (objects/info/alternates), HEAD is detached at the commit, and the
full tree and index are written by libgit2, so `git status` is clean and
`git log` works. It takes no lock on the mirror: the commit's keep-ref, made
before we start, keeps every object we read.
"""

from __future__ import annotations

import os
from typing import Callable

import pygit2

from .gitenv import SAFE_CONFIG

CHECKOUT_CONFIG = {**SAFE_CONFIG, "core.symlinks": "true", "core.filemode": "true"}
CHECKOUT_CONFIG.pop("protocol.ext.allow")


def build_checkout(tree_dir: str, mirror_objects: str, sha: str,
                   on_progress: Callable[[dict], None] | None = None) -> None:
    repo = pygit2.init_repository(tree_dir, bare=False)
    with open(os.path.join(tree_dir, ".git", "objects", "info", "alternates"), "w") as handle:
        handle.write(mirror_objects + "\n")
    for key, value in CHECKOUT_CONFIG.items():
        repo.config[key] = value
    repo = pygit2.Repository(tree_dir)  # reopen so the alternates are read
    commit = repo[sha].peel(pygit2.Commit)
    repo.set_head(commit.id)

    callbacks = None
    if on_progress is not None:
        class Progress(pygit2.CheckoutCallbacks):
            def checkout_progress(self, path, completed_steps, total_steps):
                on_progress({"phase": "checking out", "files": completed_steps, "total_files": total_steps})

        callbacks = Progress()
    repo.checkout_tree(commit.tree, strategy=pygit2.enums.CheckoutStrategy.FORCE, callbacks=callbacks)
