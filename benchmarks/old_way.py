"""A faithful reimplementation of the pruning that caused the outage, for the
side-by-side benchmark only. Never use it for anything else.

    python benchmarks/old_way.py ensure ROOT URL SHA     -> prints ready PATH | call-again
    python benchmarks/old_way.py clone ROOT URL SHA      (what ensure starts in the background)

The old system: a checkout per commit in ROOT/<sha>; a clone is made in
ROOT/<sha>.tmp-<pid> (beside the checkouts) and renamed into place; a commit
whose clone finished is remembered in ROOT/.done/<sha>. Every clone ends by
keeping only the newest 3 directories of ROOT by modification time: its glob
also catches other clones' scratch directories and checkouts in use. A commit
remembered as done whose directory is gone answers "call again", forever.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

KEEP_NEWEST = 3


def ensure(root: str, url: str, sha: str) -> str:
    path = os.path.join(root, sha)
    if os.path.isdir(path):
        return f"ready {path}"
    if os.path.exists(os.path.join(root, ".done", sha)):
        return "call-again"  # the bug: finished, but its checkout was pruned
    os.makedirs(os.path.join(root, ".locks"), exist_ok=True)
    try:
        fd = os.open(os.path.join(root, ".locks", sha), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.close(fd)
    except FileExistsError:
        return "call-again"  # a clone is (or was: its crash is never noticed) under way
    subprocess.Popen([sys.executable, os.path.abspath(__file__), "clone", root, url, sha],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return "call-again"


def clone(root: str, url: str, sha: str) -> None:
    scratch = os.path.join(root, f"{sha}.tmp-{os.getpid()}")
    try:
        subprocess.run(["git", "clone", "-q", "--no-checkout", url, scratch], check=True, capture_output=True)
        subprocess.run(["git", "-C", scratch, "checkout", "-q", "--detach", sha], check=True, capture_output=True)
        os.rename(scratch, os.path.join(root, sha))
    except (subprocess.CalledProcessError, OSError):
        shutil.rmtree(scratch, ignore_errors=True)
    finally:
        os.makedirs(os.path.join(root, ".done"), exist_ok=True)
        open(os.path.join(root, ".done", sha), "w").close()
    prune(root)


def prune(root: str) -> None:
    """Keep the newest 3 directories by mtime: the glob includes other clones' scratch."""
    entries = [p for p in glob.glob(os.path.join(root, "*")) if os.path.isdir(p)]
    entries.sort(key=lambda p: os.path.getmtime(p) if os.path.exists(p) else 0, reverse=True)
    for stale in entries[KEEP_NEWEST:]:
        shutil.rmtree(stale, ignore_errors=True)


if __name__ == "__main__":
    command, root, url, sha = sys.argv[1:5]
    os.makedirs(root, exist_ok=True)
    if command == "ensure":
        print(ensure(root, url, sha))
    else:
        clone(root, url, sha)
