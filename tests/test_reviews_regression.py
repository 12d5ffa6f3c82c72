"""The outage this product exists to prevent, as a regression test.

Six reviews of one repository at once, each asking for its own commit on
every tool call, while gc runs back to back with a limit of 3 checkouts. No
review may lose its checkout while inside the grace window, every call is a
use (it renews the window), no running clone may be deleted, each commit is
cloned once, gc keeps what the window protects over its limit and says so,
and once the reviews are over and their window has passed, gc brings the
store back to its limit, least recently used first.

Nothing here depends on the machine's speed: reviews make a number of calls
(not calls for some seconds), gc runs until it has met all six checkouts
three times (not for some seconds), and the grace window (an hour) is longer
than any test can take, so every answer is inside it whatever the load; the
window's end is made by moving the last uses back, not by waiting.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time

import pytest

from checkoutcache import Cache

from .helpers import Upstream, git, marker, only_repo, run_cli

REVIEWS = 6
LIMIT = 3
GRACE = 3600  # seconds: no call of a review can be this far from its previous one
CALLS = 6  # tool calls per review at least
GC_RUNS_OVER_THE_LIMIT = 3  # gc runs that start once all six checkouts are ready
MAX_CALLS = 500  # a bound, in case gc stops before it met the six (then the test fails saying so)
CLOCK_SLACK = 0.05  # a file's mtime comes from the kernel's coarse clock, a few ms behind time.time()


@pytest.mark.slow
def test_six_concurrent_reviews_with_gc_at_a_limit_of_three(root, tmp_path):
    upstream = Upstream(str(tmp_path / "upstream"))
    for number in range(REVIEWS):
        upstream.commit({f"file-{number}.txt": f"content {number}\n" * 50, "README.md": f"v{number}\n"})
    cache = Cache(root)
    problems: list[str] = []
    calls = [0] * REVIEWS
    first_ready = threading.Semaphore(0)  # released once per review, at its first ready answer
    released = [False] * REVIEWS
    all_ready = threading.Event()
    gc_met_all_six = threading.Event()
    reviews_over = threading.Event()
    gc_runs: list[tuple[bool, int, dict | None, str]] = []  # (started with all six ready, exit, report, output)

    def gc_loop() -> None:
        while not reviews_over.is_set():
            with_all_six = all_ready.is_set()
            code, report, out = run_cli("gc", "--max-checkouts", str(LIMIT), "--grace", str(GRACE), root=root)
            gc_runs.append((with_all_six, code, report, out))
            if code != 0:
                problems.append(f"gc exited {code}: {out[-500:]}")
                gc_met_all_six.set()  # the reviews need not wait for runs that will not come
                return
            if sum(1 for run in gc_runs if run[0]) >= GC_RUNS_OVER_THE_LIMIT:
                gc_met_all_six.set()

    def review(index: int) -> None:
        try:
            ask_and_use(index)
        finally:
            if not released[index]:  # no first answer will come: the main thread stops waiting for it
                first_ready.release()

    def ask_and_use(index: int) -> None:
        rng = random.Random(index)
        sha = upstream.shas[index]
        while calls[index] < CALLS or not gc_met_all_six.is_set():
            if calls[index] >= MAX_CALLS:
                problems.append(f"review {index}: gc never met all six checkouts in {MAX_CALLS} calls")
                return
            asked = time.time()
            answer = cache.ensure(upstream.path, sha, wait=300)  # a tool call
            calls[index] += 1
            if answer.state != "ready":
                problems.append(f"review {index}: {answer}")
                return
            try:  # the tool reads files and runs git in the checkout
                with open(os.path.join(answer.path, f"file-{index}.txt")) as handle:
                    handle.read()
                if calls[index] % 3 == 0:
                    git("log", "-1", "--format=%H", cwd=answer.path)
                last_use = os.stat(marker(answer.path)).st_mtime
            except (OSError, subprocess.CalledProcessError) as exc:
                problems.append(f"review {index} lost its checkout: {exc}")
                return
            if last_use < asked - CLOCK_SLACK:
                problems.append(f"review {index}: call {calls[index]} was not recorded as a use "
                                f"(last use {last_use}, asked at {asked})")
                return
            if not released[index]:
                released[index] = True
                first_ready.release()
            time.sleep(rng.uniform(0.02, 0.2))  # thinking

    gc_thread = threading.Thread(target=gc_loop)
    gc_thread.start()
    threads = [threading.Thread(target=review, args=(i,)) for i in range(REVIEWS)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(REVIEWS):
            if not first_ready.acquire(timeout=600):
                break
        else:
            all_ready.set()
        for thread in threads:
            thread.join(600)
    finally:
        all_ready.set()
        gc_met_all_six.set()  # lets any review still waiting end (the asserts say why)
        reviews_over.set()
        gc_thread.join(600)
    assert problems == []
    assert min(calls) >= CALLS, calls

    # gc met the six checkouts, all inside the window, over its limit of three: it removed none of
    # them and reported each as kept over the limit because of the window.
    over_the_limit = [report for with_all_six, _, report, _ in gc_runs if with_all_six]
    assert len(over_the_limit) >= GC_RUNS_OVER_THE_LIMIT, gc_runs
    for report in over_the_limit:
        assert [r for r in report["removed"] if r["reason"] in ("lru", "age")] == [], report
        kept = report["kept_over_limit"]
        # A checkout a review's git is reading at that instant is named "held" (a running command
        # in it comes first, upkeep/eviction.py); every other one is kept for the window.
        assert sorted(k["commit"] for k in kept) == sorted(upstream.shas), report
        assert {k["why"] for k in kept} <= {"grace", "held"} and "grace" in {k["why"] for k in kept}, report
        assert [{k: u[k] for k in ("limit", "target", "actual")} for u in report["unmet"]] == [
            {"limit": "max-checkouts", "target": LIMIT, "actual": REVIEWS}], report

    store = only_repo(root)
    assert sorted(store.checkout_names()) == sorted(upstream.shas)
    for sha in upstream.shas:  # one clone per commit: nothing was evicted under a review
        assert open(store.clone_log(sha)).read().count("clone of") == 1

    # The reviews are over: their window passes (every last use moved back by it, their order
    # kept), and gc trims to the limit, the least recently used first.
    last_use = {sha: os.stat(marker(store.checkout(sha))).st_mtime for sha in upstream.shas}
    # Their order kept, a second apart: reviews that ended together may share an mtime (the
    # kernel's coarse clock), and gc's order among equals is its own.
    past = min(last_use.values()) - GRACE - 60
    for rank, sha in enumerate(sorted(upstream.shas, key=last_use.get)):
        os.utime(marker(store.checkout(sha)), (past + rank, past + rank))
    code, report, out = run_cli("gc", "--max-checkouts", str(LIMIT), "--grace", str(GRACE), root=root)
    assert code == 0 and report["unmet"] == [], out
    least_recent = sorted(upstream.shas, key=last_use.get)[:REVIEWS - LIMIT]
    assert sorted(r["name"] for r in report["removed"] if r["reason"] == "lru") == sorted(least_recent), report
    assert sorted(store.checkout_names()) == sorted(set(upstream.shas) - set(least_recent))
