"""Which git implementation runs: decided here and nowhere else, from the
transport setting (CHECKOUTCACHE_TRANSPORT): the git CLI unless the setting
says pygit2, or says auto and no git is installed."""

from __future__ import annotations

import shutil

from checkoutcache.git.backend import GitBackend
from checkoutcache.git.cli import GitCliBackend
from checkoutcache.git.libgit2 import Pygit2Backend


def pick_backend(transport: str) -> GitBackend:
    if transport == "pygit2" or (transport == "auto" and shutil.which("git") is None):
        return Pygit2Backend()
    return GitCliBackend()
