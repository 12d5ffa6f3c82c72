"""The outage this product exists to prevent, as a regression test.

Six reviews of one repository at once, each asking for its own commit on
every tool call, while gc runs every few hundred milliseconds with a limit of
3 checkouts and a short grace window. No review may lose its checkout while
inside the grace window, no running clone may be deleted, each commit is
cloned once, and once the reviews stop, gc brings the store back to its limit.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest

from checkoutcache import Cache

from .helpers import Upstream, git, marker, only_repo, run_cli, wait_until

REVIEWS = 6
GRACE = 3.0
REVIEW_SECONDS = 8.0


@pytest.mark.slow
def test_six_concurrent_reviews_with_gc_at_a_limit_of_three(root, tmp_path):
    upstream = Upstream(str(tmp_path / "upstream"))
    for number in range(REVIEWS):
        upstream.commit({f"file-{number}.txt": f"content {number}\n" * 50, "README.md": f"v{number}\n"})
    stop_gc = time.time() + REVIEW_SECONDS + 2
    gc_loop = subprocess.Popen(
        ["bash", "-c", f"while [ $(date +%s) -lt {int(stop_gc)} ]; do {sys.executable} -m checkoutcache "
                       f"--root {root} --json gc --max-checkouts 3 --grace {GRACE} >> {tmp_path}/gc.log; "
                       f"sleep 0.3; done"])
    problems: list[str] = []
    calls = [0] * REVIEWS
    cache = Cache(root)

    def review(index: int) -> None:
        rng = random.Random(index)
        sha = upstream.shas[index]
        end = time.time() + REVIEW_SECONDS
        while time.time() < end:
            answer = cache.ensure(upstream.path, sha, wait=60)  # a tool call
            calls[index] += 1
            if answer.state != "ready":
                problems.append(f"review {index}: {answer}")
                return
            try:  # the tool reads files and runs git in the checkout
                with open(os.path.join(answer.path, f"file-{index}.txt")) as handle:
                    handle.read()
                if calls[index] % 3 == 0:
                    git("log", "-1", "--format=%H", cwd=answer.path)
            except (OSError, subprocess.CalledProcessError) as exc:
                problems.append(f"review {index} lost its checkout: {exc}")
                return
            time.sleep(rng.uniform(0.1, 1.0))  # thinking, well inside the grace window

    threads = [threading.Thread(target=review, args=(i,)) for i in range(REVIEWS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    gc_loop.wait(60)
    assert problems == []
    assert min(calls) >= 5

    store = only_repo(root)
    for sha in upstream.shas:  # one clone per commit: nothing was evicted under a review
        assert open(store.clone_log(sha)).read().count("clone of") == 1
    reports = [line for line in open(tmp_path / "gc.log") if line.strip()]
    assert any('"grace"' in line for line in reports), "gc reported what the grace window kept"

    # The reviews are over: once their grace has passed, gc trims to the limit.
    last_use = max(os.stat(marker(store.checkout(sha))).st_mtime for sha in store.checkout_names())
    wait_until(lambda: time.time() > last_use + GRACE + 0.1, GRACE + 30, "the last review's grace to pass")
    code, report, _ = run_cli("gc", "--max-checkouts", "3", "--grace", str(GRACE), root=root)
    assert code == 0 and report["unmet"] == []
    assert len(store.checkout_names()) == 3
