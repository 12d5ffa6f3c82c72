"""Which processes work in a tree (store/liveness.py InUse): by the paths /proc shows, then
by identity, walking up `..` from each directory a process is in or holds a file in. Real
processes made by the tests."""

from __future__ import annotations

import os
import subprocess
import sys

from checkoutcache.store.liveness import MAX_WALK, in_use_beneath, paths_in_use

from .helpers import wait_until

STAY = "import sys, time\nprint('in', flush=True)\nsys.stdin.read()\n"


def stay_in(cwd: str, *open_files: str) -> subprocess.Popen:
    """A process whose working directory is cwd, holding these files open, until its stdin closes."""
    script = "".join(f"held{n} = open({path!r})\n" for n, path in enumerate(open_files)) + STAY
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=cwd, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "in"
    return proc


def ended(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(30)


def test_a_tree_is_in_use_by_a_process_below_it_and_only_then(tmp_path):
    tree, other = tmp_path / "tree", tmp_path / "other"
    (tree / "a" / "b").mkdir(parents=True)
    (other / "x").mkdir(parents=True)
    (tree / "file.txt").write_text("x")
    inside = stay_in(str(tree / "a" / "b"))
    try:
        found = paths_in_use()
        assert in_use_beneath(str(tree), found) and in_use_beneath(str(tree / "a"), found)
        assert not in_use_beneath(str(other), found) and not in_use_beneath(str(tree / "a" / "c"), found)
    finally:
        ended(inside)
    # Only a file open in the tree, its working directory elsewhere; the tree seen through a
    # symlinked path (the string does not match, the identity does).
    holder = stay_in(str(other / "x"), str(tree / "file.txt"))
    try:
        os.symlink(tmp_path, tmp_path / "alias")
        found = paths_in_use()
        assert in_use_beneath(str(tmp_path / "alias" / "tree"), found)
        assert in_use_beneath(str(tree), found) and not in_use_beneath(str(tree / "a"), found)
    finally:
        ended(holder)
    assert not in_use_beneath(str(tree), paths_in_use())


def test_a_tree_renamed_after_the_look_is_still_seen_by_identity(tmp_path):
    """The paths /proc showed name the tree's old place; its directories are the same."""
    tree = tmp_path / "tree"
    (tree / "deep").mkdir(parents=True)
    inside = stay_in(str(tree / "deep"))
    try:
        found = paths_in_use()
        os.rename(tree, tmp_path / "moved")
        assert in_use_beneath(str(tmp_path / "moved"), found)
    finally:
        ended(inside)


def test_a_process_deeper_than_the_walk_counts_as_in_every_tree(tmp_path):
    """Past MAX_WALK levels nothing is placed: a tree then counts as in use (a spare is only
    saved time), and the look stays bounded."""
    deep = tmp_path / "deep"
    path = str(deep)
    os.makedirs(path)
    fd = os.open(path, os.O_DIRECTORY)
    try:  # made relative to a descriptor: deeper than a path can be written
        for _ in range(MAX_WALK + 10):
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        proc = subprocess.Popen([sys.executable, "-c", f"import os, sys\nos.fchdir({fd})\nprint('in', flush=True)\n"
                                 "sys.stdin.read()\n"], pass_fds=(fd,), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    finally:
        os.close(fd)
    try:
        assert proc.stdout.readline().strip() == "in"
        unrelated = tmp_path / "unrelated"
        unrelated.mkdir()
        wait_until(lambda: os.path.exists(f"/proc/{proc.pid}/cwd"), what="the process started")
        assert in_use_beneath(str(unrelated), paths_in_use())
    finally:
        ended(proc)
