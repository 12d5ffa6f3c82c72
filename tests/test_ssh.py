"""ssh remotes against a real sshd on 127.0.0.1: the operator's key and
known_hosts files (CHECKOUTCACHE_SSH_KEY_FILE, CHECKOUTCACHE_SSH_KNOWN_HOSTS_FILE),
an operator's own core.sshCommand when neither is set, and what a bad file or
an unknown host key gets. The test's HOME is private (conftest): no ~/.ssh of
anyone's can make a connection work."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from .helpers import assert_checkout_matches, free_port, only_repo, run_cli, wait_until

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = pytest.mark.skipif(not os.path.exists(SSHD) or os.geteuid() != 0,
                                reason="needs sshd (openssh-server; .ci/run installs it) and root")


def keygen(path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "checkoutcache-test", "-f", str(path)],
                   check=True)
    return (path.parent / (path.name + ".pub")).read_text().strip()


@pytest.fixture
def sshd(tmp_path):
    """sshd on a free port, accepting only the test's client key; yields (port, key, known_hosts)."""
    keys = tmp_path / "ssh"
    keys.mkdir()
    host_public = keygen(keys / "host_key")
    client_public = keygen(keys / "client_key")
    (keys / "authorized_keys").write_text(client_public + "\n")
    port = free_port()
    (keys / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_public}\n")
    config = keys / "sshd_config"
    config.write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {keys / 'host_key'}
AuthorizedKeysFile {keys / 'authorized_keys'}
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
PidFile {keys / 'sshd.pid'}
""")
    os.makedirs("/run/sshd", exist_ok=True)  # its privilege separation directory
    log = open(keys / "sshd.log", "w")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=log)

    def listening() -> bool:
        assert proc.poll() is None, (keys / "sshd.log").read_text()
        return "Server listening" in (keys / "sshd.log").read_text()

    wait_until(listening, 20, "sshd to listen")
    yield port, keys / "client_key", keys / "known_hosts"
    proc.terminate()
    proc.wait(10)
    log.close()


def ssh_url(port: int, path: str) -> str:
    return f"ssh://root@127.0.0.1:{port}{path}"


@pytest.mark.slow
def test_the_operators_key_and_known_hosts_reach_git(root, sshd, upstream):
    port, key, known_hosts = sshd
    env = {"CHECKOUTCACHE_SSH_KEY_FILE": str(key), "CHECKOUTCACHE_SSH_KNOWN_HOSTS_FILE": str(known_hosts)}
    code, answer, err = run_cli("ensure", ssh_url(port, upstream.path), upstream.shas[1], "--wait", "60",
                                root=root, env=env)
    assert code == 0, (answer, err)
    assert_checkout_matches(answer["path"], upstream.path, upstream.shas[1])


def test_a_host_the_known_hosts_file_does_not_vouch_for_is_refused(root, sshd, upstream, tmp_path):
    port, key, _ = sshd
    other = tmp_path / "other_host_key"
    (tmp_path / "known_hosts").write_text(f"[127.0.0.1]:{port} {keygen(other)}\n")
    env = {"CHECKOUTCACHE_SSH_KEY_FILE": str(key), "CHECKOUTCACHE_SSH_KNOWN_HOSTS_FILE": str(tmp_path / "known_hosts"),
           "CHECKOUTCACHE_BACKOFF": "1m"}
    code, answer, err = run_cli("ensure", ssh_url(port, upstream.path), upstream.shas[1], "--wait", "60",
                                root=root, env=env)
    assert code == 1 and answer["error"] == "UNREACHABLE", (answer, err)
    assert "host key" in answer["message"].lower(), answer


@pytest.mark.slow
def test_an_operators_core_ssh_command_is_used_when_no_ssh_file_is_set(root, sshd, upstream, tmp_path):
    """Regression: GIT_SSH_COMMAND was always set, so an operator's core.sshCommand never applied."""
    port, key, known_hosts = sshd
    operator = tmp_path / "operator.gitconfig"
    operator.write_text(f"[core]\n\tsshCommand = ssh -o BatchMode=yes -i {key} -o IdentitiesOnly=yes "
                        f"-o UserKnownHostsFile={known_hosts}\n")
    code, answer, err = run_cli("ensure", ssh_url(port, upstream.path), upstream.shas[0], "--wait", "60",
                                root=root, env={"CHECKOUTCACHE_GIT_CONFIG": str(operator)})
    assert code == 0, (answer, err)
    assert_checkout_matches(answer["path"], upstream.path, upstream.shas[0])


def test_our_default_ssh_command_never_prompts():
    """Without any ssh setting, every network git runs ssh in batch mode."""
    from checkoutcache.git.env import SSH_DEFAULT, git_env

    assert git_env(url="ssh://host/repo")["GIT_SSH_COMMAND"] == SSH_DEFAULT and "BatchMode=yes" in SSH_DEFAULT


