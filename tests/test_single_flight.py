"""Invariant 2: however many processes ask at once, one clone runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .helpers import assert_checkout_matches, only_repo, run_cli, settled

ASKERS = 16


@pytest.mark.slow
def test_sixteen_concurrent_askers_start_one_clone(root, served_upstream, fake_git, tmp_path):
    upstream, url = served_upstream
    sha = upstream.shas[1]
    fetches = tmp_path / "fetches"
    env = dict(os.environ, **fake_git(f'case "$*" in *" fetch "*) echo x >> {fetches}; sleep 0.5;; esac'))
    # First contact (the probe) happens once, before the crowd.
    assert run_cli("ensure", url, upstream.shas[0], "--wait", "60", root=root, env=env)[0] == 0
    settled(root)  # and the mirror's history (its own fetch) is done
    fetches.unlink()

    cmd = [sys.executable, "-m", "checkoutcache", "--root", root, "ensure", url, sha, "--wait", "60"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
             for _ in range(ASKERS)]
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        answers.append(json.loads(out))
    paths = {a["path"] for a in answers}
    assert len(paths) == 1
    assert_checkout_matches(paths.pop(), upstream.path, sha)

    log = open(only_repo(root).clone_log(sha)).read()
    assert log.count("clone of") == 1
    # The commit was already in the mirror (fetching shas[0] brought... no: shas[1]
    # is newer than shas[0]), so exactly one fetch ran for it.
    assert fetches.read_text().count("x") == 1


@pytest.mark.slow
def test_concurrent_askers_without_wait_all_answer_cloning(root, upstream, fake_git, tmp_path):
    sha = upstream.shas[2]
    assert run_cli("ensure", upstream.path, upstream.shas[0], "--wait", "60", root=root)[0] == 0
    # The clone's checkout waits until every asker has answered (bounded: 30 s), so no answer
    # can be "ready" and every one must name the one owner.
    release = tmp_path / "release"
    env = dict(os.environ, **fake_git(f'case "$*" in *" checkout "*) i=0; while [ ! -e {release} ] && '
                                      f'[ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done;; esac'))
    cmd = [sys.executable, "-m", "checkoutcache", "--root", root, "ensure", upstream.path, sha]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(ASKERS)]
    pids = set()
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            answer = json.loads(out)
            assert (proc.returncode, answer["state"]) == (75, "cloning"), answer
            assert answer["pid"]
            pids.add(answer["pid"])
    finally:
        release.touch()
    assert len(pids) == 1, "every cloning answer names the one owner"
    assert run_cli("ensure", upstream.path, sha, "--wait", "60", root=root)[0] == 0
    assert open(only_repo(root).clone_log(sha)).read().count("clone of") == 1
