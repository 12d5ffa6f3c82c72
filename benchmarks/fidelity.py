"""Checkouts that hold what the repository holds: submodules and Git LFS, ours
against plain git, in time and in bytes downloaded from the upstream.

    python benchmarks/fidelity.py --quick [--json-out fidelity.json]   # under ~2 minutes
    python benchmarks/fidelity.py --commits 8 --json-out fidelity.json

Everything is generated (make_repo.py) and served on 127.0.0.1 only:

1. Submodules: a superproject `top` whose submodule `lib` has a submodule
   `inner` (nested; relative URLs `../lib`, `../inner`), served by git daemon.
   N superproject commits are made one after the other, each moving both
   submodules to a new commit; right after each, one checkout of it by ours
   (`python -m checkoutcache --root R ensure URL SHA --wait 300`, one root for
   the run) and one by plain git, which starts from nothing every time:
   `git clone --recurse-submodules URL d && git -C d checkout SHA &&
   git -C d submodule update --init --recursive`. Commit 1 is the first ready
   (ours: an empty root); commits 2..N are the new commits.
2. Git LFS: a repository served over HTTPS (tests/https_git.py: git
   http-backend behind a token, the LFS batch API, a trustme CA), N commits
   each replacing a few of its LFS objects; ours (`ensure`, the CA in an
   operator git config, the token for this host only) against plain git
   doing `GIT_LFS_SKIP_SMUDGE=1 git clone` + `git lfs pull` per checkout.

Bytes are counted at the upstream: a counting TCP proxy on 127.0.0.1 in front
of the server (one for ours, one for git; both forward to the same server)
counts the bytes sent to the client. LFS objects downloaded are the server's
own counter. Ratios are ours / plain git.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT = os.path.dirname(HERE)
sys.path.insert(0, PROJECT)
sys.path.insert(0, HERE)

import make_repo
from countingproxy import CountingProxy
from gitdaemon import GitDaemon

PY = sys.executable
TOKEN = "bench-token-not-a-secret"
QUICK = {"commits": 4, "top": {"commits": 80, "files": 400}, "lib": {"commits": 60, "files": 300},
             "inner": {"commits": 40, "files": 200}, "lfs_files": 12, "lfs_size": 256 * 1024, "lfs_changes": 2}
FULL = {"commits": 8, "top": {"commits": 300, "files": 2000}, "lib": {"commits": 200, "files": 1000},
            "inner": {"commits": 100, "files": 500}, "lfs_files": 24, "lfs_size": 1024 * 1024, "lfs_changes": 3}


def loadavg() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def run(cmd: list[str], env: dict, cwd: str | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    return done


def git(*args: str, cwd: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def touch_files(repo: str, rng: random.Random, count: int, step: int) -> list[str]:
    paths = [p for p in git("ls-files", "-s", cwd=repo).splitlines() if p.startswith("100644")]
    # make_repo's files only: never .gitmodules, .gitattributes or an LFS pointer
    generated = [p.split("\t", 1)[1] for p in paths]
    chosen = rng.sample([p for p in generated if not os.path.basename(p).startswith(".")
                         and not p.endswith(".bin")], count)
    for path in chosen:
        with open(os.path.join(repo, path), "wb") as handle:
            handle.write(make_repo.file_content(rng, 4096) + f"step {step}\n".encode())
    return chosen


def commit(repo: str, files: list[str], gitlinks: dict[str, str], message: str) -> str:
    if files:
        git("add", "--", *files, cwd=repo)
    for path, sha in gitlinks.items():
        git("update-index", "--add", "--cacheinfo", f"160000,{sha},{path}", cwd=repo)
    git("-c", "user.name=Bench", "-c", "user.email=bench@example.invalid", "commit", "-q", "-m", message, cwd=repo)
    return git("rev-parse", "HEAD", cwd=repo)


def ours_ensure(root: str, url: str, sha: str, env: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run([PY, "-m", "checkoutcache", "--root", root, "ensure", url, sha, "--wait", "300"],
                          env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"ours failed: {done.stdout}\n{done.stderr}")
    return elapsed, json.loads(done.stdout)


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


# ---------------------------------------------------------------- 1. submodules

def bench_submodules(cfg: dict, work: str, env: dict) -> dict:
    base = os.path.join(work, "daemon")
    os.makedirs(base)
    repos = {}
    for seed, name in enumerate(("inner", "lib", "top"), start=11):
        path = os.path.join(base, name)
        make_repo.generate(path, commits=cfg[name]["commits"], files=cfg[name]["files"], file_size=4096,
                           depth=2, changes=8, seed=seed)
        repos[name] = path
    with open(os.path.join(repos["lib"], ".gitmodules"), "w") as handle:
        handle.write('[submodule "inner"]\n\tpath = vendor/inner\n\turl = ../inner\n')
    with open(os.path.join(repos["top"], ".gitmodules"), "w") as handle:
        handle.write('[submodule "lib"]\n\tpath = ext/lib\n\turl = ../lib\n')
    daemon = GitDaemon(base)
    proxies = {"ours": CountingProxy(daemon.port), "git": CountingProxy(daemon.port)}
    root = os.path.join(work, "root-sub")
    rng = random.Random(7)
    steps = []
    try:
        for step in range(1, cfg["commits"] + 1):
            inner = commit(repos["inner"], touch_files(repos["inner"], rng, 6, step), {}, f"inner {step}")
            lib = commit(repos["lib"], touch_files(repos["lib"], rng, 6, step) + [".gitmodules"],
                         {"vendor/inner": inner}, f"lib {step}")
            top = commit(repos["top"], touch_files(repos["top"], rng, 6, step) + [".gitmodules"],
                         {"ext/lib": lib}, f"top {step}")
            row = {"commit": step, "sha": top}
            order = ("ours", "git") if step % 2 else ("git", "ours")
            for side in order:
                url = f"git://127.0.0.1:{proxies[side].port}/top"
                before = proxies[side].read()
                if side == "ours":
                    elapsed, answer = ours_ensure(root, url, top, env)
                    assert answer.get("submodules") == "included", answer
                    checkout = answer["path"]
                else:
                    checkout = os.path.join(work, f"git-sub-{step}")
                    start = time.perf_counter()
                    run(["git", "clone", "-q", "--recurse-submodules", url, checkout], env)
                    run(["git", "-C", checkout, "checkout", "-q", top], env)
                    run(["git", "-C", checkout, "submodule", "update", "-q", "--init", "--recursive"], env)
                    elapsed = time.perf_counter() - start
                time.sleep(0.2)  # let the proxy's last bytes be counted
                row[f"{side}_s"] = round(elapsed, 3)
                row[f"{side}_bytes"] = proxies[side].read() - before
                # Fidelity: the nested submodule's work tree is there, at its commit.
                nested = os.path.join(checkout, "ext", "lib", "vendor", "inner")
                assert git("-c", "safe.directory=*", "rev-parse", "HEAD", cwd=nested) == inner, (side, step)
                if side == "git":
                    shutil.rmtree(checkout)
            steps.append(row)
            print(f"  submodules commit {step}: ours {row['ours_s']:.2f} s {row['ours_bytes']} B, "
                  f"git {row['git_s']:.2f} s {row['git_bytes']} B", flush=True)
        # Where ours' extra time goes: the work trees it wrote (each submodule repository's own
        # checkout, then the submodule's tree inside the superproject's) and the CLI's fixed cost
        # (a ready answer: a Python start), paid again by each nested ensure.
        from checkoutcache.store.layout import RootPaths
        paths = RootPaths(root)
        store_checkouts = sum(len(paths.repo(key).checkout_names()) for key in paths.repo_keys())
        ready = sorted(ours_ensure(root, f"git://127.0.0.1:{proxies['ours'].port}/top", top, env)[0]
                       for _ in range(5))[2]
        start = time.perf_counter()
        subprocess.run([PY, "-c", "pass"], env=env, check=True)
        python_start = time.perf_counter() - start
    finally:
        for proxy in proxies.values():
            proxy.stop()
        daemon.stop()
    new = steps[1:]
    summary = {
        "first_ready": {"ours_s": steps[0]["ours_s"], "git_s": steps[0]["git_s"],
                        "ratio": ratio(steps[0]["ours_s"], steps[0]["git_s"])},
        "new_commit": {"ours_s": sum(r["ours_s"] for r in new) / len(new),
                       "git_s": sum(r["git_s"] for r in new) / len(new)},
        "bytes": {"ours": sum(r["ours_bytes"] for r in steps), "git": sum(r["git_bytes"] for r in steps)},
    }
    summary["new_commit"]["ratio"] = ratio(summary["new_commit"]["ours_s"], summary["new_commit"]["git_s"])
    summary["bytes"]["ratio"] = ratio(summary["bytes"]["ours"], summary["bytes"]["git"])
    return {"steps": steps, **summary, "ours_store_checkouts": store_checkouts,
            "ours_ready_answer_s": round(ready, 4), "python_start_s": round(python_start, 4),
            "shape": {name: cfg[name] for name in ("top", "lib", "inner")}}


# ---------------------------------------------------------------- 2. Git LFS

def bench_lfs(cfg: dict, work: str, env: dict) -> dict:
    sys.path.insert(0, PROJECT)
    import hashlib

    from tests.https_git import GitHttpsServer  # needs trustme

    project_root = os.path.join(work, "https")
    os.makedirs(project_root)
    repo = os.path.join(project_root, "lfsrepo")
    make_repo.generate(repo, commits=40, files=200, file_size=4096, depth=2, changes=8, seed=21)
    server = GitHttpsServer(project_root, work, lambda user, password: password == TOKEN)
    server.lfs_objects = {}
    proxies = {"ours": CountingProxy(server.port), "git": CountingProxy(server.port)}
    operator_config = os.path.join(work, "operator-gitconfig")
    with open(operator_config, "w") as handle:
        handle.write(f"[http]\n\tsslCAInfo = {server.ca_file}\n")
    ours_env = dict(env, CHECKOUTCACHE_GIT_CONFIG=operator_config, CHECKOUTCACHE_GIT_PASSWORD=TOKEN,
                    CHECKOUTCACHE_GIT_HOSTS=f"127.0.0.1:{proxies['ours'].port}")
    helper = f"!f() {{ test \"$1\" = get && echo username=bench && echo password={TOKEN}; }}; f"
    git_config = ["-c", f"http.sslCAInfo={server.ca_file}", "-c", "credential.helper=",
                  "-c", f"credential.helper={helper}"]
    git_env = dict(env, GIT_LFS_SKIP_SMUDGE="1")
    rng = random.Random(5)
    names = [f"assets/blob{i}.bin" for i in range(cfg["lfs_files"])]
    os.makedirs(os.path.join(repo, "assets"), exist_ok=True)
    with open(os.path.join(repo, ".gitattributes"), "w") as handle:
        handle.write("*.bin filter=lfs diff=lfs merge=lfs -text\n")
    contents: dict[str, bytes] = {}
    root = os.path.join(work, "root-lfs")
    steps = []
    try:
        for step in range(1, cfg["commits"] + 1):
            changed = names if step == 1 else rng.sample(names, cfg["lfs_changes"])
            for name in changed:
                data = rng.randbytes(cfg["lfs_size"])
                oid = hashlib.sha256(data).hexdigest()
                server.lfs_objects[oid] = data
                contents[name] = data
                with open(os.path.join(repo, name), "w") as handle:
                    handle.write(f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {len(data)}\n")
            sha = commit(repo, changed + touch_files(repo, rng, 4, step) + [".gitattributes"], {}, f"lfs {step}")
            row = {"commit": step, "sha": sha}
            order = ("ours", "git") if step % 2 else ("git", "ours")
            for side in order:
                url = f"https://127.0.0.1:{proxies[side].port}/lfsrepo"
                before, before_objects = proxies[side].read(), sum(server.lfs_downloads.values())
                if side == "ours":
                    elapsed, answer = ours_ensure(root, url, sha, ours_env)
                    assert answer.get("lfs") == "content", answer
                    checkout = answer["path"]
                else:
                    checkout = os.path.join(work, f"git-lfs-{step}")
                    start = time.perf_counter()
                    run(["git", *git_config, "clone", "-q", url, checkout], git_env)
                    run(["git", *git_config, "-C", checkout, "checkout", "-q", sha], git_env)
                    run(["git", *git_config, "-C", checkout, "lfs", "pull"], git_env)
                    elapsed = time.perf_counter() - start
                time.sleep(0.2)
                row[f"{side}_s"] = round(elapsed, 3)
                row[f"{side}_bytes"] = proxies[side].read() - before
                row[f"{side}_lfs_objects"] = sum(server.lfs_downloads.values()) - before_objects
                for name, data in contents.items():  # fidelity: the content, not pointers
                    with open(os.path.join(checkout, name), "rb") as handle:
                        assert handle.read() == data, (side, step, name)
                if side == "git":
                    shutil.rmtree(checkout)
            steps.append(row)
            print(f"  lfs commit {step}: ours {row['ours_s']:.2f} s {row['ours_bytes']} B "
                  f"{row['ours_lfs_objects']} objects, git {row['git_s']:.2f} s {row['git_bytes']} B "
                  f"{row['git_lfs_objects']} objects", flush=True)
    finally:
        for proxy in proxies.values():
            proxy.stop()
        server.stop()
    total = {key: sum(r[key] for r in steps) for key in
             ("ours_s", "git_s", "ours_bytes", "git_bytes", "ours_lfs_objects", "git_lfs_objects")}
    return {"steps": steps, "objects_in_history": len(server.lfs_objects),
            "first_ready": {"ours_s": steps[0]["ours_s"], "git_s": steps[0]["git_s"],
                            "ratio": ratio(steps[0]["ours_s"], steps[0]["git_s"])},
            "new_commit": {"ours_s": sum(r["ours_s"] for r in steps[1:]) / (len(steps) - 1),
                           "git_s": sum(r["git_s"] for r in steps[1:]) / (len(steps) - 1)},
            "bytes": {"ours": total["ours_bytes"], "git": total["git_bytes"],
                      "ratio": ratio(total["ours_bytes"], total["git_bytes"])},
            "lfs_objects": {"ours": total["ours_lfs_objects"], "git": total["git_lfs_objects"],
                            "ratio": ratio(total["ours_lfs_objects"], total["git_lfs_objects"])},
            "shape": {k: cfg[k] for k in ("lfs_files", "lfs_size", "lfs_changes")}}


def add_new_commit_ratio(result: dict) -> None:
    result["new_commit"]["ratio"] = ratio(result["new_commit"]["ours_s"], result["new_commit"]["git_s"])


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small repositories, N=4 commits")
    parser.add_argument("--commits", type=int, help="N, the commits checked out (default 4 quick, 8 otherwise)")
    parser.add_argument("--json-out")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    cfg = dict(QUICK if args.quick else FULL)
    if args.commits:
        cfg["commits"] = max(2, args.commits)
    work = tempfile.mkdtemp(prefix="cc-fidelity-")
    home = os.path.join(work, "home")
    os.makedirs(home)
    env = dict(os.environ, HOME=home, GIT_CONFIG_NOSYSTEM="1", GIT_TERMINAL_PROMPT="0",
               PYTHONPATH=PROJECT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CHECKOUTCACHE_ROOT", None)
    # git's environment overrides its config: the test CA must come from config (ours: the operator's file).
    for name in ("GIT_SSL_CAINFO", "GIT_SSL_CAPATH"):
        env.pop(name, None)
    # Plain git as a user who ran `git lfs install` (ours needs none: it enables the filter itself).
    subprocess.run(["git", "lfs", "install", "--skip-repo"], env=env, check=True, capture_output=True)
    git_version = git("--version", cwd=work)
    lfs_version = subprocess.run(["git", "lfs", "version"], capture_output=True, text=True, check=False).stdout.strip()
    report = {"mode": "quick" if args.quick else "full", "commits": cfg["commits"], "loadavg_before": loadavg(),
              "git": git_version, "git_lfs": lfs_version, "cores": os.cpu_count()}
    started = time.perf_counter()
    try:
        print(f"1. submodules (top -> lib -> inner, git daemon), N={cfg['commits']}", flush=True)
        report["submodules"] = bench_submodules(cfg, os.path.join(work, "sub"), env)
        print(f"2. Git LFS (https, batch API), N={cfg['commits']}", flush=True)
        report["lfs"] = bench_lfs(cfg, os.path.join(work, "lfs"), env)
        add_new_commit_ratio(report["lfs"])
    finally:
        report["loadavg_after"] = loadavg()
        report["seconds"] = round(time.perf_counter() - started, 1)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    sub, lfs = report["submodules"], report["lfs"]
    n = cfg["commits"]
    rows = [
        ("submodules: first ready (commit 1)", f"{sub['first_ready']['ours_s']:.2f} s",
         f"{sub['first_ready']['git_s']:.2f} s", sub["first_ready"]["ratio"]),
        (f"submodules: new commit (mean of 2..{n})", f"{sub['new_commit']['ours_s']:.2f} s",
         f"{sub['new_commit']['git_s']:.2f} s", sub["new_commit"]["ratio"]),
        (f"submodules: bytes for {n} checkouts", mib(sub["bytes"]["ours"]), mib(sub["bytes"]["git"]),
         sub["bytes"]["ratio"]),
        ("LFS: first ready (commit 1)", f"{lfs['first_ready']['ours_s']:.2f} s",
         f"{lfs['first_ready']['git_s']:.2f} s", lfs["first_ready"]["ratio"]),
        (f"LFS: new commit (mean of 2..{n})", f"{lfs['new_commit']['ours_s']:.2f} s",
         f"{lfs['new_commit']['git_s']:.2f} s", lfs["new_commit"]["ratio"]),
        (f"LFS: bytes for {n} checkouts", mib(lfs["bytes"]["ours"]), mib(lfs["bytes"]["git"]), lfs["bytes"]["ratio"]),
        (f"LFS: objects downloaded for {n} checkouts ({lfs['objects_in_history']} in history)",
         str(lfs["lfs_objects"]["ours"]), str(lfs["lfs_objects"]["git"]), lfs["lfs_objects"]["ratio"]),
    ]
    report["table"] = [dict(zip(("what", "ours", "plain_git", "ratio"), row)) for row in rows]
    print("\n| what | ours | plain git | ours / git |\n| --- | --- | --- | --- |")
    for what, ours, plain, r in rows:
        print(f"| {what} | {ours} | {plain} | {r}x |")
    print(f"\nours wrote {sub['ours_store_checkouts']} store checkouts for {n} superproject commits "
          f"(top, lib, inner: one each per commit) plus the submodule trees inside top's; plain git wrote "
          f"3 work trees per checkout. CLI ready answer {sub['ours_ready_answer_s'] * 1000:.0f} ms "
          f"(python -c pass {sub['python_start_s'] * 1000:.0f} ms), paid once per nested ensure too.")
    print(f"\nload average: {report['loadavg_before']} before, {report['loadavg_after']} after; "
          f"{report['seconds']} s; {git_version}, {lfs_version}")
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
