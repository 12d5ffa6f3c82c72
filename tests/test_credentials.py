"""Invariant 8: a token given in the URL or the environment never reaches a
file under the root, an answer, an error or a log line."""

from __future__ import annotations

import base64
import os

from checkoutcache.repospec import parse_repo
from checkoutcache.store.create import init_repo_store
from checkoutcache.store.layout import RootPaths

from .helpers import files_under, grep_tree, run_cli, wait_ready

TOKEN = "s3cr3t-T0KEN-do-not-leak"


def assert_no_trace(root: str | None, *outputs: str) -> None:
    """No trace of the token in any file under root (which must hold files: else nothing was searched)
    nor in any output."""
    encoded = base64.b64encode(f"user:{TOKEN}".encode())
    if root is not None:
        assert files_under(root), "the store holds files to search"
    assert outputs and all(outputs), "outputs to search"
    for needle in (TOKEN.encode(), encoded):
        if root is not None:
            assert grep_tree(root, needle) == []
        for out in outputs:
            assert needle.decode() not in out


def test_token_in_an_unreachable_url_is_never_shown(root):
    url = f"https://user:{TOKEN}@127.0.0.1:9/team/repo.git"
    code, answer, out = run_cli("ensure", url, "a" * 40, "--wait", "20", root=root)
    assert code == 1 and answer["error"] == "UNREACHABLE"
    assert answer["repo"] == "https://127.0.0.1:9/team/repo.git"
    assert_no_trace(root, out)
    # Only the unreachable repository's failure record: no store, and no token in it (assert_no_trace).
    assert [os.path.relpath(p, root).split(os.sep)[0] for p in files_under(root)] == ["unreachable"] * 2


def test_token_used_by_a_worker_leaves_no_trace(root):
    # A store that already exists (first contact done) for an https URL whose
    # server is down: the worker gets the token, git fails and prints the URL.
    url = f"https://user:{TOKEN}@127.0.0.1:9/team/repo.git"
    spec = parse_repo(url)
    assert spec.credential.password == TOKEN and TOKEN not in spec.url and TOKEN not in repr(spec)
    init_repo_store(RootPaths(root), RootPaths(root).repo(spec.key), spec)
    code, answer, out = run_cli("ensure", url, "a" * 40, "--wait", "30", root=root)
    assert code == 1 and answer["error"] == "UNREACHABLE", answer
    assert "127.0.0.1" in answer["message"]
    status_code, _, status_out = run_cli("status", root=root)
    human = run_cli("status", root=root, env={"TERM": "dumb"})[2]
    assert status_code == 0
    assert_no_trace(root, out, status_out, human)


def test_token_from_the_environment_leaves_no_trace(root):
    url = "https://127.0.0.1:9/team/repo.git"
    spec = parse_repo(url)
    init_repo_store(RootPaths(root), RootPaths(root).repo(spec.key), spec)
    env = {"CHECKOUTCACHE_GIT_USERNAME": "user", "CHECKOUTCACHE_GIT_PASSWORD": TOKEN}
    code, answer, out = run_cli("ensure", url, "b" * 40, "--wait", "30", root=root, env=env)
    assert code == 1 and answer["error"] == "UNREACHABLE"
    assert_no_trace(root, out)


def test_userinfo_on_a_git_url_is_dropped_and_the_clone_works(root, served_upstream):
    upstream, url = served_upstream
    with_token = url.replace("git://", f"git://user:{TOKEN}@")
    answer = wait_ready(root, with_token, upstream.shas[0])
    assert answer["repo"] == url
    assert_no_trace(root, str(answer))
