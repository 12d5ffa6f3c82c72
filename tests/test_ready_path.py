"""The ready path stays cheap: no git library, no portalocker, no psutil, no
subprocess; just the marker check and touch."""

from __future__ import annotations

import json
import subprocess
import sys

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
