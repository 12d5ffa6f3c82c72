"""The eviction policy as a pure function, under a frozen clock."""

from __future__ import annotations

import time

import pytest
from freezegun import freeze_time

from checkoutcache.units import FreeTarget
from checkoutcache.upkeep.eviction import Disk, Entry, Limits, plan_eviction

MIN = 60.0
GRACE = 15 * MIN
G = 1 << 30


def entry(name: str, idle: float, size: int = 100, held: bool = False, now: float | None = None) -> Entry:
    now = time.time() if now is None else now
    return Entry(repo="r", name=name, last_used=now - idle, size=size, held=held)


def evicted(plan) -> list[str]:
    return [e.entry.name for e in plan.evict]


@freeze_time("2026-11-29 12:00:00")
def test_least_recently_used_go_first():
    entries = [entry("new", 20 * MIN), entry("oldest", 60 * MIN), entry("old", 40 * MIN)]
    plan = plan_eviction(entries, Limits(max_checkouts=1), None, time.time())
    assert evicted(plan) == ["oldest", "old"]
    assert {e.reason for e in plan.evict} == {"lru"} and plan.unmet == []


@freeze_time("2026-11-29 12:00:00")
def test_grace_boundary_is_exactly_fifteen_minutes():
    entries = [entry("at-15m", GRACE), entry("just-over", GRACE + 0.001), entry("inside", GRACE - 1)]
    plan = plan_eviction(entries, Limits(max_checkouts=0), None, time.time())
    assert evicted(plan) == ["just-over"]
    assert sorted((k.entry.name, k.why) for k in plan.kept) == [("at-15m", "grace"), ("inside", "grace")]
    assert plan.unmet[0].limit == "max-checkouts" and plan.unmet[0].actual == 2


@freeze_time("2026-11-29 12:00:00")
def test_a_checkout_used_a_moment_ago_survives_a_limit_of_zero():
    plan = plan_eviction([entry("fresh", 1)], Limits(max_checkouts=0), None, time.time())
    assert evicted(plan) == [] and plan.kept[0].why == "grace"


@freeze_time("2026-11-29 12:00:00")
def test_held_checkouts_are_never_evicted_whatever_their_age():
    entries = [entry("held", 30 * 24 * 3600, held=True), entry("idle", 60 * MIN)]
    plan = plan_eviction(entries, Limits(max_checkouts=0, max_age=MIN), None, time.time())
    assert evicted(plan) == ["idle"]
    assert [(k.entry.name, k.why) for k in plan.kept] == [("held", "held")]


@freeze_time("2026-11-29 12:00:00")
def test_max_bytes():
    entries = [entry("a", 60 * MIN, size=400), entry("b", 50 * MIN, size=400), entry("c", 40 * MIN, size=400)]
    plan = plan_eviction(entries, Limits(max_bytes=500), None, time.time())
    assert evicted(plan) == ["a", "b"] and plan.evict[0].limit == "max-bytes"


@freeze_time("2026-11-29 12:00:00")
def test_max_age_is_off_by_default_and_evicts_when_set():
    entries = [entry("week", 7 * 24 * 3600), entry("hour", 3600)]
    assert evicted(plan_eviction(entries, Limits(), None, time.time())) == []
    plan = plan_eviction(entries, Limits(max_age=24 * 3600), None, time.time())
    assert evicted(plan) == ["week"] and plan.evict[0].reason == "age"


@freeze_time("2026-11-29 12:00:00")
def test_free_space_hysteresis():
    entries = [entry(f"c{i}", (60 - i) * MIN, size=1 * G) for i in range(10)]
    limits = Limits(min_free=FreeTarget(bytes=10 * G), free_headroom=FreeTarget(bytes=3 * G))
    # Above the low mark: nothing starts, even though below the high mark.
    assert evicted(plan_eviction(entries, limits, Disk(total=100 * G, free=11 * G), time.time())) == []
    # Below the low mark: evict until free reaches low + headroom (13G): 5 checkouts of 1G from 8G.
    plan = plan_eviction(entries, limits, Disk(total=100 * G, free=8 * G), time.time())
    assert evicted(plan) == ["c0", "c1", "c2", "c3", "c4"]
    assert {e.limit for e in plan.evict} == {"min-free"}


@freeze_time("2026-11-29 12:00:00")
def test_free_space_as_a_percent():
    entries = [entry(f"c{i}", (60 - i) * MIN, size=1 * G) for i in range(5)]
    limits = Limits(min_free=FreeTarget(percent=10), free_headroom=FreeTarget(percent=0))
    plan = plan_eviction(entries, limits, Disk(total=100 * G, free=8 * G), time.time())
    assert evicted(plan) == ["c0", "c1"]


@freeze_time("2026-11-29 12:00:00")
def test_unmet_disk_target_names_what_protected_it():
    entries = [entry("busy", 1, size=5 * G), entry("idle", 60 * MIN, size=1 * G)]
    limits = Limits(min_free=FreeTarget(bytes=10 * G), free_headroom=FreeTarget(bytes=0))
    plan = plan_eviction(entries, limits, Disk(total=100 * G, free=2 * G), time.time())
    assert evicted(plan) == ["idle"]
    assert [(k.entry.name, k.why, k.limit) for k in plan.kept] == [("busy", "grace", "min-free")]
    assert plan.unmet[0].limit == "min-free" and plan.unmet[0].actual == 3 * G


