"""serve processes with equal pids on one root (issue 27): every container of the
image runs serve as the same pid (under tini, or as pid 1), so two sidecars on
one volume (a rolling upgrade, a shared PersistentVolume, a restart after an
OOM kill) must own their files by something unique, with a lock, never by a
pid alone (DESIGN invariant 3). Real serve processes, each in a PID namespace
of its own (`unshare --pid`: it is pid 1 there), on one root."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time

import pytest

from checkoutcache.store import locks
from checkoutcache.store.layout import RootPaths

from .helpers.cli import run_cli
from .helpers.serve import PID_NAMESPACE, Serve
from .helpers.waiting import wait_until

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                       reason="needs root and unshare(1) for PID namespaces"),
]


def clones(serve: Serve, outcome: str) -> int:
    """checkoutcache_clones_total of one outcome, as this serve counts it."""
    found = re.search(rf'checkoutcache_clones_total\{{error="",outcome="{outcome}"\}} ([0-9.]+)',
                      serve.client().metrics())
    return int(float(found.group(1))) if found else 0


def clone(serve: Serve, upstream, sha: str) -> None:
    """One clone through this serve, then wait until its journal follower counted it."""
    before = clones(serve, "published")
    assert serve.client().ensure(upstream.path, sha, wait=120).state == "ready"
    wait_until(lambda: clones(serve, "published") >= before + 1, 60, "the serve to count its clone")


def journals(root: str) -> list[str]:
    serve_dir = RootPaths(root).serve_dir
    return sorted(os.path.join(serve_dir, name) for name in os.listdir(serve_dir) if name.endswith(".journal"))


@pytest.mark.slow
def test_two_serves_with_equal_pids_count_only_their_own_clones(root, tmp_path, upstream):
    """Regression: the journal was <root>/serve/<pid>.journal. A second serve of the same pid
    counted the first one's clones; when it stopped it deleted the shared file, after which the
    first counted no more clones; after a SIGKILL and a restart the old events were counted again;
    gc removed a live serve's journal by its age."""
    shas = upstream.shas + upstream.standard_history(1)
    first = Serve(root, tmp_path, "--allow-local", prefix=PID_NAMESPACE)
    second = Serve(root, tmp_path, "--allow-local", prefix=PID_NAMESPACE)
    restarted = None
    try:
        # Two processes, one pid number: each is pid 1 of its own namespace.
        assert first.announced()["pid"] == second.announced()["pid"]
        assert first.serve_pid() != second.serve_pid()

        clone(first, upstream, shas[0])
        clone(second, upstream, shas[1])
        # The second serve read the journal past the first's clone before its own was counted.
        assert clones(second, "started") == 1 and clones(second, "published") == 1
        assert len(journals(root)) == 2, "each serve has a journal of its own"

        assert second.stop() == 0
        assert len(journals(root)) == 1, "the stopped serve removed its own journal, and only that"
        clone(first, upstream, shas[2])  # before: never counted (its journal was deleted under it)
        assert clones(first, "started") == 2 and clones(first, "published") == 2

        killed = journals(root)
        os.kill(first.serve_pid(), signal.SIGKILL)  # pid 1: its whole namespace goes with it
        first.proc.wait(30)
        restarted = Serve(root, tmp_path, "--allow-local", prefix=PID_NAMESPACE)
        assert restarted.announced()["pid"] == first.announced()["pid"]
        clone(restarted, upstream, shas[3])
        # Nothing of the killed serve's journal is counted (or logged) again.
        assert clones(restarted, "started") == 1 and clones(restarted, "published") == 1

        # gc: the killed serve's journal (its lock free) goes, the running serve's stays,
        # however old its last write.
        own = [j for j in journals(root) if j not in killed]
        assert len(killed) == 1 and len(own) == 1 and os.path.exists(killed[0])
        os.utime(own[0], (time.time() - 3 * 86400,) * 2)
        assert run_cli("gc", root=root)[0] == 0
        assert journals(root) == own
        assert restarted.stop() == 0 and journals(root) == []
        assert restarted.log().count("event=clone_published") == 1  # its own clone, logged once
    finally:
        for running in (first, second, restarted):
            if running is not None and running.proc.poll() is None:
                os.kill(running.serve_pid(), signal.SIGKILL)
                running.proc.wait(30)


def test_a_readiness_probe_never_takes_another_namespace_s_probe_file(root, tmp_path):
    """Regression: /readyz locked and removed locks/.health-<pid>-<n>, a name a serve of the same
    pid in another container also uses: it found the other's probe locked (and answered 503) and
    removed the other's file."""
    paths = RootPaths(root)
    os.makedirs(paths.locks_dir, exist_ok=True)
    # Another serve of pid 1 in the middle of its first probes.
    planted = [locks.try_lock(paths.health_probe(f"1-{n}")) for n in range(10)]
    assert all(planted) and len(planted) == 10
    running = Serve(root, tmp_path, prefix=PID_NAMESPACE)
    try:
        assert running.announced()["pid"] == 1
        for _ in range(3):
            ready = running.client(token=None).ready()
            assert ready["ok"] and ready["checks"]["locks_work"], ready
        assert all(os.path.exists(held.path) for held in planted)
    finally:
        running.stop()
        for held in planted:
            held.release()
