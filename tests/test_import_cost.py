"""What the CLI's new commit imports, read from `python -X importtime` of the real
command: `checkoutcache ensure REPO SHA --wait` on a pipe, the mirror warm, the
clone worker forked from it (its import lines go to the commit's clone log,
where its stderr goes). The path pays for the clone, not for modules it does
not use: no click, no libgit2, no psutil, no HTTP or S3 client, no bundle,
submodule or inventory code. A module joining this path must be added to the
agreed list below on purpose (its cost measured in benchmarks/run.py)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

from .helpers import Upstream, wait_ready

# The agreed list: the package's modules on the path of a new commit (the CLI's, then
# the forked worker's). Anything else of the package imported there fails this test.
CLI_MODULES = {
    "checkoutcache", "checkoutcache.answers", "checkoutcache.bundles", "checkoutcache.bundles.location",
    "checkoutcache.cache", "checkoutcache.cli", "checkoutcache.cli.fast", "checkoutcache.clone",
    "checkoutcache.clone.coordinator", "checkoutcache.clone.decide", "checkoutcache.clone.spawn",
    "checkoutcache.cones", "checkoutcache.config", "checkoutcache.credentials", "checkoutcache.errors",
    "checkoutcache.git", "checkoutcache.git.backend", "checkoutcache.git.env", "checkoutcache.git.transport",
    "checkoutcache.repospec", "checkoutcache.store", "checkoutcache.store.create", "checkoutcache.store.layout",
    "checkoutcache.store.liveness", "checkoutcache.store.locks", "checkoutcache.store.modes", "checkoutcache.sharing", "checkoutcache.handoff",
    "checkoutcache.store.ready", "checkoutcache.store.records", "checkoutcache.store.watch", "checkoutcache.units",
    "checkoutcache.store.tree",  # every store path reached beneath the root (standard library only, no ctypes)
    "checkoutcache.signing",  # a hand-off to the writer is signed, never a bearer token (standard library, no hashlib)
    # The forked child's first step (become_detached), read before its stderr goes to the log:
    # standard library and store modules this set already has.
    "checkoutcache.clone.process",
}
WORKER_MODULES = {
    "checkoutcache.clone.worker", "checkoutcache.git.cli", "checkoutcache.git.lfs_cli", "checkoutcache.git.mirror",
    "checkoutcache.store.checkouts", "checkoutcache.store.liveness", "checkoutcache.store.scratch",
    "checkoutcache.store.sizes", "checkoutcache.testhooks",
    "checkoutcache.git.view",  # every fetch runs in a private view of the mirror (docs/security.md)
    "checkoutcache.clone.tree", "checkoutcache.store.spares", "checkoutcache.store.beneath",  # the tree, spares
    "checkoutcache.git.quarantine",  # a partial mirror's fetch is checked before it lands (git < 2.44)
    "checkoutcache.git.messages",  # what git's output says (progress, the failing line)
    # A shallow mirror (issue 34): the commit alone, fetched privately; after the publish the
    # worker starts the mirror's background history (clone/history.py).
    "checkoutcache.git.shallow", "checkoutcache.git.boundary", "checkoutcache.clone.process",
    "checkoutcache.clone.history", "checkoutcache.clone.decide",
}
# Never on this path, whatever else joins it: what the measured issue found there.
# (logging is imported by setproctitle, which the fork's retitling needs.)
FORBIDDEN = {"click", "pygit2", "psutil", "boto3", "botocore", "ssl", "http", "email", "urllib.request",
             "checkoutcache.cli.commands", "checkoutcache.git.libgit2", "checkoutcache.bundles.seed",
             "checkoutcache.bundles.objectstore", "checkoutcache.clone.submodules", "checkoutcache.store.inventory"}
LINE = re.compile(r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$")


def imported(text: str) -> list[str]:
    return [m.group(1) for m in map(LINE.match, text.splitlines()) if m]


def test_a_new_commits_path_imports_only_the_agreed_modules(root, tmp_path):
    upstream = Upstream(str(tmp_path / "upstream"))
    upstream.standard_history()
    wait_ready(root, upstream.path, upstream.shas[0])  # the mirror is warm
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "checkoutcache", "--root", root, "ensure",
                           upstream.path, upstream.shas[1], "--wait", "60"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = imported(done.stderr)
    cli = lines[lines.index("site") + 1:]  # what the interpreter's own start imported is not ours
    (log,) = [p for p in glob.glob(os.path.join(root, "repos", "*", "logs", f"{upstream.shas[1]}.log"))]
    worker = imported(open(log).read())
    assert "checkoutcache.cli.fast" in cli and "checkoutcache.clone.worker" in worker  # both were read
    ours = {m for m in cli if m.startswith("checkoutcache")}
    assert ours <= CLI_MODULES, sorted(ours - CLI_MODULES)
    theirs = {m for m in worker if m.startswith("checkoutcache")}
    assert theirs <= WORKER_MODULES, sorted(theirs - WORKER_MODULES)
    every = set(cli) | set(worker)
    assert not {m for m in every if m in FORBIDDEN or m.split(".")[0] in FORBIDDEN}, \
        sorted(m for m in every if m in FORBIDDEN or m.split(".")[0] in FORBIDDEN)


# A new commit handed to serve: the CLI only asks and reads the marker serve wrote.
HANDOFF_MODULES = {
    "checkoutcache", "checkoutcache.cli", "checkoutcache.cli.fast", "checkoutcache.cones",
    "checkoutcache.credentials", "checkoutcache.errors", "checkoutcache.repospec", "checkoutcache.store",
    "checkoutcache.store.layout", "checkoutcache.store.ready", "checkoutcache.units", "checkoutcache.handoff",
    "checkoutcache.signing",
}


def test_a_new_commit_handed_to_serve_imports_neither_attrs_nor_the_library(root, tmp_path, served_upstream):
    """Regression: the hand-off parsed --wait with checkoutcache.units, which imported attrs
    (34 ms of a ~200 ms answer) for a class the hand-off never uses."""
    from .helpers import TOKEN, Serve

    repo, url = served_upstream
    os.makedirs(root, exist_ok=True)
    running = Serve(root, tmp_path, "--gc-interval", "0", unix=os.path.join(root, "checkoutcache.sock"))
    try:
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "checkoutcache", "--root", root, "ensure",
                               url, repo.shas[1], "--wait", "60"], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, CHECKOUTCACHE_API_TOKEN=TOKEN))
    finally:
        running.stop()
    assert done.returncode == 0, done.stderr[-2000:]
    lines = imported(done.stderr)
    cli = lines[lines.index("site") + 1:]
    assert "checkoutcache.cli.fast" in cli and "_socket" in cli  # it asked serve
    ours = {m for m in cli if m.startswith("checkoutcache")}
    assert ours <= HANDOFF_MODULES, sorted(ours - HANDOFF_MODULES)  # never the library: serve answered
    assert not {m for m in cli if m.split(".")[0] in ("attrs", "attr", "click")}