def test_plan_is_deterministic_for_equal_last_use():
    now = 1_000_000.0
    entries = [Entry("r", s, now - 3600, 1) for s in ("c", "a", "b")]
    assert evicted(plan_eviction(entries, Limits(max_checkouts=1), None, now)) == ["a", "b"]


@pytest.mark.parametrize("limits", [Limits(), Limits(max_checkouts=10), Limits(max_bytes=10 ** 12)])
def test_within_limits_nothing_is_evicted(limits):
    now = 1_000_000.0
    assert plan_eviction([Entry("r", "a", now - 7200, 1)], limits, Disk(10, 5), now).evict == []


# ------------------------------------------------------------ whole repositories (issue 27)

from checkoutcache.upkeep.eviction import RepoEntry, plan_repo_drops, unmet_after, Unmet  # noqa: E402

DAY = 86400.0


def repo(name: str, idle: float, size: int = 1 * G, busy: str | None = None) -> RepoEntry:
    return RepoEntry(repo=name, last_used=time.time() - idle, size=size, busy=busy)


def dropped(drops) -> list[str]:
    return [d.entry.repo for d in drops]


@freeze_time("2026-11-29 12:00:00")
def test_repositories_unused_past_the_limit_go_and_busy_ones_never():
    repos = [repo("old", 8 * DAY), repo("recent", 2 * DAY), repo("held", 30 * DAY, busy="held"),
             repo("cloning", 30 * DAY, busy="cloning"), repo("borrowed", 30 * DAY, busy="borrowed")]
    drops, kept = plan_repo_drops(repos, Limits(repo_max_idle=7 * DAY), None, 0, time.time())
    assert dropped(drops) == ["old"] and {d.limit for d in drops} == {"repo-max-idle"} and kept == []
    assert plan_repo_drops(repos, Limits(repo_max_idle=None), None, 0, time.time()) == ([], [])


@freeze_time("2026-11-29 12:00:00")
def test_an_unmet_min_free_drops_repositories_past_the_grace_window_least_recently_used_first():
    limits = Limits(min_free=FreeTarget(bytes=10 * G), free_headroom=FreeTarget(bytes=2 * G),
                    repo_max_idle=7 * DAY)
    repos = [repo("a", 3 * 3600, size=3 * G), repo("b", 5 * 3600, size=3 * G), repo("c", 1 * 3600, size=3 * G),
             repo("fresh", 5 * MIN), repo("busy", DAY, busy="checkouts")]
    # 5G free, 1G freed by checkouts: 12G is the stop mark, so two of 3G (oldest first).
    drops, kept = plan_repo_drops(repos, limits, Disk(total=100 * G, free=5 * G), 1 * G, time.time())
    assert dropped(drops) == ["b", "a"] and {d.limit for d in drops} == {"min-free"}
    assert [(k.repo, k.why) for k in kept] == [("busy", "checkouts")]  # met before "fresh" was looked at
    # Not below min-free: nothing goes before its idle limit.
    assert plan_repo_drops(repos, limits, Disk(total=100 * G, free=11 * G), 0, time.time()) == ([], [])
    # Nothing idle enough: what stayed, and why, for the report.
    drops, kept = plan_repo_drops([repo("fresh", 5 * MIN), repo("busy", DAY, busy="held")], limits,
                                  Disk(total=100 * G, free=1 * G), 0, time.time())
    assert drops == [] and sorted((k.repo, k.why) for k in kept) == [("busy", "held"), ("fresh", "grace")]


def test_dropped_repositories_count_toward_min_free_only():
    unmet = [Unmet("min-free", 12 * G, 6 * G), Unmet("max-checkouts", 1, 3)]
    assert unmet_after(unmet, 7 * G) == [Unmet("max-checkouts", 1, 3)]
    assert unmet_after(unmet, 1 * G) == [Unmet("min-free", 12 * G, 7 * G), Unmet("max-checkouts", 1, 3)]


@freeze_time("2026-11-29 12:00:00")
def test_readers_holds_protect_at_most_max_held_and_for_at_most_max_hold_age():
    now = time.time()
    held = [attrs_evolve(entry(f"held-{i}", (10 - i) * 60 * MIN, held=True), held_since=now - 60) for i in range(4)]
    old = attrs_evolve(entry("held-long", 30 * MIN, held=True), held_since=now - 7 * 3600)
    serves = attrs_evolve(entry("serve-hold", 90 * 60 * MIN, held=True), writer_hold=True, held_since=now - 10 * 24 * 3600)
    fresh = attrs_evolve(entry("held-fresh", MIN, held=True), held_since=now - 7 * 3600)
    plan = plan_eviction([*held, old, serves, fresh], Limits(max_checkouts=0, max_held=2, max_hold_age=6 * 3600.0),
                         None, now)
    broke = {e.entry.name: e.broke_hold for e in plan.evict}
    # held-long: past the age; of the rest, the two most recently used stay held (held-3, held-2).
    assert broke == {"held-long": "held-too-long", "held-0": "held-over-count", "held-1": "held-over-count"}, broke
    kept = {k.entry.name: k.why for k in plan.kept}
    # serve's own hold is never a reader's; a hold past its age still keeps a checkout in its grace window.
    assert kept == {"held-2": "held", "held-3": "held", "serve-hold": "held", "held-fresh": "grace"}, kept
    # No bounds set: every hold protects, as before.
    assert evicted(plan_eviction([*held, old], Limits(max_checkouts=0), None, now)) == []


def attrs_evolve(value, **changes):
    import attrs

    return attrs.evolve(value, **changes)
