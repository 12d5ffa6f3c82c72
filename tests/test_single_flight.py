"""Invariant 2: however many processes ask at once, one clone runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import assert_checkout_matches, run_cli

ASKERS = 16


def test_sixteen_concurrent_askers_start_one_clone(root, served_upstream, fake_git, tmp_path):
    upstream, url = served_upstream
    sha = upstream.shas[1]
    fetches = tmp_path / "fetches"
    env = dict(os.environ, **fake_git(f'case "$*" in *" fetch "*) echo x >> {fetches}; sleep 0.5;; esac'))
    # First contact (the probe) happens once, before the crowd.
    assert run_cli("ensure", url, upstream.shas[0], "--wait", "60", root=root, env=env)[0] == 0
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

    log = open(os.path.join(root, "repos", os.listdir(os.path.join(root, "repos"))[0], "logs",
                            f"{sha}.log")).read()
    assert log.count("clone of") == 1
    # The commit was already in the mirror (fetching shas[0] brought... no: shas[1]
    # is newer than shas[0]), so exactly one fetch ran for it.
    assert fetches.read_text().count("x") == 1


def test_concurrent_askers_without_wait_all_answer_cloning_or_ready(root, upstream):
    sha = upstream.shas[2]
    assert run_cli("ensure", upstream.path, upstream.shas[0], "--wait", "60", root=root)[0] == 0
    cmd = [sys.executable, "-m", "checkoutcache", "--root", root, "ensure", upstream.path, sha]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(ASKERS)]
    pids = set()
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        answer = json.loads(out)
        assert (proc.returncode, answer["state"]) in ((75, "cloning"), (0, "ready"))
        if answer["state"] == "cloning":
            assert answer["pid"]
            pids.add(answer["pid"])
    assert len(pids) <= 1, "every cloning answer names the one owner"
    assert run_cli("ensure", upstream.path, sha, "--wait", "60", root=root)[0] == 0
