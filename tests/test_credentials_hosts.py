"""Credentials go only where they belong, against a real HTTPS git server
(tests/https_git.py) that records every Authorization header; and the
caller's git config never applies, the operator's only where allowed."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading

import pytest

from .helpers import Upstream, assert_checkout_matches, grep_tree, run_cli
from .https_git import GitHttpsServer

# Random per run: the argv test scans every process on the machine, other sessions' included.
TOKEN = "s3cr3t-" + secrets.token_hex(8)


@pytest.fixture
def https_server(tmp_path):
    project_root = tmp_path / "srv"
    project_root.mkdir()
    upstream = Upstream(str(project_root / "repo"))
    upstream.standard_history()
    accepted = {"password": TOKEN}
    server = GitHttpsServer(str(project_root), str(tmp_path), lambda user, password: password == accepted["password"])
    operator_config = tmp_path / "operator-gitconfig"
    operator_config.write_text(f"[http]\n\tsslCAInfo = {server.ca_file}\n")
    server.upstream = upstream
    server.accepted = accepted
    server.operator_config = str(operator_config)
    yield server
    server.stop()


def env_for(server: GitHttpsServer, **extra: str) -> dict:
    env = {"CHECKOUTCACHE_GIT_CONFIG": server.operator_config, "CHECKOUTCACHE_BACKOFF": "1s"}
    env.update(extra)
    return env


@pytest.mark.slow
def test_an_environment_token_reaches_only_the_listed_host(root, https_server, tmp_path):
    sha = https_server.upstream.shas[0]
    env = env_for(https_server, CHECKOUTCACHE_GIT_PASSWORD=TOKEN,
                  CHECKOUTCACHE_GIT_HOSTS=f"localhost:{https_server.port}")
    code, answer, err = run_cli("ensure", https_server.url("localhost", "repo"), sha, "--wait", "60",
                                root=root, env=env)
    assert code == 0, (answer, err)
    assert https_server.authorizations_to("localhost"), "the listed host must have received the token"
    # 127.0.0.1 is another host to git: the same token is never sent there.
    code, answer, err = run_cli("ensure", https_server.url("127.0.0.1", "repo"), sha, "--wait", "60",
                                root=root, env=env)
    assert code == 1 and answer["error"] == "UNREACHABLE", (answer, err)
    assert "no credential applies to 127.0.0.1" in answer["message"]
    assert any(r["host"].startswith("127.0.0.1") for r in https_server.requests), "the host was contacted"
    assert https_server.authorizations_to("127.0.0.1") == []
    assert grep_tree(root, TOKEN.encode()) == []


def test_a_token_without_listed_hosts_is_sent_nowhere(root, https_server):
    env = env_for(https_server, CHECKOUTCACHE_GIT_PASSWORD=TOKEN)
    code, answer, _ = run_cli("ensure", https_server.url("localhost", "repo"), https_server.upstream.shas[0],
                              root=root, env=env)
    assert code == 1 and answer["error"] == "UNREACHABLE"
    assert [r for r in https_server.requests if r["authorization"]] == []
    assert https_server.requests, "the server was contacted"


def test_a_redirect_to_another_host_never_carries_the_credential(root, https_server):
    env = env_for(https_server, CHECKOUTCACHE_GIT_PASSWORD=TOKEN,
                  CHECKOUTCACHE_GIT_HOSTS=f"localhost:{https_server.port}")
    run_cli("ensure", https_server.url("localhost", "moved/repo"), https_server.upstream.shas[0],
            "--wait", "30", root=root, env=env)
    assert any(r["host"].startswith("127.0.0.1") for r in https_server.requests), "the redirect was followed"
    assert https_server.authorizations_to("127.0.0.1") == []


@pytest.mark.slow
def test_a_credential_helper_in_the_operator_config_is_used_and_rotated(root, https_server, tmp_path):
    token_file = tmp_path / "rotating-token"
    token_file.write_text("first-token-1111")
    https_server.accepted["password"] = "first-token-1111"
    with open(https_server.operator_config, "a") as handle:
        handle.write(f'[credential]\n\thelper = "!f() {{ test \\"$1\\" = get && echo username=bot && '
                     f'echo password=$(cat {token_file}); }}; f"\n')
    env = env_for(https_server)
    url = https_server.url("localhost", "repo")
    upstream = https_server.upstream
    code, answer, err = run_cli("ensure", url, upstream.shas[0], "--wait", "60", root=root, env=env)
    assert code == 0, (answer, err)
    token_file.write_text("second-token-2222")  # the installation token expired and was renewed
    https_server.accepted["password"] = "second-token-2222"
    code, answer, err = run_cli("ensure", url, upstream.shas[1], "--wait", "60", root=root, env=env)
    assert code == 0, (answer, err)
    assert_checkout_matches(answer["path"], upstream.path, upstream.shas[1])
    for secret in (b"first-token-1111", b"second-token-2222"):
        assert grep_tree(root, secret) == []


@pytest.mark.slow
def test_no_token_in_any_argv_during_a_clone(root, https_server):
    url = https_server.url(f"bot:{TOKEN}@localhost", "repo")
    seen: list[tuple[int, str]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
                except OSError:
                    continue
                if TOKEN.encode() in cmdline:
                    seen.append((int(pid), cmdline.replace(b"\0", b" ").decode(errors="replace")))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    env = dict(os.environ, **env_for(https_server))
    # The caller put the token in its own argv; every process we start or fork must not have it.
    cli = subprocess.Popen([sys.executable, "-m", "checkoutcache", "--root", root, "ensure", url,
                            https_server.upstream.shas[0], "--wait", "60"], env=env, stdout=subprocess.PIPE,
                           text=True)
    out, _ = cli.communicate(timeout=120)
    stop.set()
    sampler.join()
    assert '"ready"' in out, out
    assert https_server.authorizations_to("localhost"), "the clone used the token"
    assert sorted({entry[0] for entry in seen if entry[0] != cli.pid}) == [], (cli.pid, sorted({e[0] for e in seen}))
    assert grep_tree(root, TOKEN.encode()) == [] and TOKEN not in out


def test_the_callers_git_config_never_applies_and_the_operators_only_where_allowed(root, tmp_path, daemon):
    marker_filter, marker_hook = tmp_path / "filter-ran", tmp_path / "hook-ran"
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "post-checkout").write_text(f"#!/bin/sh\ntouch {marker_hook}\n")
    (hooks / "post-checkout").chmod(0o755)
    (hooks / "reference-transaction").write_text(f"#!/bin/sh\ntouch {marker_hook}\n")
    (hooks / "reference-transaction").chmod(0o755)
    upstream = Upstream(os.path.join(daemon.base, "filtered"))
    sha = upstream.commit({".gitattributes": "*.txt filter=evil\n", "a.txt": "plain text\n"})
    evil = (f'[filter "evil"]\n\tsmudge = "touch {marker_filter}; cat"\n\tprocess = "touch {marker_filter}"\n'
            f"[core]\n\thooksPath = {hooks}\n\tfsmonitor = true\n"
            f'[url "git://127.0.0.1:1/nowhere/"]\n\tinsteadOf = {daemon.url("")}\n')
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text(evil)
    env = {"HOME": str(home)}
    code, answer, err = run_cli("ensure", daemon.url("filtered"), sha, "--wait", "60", root=root, env=env)
    assert code == 0, (answer, err)
    assert_checkout_matches(answer["path"], upstream.path, sha)
    assert not marker_filter.exists() and not marker_hook.exists()
    # The operator's file: its insteadOf applies to fetches; its filter and hooks never run.
    operator = tmp_path / "operator"
    operator.write_text(evil.replace(f'[url "git://127.0.0.1:1/nowhere/"]\n\tinsteadOf = {daemon.url("")}\n',
                                     f'[url "{daemon.url("filtered")}"]\n\tinsteadOf = git://alias.invalid/x\n'))
    second = upstream.commit({"b.txt": "more\n"})
    code, answer, err = run_cli("ensure", "git://alias.invalid/x", second, "--wait", "60", root=root,
                                env={"CHECKOUTCACHE_GIT_CONFIG": str(operator)})
    assert code == 0, (answer, err)
    assert_checkout_matches(answer["path"], upstream.path, second)
    assert not marker_filter.exists() and not marker_hook.exists()
