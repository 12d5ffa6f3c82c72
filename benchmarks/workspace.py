"""What a writable workspace costs, against plain git and a plain copy, in one run.

    python benchmarks/workspace.py [--rounds-small 9] [--rounds-mono 3] [--mono /path/mono.git] [--json-out F]

For each repository (a small one: 250 files of make_repo.py; the monorepo of
monorepo.py: 50,000 files, ~195 MiB, generated with 3 commits to keep the run
short, or an existing one with --mono), one store with the commit ready, then
rounds that each measure, in a rotating order (the machine is shared: both
sides see the same load):

- `worktree add`: `git --git-dir=MIRROR worktree add --detach DIR SHA` (the
  bar's baseline for a new tree of a commit whose objects are local);
- `cp -a`: `cp -a --reflink=auto CHECKOUT DIR` of the ready checkout (a copy
  and nothing else; ext4 here: no reflinks, every byte is copied);
- `library`: `make_workspace(Cache(root), repo, sha)`: hold, copy, make it a
  repository of its own, publish (what `exec --writable` does before its command);
- `cli`: `checkoutcache workspace create --path` (a Python start, the same,
  and the keeper's fork), also against `worktree add` plus `python3 -c pass`
  (measured in the same rounds), the form of the new-commit bar;
- each side's first `git status` in the new tree (a tree is of use once git
  agrees it is clean: the copy keeps the checkout's index valid by
  core.checkStat=minimal, a plain `cp -a` would re-read every file).

Trees are removed between rounds, untimed. Medians, and ratios of medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO_ROOT)

import make_repo  # noqa: E402

from checkoutcache.cache import Cache  # noqa: E402
from checkoutcache.workspaces import make_workspace  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": REPO_ROOT, "GIT_CONFIG_NOSYSTEM": "1"}


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run(*args: str, cwd: str | None = None) -> None:
    subprocess.run(args, check=True, capture_output=True, env=ENV, cwd=cwd)


def cli(root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "checkoutcache", "--root", root, *args], check=True,
                          capture_output=True, text=True, env=ENV)


SIDES = ("worktree", "cp", "library", "cli", "python")


def measure(label: str, repo: str, sha: str, work: str, rounds: int, log=print, only: tuple[str, ...] = SIDES) -> dict:
    root = os.path.join(work, f"root-{label}")
    ready = json.loads(cli(root, "ensure", repo, sha, "--wait", "20m", "--json").stdout)
    checkout = ready["path"]
    mirror = os.path.join(os.path.dirname(os.path.dirname(checkout)), "mirror.git")
    owner = subprocess.Popen(["sleep", "100000"])
    times: dict[str, list[float]] = {k: [] for k in ("worktree add", "cp -a", "library", "cli", "python3 -c pass",
                                                       "worktree add: first status", "cp -a: first status",
                                                       "library: first status", "cli: first status")}
    scratch = os.path.join(work, f"trees-{label}")
    os.makedirs(scratch)
    cache = Cache(root)

    def worktree() -> None:
        where = os.path.join(scratch, "wt")
        times["worktree add"].append(timed(lambda: run("git", "--git-dir", mirror, "worktree", "add", "-q",
                                                       "--detach", where, sha)))
        times["worktree add: first status"].append(timed(lambda: run("git", "status", "--porcelain", cwd=where)))
        run("git", "--git-dir", mirror, "worktree", "remove", "--force", where)

    def copy() -> None:
        where = os.path.join(scratch, "cp")
        times["cp -a"].append(timed(lambda: run("cp", "-a", "--reflink=auto", checkout, where)))
        times["cp -a: first status"].append(timed(lambda: run("git", "status", "--porcelain", cwd=where)))
        shutil.rmtree(where)

    def library() -> None:
        made = []
        times["library"].append(timed(lambda: made.append(make_workspace(cache, repo, sha))))
        assert made[0].made, made[0].answer
        times["library: first status"].append(timed(lambda: run("git", "status", "--porcelain", cwd=made[0].path)))
        made[0].remove()

    def command() -> None:
        out = []
        times["cli"].append(timed(lambda: out.append(cli(root, "workspace", "create", "--path", "--owner-pid",
                                                         str(owner.pid), repo, sha).stdout.strip())))
        times["cli: first status"].append(timed(lambda: run("git", "status", "--porcelain", cwd=out[0])))
        cli(root, "workspace", "remove", out[0])

    def python_start() -> None:
        times["python3 -c pass"].append(timed(lambda: run(sys.executable, "-c", "pass")))

    named = {"worktree": worktree, "cp": copy, "library": library, "cli": command, "python": python_start}
    sides = [named[name] for name in SIDES if name in only]
    try:
        for number in range(rounds):
            for side in sides[number % len(sides):] + sides[:number % len(sides)]:
                side()
            log(f"{label}: round {number + 1}/{rounds} done")
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    times = {k: v for k, v in times.items() if v}
    medians = {k: statistics.median(v) for k, v in times.items()}
    base = medians["worktree add"]
    ready_base = base + medians["worktree add: first status"]
    def ratio(top: str, bottom: float) -> float | None:
        return round(medians[top] / bottom, 2) if top in medians else None

    return {
        "rounds": rounds, "medians_s": {k: round(v, 4) for k, v in medians.items()},
        "times_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "ratios_vs_worktree_add": {k: ratio(k, base) for k in ("cp -a", "library", "cli")},
        "ratios_vs_cp": {k: ratio(k, medians["cp -a"]) for k in ("library", "cli")} if "cp -a" in medians else None,
        "cli_vs_worktree_add_plus_python_start": ratio("cli", base + medians["python3 -c pass"])
        if "python3 -c pass" in medians else None,
        "until_clean_status_vs_worktree_add": {
            k: round((medians[k] + medians[f"{k}: first status"]) / ready_base, 2)
            for k in ("cp -a", "library", "cli") if k in medians},
    }


def loadavg() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds-small", type=int, default=9)
    parser.add_argument("--rounds-mono", type=int, default=3)
    parser.add_argument("--mono", default=None, help="an existing monorepo.py repository (bare), else generated")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--skip-mono", action="store_true")
    parser.add_argument("--skip-small", action="store_true")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"which of {','.join(SIDES)} to measure")
    args = parser.parse_args(argv)
    report = {"load_before": loadavg(), "git": subprocess.run(["git", "--version"], capture_output=True,
                                                               text=True).stdout.strip()}
    with tempfile.TemporaryDirectory(prefix="cc-ws-bench-") as work:
        only = tuple(args.sides.split(","))
        if not args.skip_small:
            small = os.path.join(work, "small")
            shas = make_repo.generate(small, commits=3, files=250, file_size=2048, depth=3, changes=20, seed=1)
            report["small"] = {"files": 250, **measure("small", small, shas[-1], work, args.rounds_small, only=only)}
            print(json.dumps(report["small"], indent=1))
        if not args.skip_mono:
            mono = args.mono
            if mono is None:
                import monorepo

                shape = dataclasses.replace(monorepo.SHAPES["full"], commits=3)
                mono = os.path.join(work, "mono.git")
                monorepo.make_monorepo(mono, shape, repack=False, log=lambda *a: None)
            tip = subprocess.run(["git", "--git-dir", mono, "rev-parse", "main"], capture_output=True, text=True,
                                 check=True).stdout.strip()
            files = len(subprocess.run(["git", "--git-dir", mono, "ls-tree", "-r", "--name-only", tip],
                                       capture_output=True, check=True).stdout.splitlines())
            report["monorepo"] = {"files": files, **measure("mono", mono, tip, work, args.rounds_mono, only=only)}
            print(json.dumps(report["monorepo"], indent=1))
    report["load_after"] = loadavg()
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(report, handle, indent=1)
    print(f"load {report['load_before']} before, {report['load_after']} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
