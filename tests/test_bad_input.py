"""Invariant 9: bad input gets a code, a message, a next step and a non-zero
exit, and writes nothing under the root."""

from __future__ import annotations

import os

import pytest

from checkoutcache import Cache

from .helpers import files_under, run_cli

SHA = "0123456789abcdef0123456789abcdef01234567"


def bad_commits():
    return [
        ("abbreviated", "0123456", "BAD_COMMIT"),
        ("non-hex", "g" * 40, "BAD_COMMIT"),
        ("branch", "main", "BAD_COMMIT"),
        ("ref", "refs/heads/main", "BAD_COMMIT"),
        ("empty", "", "BAD_COMMIT"),
        ("over-long", "a" * 41, "BAD_COMMIT"),
        ("very long", "a" * 5000, "BAD_COMMIT"),
        ("sha256", "a" * 64, "BAD_COMMIT"),
        ("option", "--upload-pack=touch /tmp/x", "BAD_ARGUMENT"),  # refused by the option parser
        ("newline", SHA[:39] + "\n", "BAD_COMMIT"),
        ("revision syntax", "HEAD~1", "BAD_COMMIT"),
    ]


def bad_repos(tmp_path):
    not_repo = tmp_path / "plain-dir"
    not_repo.mkdir()
    return [
        ("dotdot path", str(tmp_path / "a" / ".." / "upstream"), "BAD_REPO"),
        ("dotdot url", "https://example.com/a/../b.git", "BAD_REPO"),
        ("nul", "/tmp/repo\x00evil", "BAD_REPO"),
        ("newline", "https://example.com/r\n.git", "BAD_REPO"),
        ("option", "--upload-pack=touch /tmp/pwned", "BAD_ARGUMENT"),  # refused by the option parser
        ("dash path", "-repo", "BAD_ARGUMENT"),
        ("empty", "", "BAD_REPO"),
        ("too long", "https://example.com/" + "a" * 3000, "BAD_REPO"),
        ("ext transport", "ext::sh -c touch% /tmp/pwned", "UNSAFE_TRANSPORT"),
        ("fd transport", "fd::3", "UNSAFE_TRANSPORT"),
        ("http", "http://example.com/r.git", "UNSAFE_TRANSPORT"),
        ("ftp", "ftp://example.com/r.git", "UNSAFE_TRANSPORT"),
        ("query", "https://example.com/r.git?x=1", "BAD_REPO"),
        ("no host", "https:///r.git", "BAD_REPO"),
        ("not a repository", str(not_repo), "NOT_A_REPOSITORY"),
        ("missing path", str(tmp_path / "does-not-exist"), "NOT_A_REPOSITORY"),
    ]


@pytest.mark.parametrize("name,commit,code", bad_commits(), ids=[c[0] for c in bad_commits()])
def test_bad_commit(root, upstream, name, commit, code):
    exit_code, answer, _ = run_cli("ensure", upstream.path, commit, root=root)
    assert exit_code == 2
    assert answer["state"] == "failed" and answer["error"] == code
    assert answer["message"] and answer["next"]
    assert not os.path.exists(root)


@pytest.mark.parametrize("index", range(16))
def test_bad_repo_through_the_library(root, tmp_path, index):
    name, repo, code = bad_repos(tmp_path)[index]
    answer = Cache(root).ensure(repo, SHA)
    expected = "BAD_REPO" if code == "BAD_ARGUMENT" else code  # no option parser in the library
    assert (answer.state, answer.error, answer.exit_code) == ("failed", expected, 2), name
    assert not os.path.exists(root)


@pytest.mark.parametrize("index", [i for i in range(16) if i != 2])  # argv cannot carry a NUL
def test_bad_repo(root, tmp_path, index):
    name, repo, code = bad_repos(tmp_path)[index]
    exit_code, answer, _ = run_cli("ensure", repo, SHA, root=root)
    assert exit_code == 2, name
    assert answer["error"] == code, (name, answer)
    assert answer["message"] and answer["next"]
    assert not os.path.exists(root), files_under(root)
    assert not os.path.exists("/tmp/pwned")


@pytest.mark.parametrize("repo", ["--upload-pack=touch /tmp/pwned", "-repo"])
def test_option_like_repo_after_double_dash_is_refused_by_validation(root, repo):
    exit_code, answer, _ = run_cli("ensure", "--", repo, SHA, root=root)
    assert exit_code == 2 and answer["error"] == "BAD_REPO" and "option" in answer["message"]
    assert not os.path.exists(root) and not os.path.exists("/tmp/pwned")


@pytest.mark.parametrize("args,code", [
    (["--scope", "../etc"], "BAD_SCOPE"),
    (["--scope", ""], "BAD_SCOPE"),
    (["--scope", "a" * 65], "BAD_SCOPE"),
    (["--scope", "-x"], "BAD_SCOPE"),
    (["--wait", "soon"], "BAD_ARGUMENT"),
    (["--wait", "-5"], "BAD_ARGUMENT"),
    (["--wait", "1y"], "BAD_ARGUMENT"),
])
def test_bad_options(root, upstream, args, code):
    exit_code, answer, _ = run_cli("ensure", upstream.path, upstream.shas[0], *args, root=root)
    assert exit_code == 2 and answer["error"] == code
    assert not os.path.exists(root)


def test_unknown_option_and_missing_argument_are_bad_input_in_json(root):
    for args in (["ensure", "only-one-arg"], ["ensure", "--frobnicate", "a", SHA], ["no-such-command"]):
        exit_code, answer, _ = run_cli(*args, root=root)
        assert exit_code == 2 and answer["error"] == "BAD_ARGUMENT" and answer["next"]
    assert not os.path.exists(root)


def test_unwritable_root_is_a_clear_error_not_a_hang(tmp_path, upstream):
    if os.geteuid() == 0:
        root = "/proc/checkoutcache-root"  # even root cannot create directories here
    else:
        parent = tmp_path / "ro"
        parent.mkdir(mode=0o500)
        root = str(parent / "cache")
    exit_code, answer, _ = run_cli("ensure", upstream.path, upstream.shas[0], root=root, timeout=30)
    assert exit_code == 1 and answer["error"] == "ROOT_UNUSABLE"
    assert "--root" in answer["next"]


@pytest.mark.parametrize("variable, value", [("CHECKOUTCACHE_BACKOFF", "soon"), ("CHECKOUTCACHE_CLONE_TIMEOUT", "-1"),
                                             ("CHECKOUTCACHE_BUNDLE_URI", "http://bundles.example/x")])
def test_a_malformed_setting_is_bad_input_not_a_crash(tmp_path, upstream, variable, value):
    """Regression: a malformed setting in the environment made ensure crash with
    INTERNAL_ERROR (and a traceback) instead of answering which setting is wrong."""
    root = str(tmp_path / "root")
    code, answer, out = run_cli("ensure", upstream.path, upstream.shas[-1], root=root, env={variable: value})
    assert code == 2 and answer["error"] == "BAD_ARGUMENT", out
    assert "Traceback" not in out
    assert not os.path.exists(root)
