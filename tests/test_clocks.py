"""Clocks that jump: a last use in the future (a clock that went back, a
restored backup) counts as now, is repaired by gc, and never makes a checkout
unevictable or an idle time negative."""

from __future__ import annotations

import os
import time

import pytest
from freezegun import freeze_time

from checkoutcache.upkeep.eviction import (
    AGE,
    GRACE,
    LRU,
    Entry,
    Limits,
    idle_seconds,
    last_use,
    plan_eviction,
)

from .helpers import run_cli, wait_ready

YEARS = 5 * 365 * 86400.0


@freeze_time("2030-06-01 12:00:00")
def test_a_last_use_in_the_future_counts_as_now():
    now = time.time()
    future = Entry(repo="r", name="f" * 40, last_used=now + YEARS, size=1)
    past = Entry(repo="r", name="a" * 40, last_used=now - 3600, size=1)
    assert last_use(future.last_used, now) == now and idle_seconds(future.last_used, now) == 0
    assert idle_seconds(past.last_used, now) == 3600
    # The future one is the most recently used: the past one goes first, the future one is in grace.
    plan = plan_eviction([future, past], Limits(grace=60, max_checkouts=0), None, now)
    assert [(e.entry.name, e.reason) for e in plan.evict] == [(past.name, LRU)]
    assert [(k.entry.name, k.why) for k in plan.kept] == [(future.name, GRACE)]
    plan = plan_eviction([future, past], Limits(grace=60, max_age=120), None, now)
    assert [(e.entry.name, e.reason) for e in plan.evict] == [(past.name, AGE)]


@pytest.mark.slow
def test_gc_repairs_a_marker_from_the_future_and_evicts_it_later(root, upstream):
    path = wait_ready(root, upstream.path, upstream.shas[0])["path"]
    marker = os.path.join(path, ".git", "checkoutcache-ready")
    future = time.time() + YEARS
    os.utime(marker, (future, future))
    code, status, _ = run_cli("status", root=root)
    (checkout,) = status["repos"][0]["checkouts"]
    assert code == 0 and checkout["idle_seconds"] == 0 and checkout["protected"] == "grace"

    code, report, _ = run_cli("gc", "--max-age", "1s", "--grace", "1s", root=root)
    assert code == 0 and report["clock_repaired"][0]["commit"] == upstream.shas[0]
    assert os.stat(marker).st_mtime <= time.time()  # set back to (gc's) now
    assert os.path.isdir(path)  # counted as used now: inside the grace window
    time.sleep(1.5)
    code, report, _ = run_cli("gc", "--max-age", "1s", "--grace", "1s", root=root)
    assert code == 0 and [(r["name"], r["reason"]) for r in report["removed"]] == [(upstream.shas[0], "age")]
    assert not os.path.exists(path)
