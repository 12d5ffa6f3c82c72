"""Only commits are commits: an id naming an annotated tag, a tree or a blob is
the caller's mistake, answered alike by both transports, and nothing is
published for it."""

from __future__ import annotations

import os

import pytest

from .helpers import git, run_cli


@pytest.mark.parametrize("transport", ["cli", "pygit2"])
@pytest.mark.parametrize("kind", ["tag", "tree", "blob"])
@pytest.mark.slow
def test_an_id_that_is_not_a_commit_is_an_input_error(root, upstream, transport, kind):
    target = upstream.shas[1]
    git("tag", "-a", "v1", "-m", "release", target, cwd=upstream.path)
    object_id = {"tag": "v1", "tree": f"{target}^{{tree}}", "blob": f"{target}:README.md"}[kind]
    sha = git("rev-parse", object_id, cwd=upstream.path)
    env = {"CHECKOUTCACHE_TRANSPORT": transport}
    code, answer, err = run_cli("ensure", upstream.path, sha, "--wait", "60", root=root, env=env)
    assert code == 2, (answer, err)
    assert answer["state"] == "failed" and answer["error"] == "NOT_A_COMMIT", answer
    assert sha in answer["message"] and kind in answer["message"] and answer["next"]
    if kind == "tag":
        assert f"commit {target}" in answer["message"]  # names the commit to ask for instead
    (key,) = os.listdir(os.path.join(root, "repos"))
    base = os.path.join(root, "repos", key)
    assert os.listdir(os.path.join(base, "checkouts")) == []
    assert os.listdir(os.path.join(base, "scratch")) == []
    assert git("for-each-ref", "refs/keep/", cwd=os.path.join(base, "mirror.git")) == ""
    again = run_cli("ensure", upstream.path, sha, root=root, env=env)  # answered from the record
    assert again[0] == 2 and again[1]["error"] == "NOT_A_COMMIT"
    # The commit the tag names is served as usual.
    code, answer, _ = run_cli("ensure", upstream.path, target, "--wait", "60", root=root, env=env)
    assert code == 0 and os.path.basename(answer["path"]) == target
