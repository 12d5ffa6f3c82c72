"""benchmarks/monorepo.py: the generated monorepo is deterministic, its cone rules agree with git's
own cone-mode sparse checkout, and the anchor measurement runs end to end (on a tiny shape)."""

from __future__ import annotations

import subprocess

import pytest

from .helpers import daemons  # noqa: F401 - puts benchmarks/ on the path

import monorepo  # noqa: E402  (benchmarks/monorepo.py)

TINY = monorepo.Shape(files=400, commits=6, changes=20, mean_size=1024, projects=12, pool_lines=5000)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True,
                          env=monorepo.clean_env()).stdout


def test_same_seed_same_commits_other_seed_others(tmp_path):
    one = monorepo.make_monorepo(str(tmp_path / "a.git"), TINY, seed=5, log=lambda *_: None)
    two = monorepo.make_monorepo(str(tmp_path / "b.git"), TINY, seed=5, repack=False, log=lambda *_: None)
    three = monorepo.make_monorepo(str(tmp_path / "c.git"), TINY, seed=6, log=lambda *_: None)
    assert one.commits == two.commits and len(one.commits) == TINY.commits
    assert three.commits[-1] != one.commits[-1]
    assert one.files >= TINY.files
    # every commit after the first edits `changes` files, adds some and deletes one
    changed = git("-C", one.path, "diff-tree", "--no-commit-id", "-r", "--name-status", one.commits[-1]).split("\n")
    assert sum(line.startswith("M") for line in changed) == TINY.changes


def test_cone_rules_match_git_sparse_checkout(tmp_path):
    repo = monorepo.make_monorepo(str(tmp_path / "m.git"), TINY, seed=2, log=lambda *_: None)
    dirs = monorepo.cone_dirs(repo, 0.1)
    deep = next(p.rsplit("/", 1)[0] for p, _, _ in monorepo.tree_entries(repo.path, repo.commits[-1])
                if p.count("/") >= 4)
    dirs = sorted(set(dirs) | {deep})  # a deep one too: files of its ancestors are in the cone
    work = str(tmp_path / "w")
    git("clone", "-q", "--no-checkout", repo.path, work)
    git("-C", work, "sparse-checkout", "set", "--cone", *dirs)
    git("-C", work, "checkout", "-q", "--detach", repo.commits[-1])
    written = {line[2:] for line in git("-C", work, "ls-files", "-t").splitlines() if line.startswith("H ")}
    ours = {p for p, _, _ in monorepo.tree_entries(repo.path, repo.commits[-1]) if monorepo.in_cone(p, dirs)}
    assert written == ours
    # From the tree: given the commit, pathspecs would limit commits (one that changed nothing
    # in the cone lists nothing).
    listed = git("-C", repo.path, "rev-list", "--objects", f"{repo.commits[-1]}^{{tree}}", "--",
                 *monorepo.cone_pathspecs(dirs)).split("\n")
    blobs = {line[41:] for line in listed if line[41:] and git("-C", repo.path, "cat-file", "-t",
                                                                 line[:40]).strip() == "blob"}
    assert blobs == ours
    size = monorepo.cone_size(repo.path, repo.commits[-1], dirs)
    assert size["files"] == len(ours) and size["bytes"] > 0


@pytest.mark.slow
def test_anchor_end_to_end(tmp_path):
    assert monorepo.main(["--files", "300", "--commits", "8", "--changes", "10", "--quick",
                          "--work", str(tmp_path), "--json-out", str(tmp_path / "r.json")]) == 0
    import json
    report = json.loads((tmp_path / "r.json").read_text())
    anchor = report["anchor"]
    assert anchor["clone"]["bytes"] > 0 and anchor["checkout"]["objects"] == anchor["cone"]["blobs"]
    assert anchor["status"]["bytes"] == 0
    assert anchor["disk_after_first"]["tree_files"] == anchor["cone"]["files"]
