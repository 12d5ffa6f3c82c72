"""A cold node answers at the cost of one commit (issue 34): the product's first ready
answer, its background history, the next commit, six reviews at once and a partial
mirror, each against what plain git costs for the same, measured in one run.

    python benchmarks/cold_start.py --deep 10000 --real /work/.mirror/pallets+flask/repo \\
        [--real BARE ...] [--rounds 3] [--rounds-large 1] [--json-out cold.json] [--check]
    python benchmarks/cold_start.py --quick          # a 10,000-commit generated history only, 1 round

Every upstream is served by `git daemon` on 127.0.0.1 (fetch by id allowed, as the forges
allow it, and filters) behind benchmarks/countingproxy.py, which counts the bytes the
upstream sends per connection. A real history (`--real`, a bare repository such as the
`fetch` tool brings) is served as its branches and tags (no pull refs), repacked with
bitmaps as a forge keeps it; `--deep N` generates N commits with make_repo.py. Per round,
fresh directories, ours and git's interleaved; medians over rounds:

1. first ready, default settings (CHECKOUTCACHE_SUBMODULES=none: git's baselines fetch no
   submodule either): `checkoutcache ensure URL SHA --wait` into an empty root, against `git
   init` + `git fetch --depth 1 URL SHA` + `git checkout SHA`. Time, and bytes from upstream:
   ours are those of the connections opened before the answer that carry no whole-history
   fetch (the probe and the depth-1 fetch: the history's own connection, opened after the
   publish, wants whole histories). Bar: <= 1.25x in both.
2. the history: from that answer until `ensure --history full` answers complete, against `git
   clone --mirror`. Bar: <= 1.25x. Also shown: `clone --mirror` with our fsck choices
   (fetch.fsckObjects, CHECKOUTCACHE_FSCK's), which every fetch of ours runs.
3. the next commit (SHA is NEXT~5; NEXT its descendant): while the history is incomplete (a
   root whose history was stopped at its start by the test hook), `ensure NEXT` against `git
   fetch --depth 1 URL NEXT` + `git worktree add` in a shallow clone of SHA (bar <= 1.0x);
   once complete, against `git fetch URL NEXT` + `git worktree add` in a bare repository
   holding SHA's whole history, plus `python3 -c pass` (the CLI's bar: <= 1.25x).
4. six reviews of six different commits at once into an empty root: until all six are ready,
   against one first answer of the same run (1.). Bar: <= 2.5x. Also shown: git's own six
   depth-1 fetches and checkouts at once (what the machine's cores allow, the server sharing them).
5. partial mirror (CHECKOUTCACHE_FILTER=blob:none): first ready against `git clone
   --filter=blob:none --no-checkout` + `git checkout SHA`. Bar: <= 1.2x. Its history is stopped
   at its start by the test hook (after the answer), so every byte the proxy counts is the answer's.

The load average is recorded before and after each repository: this machine kind is shared.
Results and each miss's measured cause: RESULTS.md ("Cold start").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REPO = os.path.dirname(HERE)

import make_repo  # noqa: E402
from countingproxy import CountingProxy  # noqa: E402
from gitdaemon import GitDaemon  # noqa: E402

PY = sys.executable
BARS = {"first_time": 1.25, "first_bytes": 1.25, "history": 1.25, "next_shallow": 1.0, "next_complete": 1.25,
        "six_reviews": 2.5, "partial": 1.2}
FSCK = ["-c", "fetch.fsckObjects=true"]


def loadavg() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "CHECKOUTCACHE_"))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update({"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C", "GIT_TERMINAL_PROMPT": "0",
                "PYTHONPATH": REPO, "CHECKOUTCACHE_SUBMODULES": "none"})
    env.update(extra or {})
    return env


def fsck_choices() -> list[str]:
    sys.path.insert(0, REPO)
    from checkoutcache.git.env import FSCK_CHOICES

    return [arg for msg, (level, _why) in FSCK_CHOICES.items() for arg in ("-c", f"fetch.fsck.{msg}={level}")]


class RecordingProxy(CountingProxy):
    """A CountingProxy that also keeps what each connection's client asked (its first bytes),
    to tell a depth-1 fetch and a probe from the history's whole-history fetch."""

    def __init__(self, target: int):
        super().__init__(target)
        self.asked: dict[int, bytearray] = {}
        self.opened: dict[int, float] = {}

    def _pipe(self, conn, src, dst, down, ends, client, upstream):
        if not down:
            self.asked.setdefault(id(conn), bytearray())
            self.opened.setdefault(id(conn), time.monotonic())
            original = src.recv

            def recv(size, _original=original, _conn=conn):
                data = _original(size)
                buf = self.asked[id(_conn)]
                if len(buf) < 1 << 20:
                    buf += data
                return data

            src = _Recv(src, recv)
        return super()._pipe(conn, src, dst, down, ends, client, upstream)

    def answer_bytes(self, label: str, before: float) -> int:
        """Bytes sent on the label's connections opened before `before` that fetch no whole history."""
        total = 0
        with self.lock:
            for conn in self.connections:
                if conn.label != label or self.opened.get(id(conn), 0) > before:
                    continue
                asked = bytes(self.asked.get(id(conn), b""))
                whole = (b"want " in asked or b"want-ref" in asked) and not re.search(rb"deepen \d", asked)
                if not whole:
                    total += conn.to_client
        return total