@pytest.mark.slow
def test_an_ssh_command_planted_in_a_mirrors_config_never_runs(root, sshd, upstream, tmp_path):
    """Regression (review): a group member's core.sshCommand in a mirror's config (the
    repository's level) beat the operator's and our default, and ran as whoever fetched."""
    port, key, known_hosts = sshd
    operator = tmp_path / "operator.gitconfig"
    operator.write_text(f"[core]\n\tsshCommand = ssh -o BatchMode=yes -i {key} -o IdentitiesOnly=yes "
                        f"-o UserKnownHostsFile={known_hosts}\n")
    env = {"CHECKOUTCACHE_GIT_CONFIG": str(operator)}
    url = ssh_url(port, upstream.path)
    code, answer, err = run_cli("ensure", url, upstream.shas[0], "--wait", "60", root=root, env=env)
    assert code == 0, (answer, err)
    mark = tmp_path / "planted-ran"
    planted = tmp_path / "planted-ssh"
    planted.write_text(f"#!/bin/sh\necho \"$*\" >> {mark}\nexec ssh \"$@\"\n")
    planted.chmod(0o755)
    mirror = only_repo(root).mirror
    with open(os.path.join(mirror, "config"), "a") as handle:
        handle.write(f"[core]\n\tsshCommand = {planted} -o BatchMode=yes -i {key} "
                     f"-o UserKnownHostsFile={known_hosts}\n")
    new = upstream.commit({"NEW.txt": "new\n"}, message="new")  # a commit the mirror lacks: a fetch
    code, answer, err = run_cli("ensure", url, new, "--wait", "60", root=root, env=env)
    assert code == 0, (answer, err)
    assert not mark.exists(), mark.read_text()


@pytest.mark.slow
def test_key_and_known_hosts_paths_with_blanks_and_percent_signs_work(root, sshd, upstream, tmp_path):
    """Regression (review): ssh splits UserKnownHostsFile at blanks and expands %-tokens in
    both paths: such a path failed with "Host key verification failed"."""
    port, key, known_hosts = sshd
    folder = tmp_path / "ops files %d 100%"
    folder.mkdir()
    shutil.copy(key, folder / "client key")
    os.chmod(folder / "client key", 0o600)
    shutil.copy(known_hosts, folder / "known hosts")
    env = {"CHECKOUTCACHE_SSH_KEY_FILE": str(folder / "client key"),
           "CHECKOUTCACHE_SSH_KNOWN_HOSTS_FILE": str(folder / "known hosts")}
    code, answer, err = run_cli("ensure", ssh_url(port, upstream.path), upstream.shas[0], "--wait", "60",
                                root=root, env=env)
    assert code == 0, (answer, err)
    assert_checkout_matches(answer["path"], upstream.path, upstream.shas[0])


def test_a_path_ssh_cannot_be_given_is_bad_argument(root, upstream, tmp_path):
    quoted = tmp_path / 'a"b'
    quoted.write_text("key")
    code, answer, err = run_cli("ensure", "ssh://root@127.0.0.1:1/repo", upstream.shas[0], root=root,
                                env={"CHECKOUTCACHE_SSH_KEY_FILE": str(quoted)})
    assert code == 2 and answer["error"] == "BAD_ARGUMENT" and "double quote" in answer["message"], (answer, err)
    assert os.listdir(root) == [] if os.path.isdir(root) else True


@pytest.mark.parametrize("variable", ["CHECKOUTCACHE_SSH_KEY_FILE", "CHECKOUTCACHE_SSH_KNOWN_HOSTS_FILE"])
def test_an_unreadable_ssh_file_is_bad_argument_and_writes_nothing(root, sshd, upstream, tmp_path, variable):
    port, key, known_hosts = sshd
    env = {"CHECKOUTCACHE_SSH_KEY_FILE": str(key), "CHECKOUTCACHE_SSH_KNOWN_HOSTS_FILE": str(known_hosts),
           variable: str(tmp_path / "missing")}
    code, answer, err = run_cli("ensure", ssh_url(port, upstream.path), upstream.shas[0], "--wait", "60",
                                root=root, env=env)
    assert code == 2 and answer["error"] == "BAD_ARGUMENT", (answer, err)
    assert variable in answer["message"] and answer["next"]
    assert not os.path.exists(os.path.join(root, "repos")) or os.listdir(os.path.join(root, "repos")) == []
    assert not os.path.exists(os.path.join(root, "unreachable")) or os.listdir(os.path.join(root, "unreachable")) == []


def test_libgit2_refuses_ssh_files_rather_than_ignoring_them(root, sshd, upstream):
    port, key, known_hosts = sshd
    env = {"CHECKOUTCACHE_SSH_KEY_FILE": str(key), "CHECKOUTCACHE_SSH_KNOWN_HOSTS_FILE": str(known_hosts),
           "CHECKOUTCACHE_TRANSPORT": "pygit2"}
    code, answer, err = run_cli("ensure", ssh_url(port, upstream.path), upstream.shas[0], "--wait", "60",
                                root=root, env=env)
    assert code == 2 and answer["error"] == "BAD_ARGUMENT", (answer, err)
    assert "CHECKOUTCACHE_TRANSPORT=cli" in answer["message"]
