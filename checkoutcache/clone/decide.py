"""What to do with a commit: pure decisions over facts the caller gathered.
No disk, no clock of their own; tested without either (tests/test_pure.py).

States (DESIGN.md): ready > cloning > failed > absent, in that order of
precedence. A clone record counts only while its clone lock is held (a live
owner); a dead owner's leftovers make the commit absent, never "cloning"
forever. A failure counts only until its back-off has passed.

An absent commit is cloned, unless its workers keep dying: a worker that dies
records nothing, so the commit is simply absent and is cloned again, but one
that keeps dying (the OOM killer) must not be restarted in a loop: after
MAX_DEATHS deaths in a row the commit fails with WORKER_DIED and backs off.
"""

from __future__ import annotations

import enum

import attrs

from checkoutcache.answers import State
from checkoutcache.store.records import Failure

MAX_DEATHS = 3


@attrs.frozen
class CommitFacts:
    marker_present: bool
    clone_lock_held: bool
    failure: Failure | None
    now: float


def state_of(facts: CommitFacts) -> State:
    if facts.marker_present:
        return State.READY
    if facts.clone_lock_held:
        return State.CLONING
    if facts.failure is not None and facts.now < facts.failure.retry_at:
        return State.FAILED
    return State.ABSENT


class Step(enum.Enum):
    BACK_OFF = "back-off"  # answer the recorded failure until its retry time
    GIVE_UP = "give-up"  # record WORKER_DIED with a back-off, answer it
    CLONE = "clone"  # start a worker, telling it how many died before it


@attrs.frozen
class NextStep:
    step: Step
    deaths: int = 0


def next_step_for_not_ready(failure: Failure | None, dead_owner_deaths: int | None, now: float,
                            max_deaths: int = MAX_DEATHS, queued: bool = False) -> NextStep:
    """For a commit with no marker and a free clone lock (the caller holds it):
    dead_owner_deaths is the death count in a dead owner's clone record, None
    when there is no such record; queued: that owner only queued the clone (serve,
    killed before its worker started), which is no worker's death."""
    if failure is not None and now < failure.retry_at:
        return NextStep(Step.BACK_OFF)
    deaths = 0 if dead_owner_deaths is None else dead_owner_deaths + (0 if queued else 1)
    if deaths >= max_deaths:
        return NextStep(Step.GIVE_UP, deaths)
    return NextStep(Step.CLONE, deaths)


def backoff_seconds(attempts: int, base: float, cap: float) -> float:
    """Back-off after the attempts-th consecutive failure: base, 2*base, 4*base... up to cap."""
    if attempts < 1:
        return 0.0
    return float(min(cap, base * (2 ** min(attempts - 1, 32))))


def next_failure(previous: Failure | None, code: str, message: str, next_step: str,
                 now: float, base: float, cap: float) -> Failure:
    attempts = (previous.attempts if previous else 0) + 1
    return Failure(code=code, message=message, next=next_step, attempts=attempts,
                   failed_at=now, retry_at=now + backoff_seconds(attempts, base, cap))
