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
  4. --mono-rounds rounds: ensure MID (even rounds) or NEW (odd), each from the spare of the
     other, five commits apart either way, asked three ways in turn (WAYS: the CLI with no
     serve to hand it to, the CLI handing it to the serve on the root's socket, and that
     serve's HTTP API, Client.ensure); after each, gc makes the round's tree the next round's
     spare.
The anchor: plain git with one work tree of the same kind (a clone checked out at NEW; the
partial one `--filter=blob:none` with the same sparse cone), timed `git checkout --detach` to
the round's commit in the same round (in a partial clone it fetches the blobs it lacks
lazily, as the product's partial mirror fetches them). Ratios are medians over medians,
all measured in this run. MID is --back commits before the tip, OLD 2x that.

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


# How a new commit is asked for, two rounds each in turn (one MID, one NEW).
WAYS = ("cli_alone", "cli", "serve")


def monorepo_variant(work: str, url: str, old: str, mid: str, new: str, dirs: list[str], partial: bool,
                     rounds: int) -> dict:
    """One variant (a full mirror, or partial + sparse), a cold root. Round r asks for MID when r
    is even and NEW when odd, each time from the spare of the other (five commits apart both
    ways), two rounds per way of WAYS in turn; the anchor, one plain-git work tree, is checked
    out to the same commit in the same round. Medians per way, so one slow round (a page cache
    turned cold) does not decide."""
    import run
    from checkoutcache.client import Client

    label = "partial + sparse" if partial else "full mirror"
    root = os.path.join(work, "root-" + ("sparse" if partial else "full"))
    extra = {"CHECKOUTCACHE_FILTER": "blob:none"} if partial else {}
    cone = [a for d in dirs for a in ("--sparse", d)] if partial else []
    # The tip first: the mirror then holds every commit measured after it (no fetch is timed).
    first_s, first = cli(root, "ensure", url, new, "--wait", "1800", *cone, extra=extra)
    os.sync()
    old_s, second = cli(root, "ensure", url, old, "--wait", "1800", *cone, extra=extra)
    started = time.monotonic()
    report = idle_and_spare(root, [first["path"], second["path"]], extra)
    gc_s = time.monotonic() - started
    spares = sum(1 for r in report["removed"] if r.get("spare"))
    # The anchor: one work tree of the same kind, checked out at NEW, then moved in place.
    anchor = os.path.join(work, "anchor-" + ("sparse" if partial else "full"))
    if partial:
        subprocess.run(["git", "clone", "-q", "--filter=blob:none", "--no-checkout", url, anchor], check=True,
                       env=monorepo.clean_env())
        subprocess.run(["git", "-C", anchor, "sparse-checkout", "set", "--cone", *dirs], check=True,
                       env=monorepo.clean_env())
    else:
        subprocess.run(["git", "clone", "-q", "--no-checkout", url, anchor], check=True, env=monorepo.clean_env())
    subprocess.run(["git", "-C", anchor, "checkout", "-q", "--detach", new], check=True, env=monorepo.clean_env())
    # What today's path (no spare) is measured against: git writing the same whole tree, OLD.
    scratch_tree = os.path.join(work, "worktree-old")
    os.sync()
    worktree_old_s = timed(["git", "-C", anchor, "worktree", "add", "-q", "--detach", scratch_tree, old])
    shutil.rmtree(scratch_tree)
    subprocess.run(["git", "-C", anchor, "worktree", "prune"], check=True, env=monorepo.clean_env())
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)  # serve reads the filter from its environment, as a deployment sets it
    serve, port = run.start_serve(work, root, "serve-" + ("sparse" if partial else "full"), socket_too=True)
    client = Client(f"http://127.0.0.1:{port}", token=run.TOKEN, timeout=1800)
    samples: dict[str, list[float]] = {way: [] for way in (*WAYS, "git")}
    recycled, logs = 0, []
    try:
        for index in range(rounds):
            target = mid if index % 2 == 0 else new
            way = WAYS[index // 2 % len(WAYS)]
            os.sync()  # gc's renames and the last round's writes are on disk before either is timed
            if way in ("cli_alone", "cli"):
                # cli_alone: no serve on the root's socket, the CLI clones itself (forks its worker);
                # cli: as a review container runs it, handing the commit to serve (the pod's token).
                hand = {"CHECKOUTCACHE_UNIX_SOCKET": "/nonexistent/checkoutcache.sock"} if way == "cli_alone" \
                    else {"CHECKOUTCACHE_API_TOKEN": run.TOKEN}
                seconds, answer = cli(root, "ensure", url, target, "--wait", "1800", *cone, extra={**extra, **hand})
                path = answer["path"]
            else:
                started = time.monotonic()
                got = client.ensure(url, target, wait=1800, sparse=dirs if partial else None)
                seconds = time.monotonic() - started
                assert got.state == "ready", got
                path = got.path
            samples[way].append(seconds)
            os.sync()
            samples["git"].append(timed(["git", "-C", anchor, "checkout", "-q", "--detach", target]))
            log_dir = os.path.join(os.path.dirname(os.path.dirname(path)), "logs")
            log = open(os.path.join(log_dir, os.path.basename(path) + ".log")).read()
            attempt = log[log.rindex(" clone of "):] if " clone of " in log else log
            recycled += "updated the spare of" in attempt
            logs.append(attempt.strip().splitlines()[-10:])
            idle_and_spare(root, [path], extra)  # this round's tree is the next round's spare
    finally:
        client.close()
        run.stop_serve(serve)
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    shutil.rmtree(anchor, ignore_errors=True)
    med = {way: round(statistics.median(values), 3) for way, values in samples.items() if values}
    return {"variant": label, "rounds": rounds, "recycled_rounds": recycled, "first_ready_s": round(first_s, 3),
            "new_commit_no_spare_s": round(old_s, 3), "gc_keeping_spares_s": round(gc_s, 3), "spares_kept": spares,
            "samples_s": {way: [round(v, 3) for v in values] for way, values in samples.items()},
            "median_s": med,
            **{f"ratio_{way}_with_spare_to_git_in_place": round(med[way] / med["git"], 2) for way in WAYS if way in med},
            "ratio_no_spare_to_git_in_place": round(old_s / med["git"], 2),
            "git_worktree_add_old_s": round(worktree_old_s, 3),
            "ratio_no_spare_to_worktree_add": round(old_s / worktree_old_s, 2),
            "worker_log_last_round": logs[-1] if logs else []}


def worker_log(path: str) -> str:
    """The clone log of the checkout at path (every attempt's lines)."""
    return open(os.path.join(os.path.dirname(os.path.dirname(path)), "logs", os.path.basename(path) + ".log")).read()


def small_repo(work: str, rounds: int) -> dict:
    up = os.path.join(work, "small", "small")
    os.makedirs(os.path.dirname(up))
    shas = make_repo.generate(up, commits=2 * rounds + 3, files=250, file_size=4096, depth=2, changes=8, seed=1)
    daemon = GitDaemon(os.path.dirname(up))
    url = daemon.url(os.path.basename(up))
    mirror = os.path.join(work, "small-mirror.git")
    subprocess.run(["git", "clone", "-q", "--mirror", url, mirror], check=True)
    spare_root, plain_root = os.path.join(work, "small-spares"), os.path.join(work, "small-plain")
    no_spares = {"CHECKOUTCACHE_MAX_SPARES": "0"}
    samples: dict[str, list[float]] = {"cli_with_spare": [], "cli_no_spare": [], "git_worktree_add": [],
                                       "python_c_pass": []}
    recycled = 0
    last_logs: dict[str, str] = {}
    try:
        # The tip first: both mirrors then hold every commit measured (warm, as the baseline's
        # mirror clone is: a new commit's cost, not a fetch's). Its checkout stays (in use, within
        # the grace window), so its keep-ref keeps that history through every gc below.
        tips = {cli(spare_root, "ensure", url, shas[-1], "--wait", "600")[1]["path"],
                cli(plain_root, "ensure", url, shas[-1], "--wait", "600", extra=no_spares)[1]["path"]}
        for index in range(rounds):
            a, b = shas[2 * index], shas[1 + 2 * index]
            # Each round: the previous checkout becomes a spare, the next commit is made from it.
            for root, extra in ((spare_root, None), (plain_root, no_spares)):
                paths = [os.path.join(root, "repos", key, "checkouts", name)
                         for key in os.listdir(os.path.join(root, "repos"))
                         for name in os.listdir(os.path.join(root, "repos", key, "checkouts"))]
                idle_and_spare(root, [p for p in paths if p not in tips], extra)
            order = ["cli_with_spare", "cli_no_spare", "git_worktree_add", "python_c_pass"]
            turn = index % len(order)
            for method in order[turn:] + order[:turn]:
                os.sync()  # what the last step wrote is on disk: no one pays for another's writeback
                if method == "cli_with_spare":
                    seconds, answer = cli(spare_root, "ensure", url, a, "--wait", "600")
                    log = last_logs["with_spare"] = worker_log(answer["path"])
                    recycled += "updated the spare of" in log
                elif method == "cli_no_spare":
                    seconds, answer = cli(plain_root, "ensure", url, b, "--wait", "600", extra=no_spares)
                    last_logs["no_spare"] = worker_log(answer["path"])
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
            "worker_logs_last_round": {k: v.strip().splitlines()[-8:] for k, v in last_logs.items()},
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
    # The files a tool call reads: files in every commit a review may ask for (a path that is a
    # directory in one of them would read as a lost checkout).
    trees = [set(subprocess.run(["git", "-C", up, "ls-tree", "-r", "--name-only", sha], capture_output=True,
                                text=True, check=True).stdout.split("\n")) - {""} for sha in shas[-25:]]
    paths = sorted(set.intersection(*trees))
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
    parser.add_argument("--mono-rounds", type=int, default=12, help="monorepo rounds per variant (WAYS in turn)")
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
                                          monorepo_variant(work, url, old, mid, new, dirs, partial, args.mono_rounds)
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
