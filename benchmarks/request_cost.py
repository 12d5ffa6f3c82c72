#!/usr/bin/env python3
"""serve's own cost per ready answer, in-process, this tree against another revision.

    python benchmarks/request_cost.py --against main            # this tree / main
    python benchmarks/request_cost.py --against c0c89ca --requests 20000 --rounds 5

The same request (`POST /v1/ensure` of a published checkout, a bearer token, a
JSON body) goes through serve's `Api` as granian would hand it over (an RSGI
scope and protocol stand-in; no sockets, no HTTP parsing), with the access log
at info written to /dev/null by serve's own log writer, so what is measured is
what serve adds per answer: admission, the policy, the ready path, metrics and
the access line. Each revision runs in a subprocess of its own (its tree on
PYTHONPATH: the other revision is checked out in a temporary git worktree),
rounds interleaved, one store and checkout shared; the ratio of medians is the
result (a busy machine slows both sides alike).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

TOP = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
TOKEN = "bench-" + "t" * 26

MEASURE = r'''
import asyncio, json, os, sys, time
sys.setswitchinterval(0.001)
from checkoutcache.cache import Cache
from checkoutcache.config import Config, ServeSettings
from checkoutcache.serve import logs
from checkoutcache.serve.app import Api, Listener, Pools, allowed_hosts
from checkoutcache.serve.policy import ApiPolicy, parse_tokens
from checkoutcache.serve.service import Service

root, repo, commit, token, count = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
config = Config()
settings = ServeSettings(listen="127.0.0.1:9", allow_local=True, gc_interval=0)
cache = Cache(root, config=config)
assert cache.ensure(repo, commit, wait=120).state == "ready"
policy = ApiPolicy(tokens=parse_tokens(token, "bench"), allow_local=True)
service = Service(cache, config, settings, os.path.join(root, "bench.journal"), policy, "bench")
api = Api(service, Listener(True, allowed_hosts("127.0.0.1", 9)), Pools(4), b"{}")
body = json.dumps({"repo": repo, "commit": commit}).encode()

class Headers(dict):
    pass

class Scope:
    proto = "http"; method = "POST"; path = "/v1/ensure"; query_string = ""; authority = "127.0.0.1:9"
    headers = Headers({"host": "127.0.0.1:9", "authorization": f"Bearer {token}",
                       "content-type": "application/json", "content-length": str(len(body))})

class Proto:
    status = None
    async def __call__(self):
        return body
    def response_bytes(self, status, headers, data):
        self.status = status

sys.stderr = open(os.devnull, "w")
logs.configure("text", "info")

async def main():
    scope, proto = Scope(), Proto()
    for _ in range(200):  # warm: the resolved request, labelled children
        await api(scope, proto)
    assert proto.status == 200, proto.status
    started = time.perf_counter()
    for _ in range(count):
        await api(scope, proto)
    return (time.perf_counter() - started) / count * 1e6

print(json.dumps({"us_per_request": asyncio.run(main())}))
logs.flush()
os._exit(0)
'''


def git(*args: str, cwd: str = TOP) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def make_repo(path: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@b", GIT_COMMITTER_NAME="b",
               GIT_COMMITTER_EMAIL="b@b")
    subprocess.run(["git", "init", "-q", path], check=True, env=env)
    for n in range(50):
        with open(os.path.join(path, f"f{n}.txt"), "w") as handle:
            handle.write(f"file {n}\n" * 20)
    subprocess.run(["git", "add", "-A"], cwd=path, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "one"], cwd=path, check=True, env=env)
    return git("rev-parse", "HEAD", cwd=path)


def measure(tree: str, root: str, repo: str, commit: str, count: int) -> float:
    done = subprocess.run([sys.executable, "-c", MEASURE, root, repo, commit, TOKEN, str(count)],
                          env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {done.stdout}{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])["us_per_request"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="main", help="the revision to compare with (default: main)")
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cc-request-cost-") as work:
        other = os.path.join(work, "other")
        git("worktree", "add", "--detach", "-q", other, args.against)
        try:
            repo = os.path.join(work, "repo")
            commit = make_repo(repo)
            ours, theirs = [], []
            for _ in range(args.rounds):
                theirs.append(measure(other, os.path.join(work, "root-other"), repo, commit, args.requests))
                ours.append(measure(TOP, os.path.join(work, "root-ours"), repo, commit, args.requests))
        finally:
            git("worktree", "remove", "--force", other)
    a, b = statistics.median(ours), statistics.median(theirs)
    print(json.dumps({"this_tree_us": [round(x, 1) for x in ours], f"{args.against}_us": [round(x, 1) for x in theirs],
                      "median_this_tree_us": round(a, 1), f"median_{args.against}_us": round(b, 1),
                      "ratio": round(a / b, 3)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
