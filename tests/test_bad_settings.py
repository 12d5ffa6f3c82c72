"""Settings that failed badly (issue 27): every setting is checked when it is read,
and a bad one is BAD_ARGUMENT naming the variable and the value, with nothing
written: no traceback, no INTERNAL_ERROR, no socket made relative to wherever
serve started, no silently ignored file or host list. Through the real CLI
(`ensure` of a new commit) and the real `serve`."""

from __future__ import annotations

import os

import pytest

from .helpers import TOKEN, free_port, run_cli


def serve_settings(tmp_path) -> list[tuple[str, str]]:
    directory = tmp_path / "a-directory"
    directory.mkdir()
    return [
        ("CHECKOUTCACHE_READY_FILE", "/nonexistent/dir/x"),  # was INTERNAL_ERROR with a traceback
        ("CHECKOUTCACHE_READY_FILE", str(directory)),
        ("CHECKOUTCACHE_API_TOKEN_FILE", "/nonexistent/tokens"),  # named neither variable nor path
        ("CHECKOUTCACHE_API_TOKEN_FILE", str(directory)),
        ("CHECKOUTCACHE_UNIX_SOCKET", "bogus!"),  # made a socket relative to the working directory
        ("CHECKOUTCACHE_UNIX_SOCKET", "/nonexistent/dir/cc.sock"),
        ("CHECKOUTCACHE_UNIX_SOCKET", "/tmp/" + "s" * 120 + ".sock"),
    ]


def config_settings(tmp_path) -> list[tuple[str, str]]:
    return [
        ("CHECKOUTCACHE_GIT_CONFIG", "/nonexistent"),  # accepted silently (git ignores a missing file)
        ("CHECKOUTCACHE_GIT_CONFIG", "relative.gitconfig"),
        ("CHECKOUTCACHE_CLONE_JOURNAL", "/nonexistent/dir/events.journal"),  # accepted silently
        ("CHECKOUTCACHE_CLONE_JOURNAL", "events.journal"),
        ("CHECKOUTCACHE_CLONE_JOURNAL", str(tmp_path)),
        ("CHECKOUTCACHE_GIT_HOSTS", "https://github.com"),  # accepted silently: matches no host, ever
        ("CHECKOUTCACHE_GIT_HOSTS", "github.com/acme,gitlab.com"),
        ("CHECKOUTCACHE_GIT_HOSTS", "git.example.com:99999"),
    ]


def assert_refused(code: int, answer: dict | None, output: str, variable: str, value: str) -> None:
    assert code == 2, output
    assert answer is not None and answer["error"] == "BAD_ARGUMENT", output
    assert variable in answer["message"] and value[:100] in answer["message"], answer["message"]
    assert "Traceback" not in output and "INTERNAL_ERROR" not in output, output


@pytest.mark.slow
def test_bad_serve_settings_are_refused_naming_the_variable_and_the_value(root, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for variable, value in serve_settings(tmp_path) + config_settings(tmp_path):
        env = {variable: value, "CHECKOUTCACHE_API_TOKEN": TOKEN}
        code, answer, output = run_cli("serve", "--listen", f"127.0.0.1:{free_port()}", root=root, env=env,
                                       cwd=str(cwd), timeout=60)
        assert_refused(code, answer, output, variable, value)
        assert not os.path.exists(root), f"{variable}: serve wrote its root"
        assert os.listdir(cwd) == [], f"{variable}: serve wrote {os.listdir(cwd)} in its working directory"


def test_a_bad_token_file_option_names_the_option_and_the_path(root, tmp_path):
    code, answer, output = run_cli("serve", "--token-file", "/nonexistent/tokens", root=root, timeout=60)
    assert_refused(code, answer, output, "--token-file", "/nonexistent/tokens")
    assert not os.path.exists(root)


@pytest.mark.parametrize("case", range(8))
def test_bad_settings_are_refused_by_ensure_before_anything_is_written(root, tmp_path, upstream, case):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    variable, value = config_settings(tmp_path)[case]
    code, answer, output = run_cli("ensure", upstream.path, upstream.shas[0], "--wait", "30", root=root,
                                   env={variable: value}, cwd=str(cwd))
    assert_refused(code, answer, output, variable, value)
    assert not os.path.exists(root) and os.listdir(cwd) == []


def test_good_values_of_the_checked_variables_are_taken(root, tmp_path, upstream):
    """The checks refuse only what cannot work: a readable git config, a journal in an existing
    directory and a list of hosts (with ports, spaces and a trailing comma) clone as before."""
    config = tmp_path / "operator.gitconfig"
    config.write_text("[core]\n\tquotepath = false\n")
    journal = tmp_path / "events.journal"
    env = {"CHECKOUTCACHE_GIT_CONFIG": str(config), "CHECKOUTCACHE_CLONE_JOURNAL": str(journal),
           "CHECKOUTCACHE_GIT_HOSTS": "github.com, git.example.com:8443,[::1]:8443,"}
    code, answer, output = run_cli("ensure", upstream.path, upstream.shas[0], "--wait", "60", root=root, env=env)
    assert code == 0 and answer["state"] == "ready", output
    assert '"published"' in journal.read_text()
