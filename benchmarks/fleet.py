"""Fleet seeding with git bundles: what a cold node costs the upstream, with and
without a published bundle, and how soon it answers its first ready.

    python benchmarks/fleet.py --quick [--json-out fleet.json]   # under a minute
    python benchmarks/fleet.py [--rounds 4] [--sequential] [--check] [--json-out fleet.json]   # ~4 minutes

Everything is generated and served on 127.0.0.1 (no network):

1. A repository with a long history (make_repo.py: 3000 commits over 3000
   files by default, 1000 over 500 in --quick) is served by `git daemon`
   behind counting TCP proxies (below). At first the upstream's `main` is
   BEHIND (30) commits short of the generated tip.
2. Publish: a publisher root ensures that `main` with its whole history (`--history
   full`) and runs `checkoutcache bundle publish URL --to file://STORE`; the store then holds the history up
   to 30 commits before the tip. The upstream is then advanced to the tip
   (`git push`, as developers would), so every requested commit is newer than
   the bundle and needs a fetch of the difference.
3. A full clone (`git clone --mirror` through a proxy): the reference object
   count of the 5% bar. The count the proxy read from the pack header is
   checked against the objects the clone stored.
4. The fleet, per mode: four fresh roots (nodes) each run `checkoutcache
   --root NODE ensure URL SHA --wait 600` for the same 4 commits (24, 15, 7 and
   0 commits behind the tip, in that order), then waits for the mirror's history
   (`--history full`: a first answer is the commit alone, its history follows,
   seeded from the bundles; the node's traffic is counted once it is there). Concurrently by default (a fleet
   scaling up at once, all four starting together), one node after another
   with --sequential. Without seeding, then with
   CHECKOUTCACHE_BUNDLE_URI=file://STORE in the nodes' environment; the pair
   is repeated --rounds times (4; 2 in --quick), its order alternating.
   Each node's first ensure is broken down from its clone log (seeding,
   upstream fetch, checkout, the rest), and the seeded nodes' own records
   (state/mirror-seed.json) are set beside the proxy's counts.

Measured at the upstream: every node's git reaches the daemon through a proxy
of its own (an operator git config, CHECKOUTCACHE_GIT_CONFIG, rewrites the one
repository URL to that proxy with `url.<proxy>.insteadOf`; the URL itself,
hence the store key and the bundle's, is the same on every node and for the
publisher). The URL is itself a proxy, so traffic that escaped the rewrite is
counted too, as "unattributed". A proxy counts the bytes the upstream sent per
connection and reads the object count of every pack in the upload-pack
response: pkt-lines, side-band channel 1 carrying "PACK", version, and the
4-byte big-endian number of objects (protocol v0/v1 and v2; a pack sent
without side-band is read too). Time to first ready is the wall time of a
node's first `ensure` (process start to exit).

Bars (the issue's): upstream objects of the worst seeded node <= 5% of a full
clone's; time to first ready with seeding <= 1.0x without it (medians over the
nodes and rounds, one machine). Every ensure must answer ready with its
commit. The run exits 0 whatever the bars say; --check exits 1 if one is
missed. Ratios are within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import make_repo
from countingproxy import CountingProxy
from gitdaemon import GitDaemon

PY = sys.executable
NODES = 4
BEHIND = 30  # commits between the published bundle and the upstream's tip
# (commits, files, file_size, depth, changes per commit) of the generated upstream
SHAPES = {
    "quick": {"commits": 1000, "files": 500, "file_size": 2048, "depth": 2, "changes": 6},
    "default": {"commits": 3000, "files": 3000, "file_size": 4096, "depth": 3, "changes": 10},
}
BAR_OBJECTS = 0.05  # upstream objects of a seeded cold node / a full clone's
BAR_FIRST_READY = 1.0  # time to first ready, seeded / unseeded
ENSURE_WAIT = "600"


def loadavg() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


# ---------------------------------------------------------------- helpers

def git(*args: str, cwd: str | None = None, env: dict | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout.strip()


def run_cc(root: str, args: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    cmd = [PY, "-m", "checkoutcache", "--root", root, "--json", *args]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    return time.perf_counter() - started, done


def parse_json(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def tree_bytes(path: str) -> tuple[int, int]:
    """(files, bytes) under path."""
    files = size = 0
    for directory, _dirs, names in os.walk(path):
        for name in names:
            files += 1
            size += os.lstat(os.path.join(directory, name)).st_size
    return files, size


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


# ---------------------------------------------------------------- the upstream

def make_upstream(work: str, shape: dict, seed: int, behind: int) -> dict:
    """The generated history in a staging repository; the served bare repository holds it up to
    `behind` commits before the tip (pushed, then packed as a server keeps its repositories)."""
    staging = os.path.join(work, "staging")
    shas = make_repo.generate(staging, seed=seed, **shape)
    served = os.path.join(work, "served", "repo")
    git("init", "-q", "--bare", "-b", "main", served)
    git("-C", staging, "push", "-q", served, f"{shas[-1 - behind]}:refs/heads/main")
    git("-C", served, "repack", "-adq")
    return {"staging": staging, "served": served, "base": os.path.dirname(served), "shas": shas}


def advance_upstream(upstream: dict) -> None:
    """Developers push the last commits: the upstream's main moves to the generated tip."""
    git("-C", upstream["staging"], "push", "-q", upstream["served"], f"{upstream['shas'][-1]}:refs/heads/main")


