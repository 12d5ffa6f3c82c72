"""`checkoutcache demo`: the whole story on a repository built on the spot.

No network, no set-up: a small repository (files, a symlink, an executable,
three commits) is written with libgit2 into a temporary directory, and the
cache (in that directory too, unless --root is given) is asked for its
middle commit three times: at once (cloning), waiting (ready), and again
(ready at once, from the store). The directory is removed at the end unless
--keep; either way the last line says where it was. A demo whose checkout did
not become ready stops before that, exits with the answer's status and leaves
the directory.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import pygit2

from checkoutcache.cache import Cache
from checkoutcache.cli.output import ProgressBar, answer_text, emit_json


def make_demo_repository(path: str) -> list[str]:
    """A small repository with three commits; returns their ids, oldest first."""
    repo = pygit2.init_repository(path, bare=False, initial_head="main")
    author = pygit2.Signature("checkoutcache demo", "demo@example.invalid", 1_700_000_000, 0)
    shas: list[str] = []
    files = {
        "README.md": b"# demo\nA repository made by `checkoutcache demo`.\n",
        "src/app.py": b"print('hello from the demo')\n",
        "tools/run.sh": b"#!/bin/sh\necho run\n",
    }
    for number in range(1, 4):
        files[f"notes/note-{number}.txt"] = f"note {number}\n".encode()
        builder = _tree(repo, files, executable={"tools/run.sh"}, symlinks={"latest-note": f"notes/note-{number}.txt"})
        parents = [shas[-1]] if shas else []
        oid = repo.create_commit("refs/heads/main", author, author, f"commit {number}", builder, parents)
        shas.append(str(oid))
    return shas


def _tree(repo: pygit2.Repository, files: dict[str, bytes], executable: set[str], symlinks: dict[str, str]):
    entries: dict[str, dict] = {}
    for path, data in files.items():
        mode = pygit2.enums.FileMode.BLOB_EXECUTABLE if path in executable else pygit2.enums.FileMode.BLOB
        _put(entries, path.split("/"), repo.create_blob(data), mode)
    for path, target in symlinks.items():
        _put(entries, path.split("/"), repo.create_blob(target.encode()), pygit2.enums.FileMode.LINK)
    return _write(repo, entries)


def _put(entries: dict, parts: list[str], oid, mode) -> None:
    if len(parts) == 1:
        entries[parts[0]] = (oid, mode)
    else:
        _put(entries.setdefault(parts[0], {}), parts[1:], oid, mode)


def _write(repo: pygit2.Repository, entries: dict):
    builder = repo.TreeBuilder()
    for name, value in sorted(entries.items()):
        if isinstance(value, dict):
            builder.insert(name, _write(repo, value), pygit2.enums.FileMode.TREE)
        else:
            builder.insert(name, *value)
    return builder.write()


def _wait_for_history(cache: Cache, timeout: float = 60) -> None:
    """Until no clone worker and no history of the cache runs (the demo's history is a few
    commits: well under a second), or the timeout. The workers first: a worker starts its
    mirror's history after its ready answer and before it lets its clone lock go, so once
    every clone lock is free, a history that will run already holds its own."""
    from checkoutcache.store import locks

    deadline = time.monotonic() + timeout

    def busy() -> bool:
        repos = [cache.paths.repo(key) for key in cache.paths.repo_keys()]
        workers = any(locks.clone_running(paths, name) for paths in repos for name in paths.clone_lock_names())
        return workers or any(locks.history_running(paths) for paths in repos)

    while busy() and time.monotonic() < deadline:
        time.sleep(0.05)


def run_demo(root: str | None, as_json: bool, keep: bool) -> int:
    base = tempfile.mkdtemp(prefix="checkoutcache-demo-")
    upstream = os.path.join(base, "upstream")
    shas = make_demo_repository(upstream)
    cache = Cache(root or os.path.join(base, "cache"))
    commit = shas[1]

    try:
        code = _tell(cache, upstream, commit, shas, as_json)
    finally:  # whatever happened, the directory goes unless kept, and the last line says where it was
        # The first answer was shallow and the mirror's history follows in the background
        # (clone/history.py), fetching from the demo's upstream into the cache: removed under
        # it, the history would fail (or write the cache's directory again after its removal).
        _wait_for_history(cache)
        if not keep:
            import shutil

            shutil.rmtree(base, ignore_errors=True)
        where = base if root is None else f"{base} (the cache root {cache.root} was yours: it stays)"
        if as_json:
            emit_json({"step": "done", "directory": base, "kept": keep, "root": cache.root})
        elif keep:
            print(f"the demo's files are in {where}; remove them when done")
        else:
            print(f"removed the demo's directory {where} (--keep keeps it to look at)")
    return code


def _tell(cache: Cache, upstream: str, commit: str, shas: list[str], as_json: bool) -> int:
    def show(step: str, answer, seconds: float) -> None:
        if as_json:
            emit_json({"step": step, "seconds": round(seconds, 4), "answer": answer.to_json()})
        else:
            print(f"{step} ({seconds * 1000:.1f} ms): {answer_text(answer)}")

    if not as_json:
        print(f"demo repository: {upstream} (commits {', '.join(s[:8] for s in shas)})")
        print(f"cache root:      {cache.root}")
        print(f"$ checkoutcache ensure {upstream} {commit}")
    started = time.perf_counter()
    first = cache.ensure(upstream, commit)
    show("ask", first, time.perf_counter() - started)
    bar = ProgressBar() if sys.stderr.isatty() and not as_json else None
    started = time.perf_counter()
    second = cache.ensure(upstream, commit, wait=120, on_progress=bar)
    if bar is not None:
        bar.close()
    show("wait", second, time.perf_counter() - started)
    started = time.perf_counter()
    third = cache.ensure(upstream, commit)
    show("ask again", third, time.perf_counter() - started)
    if third.state != "ready":
        return third.exit_code
    if not as_json:
        print(f"the checkout holds: {', '.join(sorted(os.listdir(third.path)))}")
    return 0
