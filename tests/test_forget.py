"""What gc forgets (upkeep/forget.py): records of things that are over. A commit's failure
record, with its clone log and clone lock, goes a day after its retry time and never
during its back-off (issue 33). Real repositories, the real CLI; record times set back
as a day's wait would leave them."""

from __future__ import annotations

import json
import os
import time

import pytest

from checkoutcache.store import records
from checkoutcache.upkeep.forget import DEATHS_MEMORY

from .helpers import only_repo, run_cli, wait_ready

DAY = 86400.0


def missing_commit(number: int) -> str:
    return f"{number:02d}" + "0123456789abcdef0123456789abcdef012345"[:38]


def age_failure(path: str, failed_ago: float, retry_ago: float) -> dict:
    """Set a failure record's times back, as the clock would leave them (written whole)."""
    record = json.load(open(path))
    now = time.time()
    record.update(failed_at=now - failed_ago, retry_at=now - retry_ago)
    records.write_json(path, record)
    return record


def failed(root: str, url: str, sha: str, env: dict | None = None) -> dict:
    code, answer, out = run_cli("ensure", url, sha, "--wait", "60", root=root, env=env)
    assert code == 1 and answer["error"] == "UNKNOWN_COMMIT", out
    return answer


@pytest.mark.slow
def test_failure_records_go_a_day_after_their_retry_time_and_never_during_the_back_off(root, upstream):
    """Regression (issue 33): a commit that does not exist left its failure record, clone log
    and clone lock for good, even two days past its retry time; status, every scrape and gc
    read them all."""
    env = {"CHECKOUTCACHE_BACKOFF": "600"}
    wait_ready(root, upstream.path, upstream.shas[0])  # the repository stays: a checkout is in it
    old, recent, backing = missing_commit(1), missing_commit(2), missing_commit(3)
    for sha in (old, recent, backing):
        failed(root, upstream.path, sha, env)
    store = only_repo(root)
    age_failure(store.failure_record(old), 2 * DAY + 60, DEATHS_MEMORY + 60)  # past its retry time by a day
    age_failure(store.failure_record(recent), DEATHS_MEMORY - 600, DEATHS_MEMORY - 660)  # not yet a day
    within = open(store.failure_record(backing), "rb").read()
    leftovers = {sha: [store.failure_record(sha), store.clone_log(sha), store.clone_lock(sha)]
                 for sha in (old, recent, backing)}
    assert all(os.path.exists(path) for paths in leftovers.values() for path in paths)

    code, report, out = run_cli("gc", root=root, env=env)
    assert code == 0, out
    assert [path for path in leftovers[old] if os.path.exists(path)] == [], "forgotten: all three files"
    assert all(os.path.exists(path) for sha in (recent, backing) for path in leftovers[sha])
    assert open(store.failure_record(backing), "rb").read() == within, "a back-off is never touched"
    code, status, _ = run_cli("status", root=root)
    assert sorted(f["commit"] for r in status["repos"] for f in r["failures"]) == sorted([recent, backing])

    # Within the back-off the answer is what it was: the same failure, no new attempt.
    code, answer, out = run_cli("ensure", upstream.path, backing, root=root, env=env)
    assert code == 1 and answer["error"] == "UNKNOWN_COMMIT" and answer["retry_after"] > 500, out
    assert open(store.clone_log(backing)).read().count("clone of") == 1
    # A failure kept (past its retry time, not a day) still counts its attempts.
    failed(root, upstream.path, recent, env)
    assert json.load(open(store.failure_record(recent)))["attempts"] == 2
    # A forgotten one starts anew.
    failed(root, upstream.path, old, env)
    assert json.load(open(store.failure_record(old)))["attempts"] == 1
    assert open(store.clone_log(old)).read().count("clone of") == 1


def test_a_dry_run_forgets_nothing(root, upstream):
    sha = missing_commit(4)
    failed(root, upstream.path, sha)
    store = only_repo(root)
    age_failure(store.failure_record(sha), 3 * DAY, 2 * DAY)
    code, _report, out = run_cli("gc", "--dry-run", root=root)
    assert code == 0, out
    assert os.path.exists(store.failure_record(sha)) and os.path.exists(store.clone_lock(sha))