# ---------------------------------------------------------------- the phases

def publish(work: str, url: str, sha: str, store: str, env: dict) -> dict:
    """The publisher: a root that ensures the upstream's current main, then publishes a bundle of it."""
    root = os.path.join(work, "publisher")
    # The whole history: a bundle is made of one (a shallow first answer's mirror is refused).
    ensure_s, done = run_cc(root, ["ensure", url, sha, "--wait", ENSURE_WAIT, "--history", "full"], env)
    answer = parse_json(done.stdout)
    if done.returncode != 0 or not answer or answer.get("state") != "ready":
        raise SystemExit(f"publisher ensure failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    publish_s, done = run_cc(root, ["bundle", "publish", url, "--to", "file://" + store], env)
    if done.returncode != 0:
        raise SystemExit(f"`checkoutcache bundle publish` failed ({done.returncode}); is fleet seeding in "
                         f"this checkout?\n{done.stdout}\n{done.stderr}")
    files, size = tree_bytes(store)
    names = sorted(os.path.relpath(os.path.join(d, n), store) for d, _, ns in os.walk(store) for n in ns)
    return {"ensure_s": round(ensure_s, 3), "publish_s": round(publish_s, 3), "answer": parse_json(done.stdout),
            "store_files": files, "store_bytes": size, "store_listing": names[:20]}


def full_clone(work: str, url: str, proxy: CountingProxy, env: dict) -> dict:
    """`git clone --mirror` of the whole upstream: the reference count of the objects bar."""
    target = os.path.join(work, "full-clone.git")
    proxy.label = "full-clone"
    started = time.perf_counter()
    git("clone", "-q", "--mirror", url, target, env=env)
    seconds = time.perf_counter() - started
    proxy.wait_idle()
    proxy.label = "idle"
    counted = proxy.tally("full-clone")
    stored = dict(line.split(": ", 1) for line in git("-C", target, "count-objects", "-v").splitlines())
    result = {"seconds": round(seconds, 3), "objects": counted["objects"], "bytes": counted["bytes"],
              "packs": counted["packs"], "objects_stored": int(stored["in-pack"]) + int(stored["count"])}
    # The proxy's reading of the pack header against what git stored: a wrong parser shows here.
    if result["objects"] != result["objects_stored"] or counted["unparsed"]:
        raise SystemExit(f"the proxy counted {result['objects']} objects, the clone stored "
                         f"{result['objects_stored']} (unparsed streams: {counted['unparsed']})")
    shutil.rmtree(target)
    return result


def node_run(root: str, url: str, shas: list[str], env: dict, start: threading.Barrier | None) -> list[dict]:
    """One node: ensure each commit in turn from an empty root."""
    if start is not None:
        start.wait()
    results = []
    for sha in shas:
        seconds, done = run_cc(root, ["ensure", url, sha, "--wait", ENSURE_WAIT], env)
        answer = parse_json(done.stdout) or {}
        ok = done.returncode == 0 and answer.get("state") == "ready" and answer.get("commit") == sha
        if ok:  # the checkout really is that commit
            head = subprocess.run(["git", "-c", "safe.directory=*", "-C", answer["path"], "rev-parse", "HEAD"],
                                  capture_output=True, text=True, check=False).stdout.strip()
            ok = head == sha
        row = {"sha": sha, "seconds": round(seconds, 3), "ok": ok, "state": answer.get("state")}
        if not ok:
            row["error"] = (done.stdout + done.stderr)[-2000:]
        # Anything the answer says beyond the usual keys (how it was seeded, say) is kept for the report.
        row["extra"] = {k: v for k, v in answer.items() if k not in ("state", "commit", "repo", "path")}
        results.append(row)
    # The mirror's history follows the first answer (a shallow one) in the background, seeded from
    # the bundles: the node is done, and its upstream traffic counted, once the history is there.
    seconds, done = run_cc(root, ["ensure", url, shas[-1], "--wait", ENSURE_WAIT, "--history", "full"], env)
    results[-1]["history_s"] = round(seconds, 3)
    results[-1]["history"] = (parse_json(done.stdout) or {}).get("history")
    return results


def seed_record(root: str) -> dict | None:
    """What the node's own record says of its seeding (state/mirror-seed.json: the bundles taken in,
    the time, and what it believes the upstream sent since), to set beside the proxy's count."""
    repos = os.path.join(root, "repos")
    for key in sorted(os.listdir(repos)) if os.path.isdir(repos) else []:
        path = os.path.join(repos, key, "state", "mirror-seed.json")
        if os.path.isfile(path):
            with open(path) as handle:
                return parse_json(handle.read())
    return None


LOG_MARKS = {"start": "clone of ", "fetch": "$ git fetch ", "mirror": "mirror has the commit", "ready": "published"}


def clone_phases(root: str, sha: str, total: float) -> dict | None:
    """Where a node's first ensure spent its time, from its clone log (`HH:MM:SS.mmm message` lines):
    before the upstream fetch (seeding, when seeded), the upstream fetch, the checkout and publish,
    and the rest (the CLI's start, the first contact, starting the worker, the answer)."""
    repos = os.path.join(root, "repos")
    seen: dict[str, float] = {}
    for key in os.listdir(repos) if os.path.isdir(repos) else []:
        path = os.path.join(repos, key, "logs", f"{sha}.log")
        if not os.path.isfile(path):
            continue
        with open(path, errors="replace") as handle:
            for line in handle:
                stamp, _, message = line.rstrip("\n").partition(" ")
                try:
                    hours, minutes, seconds = stamp.split(":")
                    at = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
                except ValueError:
                    continue
                for mark, prefix in LOG_MARKS.items():
                    if mark not in seen and message.startswith(prefix):
                        seen[mark] = at
    if len(seen) != len(LOG_MARKS):
        return None  # the log's wording changed: no breakdown rather than a wrong one

    def span(a: str, b: str) -> float:
        return round((seen[b] - seen[a]) % 86400, 3)  # a log that crosses midnight

    phases = {"before_fetch_s": span("start", "fetch"), "upstream_fetch_s": span("fetch", "mirror"),
              "checkout_s": span("mirror", "ready")}
    phases["outside_worker_s"] = round(total - span("start", "ready"), 3)
    return phases


def run_fleet(work: str, label: str, url: str, shas: list[str], proxies: list[CountingProxy],
              catch_all: CountingProxy, node_envs: list[dict], sequential: bool, keep: bool) -> dict:
    """Four cold nodes ensure the same commits; per node, what its proxy counted and its times."""
    roots = [os.path.join(work, label, f"node{i}") for i in range(NODES)]
    # No fleet inherits the previous phase's dirty pages: their writeback would slow its checkouts
    # (seen as a 2x slower first fleet right after the setup wrote the repository, the clone and the bundle).
    os.sync()
    for proxy in [*proxies, catch_all]:
        proxy.label = label
    load_before = loadavg()
    results: list[list[dict]] = [[] for _ in range(NODES)]
    started = time.perf_counter()
    if sequential:
        for i in range(NODES):
            results[i] = node_run(roots[i], url, shas, node_envs[i], None)
    else:
        barrier = threading.Barrier(NODES)  # a fleet scaling up at once: all four start together

        def node(i: int) -> None:
            results[i] = node_run(roots[i], url, shas, node_envs[i], barrier)

        threads = [threading.Thread(target=node, args=(i,)) for i in range(NODES)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    wall = time.perf_counter() - started
    for proxy in [*proxies, catch_all]:
        proxy.wait_idle()
        proxy.label = "idle"
    nodes = []
    for i in range(NODES):
        counted = proxies[i].tally(label)
        nodes.append({"node": i, "ensures": results[i], "first_ready_s": results[i][0]["seconds"],
                      "all_commits_s": round(sum(r["seconds"] for r in results[i]), 3),
                      "objects": counted["objects"], "bytes": counted["bytes"], "packs": counted["packs"],
                      "connections": counted["connections"], "unparsed": counted["unparsed"],
                      "still_open": counted["still_open"], "seed_record": seed_record(roots[i]),
                      "first_ready_phases": clone_phases(roots[i], shas[0], results[i][0]["seconds"])})
    unattributed = catch_all.tally(label)
    if not keep:
        shutil.rmtree(os.path.join(work, label), ignore_errors=True)
    return {"label": label, "nodes": nodes, "wall_s": round(wall, 3), "unattributed": unattributed,
            "errors": sum(not r["ok"] for n in nodes for r in n["ensures"]),
            "loadavg_before": load_before, "loadavg_after": loadavg()}


# ---------------------------------------------------------------- summary and bars

def summarize(fleets: list[dict], mode: str) -> dict:
    mine = [f for f in fleets if f["mode"] == mode]
    nodes = [n for f in mine for n in f["nodes"]]
    # What escaped a node's proxy was still sent by the upstream: shared over the fleet's nodes.
    objects = [n["objects"] + f["unattributed"]["objects"] / NODES for f in mine for n in f["nodes"]]
    sent = [n["bytes"] + f["unattributed"]["bytes"] / NODES for f in mine for n in f["nodes"]]
    first = [n["first_ready_s"] for n in nodes]
    return {"fleets": len(mine), "nodes": len(nodes),
            "objects_per_node": {"mean": statistics.mean(objects), "max": max(objects)},
            "bytes_per_node": {"mean": statistics.mean(sent), "max": max(sent)},
            "first_ready_s": {"median": median(first), "max": max(first), "min": min(first)},
            "fleet_first_ready_s": median([max(n["first_ready_s"] for n in f["nodes"]) for f in mine]),
            "all_commits_s": {"median": median([n["all_commits_s"] for n in nodes])},
            "unattributed_objects": sum(f["unattributed"]["objects"] for f in mine),
            "errors": sum(f["errors"] for f in mine)}


def round_ratios(fleets: list[dict]) -> list[dict]:
    """Per round, seeded / unseeded of the median first ready: the run-to-run spread of the time bar."""
    rounds: dict[str, dict] = {}
    for fleet in fleets:
        rounds.setdefault(fleet["label"].split("-")[0], {})[fleet["mode"]] = median(
            [n["first_ready_s"] for n in fleet["nodes"]])
    return [{"round": name, **pair, "ratio": ratio(pair.get("seeded"), pair.get("unseeded"))}
            for name, pair in rounds.items()]


def bars(report: dict) -> list[dict]:
    """Each bar: name, value, limit, met (None when this run could not measure it)."""
    seeded, unseeded = report["summary"].get("seeded"), report["summary"].get("unseeded")
    full = report["full_clone"]["objects"]
    checks = [
        ("upstream objects, worst seeded node / full clone",
         ratio(seeded["objects_per_node"]["max"], full) if seeded else None, BAR_OBJECTS),
        ("time to first ready, seeded / unseeded (median)",
         ratio(seeded["first_ready_s"]["median"], unseeded["first_ready_s"]["median"]) if seeded else None,
         BAR_FIRST_READY),
        ("ensures not answering ready with their commit",
         sum(s["errors"] for s in (seeded, unseeded) if s), 0),
    ]
    return [{"name": name, "value": value, "bar": limit, "met": None if value is None else value <= limit}
            for name, value, limit in checks]


def print_report(report: dict) -> None:
    s, u, full = report["summary"].get("seeded"), report["summary"]["unseeded"], report["full_clone"]
    shape = report["shape"]
    print(f"\nfleet: {NODES} cold nodes x {len(report['commits'])} commits "
          f"({'one after another' if report['sequential'] else 'concurrently'}), {report['rounds']} round(s); "
          f"upstream {shape['commits']} commits x {shape['files']} files, bundle {report['behind']} commits "
          f"behind the tip; full clone {full['objects']} objects, {full['bytes'] / 2**20:.2f} MiB, "
          f"{full['seconds']:.2f} s")
    if report.get("publish"):
        pub = report["publish"]
        print(f"publish: ensure {pub['ensure_s']:.2f} s, bundle publish {pub['publish_s']:.2f} s, store "
              f"{pub['store_files']} files {pub['store_bytes'] / 2**20:.2f} MiB")
    print("\n| per cold node | without seeding | with seeding | seeded / unseeded | seeded / full clone |")
    print("| --- | --- | --- | --- | --- |")

    def row(what: str, key: str, stat: str, fmt, full_value: float | None = None) -> None:
        a = u[key][stat]
        b = s[key][stat] if s else None
        print(f"| {what} | {fmt(a)} | {fmt(b) if b is not None else 'not run'} | {ratio(b, a) or '-'} | "
              f"{ratio(b, full_value) if full_value and b is not None else '-'} |")

    def count(x: float) -> str:
        return f"{x:,.0f}"

    def mib(x: float) -> str:
        return f"{x / 2**20:.2f} MiB"

    def secs(x: float) -> str:
        return f"{x:.2f} s"

    row("upstream objects (mean)", "objects_per_node", "mean", count, full["objects"])
    row("upstream objects (worst node)", "objects_per_node", "max", count, full["objects"])
    row("upstream bytes (mean)", "bytes_per_node", "mean", mib, full["bytes"])
    row("time to first ready (median)", "first_ready_s", "median", secs)
    row("time to first ready (slowest node)", "first_ready_s", "max", secs)
    row("time for all 4 commits (median)", "all_commits_s", "median", secs)
    for fleet in report["fleets"]:
        per_node = ", ".join(f"{n['objects']} obj/{n['first_ready_s']:.2f} s" for n in fleet["nodes"])
        extra = f"; unattributed {fleet['unattributed']['objects']} obj" if fleet["unattributed"]["connections"] else ""
        print(f"  {fleet['label']}: {per_node}{extra} (load {fleet['loadavg_before']} -> {fleet['loadavg_after']})")
    if s:
        print("  time to first ready, seeded / unseeded, per round: "
              + ", ".join(f"{r['ratio']}" for r in report["first_ready_by_round"]))
        for mode in ("unseeded", "seeded"):
            phases = [n["first_ready_phases"] for f in report["fleets"] if f["mode"] == mode for n in f["nodes"]
                      if n["first_ready_phases"]]
            if phases:
                print(f"  first ready, {mode}, medians from the clone logs: " + ", ".join(
                    f"{name[:-2].replace('_', ' ')} {median([p[name] for p in phases]):.2f} s" for name in phases[0]))
        records = [n["seed_record"] for f in report["fleets"] if f["mode"] == "seeded" for n in f["nodes"]]
        seeded = [r for r in records if r and r.get("seeded")]
        print(f"  seeded nodes' own records (state/mirror-seed.json): {len(seeded)} of {len(records)} seeded"
              + (f", seeding took {median([r['seconds'] for r in seeded]):.2f} s (median), upstream objects "
                 f"{median([r.get('upstream', {}).get('objects', 0) for r in seeded]):.0f}, bytes "
                 f"{median([r.get('upstream', {}).get('bytes', 0) for r in seeded]) / 2**20:.2f} MiB by their "
                 f"count" if seeded else ""))
    print("\nbars")
    for bar in report["bars"]:
        if bar["met"] is None:
            print(f"  not run {bar['name']:<52} {'-':>8}  (bar: <= {bar['bar']})")
        else:
            print(f"  {'met    ' if bar['met'] else 'MISSED '} {bar['name']:<52} {bar['value']:>8}  "
                  f"(bar: <= {bar['bar']})")
    print(f"\nload average {report['loadavg_before']} before, {report['loadavg_after']} after; "
          f"{report['seconds']} s; git {report['machine']['git']}, {report['machine']['cores']} cores")


def exit_status(results: list[dict], check: bool) -> int:
    missed = [bar["name"] for bar in results if bar["met"] is False]
    if check and missed:
        print(f"\n--check: {len(missed)} bar(s) missed: {'; '.join(missed)}")
        return 1
    return 0


# ---------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller history (1000 commits)")
    parser.add_argument("--rounds", type=int, help="pairs of fleets (unseeded, seeded), order alternating "
                                                   "(default 2 with --quick, else 4)")
    parser.add_argument("--sequential", action="store_true", help="nodes one after another, not all at once")
    parser.add_argument("--behind", type=int, default=BEHIND, help="commits between the bundle and the tip")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-seeding", action="store_true",
                        help="measure only the full clone and the unseeded fleet (no `bundle publish`)")
    parser.add_argument("--json-out")
    parser.add_argument("--workdir", help="work here and keep everything (default: a temporary directory)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    args = parser.parse_args()
    shape = SHAPES["quick" if args.quick else "default"]
    # Even, so that each mode goes first in as many rounds as the other: in most concurrent runs the
    # fleet that went first in its round was the faster, by most in round 1 (seeded/unseeded 1.1-1.6).
    rounds = args.rounds or (2 if args.quick else 4)
    if not 4 <= args.behind < shape["commits"] // 2:
        parser.error("--behind must leave room for 4 commits and a long history")
    keep = args.workdir is not None
    work = args.workdir or tempfile.mkdtemp(prefix="cc-fleet-")
    os.makedirs(work, exist_ok=True)
    home = os.path.join(work, "home")
    os.makedirs(home, exist_ok=True)
    # Every child (git, the CLI, its workers) runs here: checkoutcache from this checkout, no git or
    # cache settings of the caller's.
    os.environ.update(HOME=home, GIT_CONFIG_NOSYSTEM="1", GIT_TERMINAL_PROMPT="0",
                      PYTHONPATH=PROJECT + (os.pathsep + os.environ["PYTHONPATH"]
                                            if os.environ.get("PYTHONPATH") else ""))
    for name in ("CHECKOUTCACHE_ROOT", "CHECKOUTCACHE_BUNDLE_URI", "CHECKOUTCACHE_GIT_CONFIG"):
        os.environ.pop(name, None)
    env = dict(os.environ)
    started = time.perf_counter()
    report: dict = {"mode": "quick" if args.quick else "default", "shape": shape, "seed": args.seed,
                    "behind": args.behind, "rounds": rounds, "sequential": args.sequential,
                    "loadavg_before": loadavg(),
                    "machine": {"cores": os.cpu_count(), "git": git("--version").split()[-1],
                                "python": platform.python_version()}}
    print(f"generating {shape['commits']} commits x {shape['files']} files ...", flush=True)
    upstream = make_upstream(work, shape, args.seed, args.behind)
    shas = upstream["shas"]
    tip = len(shas) - 1
    # Newer than the bundle, oldest first: each needs the bundle's history plus a difference.
    offsets = [args.behind * 4 // 5, args.behind // 2, args.behind // 4, 0]
    commits = [shas[tip - k] for k in offsets]
    report["commits"] = [{"sha": sha, "behind_tip": k} for sha, k in zip(commits, offsets)]
    daemon = GitDaemon(upstream["base"])
    catch_all = CountingProxy(daemon.port, "url")
    proxies = [CountingProxy(daemon.port, f"node{i}") for i in range(NODES)]
    url = f"git://127.0.0.1:{catch_all.port}/repo"
    store = os.path.join(work, "store")
    os.makedirs(store, exist_ok=True)
    node_envs = {"unseeded": [], "seeded": []}
    for i, proxy in enumerate(proxies):
        config = os.path.join(work, f"node{i}.gitconfig")
        with open(config, "w") as handle:  # this node's fetches reach the upstream through its own proxy
            handle.write(f'[url "git://127.0.0.1:{proxy.port}/"]\n\tinsteadOf = git://127.0.0.1:{catch_all.port}/\n')
        node_envs["unseeded"].append(dict(env, CHECKOUTCACHE_GIT_CONFIG=config))
        node_envs["seeded"].append(dict(env, CHECKOUTCACHE_GIT_CONFIG=config,
                                        CHECKOUTCACHE_BUNDLE_URI="file://" + store))
    modes = ["unseeded"] if args.no_seeding else ["unseeded", "seeded"]
    try:
        if not args.no_seeding:
            print(f"publishing a bundle of main ({args.behind} commits before the tip) ...", flush=True)
            catch_all.label = "publish"
            report["publish"] = publish(work, url, shas[tip - args.behind], store, env)
            catch_all.wait_idle()
            report["publish"]["upstream"] = catch_all.tally("publish")
            catch_all.label = "idle"
        advance_upstream(upstream)
        report["full_clone"] = full_clone(work, url, catch_all, env)
        print(f"full clone: {report['full_clone']['objects']} objects in {report['full_clone']['seconds']:.2f} s",
              flush=True)
        fleets = []
        for number in range(rounds):
            order = modes if number % 2 == 0 else modes[::-1]
            for mode in order:
                label = f"round{number + 1}-{mode}"
                fleet = run_fleet(work, label, url, commits, proxies, catch_all, node_envs[mode],
                                  args.sequential, keep)
                fleet["mode"] = mode
                fleets.append(fleet)
                print(f"  {label}: first ready " + ", ".join(f"{n['first_ready_s']:.2f}" for n in fleet["nodes"])
                      + " s; upstream objects " + ", ".join(str(n["objects"]) for n in fleet["nodes"])
                      + (f"; {fleet['errors']} ensure(s) not ready" if fleet["errors"] else ""), flush=True)
        report["fleets"] = fleets
        report["summary"] = {mode: summarize(fleets, mode) for mode in modes}
        report["first_ready_by_round"] = round_ratios(fleets)
    finally:
        for proxy in [*proxies, catch_all]:
            proxy.stop()
        daemon.stop()
        report["loadavg_after"] = loadavg()
        report["seconds"] = round(time.perf_counter() - started, 1)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    report["bars"] = bars(report)
    print_report(report)
    for fleet in report["fleets"]:
        for node in fleet["nodes"]:
            for row in node["ensures"]:
                if not row["ok"]:
                    print(f"\n{fleet['label']} node{node['node']} {row['sha']}: {row.get('error', '')}")
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(report, handle, indent=2)
    return exit_status(report["bars"], args.check)


if __name__ == "__main__":
    sys.exit(main())
