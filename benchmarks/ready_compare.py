"""The ready answer of this checkout against another checkout of the package, in one run.

    python benchmarks/ready_compare.py --base /path/to/other/checkout [-n 80]

For a change on the ready path (store/ready.py, cli/fast.py): both trees answer the
same ready checkout through the CLI (`python -m checkoutcache ensure`, cwd=/ so each
child imports only the tree its PYTHONPATH names), interleaved with `python3 -c pass`
and alternating which goes first, so machine noise hits all three alike; then the
library's ready_record of each tree, in process. Prints medians and the ratios the
ready bar is stated in (DESIGN.md: the CLI at most 1.5x `python3 -c pass`).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tests.helpers.repos import Upstream  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="another checkout of the package (its top directory)")
    parser.add_argument("-n", type=int, default=80, help="CLI answers per tree")
    parser.add_argument("--library-n", type=int, default=20000)
    args = parser.parse_args()
    mine = os.path.dirname(HERE)
    work = tempfile.mkdtemp(prefix="ready-compare-")
    upstream = Upstream(os.path.join(work, "upstream"))
    upstream.standard_history()
    root = os.path.join(work, "root")
    sha = upstream.shas[0]

    def ensure(tree: str) -> list[str]:
        return [sys.executable, "-m", "checkoutcache", "--root", root, "ensure", upstream.path, sha]

    def timed(cmd: list[str], tree: str | None) -> float:
        env = dict(os.environ, PYTHONPATH=tree) if tree else dict(os.environ)
        started = time.perf_counter()
        subprocess.run(cmd, env=env, cwd="/", check=True, capture_output=True)
        return time.perf_counter() - started

    subprocess.run(ensure(mine) + ["--wait", "120"], env=dict(os.environ, PYTHONPATH=mine), cwd="/", check=True,
                   capture_output=True)
    baseline, base, new = [], [], []
    for i in range(args.n):
        baseline.append(timed([sys.executable, "-c", "pass"], None))
        pair = [(base, args.base), (new, mine)]
        for into, tree in pair if i % 2 else reversed(pair):
            into.append(timed(ensure(tree), tree))
    median = statistics.median
    print(f"python -c pass {median(baseline) * 1000:.1f} ms; CLI ready answer: base {median(base) * 1000:.1f} ms "
          f"({median(base) / median(baseline):.3f}x), this tree {median(new) * 1000:.1f} ms "
          f"({median(new) / median(baseline):.3f}x)")
    marker = glob.glob(os.path.join(root, "repos", "*", "checkouts", sha, ".git", "checkoutcache-ready"))[0]
    for label, tree in (("base", args.base), ("this tree", mine)) * 2:
        spec = importlib.util.spec_from_file_location(f"ready_{len(label)}",
                                                      os.path.join(tree, "checkoutcache", "store", "ready.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        started = time.perf_counter()
        for _ in range(args.library_n):
            assert module.ready_record(marker)
        print(f"library ready_record, {label}: {(time.perf_counter() - started) / args.library_n * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
