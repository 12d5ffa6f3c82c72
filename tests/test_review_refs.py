"""A commit reachable only from a review ref (a pull request) on a server that
refuses to hand out an unadvertised id (protocol v0, allowReachableSHA1InWant
false): fetched from the review refs, only as much as needed."""

from __future__ import annotations

import os
import subprocess

import pytest

from .helpers import Upstream, assert_checkout_matches, git, only_repo, run_cli


@pytest.fixture
def pull_request(daemon, tmp_path):
    """A repository whose refs/pull/7/head holds two commits no branch or tag reaches."""
    upstream = Upstream(os.path.join(daemon.base, f"pr-{os.urandom(4).hex()}"))
    upstream.commit({"README.md": "main\n"})
    git("checkout", "-q", "-b", "feature", cwd=upstream.path)
    first = upstream.commit({"feature.txt": "one\n"})
    tip = upstream.commit({"feature.txt": "two\n"})
    git("update-ref", "refs/pull/7/head", tip, cwd=upstream.path)
    git("checkout", "-q", "main", cwd=upstream.path)
    git("branch", "-q", "-D", "feature", cwd=upstream.path)
    operator = tmp_path / "operator-gitconfig"
    operator.write_text("[protocol]\n\tversion = 0\n")  # the server then refuses unadvertised ids
    env = {"CHECKOUTCACHE_GIT_CONFIG": str(operator)}
    url = daemon.url(os.path.basename(upstream.path))
    probe = tmp_path / "probe.git"
    git("init", "-q", "--bare", str(probe))
    refused = subprocess.run(["git", "-c", "protocol.version=0", "fetch", url, first],
                             cwd=probe, capture_output=True, text=True)
    assert "unadvertised" in refused.stderr, "the server must refuse an unadvertised id"
    return upstream, url, first, tip, env


def test_a_pull_request_tip_is_fetched_by_id(root, pull_request):
    upstream, url, _first, tip, env = pull_request
    code, answer, err = run_cli("ensure", url, tip, "--wait", "60", root=root, env=env)
    assert code == 0, (answer, err)
    assert_checkout_matches(answer["path"], upstream.path, tip)  # an advertised tip: by id, as any commit


@pytest.mark.parametrize("transport", ["cli", "pygit2"])
def test_a_commit_inside_a_pull_request_is_fetched_from_the_review_refs(root, pull_request, transport):
    upstream, url, first, _tip, env = pull_request
    env = {**env, "CHECKOUTCACHE_TRANSPORT": transport}
    code, answer, err = run_cli("ensure", url, first, "--wait", "60", root=root, env=env)
    assert code == 0, (answer, err)
    assert_checkout_matches(answer["path"], upstream.path, first)
    mirror = only_repo(root).mirror
    refs = git("for-each-ref", "--format=%(refname)", cwd=mirror).split()
    assert f"refs/keep/{first}" in refs and not [r for r in refs if r.startswith("refs/review/")]
    assert "review ref(s) under refs/pull/*" in open(only_repo(root).clone_log(first)).read()


def test_without_review_refs_the_commit_is_unknown(root, pull_request):
    _upstream, url, first, _tip, env = pull_request
    code, answer, _ = run_cli("ensure", url, first, "--wait", "60", root=root,
                              env={**env, "CHECKOUTCACHE_REVIEW_REFS": "none"})
    assert code == 1 and answer["error"] == "UNKNOWN_COMMIT"


@pytest.mark.slow
def test_review_refs_are_fetched_newest_first_in_batches_up_to_a_cap(root, daemon, tmp_path):
    """Regression: the fallback fetched every refs/pull/* for one commit (100k refs: 224 s and
    300k objects). Now newest first, a batch at a time, stopping at the batch that has it, and
    at most CHECKOUTCACHE_MAX_REVIEW_REFS refs per attempt."""
    upstream = Upstream(os.path.join(daemon.base, f"prs-{os.urandom(4).hex()}"))
    base = upstream.commit({"README.md": "main\n"})
    # 600 pull requests, one commit each on top of main, no branch reaching any.
    stream = "".join(f"commit refs/pull/{n}/head\ncommitter t <t@x> {n} +0000\ndata 3\npr\nfrom {base}\n"
                     f"M 100644 inline pr.txt\ndata {len(str(n)) + 1}\n{n}\n\n" for n in range(1, 601))
    subprocess.run(["git", "-C", upstream.path, "fast-import", "--quiet"], input=stream.encode(), check=True)
    old_pr = git("rev-parse", "refs/pull/5/head^{commit}", cwd=upstream.path)
    new_pr = git("rev-parse", "refs/pull/598/head^{commit}", cwd=upstream.path)
    operator = tmp_path / "operator-gitconfig"
    operator.write_text("[protocol]\n\tversion = 0\n")
    # Each commit sits one below its PR's tip, so it is no advertised tip: reach it through a child.
    for n, sha in ((5, old_pr), (598, new_pr)):
        child = git("commit-tree", f"{sha}^{{tree}}", "-p", sha, "-m", "child", cwd=upstream.path)
        git("update-ref", f"refs/pull/{n}/head", child, cwd=upstream.path)
    env = {"CHECKOUTCACHE_GIT_CONFIG": str(operator)}
    url = daemon.url(os.path.basename(upstream.path))
    code, answer, err = run_cli("ensure", url, new_pr, "--wait", "60", root=root, env=env)
    assert code == 0, (answer, err)
    log = open(only_repo(root).clone_log(new_pr)).read()
    assert "found in review ref batch 1 (200 ref(s) fetched)" in log, log
    code, answer, _ = run_cli("ensure", url, old_pr, "--wait", "60", root=root,
                              env={**env, "CHECKOUTCACHE_MAX_REVIEW_REFS": "250"})
    assert code == 1 and answer["error"] == "UNKNOWN_COMMIT", answer
    assert "newest 250 of the server's 600 review refs" in answer["message"], answer
    assert "CHECKOUTCACHE_MAX_REVIEW_REFS" in answer["message"]
    code, answer, err = run_cli("ensure", url, old_pr, "--wait", "60", root=root + "-2", env=env)
    assert code == 0, (answer, err)
    assert_checkout_matches(answer["path"], upstream.path, old_pr)
    assert "found in review ref batch 3 (600 ref(s) fetched)" in open(only_repo(root + "-2").clone_log(old_pr)).read()
