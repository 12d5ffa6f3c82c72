"""A repository's shallow file: git's record of its history's boundary (the commits whose
parents it lacks), read, written and linked the way the store needs (git/shallow.py says
who writes it when, and why in that order). Plain files only: no git is started."""

from __future__ import annotations

import os

from checkoutcache.git.view import SHALLOW, shallow_removed
from checkoutcache.store import modes

SHALLOW_LOCK = SHALLOW + ".lock"


def shallow_file(git_dir: str) -> str:
    return os.path.join(git_dir, SHALLOW)


def is_shallow(git_dir: str) -> bool:
    """Whether the repository's history has a boundary (one stat, following a checkout's link).
    An empty file lists none: libgit2's fetch writes one (git/libgit2.py)."""
    try:
        return os.stat(os.path.join(git_dir, SHALLOW)).st_size > 0
    except (FileNotFoundError, NotADirectoryError):
        return False


def read_shallow(git_dir: str) -> frozenset[str]:
    """The boundary commits (empty: the history is complete)."""
    try:
        with open(os.path.join(git_dir, SHALLOW)) as handle:
            return frozenset(line.strip() for line in handle if len(line.strip()) in (40, 64))
    except FileNotFoundError:
        return frozenset()


def write_shallow(git_dir: str, commits: frozenset[str] | set[str]) -> None:
    """The boundary becomes these commits (none: the file goes). Caller holds the mirror lock,
    so a shallow.lock found is a killed writer's."""
    target = os.path.join(git_dir, SHALLOW)
    if not commits:
        try:
            os.unlink(target)
        except FileNotFoundError:
            pass
        return
    lock = os.path.join(git_dir, SHALLOW_LOCK)
    try:
        os.unlink(lock)
    except FileNotFoundError:
        pass
    fd = modes.open_created(lock, os.O_WRONLY | os.O_EXCL | os.O_NOFOLLOW)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write("".join(f"{sha}\n" for sha in sorted(commits)))
        os.replace(lock, target)
    except BaseException:
        try:
            os.unlink(lock)
        except FileNotFoundError:
            pass
        raise


def link_shallow(tree_dir: str, mirror_objects: str) -> None:
    """A checkout's .git/shallow: the mirror's, whatever it holds now or later (dangling while
    the mirror's history is complete: git then sees none)."""
    os.symlink(os.path.join(os.path.dirname(mirror_objects), SHALLOW), os.path.join(tree_dir, ".git", SHALLOW))


def after_view_fetch(mirror: str, view: str) -> None:
    """After a fetch through a view of the mirror that succeeded: git unlinked the view's link
    when the history became complete; the mirror's file goes too."""
    if shallow_removed(view):
        write_shallow(mirror, frozenset())
