"""The ready answer of a read-only reader (issue: one writer), against `python3 -c pass`.

A review container of the shipped pod reads the root through a read-only mount
and has the writer (`serve`) record each use: one HTTP request over loopback,
made while it holds the marker's shared lock. This measures what that request
costs the CLI's ready answer, interleaved with its baselines in one run:

    python3 -c pass                      the bar's baseline (bar: reader <= 1.5x)
    ensure, the writer's own view        the use recorded by touching the marker
    ensure, a read-only view             the use recorded by the writer over HTTP

The read-only view is a bind mount of the root remounted read-only (root is
needed; without it the script says so and exits 2). Run:

    python benchmarks/reader.py [--rounds 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_repo  # noqa: E402
from gitdaemon import GitDaemon, free_port  # noqa: E402

PY = sys.executable
CC = [PY, "-m", "checkoutcache"]
TOKEN = "bench-token-not-a-secret"
BAR_READER = 1.5


def timed(cmd: list[str], env: dict) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root: the read-only view is a bind mount", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="cc-reader-bench-")
    served = os.path.join(work, "served")
    os.makedirs(served)
    sha = make_repo.generate(os.path.join(served, "small"), commits=20, files=250, file_size=4096, depth=2,
                             changes=8, seed=1)[-1]
    daemon = GitDaemon(served)
    root, view = os.path.join(work, "root"), os.path.join(work, "view")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKOUTCACHE_")}
    url = daemon.url("small")
    port = free_port()
    ready_file = os.path.join(work, "serve-ready")
    serve = subprocess.Popen(CC + ["--root", root, "serve", "--listen", f"127.0.0.1:{port}", "--gc-interval", "0",
                                   "--ready-file", ready_file], stdout=subprocess.DEVNULL,
                             stderr=open(os.path.join(work, "serve.log"), "w"), env=dict(env, CHECKOUTCACHE_API_TOKEN=TOKEN))
    mounted = False
    try:
        while not os.path.exists(ready_file):
            assert serve.poll() is None, open(os.path.join(work, "serve.log")).read()
            time.sleep(0.02)
        subprocess.run(CC + ["--root", root, "ensure", url, sha, "--wait", "120"], check=True, capture_output=True,
                       env=env)
        os.makedirs(view)
        subprocess.run(["mount", "--bind", root, view], check=True)
        mounted = True
        subprocess.run(["mount", "-o", "remount,bind,ro", view], check=True)
        reader_env = dict(env, CHECKOUTCACHE_API_URL=f"http://127.0.0.1:{port}", CHECKOUTCACHE_API_TOKEN=TOKEN)
        check = subprocess.run(CC + ["--root", view, "ensure", url, sha], capture_output=True, text=True,
                               env=reader_env)
        assert check.returncode == 0 and "not recorded" not in check.stderr, check.stderr + check.stdout
        base, writer, reader = [], [], []
        for _ in range(args.rounds):  # interleaved, so machine noise hits all three alike
            base.append(timed([PY, "-c", "pass"], env))
            writer.append(timed(CC + ["--root", root, "ensure", url, sha], env))
            reader.append(timed(CC + ["--root", view, "ensure", url, sha], reader_env))
        result = {name: {"median_ms": statistics.median(s) * 1000, "p90_ms": sorted(s)[int(len(s) * 0.9)] * 1000}
                  for name, s in (("python_c_pass", base), ("writer", writer), ("reader", reader))}
        result["ratio_writer"] = statistics.median(writer) / statistics.median(base)
        result["ratio_reader"] = statistics.median(reader) / statistics.median(base)
        result["reader_minus_writer_ms"] = (statistics.median(reader) - statistics.median(writer)) * 1000
        print(json.dumps(result, indent=1))
        print(f"reader / python3 -c pass: {result['ratio_reader']:.2f} (bar <= {BAR_READER}): "
              f"{'met' if result['ratio_reader'] <= BAR_READER else 'MISSED'}")
        return 0
    finally:
        if mounted:
            subprocess.run(["umount", view])
        serve.terminate()
        serve.wait(30)
        daemon.stop()
        subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    sys.exit(main())
