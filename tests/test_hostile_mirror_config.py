"""A group member writes a mirror's config (the store is the group's to write,
docs/security.md): what a fetch runs, where it fetches from and whom it gives
a credential to must never come from that file. Each test plants settings
that would run a command leaving a mark, or a helper that would record the
credential, then makes the cache fetch into that mirror, against real
servers (git daemon, an HTTPS server with Basic authentication)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess

import pytest

from .helpers import GitDaemon, Upstream, git, only_repo, run_cli, wait_ready
from .helpers.daemons import answer_each
from .helpers.lfs import LfsUpstream
from .test_credentials_hosts import TOKEN, env_for, https_server  # noqa: F401 - the fixture
from .test_monorepo import PARTIAL, monorepo, worktree_files


def marking_script(tmp_path, mark) -> str:
    """A program that leaves `mark` whenever anything runs it (with any arguments)."""
    script = tmp_path / "planted.sh"
    script.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {mark}\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(script)


def planting_kit(tmp_path) -> tuple:
    """(mark, script leaving it, another repository to fetch from instead): what a planted
    setting would use."""
    mark = tmp_path / "planted-ran"
    elsewhere = Upstream(str(tmp_path / "elsewhere"))
    elsewhere.commit({"README.md": "not the upstream\n"})
    return mark, marking_script(tmp_path, mark), elsewhere


def plant(mirror: str, text: str) -> None:
    with open(os.path.join(mirror, "config"), "a") as handle:
        handle.write(text)


def test_a_partial_mirrors_config_names_neither_what_a_fetch_runs_nor_where_it_fetches(root, tmp_path,
                                                                                      served_upstream):
    """Regression (review): a partial mirror fetched through the remote `origin`, read from the
    mirror's config: a planted `uploadpack` ran as whoever fetched, a planted `url` was fetched from."""
    repo, url = served_upstream
    first = monorepo(repo)
    wait_ready(root, url, first, env=PARTIAL, extra=("--sparse", "services/alpha"))
    mirror = only_repo(root).mirror
    mark, script, elsewhere = planting_kit(tmp_path)
    plant(mirror, f'[remote "origin"]\n\tuploadpack = {script}\n\turl = {elsewhere.path}\n'
                  f'[core]\n\tgitProxy = {script}\n\taskPass = {script}\n\talternateRefsCommand = {script}\n')
    with open(os.path.join(mirror, "objects", "info", "alternates"), "a") as handle:
        handle.write(os.path.join(elsewhere.path, ".git", "objects") + "\n")

    # A new commit (a filtered fetch) and a new cone of the first (the cone's blobs fetched).
    second = repo.commit({"services/alpha/NEW.txt": "new\n"}, message="second")
    alpha = wait_ready(root, url, second, env=PARTIAL, extra=("--sparse", "services/alpha"))
    beta = wait_ready(root, url, first, env=PARTIAL, extra=("--sparse", "services/beta"))
    assert not mark.exists(), mark.read_text()
    assert "services/alpha/NEW.txt" in worktree_files(alpha["path"])
    assert {f"services/beta/src/file_{n}.txt" for n in range(5)} <= worktree_files(beta["path"])
    assert git("rev-parse", "HEAD", cwd=alpha["path"]) == second
    # The mirror's own config is left as it was: nothing was registered in it.
    assert "checkoutcache-" not in open(os.path.join(mirror, "config")).read()


def test_a_mirrors_config_gets_no_credential_and_runs_no_askpass(root, tmp_path, https_server):  # noqa: F811
    """Regression (review): a credential helper planted in a mirror's config was asked first and,
    once the fetch succeeded, given the username and password to store."""
    sha = https_server.upstream.shas[0]
    env = env_for(https_server, CHECKOUTCACHE_GIT_PASSWORD=TOKEN,
                  CHECKOUTCACHE_GIT_HOSTS=f"localhost:{https_server.port}")
    code, answer, err = run_cli("ensure", https_server.url("localhost", "repo"), sha, "--wait", "60",
                                root=root, env=env)
    assert code == 0, (answer, err)
    mirror = only_repo(root).mirror
    leak = tmp_path / "leaked"
    mark = tmp_path / "planted-ran"
    script = marking_script(tmp_path, mark)
    plant(mirror, f'[credential]\n\thelper = "!f() {{ cat >> {leak}; }}; f"\n'
                  f'[credential "https://localhost:{https_server.port}"]\n\thelper = "!f() {{ cat >> {leak}; }}; f"\n'
                  f'[core]\n\taskPass = {script}\n')
    new = https_server.upstream.commit({"NEW.txt": "new\n"}, message="new")
    code, answer, err = run_cli("ensure", https_server.url("localhost", "repo"), new, "--wait", "60",
                                root=root, env=env)
    assert code == 0, (answer, err)
    assert https_server.authorizations_to("localhost"), "the fetch used the credential"
    assert not leak.exists(), leak.read_text()
    assert not mark.exists(), mark.read_text()


