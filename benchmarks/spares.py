"""Recycled trees (issue 28): a new commit made from a spare against plain git's in-place
checkout of the same commit in one work tree, measured in one run.

    python benchmarks/spares.py --quick                  # 5,000-file monorepo, 250-file small repo
    python benchmarks/spares.py --mono /path/mono.git    # reuse a generated monorepo (monorepo.py)
    python benchmarks/spares.py --json-out spares.json

Monorepo (monorepo.py's generated repository, served by git daemon), per variant (a full
mirror; a partial mirror with a sparse cone), a cold root:
  1. ensure NEW, the tip (the mirror is made and holds every commit below: no fetch of
     commits is timed after it; monorepo.py measures first clones);
  2. ensure OLD: a new commit with no spare (today's path);
  3. gc --max-checkouts 0 (NEW and OLD idle): both trees kept as spares;
  4. ensure MID: a new commit made from the nearest spare, timed.
The anchor: plain git with one work tree of the same kind (a clone checked out at NEW; the
partial one `--filter=blob:none` with the same sparse cone), timed `git checkout --detach MID`
(in a partial clone it fetches the blobs it lacks lazily, as the product's partial mirror
fetches them). Each ratio is the product's step over the anchor's, both measured in this
run. MID is --back commits before the tip (the issue's "five behind the tip"), OLD 2x that.

Small repository (make_repo.py, 250 files): the CLI's new commit with a spare and without
one, against `git worktree add --detach` plus `python3 -c pass` (the CLI's bar), rounds
interleaved.

Reviews (--reviews SECONDS): run.py's review scenario at a limit (16 reviewers, 24 distinct
commits, gc every 2 s at max 8 checkouts, 3,000 files), spares on and off in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import make_repo  # noqa: E402
import monorepo  # noqa: E402
from gitdaemon import GitDaemon  # noqa: E402

PY = sys.executable
REPO_ROOT = os.path.dirname(HERE)
BAR_MONOREPO = 1.5  # a new commit with a spare against plain git's in-place checkout
BAR_CLI = 1.25  # the CLI's new commit against worktree add + python -c pass


def env_for(root: str, extra: dict | None = None) -> dict:
    return monorepo.clean_env({"CHECKOUTCACHE_ROOT": root, "PYTHONPATH": REPO_ROOT, **(extra or {})})


def cli(root: str, *args: str, extra: dict | None = None) -> tuple[float, dict]:
    started = time.monotonic()
    done = subprocess.run([PY, "-m", "checkoutcache", "--json", *args], env=env_for(root, extra),
                          capture_output=True, cwd="/")
    seconds = time.monotonic() - started
    answer = json.loads(done.stdout or b"{}")
    if done.returncode != 0:
        raise RuntimeError(f"{args}: {done.stdout[-400:]!r} {done.stderr[-400:]!r}")
    return seconds, answer


def idle_and_spare(root: str, paths: list[str], extra: dict | None = None) -> dict:
    then = time.time() - 7200
    for path in paths:
        os.utime(os.path.join(path, ".git", "checkoutcache-ready"), (then, then))
    _, report = cli(root, "gc", "--max-checkouts", "0", extra=extra)
    return report


def timed(cmd: list[str], cwd: str = "/") -> float:
    started = time.monotonic()
    subprocess.run(cmd, check=True, capture_output=True, cwd=cwd, env=monorepo.clean_env())
    return time.monotonic() - started


def monorepo_variant(work: str, url: str, old: str, mid: str, new: str, dirs: list[str], partial: bool) -> dict:
    label = "partial + sparse" if partial else "full mirror"
    root = os.path.join(work, "root-" + ("sparse" if partial else "full"))
    extra = {"CHECKOUTCACHE_FILTER": "blob:none"} if partial else {}
    cone = [a for d in dirs for a in ("--sparse", d)] if partial else []
    # The tip first: the mirror then holds every commit measured after it (no fetch is timed).
    first_s, first = cli(root, "ensure", url, new, "--wait", "1800", *cone, extra=extra)
    old_s, second = cli(root, "ensure", url, old, "--wait", "1800", *cone, extra=extra)
    started = time.monotonic()
    report = idle_and_spare(root, [first["path"], second["path"]], extra)
    gc_s = time.monotonic() - started
    spares = sum(1 for r in report["removed"] if r.get("spare"))
    new_s, third = cli(root, "ensure", url, mid, "--wait", "1800", *cone, extra=extra)
    log_dir = os.path.join(os.path.dirname(os.path.dirname(third["path"])), "logs")
    log = open(os.path.join(log_dir, os.path.basename(third["path"]) + ".log")).read()
    recycled = "updated the spare of" in log
    # The anchor: one work tree of the same kind, checked out at MID, updated in place to NEW.
    anchor = os.path.join(work, "anchor-" + ("sparse" if partial else "full"))
    if partial:
        subprocess.run(["git", "clone", "-q", "--filter=blob:none", "--no-checkout", url, anchor], check=True,
                       env=monorepo.clean_env())
        subprocess.run(["git", "-C", anchor, "sparse-checkout", "set", "--cone", *dirs], check=True,
                       env=monorepo.clean_env())
    else:
        subprocess.run(["git", "clone", "-q", "--no-checkout", url, anchor], check=True, env=monorepo.clean_env())
    subprocess.run(["git", "-C", anchor, "checkout", "-q", "--detach", new], check=True, env=monorepo.clean_env())
    anchor_s = timed(["git", "-C", anchor, "checkout", "-q", "--detach", mid])
    shutil.rmtree(anchor, ignore_errors=True)
    return {"variant": label, "first_ready_s": round(first_s, 3), "new_commit_no_spare_s": round(old_s, 3),
            "gc_keeping_spares_s": round(gc_s, 3), "spares_kept": spares,
            "new_commit_with_spare_s": round(new_s, 3), "recycled": recycled,
            "git_in_place_checkout_s": round(anchor_s, 3),
            "ratio_spare_to_git_in_place": round(new_s / anchor_s, 2),
            "ratio_no_spare_to_git_in_place": round(old_s / anchor_s, 2),
            "worker_log": log.strip().splitlines()[-24:]}


def small_repo(work: str, rounds: int) -> dict:
    up = os.path.join(work, "small", "small")
    os.makedirs(os.path.dirname(up))
    shas = make_repo.generate(up, commits=2 * rounds + 2, files=250, file_size=4096, depth=2, changes=8, seed=1)
    daemon = GitDaemon(os.path.dirname(up))
    url = daemon.url(os.path.basename(up))
    mirror = os.path.join(work, "small-mirror.git")
    subprocess.run(["git", "clone", "-q", "--mirror", url, mirror], check=True)
    spare_root, plain_root = os.path.join(work, "small-spares"), os.path.join(work, "small-plain")
    no_spares = {"CHECKOUTCACHE_MAX_SPARES": "0"}
    samples: dict[str, list[float]] = {"cli_with_spare": [], "cli_no_spare": [], "git_worktree_add": [],
                                       "python_c_pass": []}
    recycled = 0
    try:
        cli(spare_root, "ensure", url, shas[0], "--wait", "600")
        cli(plain_root, "ensure", url, shas[0], "--wait", "600", extra=no_spares)
        for index in range(rounds):
            a, b = shas[1 + 2 * index], shas[2 + 2 * index]
            # Each round: the previous checkout becomes a spare, the next commit is made from it.
            for root, extra in ((spare_root, None), (plain_root, no_spares)):
                paths = [os.path.join(root, "repos", key, "checkouts", name)
                         for key in os.listdir(os.path.join(root, "repos"))
                         for name in os.listdir(os.path.join(root, "repos", key, "checkouts"))]
                idle_and_spare(root, paths, extra)
            order = ["cli_with_spare", "cli_no_spare", "git_worktree_add", "python_c_pass"]
            turn = index % len(order)
            for method in order[turn:] + order[:turn]:
                if method == "cli_with_spare":
                    seconds, answer = cli(spare_root, "ensure", url, a, "--wait", "600")
                    log = open(os.path.join(os.path.dirname(os.path.dirname(answer["path"])), "logs",
                                            os.path.basename(answer["path"]) + ".log")).read()
                    recycled += "updated the spare of" in log
                elif method == "cli_no_spare":
                    seconds, _ = cli(plain_root, "ensure", url, b, "--wait", "600", extra=no_spares)
                elif method == "git_worktree_add":
                    seconds = timed(["git", "-C", mirror, "worktree", "add", "-q", "--detach",
                                     os.path.join(work, "wt", str(index)), b])
                else:
                    seconds = timed([PY, "-c", "pass"])
                samples[method].append(seconds)
    finally:
        daemon.stop()
    med = {k: round(statistics.median(v), 4) for k, v in samples.items()}
    base = med["git_worktree_add"] + med["python_c_pass"]
    return {"files": 250, "rounds": rounds, "median_s": med, "recycled_rounds": recycled,
            "ratio_cli_with_spare_to_worktree_plus_python": round(med["cli_with_spare"] / base, 2),
            "ratio_cli_no_spare_to_worktree_plus_python": round(med["cli_no_spare"] / base, 2)}


def reviews_at_a_limit(work: str, seconds: float) -> dict:
    """The issue's review scenario (16 reviewers, 24 distinct commits, gc at max 8 checkouts) on
    a 3,000-file repository, twice in this run: spares on (the default) and off. What counts:
    0 lost, 0 errors, and the total time of the clones (journal: started to published)."""
    import run

    up = os.path.join(work, "reviews", "large")
    os.makedirs(os.path.dirname(up))
    shas = make_repo.generate(up, commits=40, files=3000, file_size=8192, depth=4, changes=12, seed=1)
    paths = subprocess.run(["git", "-C", up, "ls-tree", "-r", "--name-only", shas[-1]], capture_output=True,
                           text=True, check=True).stdout.split("\n")
    daemon = GitDaemon(os.path.dirname(up))
    url = daemon.url("large")
    cfg = dict(reviewers=16, commits=24, review_seconds=seconds, tool_calls=5, think=(0.4, 1.2), gc_every=2.0,
               max_checkouts=8)
    out = {"config": cfg}
    try:
        for label, spares in (("spares on", None), ("spares off", "0")):
            journal = os.path.join(work, f"journal-{spares or 'on'}")
            impl = run.Ours(os.path.join(work, f"rev-{spares or 'on'}"), url, grace=5.0, max_checkouts=8, hold=False,
                            journal=journal)
            if spares is not None:
                impl.env["CHECKOUTCACHE_MAX_SPARES"] = spares
            result = run.run_reviews(impl, shas, paths, cfg, 1)
            events = impl.clones()
            published = [e for e in events if e["event"] == "published"]
            result["clone_seconds_total"] = round(sum(e.get("seconds", 0.0) for e in published), 2)
            result["clone_seconds_median"] = round(statistics.median([e.get("seconds", 0.0) for e in published]), 3) \
                if published else None
            result["recycled"] = sum(1 for r in impl.gc_reports for x in r["removed"] if x.get("spare"))
            out[label] = result
    finally:
        daemon.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 5,000-file monorepo")
    parser.add_argument("--mono", help="reuse (or make here) the generated monorepo")
    parser.add_argument("--back", type=int, default=5, help="MID is this many commits before the tip")
    parser.add_argument("--rounds", type=int, default=5, help="small-repository rounds")
    parser.add_argument("--skip-small", action="store_true")
    parser.add_argument("--skip-mono", action="store_true")
    parser.add_argument("--reviews", type=float, default=0, help="also the review scenario, this many seconds each")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="spares-bench-")
    # As pip installs it: every module compiled, so no run pays for compiling one.
    subprocess.run([PY, "-m", "compileall", "-q", os.path.join(REPO_ROOT, "checkoutcache")], check=True,
                   env=monorepo.clean_env())
    report: dict = {"machine": {"cores": os.cpu_count(), "loadavg_before": os.getloadavg()}}
    try:
        if not args.skip_mono:
            shape = monorepo.SHAPES["quick" if args.quick else "full"]
            path = args.mono or os.path.join(work, "mono.git")
            repo = monorepo.load_monorepo(path, shape, 1) if os.path.exists(path) else \
                monorepo.make_monorepo(path, shape)
            dirs = monorepo.cone_dirs(repo, 0.05)
            new, mid, old = repo.commits[-1], repo.commits[-1 - args.back], repo.commits[-1 - 2 * args.back]
            daemon = monorepo.serve(repo)
            url = f"git://127.0.0.1:{daemon.port}/{os.path.basename(repo.path)}"
            try:
                report["monorepo"] = {"files": repo.files, "changes_per_commit": repo.shape.changes,
                                      "back": args.back, "variants": [
                                          monorepo_variant(work, url, old, mid, new, dirs, partial)
                                          for partial in (False, True)]}
            finally:
                daemon.stop()
        if not args.skip_small:
            report["small"] = small_repo(work, args.rounds)
        if args.reviews:
            report["reviews"] = reviews_at_a_limit(work, args.reviews)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["machine"]["loadavg_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
