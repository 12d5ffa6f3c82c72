"""A reviewer, run inside a review container (`python3 -c SOURCE ...`, with the
image's own Python and checkoutcache): ASKS asks over the commits in a seeded
random order, each answer verified at once in the checkout it names; one JSON
line per ask on stdout. Only the standard library and checkoutcache.

    python3 -c "$(cat reviewer.py)" MODE REPO SHAS_JSON ASKS SEED

MODE is how it asks:
- api:    Client.from_env() (the pod's CHECKOUTCACHE_API_URL and token): hold the
          checkout, verify it, release it;
- exec:   `checkoutcache exec REPO SHA -- python3 -c VERIFY`: verified under the
          exec's hold, in the checkout (its working directory);
- ensure: `checkoutcache ensure REPO SHA --wait`, then verify. A plain ready
          answer protects the checkout for the grace window only: a checkout
          found gone is reported with the seconds since the answer, so the test
          can tell an eviction after the window (allowed) from a loss inside it.

Verification: HEAD is the commit and `git status` finds nothing changed,
deleted or added, which holds only for the commit's whole tree.
"""

import json
import os
import random
import subprocess
import sys
import time

GIT = ["git", "-c", "safe.directory=*", "--no-optional-locks"]
VERIFY = r"""
import subprocess, sys
git = ["git", "-c", "safe.directory=*", "--no-optional-locks"]
head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True)
status = subprocess.run(git + ["status", "--porcelain", "--untracked-files=all"], capture_output=True, text=True)
if head.returncode or status.returncode:
    sys.exit("git failed: " + head.stderr + status.stderr)
if head.stdout.strip() != sys.argv[1]:
    sys.exit("HEAD is " + head.stdout.strip())
if status.stdout:
    sys.exit("not clean: " + status.stdout[:300])
"""


def verify(path: str, sha: str) -> str | None:
    if not os.path.isdir(path):
        return "gone"
    done = subprocess.run([sys.executable, "-c", VERIFY, sha], cwd=path, capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


def ask_api(client, repo: str, sha: str) -> dict:
    from checkoutcache.client import HoldFailed

    try:
        hold = client.hold(repo, sha, wait=300, ttl=120)
    except HoldFailed as failed:
        return {"state": failed.answer.state, "error": failed.answer.error, "message": failed.answer.message}
    try:
        return {"state": "ready", "path": hold.answer.path, "problem": verify(hold.answer.path, sha)}
    finally:
        hold.release()


def ask_exec(repo: str, sha: str) -> dict:
    done = subprocess.run(["checkoutcache", "--json", "exec", repo, sha, "--wait", "300", "--",
                           sys.executable, "-c", VERIFY, sha], capture_output=True, text=True)
    if done.returncode == 125:  # not provided: the answer is on stderr
        answer = json.loads(done.stderr.strip().splitlines()[-1])
        return {"state": answer.get("state"), "error": answer.get("error"), "message": answer.get("message")}
    return {"state": "ready", "problem": None if done.returncode == 0 else (done.stderr.strip() or
                                                                           f"exit {done.returncode}")}


def ask_ensure(repo: str, sha: str) -> dict:
    done = subprocess.run(["checkoutcache", "--json", "ensure", repo, sha, "--wait", "300"], capture_output=True,
                          text=True)
    answered = time.monotonic()
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        return {"state": None, "error": "NO_JSON", "message": (done.stdout + done.stderr)[-500:]}
    if answer.get("state") != "ready":
        return {"state": answer.get("state"), "error": answer.get("error"), "message": answer.get("message")}
    problem = verify(answer["path"], sha)
    return {"state": "ready", "path": answer["path"], "problem": problem,
            "seconds_after_answer": round(time.monotonic() - answered, 3)}


def main() -> None:
    mode, repo, shas, asks, seed = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    order = random.Random(seed)
    client = None
    if mode == "api":
        from checkoutcache.client import Client

        client = Client.from_env(timeout=400)
    for number in range(asks):
        sha = order.choice(shas)
        if mode == "api":
            result = ask_api(client, repo, sha)
        elif mode == "exec":
            result = ask_exec(repo, sha)
        else:
            result = ask_ensure(repo, sha)
        print(json.dumps({"ask": number, "mode": mode, "commit": sha, "uid": os.getuid(), **result}), flush=True)


if __name__ == "__main__":
    main()
