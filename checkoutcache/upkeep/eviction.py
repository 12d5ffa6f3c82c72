"""Which checkouts to evict: a pure function over facts, limits and now.

Invariant 4, the decision: least recently used first; never a checkout used
within the grace window (a use exactly `grace` seconds ago still counts as
within it) and never one held by a running exec, whatever a limit says. Live
workspaces (a review's own trees) count against max-bytes but are never
evicted: checkouts are evicted to make room for them. What
a protected checkout keeps over a limit is reported (which checkout, why),
never silently dropped. Free-space targets use hysteresis: eviction for disk
starts only below `min_free` and then goes on until `min_free + headroom`, so
gc does not thrash at the boundary.

Holds are bounded too (DESIGN invariant 18): a checkout held by a reader's lock (the
marker's shared flock: an exec, a workspace's source, any process that took it, through
a read-only mount too) is kept past a limit only while it is one of the `max_held` most
recently used held ones and has been held (as gc's runs saw it: `held_since`) for less
than `max_hold_age`; past either, it is evicted like any other when a limit needs it,
without its exclusive lock (gc.py: evict_checkout with held=True). serve's own holds (`writer_hold`) have
their own count and ttl and keep their protection.

Clocks are not trusted: a last use in the future (a clock that jumped back, a
restored backup) counts as now, never as "used in a negative time"; otherwise
such a checkout would stay inside the grace window forever (gc repairs the
marker's mtime to now, see gc.py).

Whole repositories (plan_repo_drops) go only when nothing is in them: no
checkout, no hold, no clone, no failure within its back-off (a failure is no
use: its repository's last use is its checkouts'); then when unused past repo_max_idle, and, while
min-free is still unmet after the checkouts' evictions, past the grace window
(least recently used first). The dropper re-checks all of it under the
repository's locks (evict.py).

The plan is advice: the evictor re-checks each checkout's last use under the
checkout's exclusive lock before it renames anything (see gc.py).
"""

from __future__ import annotations

import attrs

from checkoutcache.units import FreeTarget

LRU = "lru"
AGE = "age"
GRACE = "grace"
HELD = "held"
# Why a reader's hold no longer protects a checkout (Eviction.broke_hold).
HELD_TOO_LONG = "held-too-long"
HELD_OVER_COUNT = "held-over-count"


@attrs.frozen
class Entry:
    repo: str  # the repository key
    name: str  # the checkout's name (store/layout.py checkout_name)
    last_used: float
    size: int
    held: bool = False
    held_since: float | None = None  # when gc first saw it held, in an unbroken run of looks
    writer_hold: bool = False  # held by serve's own /v1/hold (bounded there)


@attrs.frozen
class Limits:
    grace: float = 900.0
    max_checkouts: int | None = None
    max_bytes: int | None = None
    min_free: FreeTarget | None = None
    free_headroom: FreeTarget = FreeTarget(percent=2.0)
    max_age: float | None = None
    repo_max_idle: float | None = None
    max_held: int | None = None  # None: a reader's hold is never broken
    max_hold_age: float | None = None

    @classmethod
    def from_config(cls, config) -> "Limits":
        return cls(grace=config.grace, max_checkouts=config.max_checkouts, max_bytes=config.max_bytes,
                   min_free=config.min_free, free_headroom=config.free_headroom, max_age=config.max_age,
                   repo_max_idle=getattr(config, "repo_max_idle", None),
                   max_held=getattr(config, "max_held", None), max_hold_age=getattr(config, "max_hold_age", None))


@attrs.frozen
class Disk:
    total: int
    free: int


@attrs.frozen
class Eviction:
    entry: Entry
    reason: str  # lru or age
    limit: str  # max-checkouts, max-bytes, min-free, max-age
    broke_hold: str | None = None  # held-too-long, held-over-count: evicted though a reader holds it


@attrs.frozen
class Kept:
    entry: Entry
    why: str  # grace or held
    limit: str


@attrs.frozen
class Unmet:
    limit: str
    target: int
    actual: int


@attrs.frozen
class Plan:
    evict: list[Eviction]
    kept: list[Kept]
    unmet: list[Unmet]


def last_use(last_used: float, now: float) -> float:
    """When a checkout was last used, as far as eviction goes: a time in the future counts as now."""
    return min(last_used, now)


def idle_seconds(last_used: float, now: float) -> float:
    """How long a checkout has been unused: never negative."""
    return now - last_use(last_used, now)


def protection(entry: Entry, grace: float, now: float, broken: dict | None = None) -> str | None:
    """Why the checkout is kept whatever a limit says (None: it may go). broken: the held
    entries whose reader's hold no longer protects them (broken_holds)."""
    if entry.held and (broken is None or (entry.repo, entry.name) not in broken):
        return HELD
    if idle_seconds(entry.last_used, now) <= grace:
        return GRACE
    return None


def broken_holds(entries: list[Entry], limits: Limits, now: float) -> dict[tuple[str, str], str]:
    """The held checkouts a reader's hold no longer protects, and why: held longer than
    max_hold_age, or beyond the max_held most recently used ones still held. serve's own
    holds are never among them."""
    readers = [e for e in entries if e.held and not e.writer_hold]
    broken = {}
    if limits.max_hold_age is not None:
        broken = {(e.repo, e.name): HELD_TOO_LONG for e in readers
                  if e.held_since is not None and now - e.held_since > limits.max_hold_age}
    if limits.max_held is not None:
        left = sorted((e for e in readers if (e.repo, e.name) not in broken),
                      key=lambda e: (-last_use(e.last_used, now), e.repo, e.name))
        broken.update({(e.repo, e.name): HELD_OVER_COUNT for e in left[limits.max_held:]})
    return broken


