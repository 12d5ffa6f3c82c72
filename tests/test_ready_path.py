"""The ready path stays cheap: no git library, no psutil, no
subprocess; just the marker check and touch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from checkoutcache import Cache

PROBE = """
import json, sys
from checkoutcache.cli.commands import main
import checkoutcache.cache as cache
answer = cache.Cache(sys.argv[1]).ensure(sys.argv[2], sys.argv[3])
heavy = [m for m in ("pygit2", "portalocker", "psutil", "subprocess", "checkoutcache.clone.coordinator",
                     "checkoutcache.clone.worker") if m in sys.modules]
print(json.dumps({"state": answer.state, "heavy": heavy}))
"""


def test_ready_answer_imports_no_git_library(root, upstream):
    sha = upstream.shas[0]
    assert Cache(root).ensure(upstream.path, sha, wait=60).state == "ready"
    out = subprocess.run([sys.executable, "-c", PROBE, root, upstream.path, sha], capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out) == {"state": "ready", "heavy": []}


def imported_by(*args: str) -> set[str]:
    """Modules a command imports beyond what `python -c pass` does (python -X importtime)."""
    def modules(argv: list[str]) -> set[str]:
        done = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True)
        return {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}

    return modules(list(args)) - modules(["-c", "pass"])


# Budgets, in modules beyond a bare Python start: the CLI's ready answer and its slow path
# (a new commit: the coordinator and a forked worker). Measured: 20 and 120 on this machine.
READY_BUDGET, SLOW_BUDGET = 40, 160
NEVER_ON_THE_READY_PATH = {"pygit2", "psutil", "subprocess", "checkoutcache.clone.coordinator",
                           "checkoutcache.clone.worker", "prometheus_client", "setproctitle",
                           "click", "attrs", "attr"}  # cli/fast.py answers before either
NEVER_ON_THE_SLOW_PATH = {"pygit2", "portalocker", "prometheus_client", "checkoutcache.serve.http",
                          "checkoutcache.upkeep.gc", "checkoutcache.upkeep.mirror_upkeep",
                          "checkoutcache.upkeep.spare_upkeep", "checkoutcache.upkeep.workspace_upkeep",
                          "checkoutcache.upkeep.leftovers", "uvicorn", "schemathesis"}


def test_cli_import_budgets(root, upstream):
    ready_sha, new_sha = upstream.shas[0], upstream.shas[1]
    assert Cache(root).ensure(upstream.path, ready_sha, wait=60).state == "ready"
    ready = imported_by("-m", "checkoutcache", "--root", root, "ensure", upstream.path, ready_sha)
    assert "checkoutcache.store.ready" in ready and "checkoutcache.cli.fast" in ready, "a ready answer was measured"
    assert not ready & NEVER_ON_THE_READY_PATH and len(ready) <= READY_BUDGET, (len(ready), ready & NEVER_ON_THE_READY_PATH)
    slow = imported_by("-m", "checkoutcache", "--root", root, "ensure", upstream.path, new_sha, "--wait", "60")
    assert "checkoutcache.clone.coordinator" in slow, "the probe measured the slow path"
    assert not slow & NEVER_ON_THE_SLOW_PATH and len(slow) <= SLOW_BUDGET, (len(slow), slow & NEVER_ON_THE_SLOW_PATH)


@pytest.mark.slow
def test_the_fast_ready_answer_is_the_full_clis_answer(root, upstream):
    """cli/fast.py answers a plain ensure of a ready checkout; the full CLI (reached
    here with --wait 0) must say the same, for every scope and output form."""
    from .helpers import run_cli, settled

    sha = upstream.shas[0]
    for scope in ("default", "tenant-a"):
        assert run_cli("ensure", upstream.path, sha, "--scope", scope, "--wait", "60", root=root)[0] == 0
        settled(root)  # the first answer is shallow, and its history may arrive between the two below
        fast = run_cli("ensure", upstream.path, sha, "--scope", scope, root=root)
        full = run_cli("ensure", upstream.path, sha, "--scope", scope, "--wait", "0", root=root)
        assert fast[0] == full[0] == 0 and fast[1] == full[1] and fast[1]["state"] == "ready"
        assert run_cli("--json", "ensure", upstream.path, sha, "--scope", scope, root=root)[1] == full[1]
    # Not ready, bad input, other commands: the full CLI answers (and the fast path wrote nothing).
    assert run_cli("ensure", upstream.path, "main", root=root)[1]["error"] == "BAD_COMMIT"
    assert run_cli("ensure", upstream.path, upstream.shas[1], root=root)[1]["state"] == "cloning"


def test_an_exclusive_flock_is_waited_for_before_the_description_lock_is_tried(tmp_path):
    """Third review of issue 33's fix: an older version's evictor takes flock's exclusive lock
    alone, to re-check a last use and rename the checkout (milliseconds); a ready answer that
    passed it at once by the description's read lock could record a use the evictor never saw
    and answer a checkout renamed away the next instant. A held exclusive flock is waited for
    FALLBACK_AFTER first (a lower bound: what happens within it is the evictor's)."""
    import fcntl
    import time

    from checkoutcache.store.ready import FALLBACK_AFTER, open_marker_shared

    marker = tmp_path / "checkoutcache-ready"
    marker.write_text("{}")
    evictor = os.open(marker, os.O_RDONLY)
    try:
        fcntl.flock(evictor, fcntl.LOCK_EX)
        started = time.monotonic()
        fd = open_marker_shared(str(marker), wait=5)
        assert fd is not None and time.monotonic() - started >= FALLBACK_AFTER
        os.close(fd)
    finally:
        os.close(evictor)


def test_without_description_locks_the_evictor_and_ready_answers_keep_to_flock(root, upstream, monkeypatch):
    """Third review of issue 33's fix: where the kernel (or file system) has no open file
    description locks, every F_OFD call fails EINVAL, and gc took that for a reader's hold:
    nothing was ever evicted. Both sides keep to flock alone there, as before."""
    import errno
    import fcntl

    from checkoutcache import Cache
    from checkoutcache.config import Config
    from checkoutcache.store import ready
    from checkoutcache.upkeep import gc

    real = fcntl.fcntl

    def no_ofd(fd, cmd, *args):
        if cmd in (fcntl.F_OFD_SETLK, fcntl.F_OFD_SETLKW, fcntl.F_OFD_GETLK):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, *args)

    cache = Cache(root)
    answer = cache.ensure(upstream.path, upstream.shas[0], wait=60)
    assert answer.state == "ready"
    monkeypatch.setattr(ready.fcntl, "fcntl", no_ofd)
    assert cache.ensure(upstream.path, upstream.shas[0]).state == "ready"
    monkeypatch.setenv("CHECKOUTCACHE_GRACE", "0")
    monkeypatch.setenv("CHECKOUTCACHE_MAX_CHECKOUTS", "0")
    report = gc.run_gc(cache.paths, Config.from_env())
    assert [r.name for r in report.removed if r.reason == "lru"] == [upstream.shas[0]], report