class _Recv:
    def __init__(self, sock, recv):
        self._sock, self.recv = sock, recv

    def __getattr__(self, name):
        return getattr(self._sock, name)


def run(cmd: list[str], cwd: str = "/", env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=env or clean_env(), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{cmd}: {done.stdout[-500:]} {done.stderr[-1500:]}")
    return done


def timed(cmds: list[list[str]], cwd: str = "/", env: dict | None = None) -> float:
    started = time.monotonic()
    for cmd in cmds:
        run(cmd, cwd=cwd, env=env)
    return time.monotonic() - started


def ensure(root: str, url: str, sha: str, *extra: str, env: dict | None = None) -> tuple[float, dict]:
    started = time.monotonic()
    done = run([PY, "-m", "checkoutcache", "--root", root, "--json", "ensure", url, sha, "--wait", "3600", *extra],
               env=clean_env(env), check=False)
    seconds = time.monotonic() - started
    answer = json.loads(done.stdout or "{}")
    if done.returncode != 0 or answer.get("state") != "ready":
        raise RuntimeError(f"ensure {sha} {extra}: {done.stdout[-800:]} {done.stderr[-800:]}")
    return seconds, answer


class Served:
    """One upstream behind the daemon and a counting proxy."""

    def __init__(self, name: str, bare: str, work: str):
        self.name = name
        self.base = os.path.join(work, "served")
        os.makedirs(self.base, exist_ok=True)
        self.path = os.path.join(self.base, f"{name}.git")
        if not os.path.isdir(self.path):
            run(["git", "init", "-q", "--bare", self.path])
            run(["git", "-C", self.path, "fetch", "-q", bare, "+refs/heads/*:refs/heads/*",
                 "+refs/tags/*:refs/tags/*"])
            head = run(["git", "-C", bare, "symbolic-ref", "-q", "HEAD"], check=False).stdout.strip()
            if head and run(["git", "-C", self.path, "rev-parse", "-q", "--verify", head], check=False).returncode == 0:
                run(["git", "-C", self.path, "symbolic-ref", "HEAD", head])
            run(["git", "-C", self.path, "repack", "-adq", "-b"])
        for key, value in (("uploadpack.allowAnySHA1InWant", "true"), ("uploadpack.allowFilter", "true")):
            run(["git", "-C", self.path, "config", key, value])
        self.daemon = GitDaemon(self.base)
        self.proxy = RecordingProxy(self.daemon.port)
        self.url = f"git://127.0.0.1:{self.proxy.port}/{name}.git"
        line = run(["git", "-C", self.path, "rev-list", "--first-parent", "-n", "70", "HEAD"]).stdout.split()
        self.next, self.sha = line[0], line[5]  # NEXT, and SHA = NEXT~5 (first parents)
        self.six = [line[i] for i in (10, 12, 20, 30, 45, 65)]
        self.commits = int(run(["git", "-C", self.path, "rev-list", "--count", "HEAD"]).stdout)
        self.size = int(run(["du", "-sb", os.path.join(self.path, "objects")]).stdout.split()[0])

    def label(self, name: str) -> str:
        self.proxy.label = name
        return name

    def sent(self, label: str) -> int:
        self.proxy.wait_idle(30)
        return self.proxy.tally(label)["bytes"]

    def stop(self) -> None:
        self.proxy.stop()
        self.daemon.stop()


def one_round(s: Served, work: str, number: int) -> dict:
    r: dict = {}
    tag = f"r{number}"
    os.sync()
    # 1. git's depth 1
    d1 = os.path.join(work, f"{tag}-depth1")
    run(["git", "init", "-q", d1])
    s.label(f"{tag}-depth1")
    r["depth1"] = timed([["git", "-C", d1, "fetch", "-q", "--depth", "1", s.url, s.sha],
                         ["git", "-C", d1, "-c", "advice.detachedHead=false", "checkout", "-q", s.sha]])
    r["depth1_bytes"] = s.sent(f"{tag}-depth1")
    os.sync()
    # 1. ours, first ready; 2. its history
    root = os.path.join(work, f"{tag}-root")
    s.label(f"{tag}-ours")
    started = time.monotonic()
    r["first"], answer = ensure(root, s.url, s.sha)
    answered = time.monotonic()
    r["first_history"] = answer.get("history")
    done, full = ensure(root, s.url, s.sha, "--history", "full")
    r["history"] = time.monotonic() - answered
    r["first_bytes"] = s.proxy.answer_bytes(f"{tag}-ours", started + r["first"])
    r["history_log"] = _history_log(root)
    os.sync()
    # 2. git's clone --mirror (and with our fsck choices)
    mirror = os.path.join(work, f"{tag}-mirror.git")
    s.label(f"{tag}-mirror")
    r["clone_mirror"] = timed([["git", "clone", "-q", "--mirror", s.url, mirror]])
    r["clone_mirror_bytes"] = s.sent(f"{tag}-mirror")
    shutil.rmtree(mirror)
    os.sync()
    r["clone_mirror_fsck"] = timed([["git", *FSCK, *fsck_choices(), "clone", "-q", "--mirror", s.url, mirror]])
    shutil.rmtree(mirror)
    os.sync()
    # 3. the next commit, history complete (root above) ...
    r["next_complete"], _ = ensure(root, s.url, s.next)
    full_repo = os.path.join(work, f"{tag}-full.git")
    run(["git", "init", "-q", "--bare", full_repo])
    run(["git", "-C", full_repo, "fetch", "-q", s.url, f"+{s.sha}:refs/keep/{s.sha}"])
    os.sync()
    r["next_complete_git"] = timed([["git", "-C", full_repo, "fetch", "-q", s.url, f"+{s.next}:refs/keep/{s.next}"],
                                    ["git", "-C", full_repo, "worktree", "add", "-q", "--detach",
                                     os.path.join(work, f"{tag}-full-wt"), s.next]])
    r["python_start"] = timed([[PY, "-c", "pass"]])
    # ... and while incomplete (the history stopped at its start)
    held = os.path.join(work, f"{tag}-held")
    ensure(held, s.url, s.sha, env={"CHECKOUTCACHE_TEST_KILL_AT": "history-start"})
    time.sleep(0.5)  # the history's process is killed at once; this is not a measurement
    os.sync()
    s.label(f"{tag}-next-shallow")
    r["next_shallow"], answer = ensure(held, s.url, s.next, env={"CHECKOUTCACHE_TEST_KILL_AT": "history-start"})
    r["next_shallow_history"] = answer.get("history")
    r["next_shallow_bytes"] = s.proxy.answer_bytes(f"{tag}-next-shallow", time.monotonic())
    s.label(f"{tag}-next-shallow-git")
    os.sync()
    r["next_shallow_git"] = timed([["git", "-C", d1, "fetch", "-q", "--depth", "1", s.url, s.next],
                                   ["git", "-C", d1, "worktree", "add", "-q", "--detach",
                                    os.path.join(work, f"{tag}-d1-wt"), s.next]])
    r["next_shallow_git_bytes"] = s.sent(f"{tag}-next-shallow-git")
    os.sync()
    # 4. six reviews at once into an empty root
    six = os.path.join(work, f"{tag}-six")
    started = time.monotonic()
    procs = [subprocess.Popen([PY, "-m", "checkoutcache", "--root", six, "--json", "ensure", s.url, sha, "--wait",
                               "3600"], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for sha in s.six]
    ends = []
    for proc in procs:
        out, err = proc.communicate()
        ends.append(time.monotonic() - started)
        if proc.returncode != 0:
            raise RuntimeError(f"six reviews: {out[-500:]} {err[-500:]}")
    r["six"] = max(ends)
    os.sync()
    # ... and git's own six depth-1 fetches and checkouts at once: what this machine's cores give
    started = time.monotonic()
    gits = []
    for n, sha in enumerate(s.six):
        target = os.path.join(work, f"{tag}-git-six-{n}")
        run(["git", "init", "-q", target])
        gits.append(subprocess.Popen(["sh", "-c", f"git -C {target} fetch -q --depth 1 {s.url} {sha} && git -C {target} "
                                      f"-c advice.detachedHead=false checkout -q {sha}"], env=clean_env()))
    ends = []
    for proc in gits:
        proc.wait()
        ends.append(time.monotonic() - started)
    r["git_six"] = max(ends)
    os.sync()
    # 5. partial mirror
    bl = os.path.join(work, f"{tag}-blobless")
    s.label(f"{tag}-blobless")
    r["blobless"] = timed([["git", "clone", "-q", "--filter=blob:none", "--no-checkout", s.url, bl],
                           ["git", "-C", bl, "-c", "advice.detachedHead=false", "checkout", "-q", s.sha]])
    r["blobless_bytes"] = s.sent(f"{tag}-blobless")
    os.sync()
    s.label(f"{tag}-partial")
    # Its history stopped at its start (the test hook, after the answer): every byte counted is
    # the answer's (its blobs' fetch wants no depth: it cannot be told from a history by its request).
    r["partial"], _ = ensure(os.path.join(work, f"{tag}-partial"), s.url, s.sha,
                             env={"CHECKOUTCACHE_FILTER": "blob:none", "CHECKOUTCACHE_TEST_KILL_AT": "history-start"})
    r["partial_bytes"] = s.sent(f"{tag}-partial")
    for name in os.listdir(work):
        if name.startswith(tag):
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    return r


def _history_log(root: str) -> str:
    for key in os.listdir(os.path.join(root, "repos")):
        path = os.path.join(root, "repos", key, "logs", "history.log")
        if os.path.exists(path):
            return open(path).read()[-4000:]
    return ""


def ratios(rounds: list[dict]) -> dict:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    return {
        "first_time": med("first") / med("depth1"),
        "first_bytes": med("first_bytes") / med("depth1_bytes"),
        "history": med("history") / med("clone_mirror"),
        "history_vs_fsck_clone": med("history") / med("clone_mirror_fsck"),
        "next_shallow": med("next_shallow") / med("next_shallow_git"),
        "next_shallow_bytes": med("next_shallow_bytes") / max(1, med("next_shallow_git_bytes")),
        "next_complete": med("next_complete") / (med("next_complete_git") + med("python_start")),
        "six_reviews": med("six") / med("first"),
        "git_six_vs_depth1": med("git_six") / med("depth1"),
        "six_vs_git_six": med("six") / med("git_six"),
        "partial": med("partial") / med("blobless"),
        "partial_bytes": med("partial_bytes") / med("blobless_bytes"),
    }


def measure(name: str, bare: str, work: str, rounds: int) -> dict:
    s = Served(name, bare, work)
    load_before = loadavg()
    try:
        results = [one_round(s, work, n) for n in range(rounds)]
    finally:
        s.stop()
    medians = {key: statistics.median(r[key] for r in results) for key in results[0]
               if isinstance(results[0][key], (int, float))}
    return {"repo": name, "commits": s.commits, "objects_bytes": s.size, "sha": s.sha, "next": s.next,
            "rounds": results, "medians": medians, "ratios": ratios(results),
            "loadavg_before": load_before, "loadavg_after": loadavg()}


def bars_of(report: dict) -> list[dict]:
    rows = []
    for repo in report["repos"]:
        for bar, limit in BARS.items():
            value = repo["ratios"][bar]
            rows.append({"repo": repo["repo"], "bar": bar, "value": round(value, 3), "limit": limit,
                         "met": value <= limit})
    return rows


def show(report: dict) -> None:
    for repo in report["repos"]:
        m, q = repo["medians"], repo["ratios"]
        mib = 1 << 20
        print(f"\n{repo['repo']}: {repo['commits']} commits, {repo['objects_bytes'] / mib:.0f} MiB packed "
              f"(load {repo['loadavg_before']} -> {repo['loadavg_after']}), {len(repo['rounds'])} round(s)")
        print(f"  1. first ready        ours {m['first']:.2f} s, {m['first_bytes'] / mib:.2f} MiB | depth 1 "
              f"{m['depth1']:.2f} s, {m['depth1_bytes'] / mib:.2f} MiB -> {q['first_time']:.2f}x, "
              f"{q['first_bytes']:.2f}x bytes")
        print(f"  2. history            ours {m['history']:.2f} s after the answer | clone --mirror "
              f"{m['clone_mirror']:.2f} s ({m['clone_mirror_fsck']:.2f} s with our fsck) -> {q['history']:.2f}x "
              f"({q['history_vs_fsck_clone']:.2f}x of the fsck'd clone)")
        print(f"  3. next, incomplete   ours {m['next_shallow']:.2f} s, {m['next_shallow_bytes'] / 1024:.0f} KiB | "
              f"depth-1 fetch + worktree add {m['next_shallow_git']:.2f} s, "
              f"{m['next_shallow_git_bytes'] / 1024:.0f} KiB -> {q['next_shallow']:.2f}x")
        print(f"     next, complete     ours {m['next_complete']:.2f} s | fetch + worktree add "
              f"{m['next_complete_git']:.2f} s + python {m['python_start']:.2f} s -> {q['next_complete']:.2f}x")
        print(f"  4. six reviews        all ready {m['six']:.2f} s -> {q['six_reviews']:.2f}x one first answer | "
              f"git's six depth-1 fetches + checkouts at once {m['git_six']:.2f} s ({q['git_six_vs_depth1']:.2f}x "
              f"one) -> ours {q['six_vs_git_six']:.2f}x git's")
        print(f"  5. partial mirror     ours {m['partial']:.2f} s, {m['partial_bytes'] / mib:.2f} MiB | blobless "
              f"clone + checkout {m['blobless']:.2f} s, {m['blobless_bytes'] / mib:.2f} MiB -> {q['partial']:.2f}x")
    print("\nbars")
    for row in report["bars"]:
        print(f"  {row['repo']:<12} {row['bar']:<14} {row['value']:>6.2f} <= {row['limit']:<5} "
              f"{'met' if row['met'] else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deep", type=int, default=10000, help="generated commits (0: none)")
    parser.add_argument("--real", action="append", default=[], metavar="BARE", help="a real history (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rounds-large", type=int, default=1, help="rounds for a history over 200 MiB")
    parser.add_argument("--quick", action="store_true", help="the generated history alone, one round")
    parser.add_argument("--workdir")
    parser.add_argument("--json-out")
    parser.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    args = parser.parse_args()
    if args.quick:
        args.real, args.rounds = [], 1
    work = args.workdir or tempfile.mkdtemp(prefix="cold-start-")
    os.makedirs(work, exist_ok=True)
    sources = []
    if args.deep:
        generated = os.path.join(work, f"deep-{args.deep}")
        if not os.path.isdir(generated):
            make_repo.generate(generated, args.deep, 1000, 2048, 3, 6, 1)
        sources.append((f"deep-{args.deep}", os.path.join(generated, ".git")))
    for path in args.real:
        name = os.path.basename(os.path.dirname(path.rstrip("/"))) if path.rstrip("/").endswith("/repo") else \
            os.path.basename(path.rstrip("/"))
        sources.append((name.replace("+", "-").replace(".git", ""), path))
    report = {"machine": {"cores": os.cpu_count(), "git": run(["git", "version"]).stdout.strip()},
              "loadavg_before": loadavg(), "repos": []}
    for name, bare in sources:
        size = int(run(["du", "-sb", bare]).stdout.split()[0])
        rounds = args.rounds_large if size > 200 << 20 else args.rounds
        print(f"measuring {name} ({rounds} round(s))...", flush=True)
        report["repos"].append(measure(name, bare, work, rounds))
    report["loadavg_after"] = loadavg()
    report["bars"] = bars_of(report)
    show(report)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(report, handle, indent=1)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    if args.check and not all(row["met"] for row in report["bars"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