def plan_eviction(entries: list[Entry], limits: Limits, disk: Disk | None, now: float,
                  pinned_bytes: int = 0) -> Plan:
    """pinned_bytes: what live workspaces hold (gc cannot evict them): counted against
    max-bytes, so checkouts make room for them."""
    evict: list[Eviction] = []
    kept: list[Kept] = []
    chosen: set[tuple[str, str]] = set()
    order = sorted(entries, key=lambda e: (last_use(e.last_used, now), e.repo, e.name))
    broken = broken_holds(entries, limits, now)

    def eviction(entry: Entry, reason: str, limit: str) -> Eviction:
        return Eviction(entry, reason, limit, broken.get((entry.repo, entry.name)) if entry.held else None)

    if limits.max_age is not None:
        for entry in order:
            if idle_seconds(entry.last_used, now) > limits.max_age and \
                    protection(entry, limits.grace, now, broken) is None:
                evict.append(eviction(entry, AGE, "max-age"))
                chosen.add((entry.repo, entry.name))

    count = len(entries) - len(evict)
    size = sum(e.size for e in entries) + pinned_bytes - sum(e.entry.size for e in evict)
    freed = sum(e.entry.size for e in evict)
    low = high = None
    if limits.min_free is not None and disk is not None:
        low = limits.min_free.bytes_of(disk.total)
        high = low + limits.free_headroom.bytes_of(disk.total)
    disk_started = low is not None and disk.free < low

    def exceeded() -> str | None:
        if limits.max_checkouts is not None and count > limits.max_checkouts:
            return "max-checkouts"
        if limits.max_bytes is not None and size > limits.max_bytes:
            return "max-bytes"
        if disk_started and disk.free + freed < high:
            return "min-free"
        return None

    for entry in order:
        limit = exceeded()
        if limit is None:
            break
        if (entry.repo, entry.name) in chosen:
            continue
        why = protection(entry, limits.grace, now, broken)
        if why is not None:
            kept.append(Kept(entry, why, limit))
            continue
        evict.append(eviction(entry, LRU, limit))
        chosen.add((entry.repo, entry.name))
        count -= 1
        size -= entry.size
        freed += entry.size

    unmet = []
    if limits.max_checkouts is not None and count > limits.max_checkouts:
        unmet.append(Unmet("max-checkouts", limits.max_checkouts, count))
    if limits.max_bytes is not None and size > limits.max_bytes:
        unmet.append(Unmet("max-bytes", limits.max_bytes, size))
    if disk_started and disk.free + freed < high:
        unmet.append(Unmet("min-free", high, disk.free + freed))
    return Plan(evict=evict, kept=kept, unmet=unmet)


REPO_MAX_IDLE = "repo-max-idle"
MIN_FREE = "min-free"


@attrs.frozen
class RepoEntry:
    repo: str  # the repository key
    last_used: float  # its checkouts' latest use, or the latest one evicted (state/last-use.json)
    size: int  # what dropping it frees: mirror, LFS objects, records
    busy: str | None = None  # what keeps it whatever a limit says: checkouts, held, cloning, backing-off


@attrs.frozen
class RepoDrop:
    entry: RepoEntry
    limit: str  # repo-max-idle or min-free


@attrs.frozen
class RepoKept:
    repo: str
    why: str  # checkouts, held, cloning, borrowed, backing-off, grace


def free_targets(limits: Limits, disk: Disk | None) -> tuple[int, int] | None:
    """(min-free in bytes, where eviction for disk stops) on this disk; None: no min-free."""
    if limits.min_free is None or disk is None:
        return None
    low = limits.min_free.bytes_of(disk.total)
    return low, low + limits.free_headroom.bytes_of(disk.total)


def plan_repo_drops(repos: list[RepoEntry], limits: Limits, disk: Disk | None, freed: int,
                    now: float) -> tuple[list[RepoDrop], list[RepoKept]]:
    """Whole repositories to drop, and (while min-free is unmet) those that had to stay.
    freed: what the checkouts' evictions free already."""
    drops: list[RepoDrop] = []
    chosen: set[str] = set()
    order = sorted(repos, key=lambda r: (last_use(r.last_used, now), r.repo))
    if limits.repo_max_idle is not None:
        for repo in order:
            if repo.busy is None and idle_seconds(repo.last_used, now) > limits.repo_max_idle:
                drops.append(RepoDrop(repo, REPO_MAX_IDLE))
                chosen.add(repo.repo)
                freed += repo.size
    kept: list[RepoKept] = []
    targets = free_targets(limits, disk)
    if targets is None or disk is None or disk.free >= targets[0]:
        return drops, kept
    for repo in order:
        if disk.free + freed >= targets[1]:
            break
        if repo.repo in chosen:
            continue
        if repo.busy is not None:
            kept.append(RepoKept(repo.repo, repo.busy))
        elif idle_seconds(repo.last_used, now) <= limits.grace:
            kept.append(RepoKept(repo.repo, GRACE))
        else:
            drops.append(RepoDrop(repo, MIN_FREE))
            chosen.add(repo.repo)
            freed += repo.size
    return drops, kept


def unmet_after(unmet: list[Unmet], dropped: int) -> list[Unmet]:
    """The plan's unmet limits once whole repositories freed `dropped` bytes of disk
    (they count for min-free only: checkouts' limits are about checkouts)."""
    left = []
    for item in unmet:
        if item.limit == MIN_FREE:
            item = Unmet(MIN_FREE, item.target, item.actual + dropped)
            if item.actual >= item.target:
                continue
        left.append(item)
    return left
