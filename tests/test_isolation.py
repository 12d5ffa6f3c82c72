"""Isolation on a shared volume: several PID namespaces (containers) on one
root, real ones made with `unshare --pid --fork --mount-proc`.

Two clone workers in different namespaces get equal pids. Their scratch
names must never collide, nothing of a live owner may be renamed, reaped or
deleted by anyone, and gc from a third namespace reaps nothing alive.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from checkoutcache.store import locks
from checkoutcache.store.layout import RepoPaths, RootPaths

from .helpers import assert_checkout_matches, run_cli, settled, wait_ready, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="PID namespaces need root and unshare (CI runs as root)")


def in_new_pid_namespace(root: str, url: str, sha: str, wait: int = 60) -> subprocess.Popen:
    """`checkoutcache ensure --wait` as a container would run it: its own PID namespace,
    with a shell as the namespace's init, so the CLI, its forked middle child and the
    worker get the same small pids in every namespace."""
    script = (f"{sys.executable} -m checkoutcache --root {root} ensure {url} {sha} --wait {wait}; "
              "echo exit=$?")
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))


def repo_paths(root: str) -> RepoPaths:
    (key,) = RootPaths(root).repo_keys()
    return RootPaths(root).repo(key)


def scratch_names(paths: RepoPaths) -> list[str]:
    return sorted(os.listdir(paths.scratch_dir))


@pytest.mark.slow
def test_equal_pids_in_two_namespaces_never_touch_each_others_clone(root, served_upstream):
    upstream, url = served_upstream
    wait_ready(root, url, upstream.shas[0])  # the mirror exists; the next clones only fetch
    settled(root)  # its history complete (it takes the mirror lock the test holds, and leaves trash)
    paths = repo_paths(root)
    # Hold the mirror lock so that both workers sit between making their scratch and fetching.
    mirror_lock = locks.mirror_write(paths, timeout=10)
    namespaces = []
    try:
        namespaces = [in_new_pid_namespace(root, url, sha) for sha in upstream.shas[1:3]]
        names = wait_until(lambda: len(scratch_names(paths)) == 2 and scratch_names(paths), 30,
                           "both workers' scratch directories")
        pids = {RepoPaths.scratch_pid(name) for name in names}
        assert len(pids) == 1, f"the workers should have equal pids in their namespaces: {names}"
        owners = [os.path.join(paths.scratch_dir, name) for name in names]
        # Each owner takes its lock right after making its directory: wait for both.
        wait_until(lambda: all(locks.is_locked(RepoPaths.scratch_owner_lock(path)) for path in owners), 10,
                   "both owners' locks")
        # gc from a third namespace (ours) while both are alive: nothing alive is reaped.
        code, report, err = run_cli("gc", "--max-checkouts", "0", "--grace", "0", root=root, timeout=120)
        assert code == 0, err
        assert [r for r in report["removed"] if r["reason"] == "dead-scratch"] == []
        assert scratch_names(paths) == names
        # A cloning answer names a live owner in its own namespace, never ours.
        code, answer, _ = run_cli("ensure", url, upstream.shas[1], root=root)
        assert answer["state"] == "cloning"
        assert answer["pid_namespace"] and answer["pid_namespace"] != os.readlink("/proc/self/ns/pid")
    finally:
        mirror_lock.release()
    outputs = [proc.communicate(timeout=120) for proc in namespaces]
    for out, err in outputs:
        assert "exit=0" in out, (out, err)
    for sha in upstream.shas[1:3]:
        assert_checkout_matches(paths.checkout(sha), upstream.path, sha)
    # The workers' own cleanup removed only their own scratch; gc finds nothing of theirs alive.
    # (No settling here: a namespace's end kills its worker, whose leftovers are gc's to reap.)
    run_cli("gc", root=root)
    assert scratch_names(paths) == []
    assert os.listdir(paths.trash_dir) == []


@pytest.mark.slow
def test_random_kills_in_two_namespaces_recover(root, served_upstream):
    upstream, url = served_upstream
    shas = upstream.shas
    wait_ready(root, url, shas[0])
    settled(root)  # its history complete: the rounds' clones are a complete mirror's
    paths = repo_paths(root)
    rng = random.Random(7)
    for round_number in range(4):
        # Every round starts from absent commits, so there is a clone to kill.
        assert run_cli("gc", "--max-checkouts", "0", "--grace", "0", root=root)[0] == 0
        mirror_lock = locks.mirror_write(paths, timeout=10)  # both workers wait at the mirror...
        procs = [in_new_pid_namespace(root, url, sha, wait=30) for sha in (shas[1], shas[2])]
        names = wait_until(lambda: len(scratch_names(paths)) == 2 and scratch_names(paths), 30,
                           "both workers' scratch directories")
        victim = rng.randrange(2)
        time.sleep(rng.uniform(0.0, 0.2))
        # ...so killing a namespace's init kills a live clone: its CLI and its worker.
        for child in psutil.Process(procs[victim].pid).children():
            child.kill()
        procs[victim].communicate(timeout=30)
        owners = [RepoPaths.scratch_owner_lock(os.path.join(paths.scratch_dir, n)) for n in names]
        dead = wait_until(lambda: [o for o in owners if not locks.is_locked(o)], 10, "the victim's worker to die")
        assert len(dead) == 1, "exactly the victim's worker died"
        if round_number % 2:  # gc between the death and the survivor: reaps only the dead scratch
            code, report, _ = run_cli("gc", root=root)
            assert code == 0
            assert [r["name"] for r in report["removed"] if r["reason"] == "dead-scratch"] == \
                [os.path.basename(os.path.dirname(dead[0]))]
        mirror_lock.release()
        out, err = procs[1 - victim].communicate(timeout=120)
        assert "exit=0" in out, (out, err)
    for sha in shas[1:3]:
        answer = wait_ready(root, url, sha)
        assert_checkout_matches(answer["path"], upstream.path, sha)
    assert run_cli("gc", root=root)[0] == 0
    assert scratch_names(paths) == [] and os.listdir(paths.trash_dir) == []
    assert run_cli("verify", root=root)[0] == 0
