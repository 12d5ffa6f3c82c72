"""What checking a partial mirror's fetch costs (git/quarantine.py, issue 27).

    python benchmarks/quarantine.py BARE_REPO [--runs 3]

git before 2.44 cannot be told our fsck choices for a partial fetch, so the fetch
goes into a quarantine and `git fsck` checks it before it is admitted. This measures
a cold root's first ready answer through the CLI (`ensure --wait`, the commit at the
repository's HEAD, CHECKOUTCACHE_FILTER=blob:none) with the check (the default) and
with CHECKOUTCACHE_FSCK=off, alternating, on the same `git daemon` (uploadpack.allowFilter
in the served copy), and prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gitdaemon import GitDaemon  # noqa: E402

TOP = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def first_ready(url: str, sha: str, root: str, fsck: str) -> float:
    env = {**os.environ, "PYTHONPATH": TOP, "CHECKOUTCACHE_FILTER": "blob:none", "CHECKOUTCACHE_FSCK": fsck}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "checkoutcache", "--root", root, "ensure", url, sha, "--wait",
                           "600", "--json"], capture_output=True, text=True, env=env)
    took = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"ensure failed ({fsck}): {done.stdout} {done.stderr[-500:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repo", help="a bare repository to serve (a copy is made)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="quarantine-bench-")
    try:
        served = os.path.join(work, "served")
        os.makedirs(served)
        subprocess.run(["git", "clone", "-q", "--bare", args.repo, os.path.join(served, "repo.git")], check=True)
        subprocess.run(["git", "-C", os.path.join(served, "repo.git"), "config", "uploadpack.allowFilter", "true"],
                       check=True)
        sha = subprocess.run(["git", "-C", os.path.join(served, "repo.git"), "rev-parse", "HEAD"], check=True,
                             capture_output=True, text=True).stdout.strip()
        daemon = GitDaemon(served)
        times: dict[str, list[float]] = {"on": [], "off": []}
        try:
            for run in range(args.runs):
                for fsck in ("on", "off") if run % 2 == 0 else ("off", "on"):
                    root = os.path.join(work, f"root-{fsck}-{run}")
                    times[fsck].append(first_ready(daemon.url("repo.git"), sha, root, fsck))
                    shutil.rmtree(root, ignore_errors=True)
        finally:
            daemon.stop()
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"checked (quarantine + git fsck): {', '.join(f'{t:.2f}' for t in times['on'])} s, median {on:.2f} s")
        print(f"unchecked (CHECKOUTCACHE_FSCK=off): {', '.join(f'{t:.2f}' for t in times['off'])} s, "
              f"median {off:.2f} s")
        print(f"ratio: {on / off:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
