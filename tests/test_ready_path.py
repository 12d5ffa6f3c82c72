"""The ready path stays cheap: no git library, no psutil, no
subprocess; just the marker check and touch."""

from __future__ import annotations

import json
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
