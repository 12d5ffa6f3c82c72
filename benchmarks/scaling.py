"""How the cost of `gc` and `status` grows: with the number of checkouts, not of files.

    python benchmarks/scaling.py                                  # 10/50/200 checkouts x 1k/10k/50k files
    python benchmarks/scaling.py --checkouts 200 --files 10000    # only the bar's cell
    python benchmarks/scaling.py --json-out scaling.json --png benchmarks/scaling.png

For each file count, ONE checkout is made with the real product (a generated
repository of that many files, `checkoutcache ensure --wait` into an empty
root). It is then replicated, cheaply, into checkouts/<fake-sha> directories
of the same repository store: `cp -al` (hard links: no data is copied, the
directories are new), with a real copy of the ready marker (its own mtime:
its own last use) and a size record (state/<fake-sha>.size.json) copied from
the real one with its `use_at_measure` set to that marker's mtime, as publish
writes it. gc and status then see a real-looking store: N ready, intact,
recently used checkouts of F files each. Nothing is over a limit (no limits
are set; every marker is within the grace window), so gc has nothing to evict;
the run checks that it evicted nothing.

Stores grow in place: 10 checkouts are measured, then 40 more are added and
50 measured, then 200. Each cell times `checkoutcache gc` and `checkoutcache
status --json` as subprocesses (after one untimed warm-up of each), median of
--repeats. Cells over --max-files files in all (default 2.5 million: the disk
and the time of one run) are skipped and listed as skipped. The bar (the
performance issue): 200 checkouts x 10,000 files, gc with nothing to evict <=
1 s, status <= 0.5 s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import make_repo  # noqa: E402

PY = sys.executable
CC = [PY, "-m", "checkoutcache"]
BAR_GC_SECONDS = 1.0
BAR_STATUS_SECONDS = 0.5
BAR_CELL = (200, 10000)


def child_env() -> dict:
    """Our checkout on the children's path, and no limits from the caller's environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKOUTCACHE_")}
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def loadavg() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-500:]}")
    return elapsed, done.stdout


def fake_sha(files: int, index: int) -> str:
    return hashlib.sha1(f"checkoutcache-scaling-{files}-{index}".encode()).hexdigest()


class Store:
    """A root holding one real checkout of `files` files and its replicas."""

    def __init__(self, work: str, files: int, env: dict):
        self.files, self.env = files, env
        self.base = os.path.join(work, f"files-{files}")
        os.makedirs(self.base, exist_ok=True)
        upstream = os.path.join(self.base, "upstream")
        started = time.monotonic()
        shas = make_repo.generate(upstream, commits=2, files=files, file_size=256, depth=3, changes=1, seed=1)
        self.root = os.path.join(self.base, "root")
        _, out = timed(CC + ["--root", self.root, "--json", "ensure", upstream, shas[-1], "--wait", "900"], env)
        answer = json.loads(out)
        assert answer["state"] == "ready", answer
        self.sha = shas[-1]
        self.real = answer["path"]
        self.checkouts_dir = os.path.dirname(self.real)
        self.key_dir = os.path.dirname(self.checkouts_dir)
        self.state_dir = os.path.join(self.key_dir, "state")
        self.count = 1
        self.setup_seconds = time.monotonic() - started
        self.replicate_seconds = 0.0
        # Measure the real checkout once (its publish record, and the use the ready answer made).
        timed(CC + ["--root", self.root, "--json", "gc"], env)
        with open(os.path.join(self.state_dir, f"{self.sha}.size.json")) as handle:
            self.size_record = json.load(handle)

    def grow_to(self, count: int) -> None:
        started = time.monotonic()
        marker_name = os.path.join(".git", "checkoutcache-ready")
        real_marker = os.path.join(self.real, marker_name)
        while self.count < count:
            sha = fake_sha(self.files, self.count)
            target = os.path.join(self.checkouts_dir, sha)
            subprocess.run(["cp", "-al", self.real, target], check=True)
            marker = os.path.join(target, marker_name)
            os.unlink(marker)  # its own marker: its own last use, its own lock
            with open(real_marker) as handle:
                record = json.load(handle)
            record["commit"] = sha
            with open(marker, "w") as handle:
                json.dump(record, handle)
            used = time.time()
            os.utime(marker, (used, used))
            size = dict(self.size_record, use_at_measure=os.stat(marker).st_mtime)
            with open(os.path.join(self.state_dir, f"{sha}.size.json"), "w") as handle:
                json.dump(size, handle)
            self.count += 1
        self.replicate_seconds += time.monotonic() - started

    def measure(self, repeats: int) -> dict:
        gc_cmd = CC + ["--root", self.root, "--json", "gc"]
        status_cmd = CC + ["--root", self.root, "--json", "status"]
        # One untimed warm-up of each: the page cache, and any size record gc measures again.
        _, out = timed(gc_cmd, self.env)
        timed(status_cmd, self.env)
        gc_times, status_times = [], []
        report = {}
        for _ in range(repeats):  # interleaved
            seconds, out = timed(gc_cmd, self.env)
            gc_times.append(seconds)
            report = json.loads(out)
            seconds, out = timed(status_cmd, self.env)
            status_times.append(seconds)
            status = json.loads(out)
        listed = sum(len(repo.get("checkouts", [])) for repo in status.get("repos", [])) \
            if isinstance(status, dict) else None
        return {"gc_seconds": statistics.median(gc_times), "status_seconds": statistics.median(status_times),
                "gc_samples": gc_times, "status_samples": status_times,
                "gc_removed": len(report.get("removed", [])), "gc_skipped": report.get("skipped"),
                "status_checkouts": listed}

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def run(work: str, checkouts: list[int], files: list[int], repeats: int, max_files: int,
        log=print) -> dict:
    env = child_env()
    result = {"cells": [], "skipped": [], "repeats": repeats, "max_files": max_files,
              "loadavg_before": loadavg()}
    started = time.monotonic()
    for file_count in files:
        wanted = [n for n in sorted(checkouts) if n * file_count <= max_files]
        result["skipped"] += [{"checkouts": n, "files": file_count, "total_files": n * file_count}
                              for n in sorted(checkouts) if n * file_count > max_files]
        if not wanted:
            continue
        store = Store(work, file_count, env)
        try:
            for count in wanted:
                store.grow_to(count)
                load = loadavg()
                cell = {"checkouts": count, "files": file_count, "loadavg_before": load}
                cell.update(store.measure(repeats))
                cell["loadavg_after"] = loadavg()
                cell["replicate_seconds_so_far"] = round(store.replicate_seconds, 1)
                result["cells"].append(cell)
                log(f"  {count:>4} checkouts x {file_count:>6} files: gc {cell['gc_seconds']:.3f} s, status "
                    f"{cell['status_seconds']:.3f} s (removed {cell['gc_removed']}, listed "
                    f"{cell['status_checkouts']}; load {load} -> {cell['loadavg_after']})")
        finally:
            store.remove()
    result["loadavg_after"] = loadavg()
    result["seconds"] = round(time.monotonic() - started, 1)
    result["bar"] = bar(result)
    return result


