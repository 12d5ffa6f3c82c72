"""Which state a commit is in, and how long a failure backs off: pure decisions
over facts the caller gathered. No disk, no clock of their own.

States (DESIGN.md): ready > cloning > failed > absent, in that order of
precedence. A clone record counts only while its clone lock is held (a live
owner); a dead owner's leftovers make the commit absent, never "cloning"
forever. A failure counts only until its back-off has passed.
"""

from __future__ import annotations

import enum

import attrs


class State(enum.Enum):
    READY = "ready"
    CLONING = "cloning"
    FAILED = "failed"
    ABSENT = "absent"


@attrs.frozen
class Failure:
    code: str
    message: str
    next: str
    attempts: int
    failed_at: float
    retry_at: float

    @classmethod
    def from_record(cls, record: dict | None) -> "Failure | None":
        if not record:
            return None
        try:
            return cls(code=str(record["code"]), message=str(record["message"]),
                       next=str(record["next"]), attempts=int(record["attempts"]),
                       failed_at=float(record["failed_at"]), retry_at=float(record["retry_at"]))
        except (KeyError, TypeError, ValueError):
            return None

    def to_record(self) -> dict:
        return attrs.asdict(self)


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
