"""Which git implementation runs: decided here and nowhere else, from the
transport setting (CHECKOUTCACHE_TRANSPORT): the git CLI unless the setting
says pygit2, or says auto and no git is installed. Each backend's module is
imported only when it is the one picked (a CLI ask never loads libgit2's)."""

from __future__ import annotations

import functools
import shutil

from checkoutcache.git.backend import GitBackend


def pick_backend(transport: str) -> GitBackend:
    if transport == "pygit2" or (transport == "auto" and not _git_installed()):
        from checkoutcache.git.libgit2 import Pygit2Backend

        return Pygit2Backend()
    from checkoutcache.git.cli import GitCliBackend

    return GitCliBackend()


@functools.cache
def _git_installed() -> bool:
    return shutil.which("git") is not None
