"""verify: compare published checkouts with their commits, deeply.

The ready path only makes a cheap check (the marker, the top-level names).
verify makes the deep one: HEAD at the commit, the commit's objects readable
through the mirror, and no tracked file differing from the commit (`git
status`, without taking git's index lock, so a review's own git commands in
the checkout are never disturbed). Untracked files, a review's build outputs,
are not damage. With remove_broken, a broken checkout that no exec holds is
renamed into trash, so the next ensure clones it again.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from . import locks, records
from .gitenv import git_env
from .layout import RepoPaths, RootPaths
from .ready import looks_intact


def _git(path: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "--no-optional-locks", "-C", path, *args], capture_output=True, text=True,
                          env=git_env(), stdin=subprocess.DEVNULL, errors="replace")


def _deep_problems_cli(path: str, sha: str) -> list[str]:
    problems = []
    if _git(path, "cat-file", "-e", f"{sha}^{{tree}}").returncode != 0:
        return ["the commit's objects cannot be read (is the mirror damaged?)"]
    status = _git(path, "status", "--porcelain", "--untracked-files=no")
    if status.returncode != 0:
        problems.append("git status fails: " + (status.stderr.strip().splitlines() or ["?"])[-1][:200])
    elif status.stdout.strip():
        changed = status.stdout.strip().splitlines()
        problems.append(f"{len(changed)} tracked file(s) differ from the commit, e.g. {changed[0].strip()}")
    return problems


def _deep_problems_pygit2(path: str, sha: str) -> list[str]:
    import pygit2

    try:
        repo = pygit2.Repository(path)
        repo[sha].peel(pygit2.Tree)
        changed = [p for p, flags in repo.status(untracked_files="no").items() if flags]
    except (pygit2.GitError, KeyError, ValueError) as exc:
        return [f"the commit's objects cannot be read: {exc}"]
    return [f"{len(changed)} tracked file(s) differ from the commit, e.g. {changed[0]}"] if changed else []


def verify_checkout(paths: RepoPaths, sha: str) -> dict:
    path = paths.checkout(sha)
    problems = []
    record = records.read_json(paths.ready_marker(sha))
    if record is None:
        problems.append("no ready marker")
    elif not looks_intact(path, record):
        problems.append("top-level entries are missing")
    try:
        head = open(os.path.join(path, ".git", "HEAD")).read().strip()
    except OSError:
        head = ""
    if head != sha:
        problems.append(f"HEAD is {head[:60]!r}, not the commit")
    elif not problems:
        problems += (_deep_problems_cli if shutil.which("git") else _deep_problems_pygit2)(path, sha)
    return {"commit": sha, "path": path, "ok": not problems, "problems": problems,
            "held": locks.is_locked(paths.ready_marker(sha))}


def move_aside(paths: RepoPaths, sha: str, why: str) -> str | None:
    """Rename a checkout into trash unless an exec holds it; returns its trash path."""
    marker = paths.ready_marker(sha)
    exclusive = locks.try_lock(marker, shared=False, create=False) if os.path.exists(marker) else None
    if exclusive is None and os.path.exists(marker):
        return None  # held: never pulled from under a running command
    slot = paths.trash_slot(f"{why}-{sha}")
    try:
        os.rename(paths.checkout(sha), slot)
        return slot
    except FileNotFoundError:
        return None
    finally:
        if exclusive is not None:
            exclusive.release()


def run_verify(root_paths: RootPaths, key: str | None = None, sha: str | None = None,
               remove_broken: bool = False) -> dict:
    results = []
    for repo_key in root_paths.repo_keys():
        if key is not None and repo_key != key:
            continue
        paths = root_paths.repo(repo_key)
        for commit in paths.checkout_shas():
            if sha is not None and commit != sha:
                continue
            result = verify_checkout(paths, commit)
            result["repo"] = repo_key
            if not result["ok"] and remove_broken:
                slot = move_aside(paths, commit, "broken")
                result["removed"] = slot is not None
                if slot is not None:
                    shutil.rmtree(slot, ignore_errors=True)
            results.append(result)
    return {"checkouts": results, "broken": sum(1 for r in results if not r["ok"])}
