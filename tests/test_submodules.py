"""Checkouts hold their submodules' work trees: each submodule repository is a
repository of the store (its own key, mirror and single-flight clone), relative
URLs resolve against the superproject's, transport rules hold, and gc keeps the
objects a checkout borrows for as long as it exists."""

from __future__ import annotations

import os

import pytest

from .helpers import Serve, Upstream, git, run_cli


def with_submodule(upstream: Upstream, path: str, url: str, sha: str, message: str = "submodule") -> str:
    """A commit of upstream whose `path` is a submodule at sha, named in .gitmodules."""
    gitmodules = os.path.join(upstream.path, ".gitmodules")
    existing = open(gitmodules).read() if os.path.exists(gitmodules) else ""
    name = path.replace("/", "-")
    if f'[submodule "{name}"]' not in existing:
        existing += f'[submodule "{name}"]\n\tpath = {path}\n\turl = {url}\n'
    else:
        existing = existing.replace(existing.split(f'[submodule "{name}"]')[1].split("[submodule")[0],
                                    f"\n\tpath = {path}\n\turl = {url}\n")
    with open(gitmodules, "w") as handle:
        handle.write(existing)
    git("add", ".gitmodules", cwd=upstream.path)
    git("update-index", "--add", "--cacheinfo", f"160000,{sha},{path}", cwd=upstream.path)
    git("commit", "-q", "-m", message, cwd=upstream.path)
    commit = git("rev-parse", "HEAD", cwd=upstream.path)
    upstream.shas.append(commit)
    return commit


def served(daemon, name: str) -> tuple[Upstream, str]:
    repo = Upstream(os.path.join(daemon.base, f"{name}-{os.urandom(3).hex()}"))
    return repo, daemon.url(os.path.basename(repo.path))


def test_a_submodule_is_checked_out_from_its_own_store(root, daemon):
    sub, sub_url = served(daemon, "sub")
    sub_sha = sub.commit({"lib.txt": "library v1\n"})
    top, top_url = served(daemon, "top")
    top.commit({"README.md": "top\n"})
    sha = with_submodule(top, "vendor/lib", f"../{os.path.basename(sub.path)}", sub_sha)
    code, answer, err = run_cli("ensure", top_url, sha, "--wait", "120", root=root)
    assert code == 0, (answer, err)
    assert answer["submodules"] == "included"
    lib = os.path.join(answer["path"], "vendor", "lib")
    assert open(os.path.join(lib, "lib.txt")).read() == "library v1\n"
    assert git("rev-parse", "HEAD", cwd=lib) == sub_sha
    assert git("status", "--porcelain", cwd=answer["path"]) == ""
    # The submodule repository is a repository of the store: ensured on its own, it is ready at once.
    code, sub_answer, _ = run_cli("ensure", sub_url, sub_sha, root=root)
    assert code == 0 and sub_answer["state"] == "ready"
    assert len(os.listdir(os.path.join(root, "repos"))) == 2


@pytest.mark.slow
def test_nested_submodules_and_a_url_that_changes_between_commits(root, daemon):
    inner, _ = served(daemon, "inner")
    inner_sha = inner.commit({"inner.txt": "deep\n"})
    middle, _ = served(daemon, "middle")
    middle.commit({"m.txt": "m\n"})
    middle_sha = with_submodule(middle, "in", f"../{os.path.basename(inner.path)}", inner_sha)
    other, _ = served(daemon, "other")
    other_sha = other.commit({"other.txt": "other\n"})
    top, top_url = served(daemon, "top")
    top.commit({"README.md": "top\n"})
    first = with_submodule(top, "mid", f"../{os.path.basename(middle.path)}", middle_sha)
    second = with_submodule(top, "mid", f"../{os.path.basename(other.path)}", other_sha, "moved")
    code, answer, err = run_cli("ensure", top_url, first, "--wait", "180", root=root)
    assert code == 0, (answer, err)
    assert open(os.path.join(answer["path"], "mid", "in", "inner.txt")).read() == "deep\n"
    code, answer, err = run_cli("ensure", top_url, second, "--wait", "180", root=root)
    assert code == 0, (answer, err)
    assert open(os.path.join(answer["path"], "mid", "other.txt")).read() == "other\n"
    assert not os.path.exists(os.path.join(answer["path"], "mid", "in", "inner.txt"))