def test_a_full_mirrors_config_cannot_name_what_a_fetch_by_url_runs(root, tmp_path, served_upstream):
    """Regression (second review): a fetch by URL reads `remote."<that URL>".*` from the
    mirror's config: a planted `uploadpack` ran, a planted `url` was fetched from."""
    repo, url = served_upstream
    wait_ready(root, url, repo.shas[0])
    mirror = only_repo(root).mirror
    mark, script, elsewhere = planting_kit(tmp_path)
    plant(mirror, f'[remote "{url}"]\n\tuploadpack = {script}\n\turl = {elsewhere.path}\n'
                  f'[include]\n\tpath = {tmp_path / "more.gitconfig"}\n')
    (tmp_path / "more.gitconfig").write_text(f"[core]\n\tsshCommand = {script}\n")
    new = repo.commit({"NEW.txt": "new\n"}, message="new")
    answer = wait_ready(root, url, new)
    assert not mark.exists(), mark.read_text()
    assert git("rev-parse", "HEAD", cwd=answer["path"]) == new


@pytest.mark.skipif(shutil.which("git-lfs") is None, reason="git-lfs is not installed")
def test_a_mirrors_config_cannot_choose_git_lfs_transfer_agent(root, tmp_path):
    """Regression (second review): `git lfs fetch` ran in the mirror and read its config: a
    planted standalone transfer agent ran as whoever fetched."""
    upstream = LfsUpstream(str(tmp_path / "upstream"))
    first = upstream.commit_lfs({"a.bin": b"first\n" * 100})
    wait_ready(root, upstream.path, first)
    mirror = only_repo(root).mirror
    mark = tmp_path / "planted-ran"
    script = marking_script(tmp_path, mark)
    plant(mirror, f"[lfs]\n\tstandalonetransferagent = evil\n[lfs \"customtransfer.evil\"]\n\tpath = {script}\n")
    second = upstream.commit_lfs({"b.bin": b"second\n" * 100})
    answer = wait_ready(root, upstream.path, second)
    assert not mark.exists(), mark.read_text()
    assert open(os.path.join(answer["path"], "b.bin"), "rb").read() == b"second\n" * 100


def test_a_mirrors_config_cannot_route_the_credential_through_a_proxy(root, tmp_path, https_server):  # noqa: F811
    """Regression (second review): URL-specific `http.<url>.*` keys in the mirror's config
    (a proxy, TLS verification off) beat ours: the credential went to a listener of the
    member's choosing. A listener stands in for the proxy and records any connection."""
    sha = https_server.upstream.shas[0]
    env = env_for(https_server, CHECKOUTCACHE_GIT_PASSWORD=TOKEN,
                  CHECKOUTCACHE_GIT_HOSTS=f"localhost:{https_server.port}")
    code, answer, err = run_cli("ensure", https_server.url("localhost", "repo"), sha, "--wait", "60",
                                root=root, env=env)
    assert code == 0, (answer, err)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    heard: list[bytes] = []

    def record(conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            heard.append(conn.recv(65536))
        except OSError:
            heard.append(b"(connected)")

    answer_each(listener, record)
    try:
        base = f"https://localhost:{https_server.port}/"
        plant(only_repo(root).mirror, f'[http "{base}"]\n\tproxy = http://127.0.0.1:{listener.getsockname()[1]}\n'
                                      f'\tsslVerify = false\n')
        new = https_server.upstream.commit({"NEW.txt": "new\n"}, message="new")
        code, answer, err = run_cli("ensure", https_server.url("localhost", "repo"), new, "--wait", "60",
                                    root=root, env=env)
        assert code == 0, (answer, err)
        assert heard == [], heard
    finally:
        listener.close()


def test_a_mirrors_config_cannot_redirect_a_libgit2_fetch(root, tmp_path, served_upstream):
    """Regression (issue 27): with CHECKOUTCACHE_TRANSPORT=pygit2, libgit2 read the mirror's
    config: a planted `url.<other>.insteadOf` sent the next fetch to another server. Two
    daemons: the upstream's, and another serving a repository that lacks the new commit
    and has one of its own."""
    repo, url = served_upstream
    pygit2_env = {"CHECKOUTCACHE_TRANSPORT": "pygit2"}
    wait_ready(root, url, repo.shas[0], env=pygit2_env)
    mirror = only_repo(root).mirror
    other_base = tmp_path / "other-served"
    other_base.mkdir()
    elsewhere = Upstream.clone_of(repo.path, str(other_base / "other.git"))
    theirs = elsewhere.commit({"THEIRS.txt": "another server's\n"}, message="theirs")
    other = GitDaemon(str(other_base))
    try:
        plant(mirror, f'[url "{other.url("other.git")}"]\n\tinsteadOf = {url}\n')
        new = repo.commit({"NEW.txt": "new\n"}, message="new")
        answer = wait_ready(root, url, new, env=pygit2_env)  # was UNKNOWN_COMMIT: asked of the other server
    finally:
        other.stop()
    assert git("rev-parse", "HEAD", cwd=answer["path"]) == new
    assert subprocess.run(["git", "-C", mirror, "cat-file", "-e", theirs], capture_output=True).returncode != 0
