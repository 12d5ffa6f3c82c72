"""One repository, one key: equivalent spellings of a repository share one
store, one mirror and one clone per commit; stores made under layout v1's
keys keep serving."""

from __future__ import annotations

import os
import shutil

import pytest

from checkoutcache.repospec import parse_repo, repo_key
from checkoutcache.store.layout import RootPaths

from .helpers import Upstream, git, run_cli, wait_ready


@pytest.mark.parametrize("first, second", [
    ("git@github.com:org/repo", "ssh://git@github.com/org/repo"),
    ("ssh://git@github.com/org/repo.git", "git@github.com:org/repo.git/"),
    ("https://GitHub.com/org/repo.git", "https://github.com:443/org/repo/"),
    ("git://Example.com/org/repo.git", "git://example.com:9418/org/repo"),
])
def test_equivalent_urls_have_one_key(first, second):
    assert parse_repo(first).key == parse_repo(second).key
    assert parse_repo(first, "tenant-a").key != parse_repo(second, "tenant-b").key


def test_distinct_repositories_keep_distinct_keys():
    keys = {parse_repo(url).key for url in ("ssh://git@host/org/repo", "ssh://other@host/org/repo",
                                            "https://host/org/repo", "https://host/org/repo2",
                                            "https://host/org/repo.git2")}
    assert len(keys) == 5


def served_bare(daemon, name: str) -> Upstream:
    work = Upstream(os.path.join(daemon.base, f"{name}-work"))
    work.standard_history()
    git("clone", "-q", "--bare", work.path, os.path.join(daemon.base, f"{name}.git"))
    return work


def clones_of(root: str) -> list[str]:
    return [key for key in RootPaths(root).repo_keys()]


@pytest.mark.slow
def test_url_variants_share_one_store_and_one_clone(root, daemon):
    upstream = served_bare(daemon, "variants")
    sha = upstream.shas[0]
    base = daemon.url("variants")
    answers = [wait_ready(root, url, sha) for url in
               (base, base + ".git", base + ".git/", base + "/")]
    assert len({a["path"] for a in answers}) == 1
    assert len(clones_of(root)) == 1


def test_a_local_path_and_its_dot_git_are_one_repository(root, upstream):
    sha = upstream.shas[0]
    first = wait_ready(root, upstream.path, sha)
    code, second, _ = run_cli("ensure", os.path.join(upstream.path, ".git"), sha, root=root)
    assert code == 0 and second["path"] == first["path"]
    code, third, _ = run_cli("ensure", "file://" + upstream.path + "/", sha, root=root)
    assert code == 0 and third["path"] == first["path"]
    assert len(clones_of(root)) == 1


def test_a_store_made_under_a_layout_v1_key_keeps_serving(root, daemon):
    upstream = served_bare(daemon, "legacy")
    sha = upstream.shas[0]
    url = daemon.url("legacy") + ".git"
    spec = parse_repo(url)
    assert spec.legacy_key == repo_key("default", url) and spec.legacy_key != spec.key
    made = wait_ready(root, url, sha)
    # As if layout v1 had made it: the same store under the key of the raw spelling.
    paths = RootPaths(root)
    os.rename(paths.repo(spec.key).base, paths.repo(spec.legacy_key).base)
    code, answer, _ = run_cli("ensure", url, sha, root=root)
    assert code == 0 and answer["path"] == made["path"].replace(spec.key, spec.legacy_key)
    assert clones_of(root) == [spec.legacy_key]
    code, status, _ = run_cli("status", url, root=root)
    assert code == 0 and [r["key"] for r in status["repos"]] == [spec.legacy_key]
    shutil.rmtree(paths.repo(spec.legacy_key).base)