def bar(result: dict) -> dict | None:
    """The issue's bar, judged on the 200 x 10k cell when it was measured."""
    for cell in result["cells"]:
        if (cell["checkouts"], cell["files"]) == BAR_CELL:
            return {"gc_seconds": cell["gc_seconds"], "status_seconds": cell["status_seconds"],
                    "gc_met": cell["gc_seconds"] <= BAR_GC_SECONDS and cell["gc_removed"] == 0,
                    "status_met": cell["status_seconds"] <= BAR_STATUS_SECONDS}
    return None


def print_table(result: dict) -> None:
    files = sorted({c["files"] for c in result["cells"]} | {s["files"] for s in result["skipped"]})
    counts = sorted({c["checkouts"] for c in result["cells"]} | {s["checkouts"] for s in result["skipped"]})
    cells = {(c["checkouts"], c["files"]): c for c in result["cells"]}
    print(f"\ngc / status --json, median of {result['repeats']} (seconds)")
    print(f"  {'checkouts':>9} " + "".join(f"{f'{f} files':>22}" for f in files))
    for n in counts:
        row = []
        for f in files:
            c = cells.get((n, f))
            row.append(f"{c['gc_seconds']:.3f} / {c['status_seconds']:.3f}" if c else "skipped")
        print(f"  {n:>9} " + "".join(f"{v:>22}" for v in row))
    for s in result["skipped"]:
        print(f"  skipped: {s['checkouts']} x {s['files']} ({s['total_files']:,} files > {result['max_files']:,})")
    b = result["bar"]
    if b:
        print(f"  bar (200 x 10k): gc {b['gc_seconds']:.3f} s <= {BAR_GC_SECONDS} "
              f"{'met' if b['gc_met'] else 'MISSED'}; status {b['status_seconds']:.3f} s <= {BAR_STATUS_SECONDS} "
              f"{'met' if b['status_met'] else 'MISSED'}")
    print(f"  load average {result['loadavg_before']} before, {result['loadavg_after']} after")


def plot(result: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("  (matplotlib not installed: pip install -e '.[bench]'; no plot drawn)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    for ax, what, limit in ((axes[0], "gc", BAR_GC_SECONDS), (axes[1], "status", BAR_STATUS_SECONDS)):
        for files in sorted({c["files"] for c in result["cells"]}):
            cells = sorted((c for c in result["cells"] if c["files"] == files), key=lambda c: c["checkouts"])
            ax.plot([c["checkouts"] for c in cells], [c[f"{what}_seconds"] for c in cells], marker="o",
                    label=f"{files:,} files each")
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label=f"bar at 200 x 10k: {limit} s")
        ax.set_xlabel("checkouts in the store")
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"checkoutcache {'gc (nothing to evict)' if what == 'gc' else 'status --json'}")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Cost against the number of checkouts (2 cores, load {result['loadavg_before']} -> "
                 f"{result['loadavg_after']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"  plot: {path}")
    return True


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkouts", type=ints, default=[10, 50, 200], help="comma-separated (default 10,50,200)")
    parser.add_argument("--files", type=ints, default=[1000, 10000, 50000],
                        help="files per checkout, comma-separated (default 1000,10000,50000)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-files", type=int, default=2_500_000, help="skip cells with more files in all")
    parser.add_argument("--workdir", help="default: a temporary directory under /tmp, removed after")
    parser.add_argument("--json-out")
    parser.add_argument("--png", help="draw the plot here (matplotlib), e.g. benchmarks/scaling.png")
    parser.add_argument("--check", action="store_true", help="exit 1 if the 200 x 10k bar is missed")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="checkoutcache-scaling-")
    os.makedirs(work, exist_ok=True)
    print(f"scaling: {args.checkouts} checkouts x {args.files} files, work in {work}; "
          f"df: {shutil.disk_usage(work).free / 2**30:.0f} GiB free")
    result = run(work, args.checkouts, args.files, args.repeats, args.max_files)
    print_table(result)
    if args.png:
        plot(result, args.png)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(result, handle, indent=2)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    b = result["bar"]
    return 1 if args.check and b and not (b["gc_met"] and b["status_met"]) else 0


if __name__ == "__main__":
    sys.exit(main())