def test_a_submodule_that_cannot_be_fetched_fails_the_checkout(root, daemon, tmp_path):
    top, top_url = served(daemon, "top")
    top.commit({"README.md": "top\n"})
    missing = with_submodule(top, "gone", "../does-not-exist", "1" * 40)
    code, answer, _ = run_cli("ensure", top_url, missing, "--wait", "120", root=root)
    assert code == 1 and answer["error"] == "SUBMODULE_FAILED" and answer["retry_after"] > 0, answer
    assert "'gone'" in answer["message"] and "does-not-exist" in answer["message"]
    key = [k for k in os.listdir(os.path.join(root, "repos"))
           if os.path.exists(os.path.join(root, "repos", k, "logs", f"{missing}.log"))]
    assert len(key) == 1 and os.listdir(os.path.join(root, "repos", key[0], "checkouts")) == []
    # A .gitmodules may not reach a transport the operator did not allow.
    pwned = tmp_path / "pwned"
    evil = with_submodule(top, "evil", f"ext::sh -c touch% {pwned}", "2" * 40, "evil")
    code, answer, _ = run_cli("ensure", top_url, evil, "--wait", "120", root=root)
    assert code == 1 and answer["error"] == "SUBMODULE_FAILED" and "UNSAFE_TRANSPORT" in answer["message"]
    assert not pwned.exists()


@pytest.mark.slow
def test_without_submodules_the_checkout_says_so_at_a_path_of_its_own(root, daemon):
    sub, _ = served(daemon, "sub")
    sub_sha = sub.commit({"lib.txt": "v1\n"})
    top, top_url = served(daemon, "top")
    top.commit({"README.md": "top\n"})
    sha = with_submodule(top, "lib", f"../{os.path.basename(sub.path)}", sub_sha)
    code, flat, err = run_cli("ensure", top_url, sha, "--wait", "120", root=root,
                              env={"CHECKOUTCACHE_SUBMODULES": "none"})
    assert code == 0, (flat, err)
    assert flat["submodules"] == "none" and os.listdir(os.path.join(flat["path"], "lib")) == []
    code, full, _ = run_cli("ensure", top_url, sha, "--wait", "120", root=root)
    assert code == 0 and full["submodules"] == "included" and full["path"] != flat["path"]
    code, by_option, _ = run_cli("ensure", top_url, sha, "--submodules", "none", root=root)
    # The option is the setting's twin (the history may have arrived between the two asks).
    assert code == 0 and {**by_option, "history": None} == {**flat, "history": None}


@pytest.mark.slow
def test_gc_keeps_the_objects_a_checkout_borrows_from_a_submodule(root, daemon):
    sub, sub_url = served(daemon, "sub")
    sub_sha = sub.commit({"lib.txt": "kept\n"})
    top, top_url = served(daemon, "top")
    top.commit({"README.md": "top\n"})
    sha = with_submodule(top, "lib", f"../{os.path.basename(sub.path)}", sub_sha)
    code, answer, _ = run_cli("ensure", top_url, sha, "--wait", "120", root=root)
    assert code == 0
    sub_checkout = run_cli("ensure", sub_url, sub_sha, root=root)[1]["path"]
    old = os.path.getmtime(os.path.join(answer["path"], ".git", "checkoutcache-ready")) - 7200
    os.utime(os.path.join(sub_checkout, ".git", "checkoutcache-ready"), (old, old))
    # The submodule's own checkout goes (least recently used), and its mirror is repacked.
    code, report, _ = run_cli("gc", "--max-checkouts", "1", "--grace", "1h", "--mirror-gc-interval", "0",
                              root=root)
    assert code == 0 and [r["name"] for r in report["removed"] if r["reason"] == "lru"] == [sub_sha]
    lib = os.path.join(answer["path"], "lib")
    assert git("cat-file", "-p", f"{sub_sha}:lib.txt", cwd=lib) == "kept"
    assert git("status", "--porcelain", cwd=answer["path"]) == ""


def test_a_gitmodules_may_not_name_a_local_path_or_a_repository_the_api_may_not(root, daemon, tmp_path):
    secret = Upstream(str(tmp_path / "secret"))
    secret_sha = secret.commit({"key.txt": "TOPSECRET\n"})
    top, top_url = served(daemon, "top")
    top.commit({"README.md": "top\n"})
    local = with_submodule(top, "s", secret.path, secret_sha)
    code, answer, _ = run_cli("ensure", top_url, local, "--wait", "120", root=root)
    assert code == 1 and answer["error"] == "SUBMODULE_FAILED" and "local path" in answer["message"], answer
    # Through the sidecar: a .gitmodules names only what the API itself may name.
    other, _ = served(daemon, "other")
    other_sha = other.commit({"x.txt": "x\n"})
    remote = with_submodule(top, "o", f"../{os.path.basename(other.path)}", other_sha, "other")
    running = Serve(root, tmp_path, "--allow-repo", f"{daemon.url('top-')}*")
    try:
        answer = running.client().ensure(top_url, remote, wait=120)
        assert answer.error == "SUBMODULE_FAILED" and "matches no allowed pattern" in answer.message, answer
    finally:
        running.stop()
    from .helpers import grep_tree

    assert grep_tree(root, b"TOPSECRET") == [], "the local repository's content never reached the store"
