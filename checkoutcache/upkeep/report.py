"""What one gc run says: the report's types and its JSON form (`checkoutcache gc --json`,
serve's /v1/gc, docs/operations.md), and nothing of what gc does.

- Removed: one thing gc deleted (or, in a dry run, would delete), with why and what
  that freed; an evicted checkout kept as a spare says so and frees nothing.
- KeptOver: one checkout a limit wanted gone that gc kept, and why (grace, held,
  used-meanwhile).
- GcReport: the whole run, filled in by gc.py and the modules it calls (leftovers.py,
  workspace_upkeep.py, spare_upkeep.py, mirror_upkeep.py; history.py in its repository's
  `mirrors` entry), each appending its part.

Invariants: a report lives for one run (what must outlive it is a record under state/,
layout.py); to_json's keys are the public answer's, so a field added here is added to
docs/operations.md, serve/openapi.json and client.py too. bytes_freed counts only what
was freed: a spare's 0, a dry run's estimate.
"""

from __future__ import annotations

import attrs


REPOSITORY = "repository"  # a Removed whole repository (name empty)
USED_MEANWHILE = "used-meanwhile"  # a KeptOver whose checkout was used after the plan was made


@attrs.frozen
class Removed:
    # lru, age, dead-scratch, trash, unpublished, damaged, spare, dead-workspace,
    # dropped-leftover, repository (REPOSITORY)
    reason: str
    repo: str
    name: str
    bytes: int = 0
    limit: str | None = None
    spare: bool = False  # an evicted checkout kept as a spare (its bytes are not freed)
    # Evicted though a reader's lock held it: held-too-long or held-over-count (eviction.py)
    broke_hold: str | None = None


@attrs.frozen
class KeptOver:
    repo: str
    commit: str
    why: str  # grace, held, used-meanwhile
    limit: str
    name: str  # the checkout's name: the commit, or with a sparse checkout's cone digest


@attrs.define
class GcReport:
    dry_run: bool
    skipped: str | None = None
    removed: list[Removed] = attrs.Factory(list)
    kept: list[KeptOver] = attrs.Factory(list)
    unmet: list[dict] = attrs.Factory(list)
    # Last uses that lay in the future, set back to now: {"repo", "commit", "was"}.
    clock_repaired: list[dict] = attrs.Factory(list)
    mirrors: list[dict] = attrs.Factory(list)
    # What could not be deleted: {"repo", "path" (relative to the root), "error" (errno name)}.
    unremovable: list[dict] = attrs.Factory(list)
    # Entries gc could not read or whose records did not fit (a peer's chmod, a bad record):
    # {"path", "error" (errno name or INVALID), "why"}; each is left alone.
    problems: list[dict] = attrs.Factory(list)
    disk_before: dict | None = None
    disk_after: dict | None = None
    # The workspaces directory as this gc sees it: {"dir", "live", "bytes", "dead_left": [...],
    # "partial": [{"workspace", "bytes", "entries", "why"}]: live ones measured only in part,
    # whose counted bytes are a lower bound}.
    workspaces: dict | None = None
    # What the store holds after this run (ready, intact checkouts): computed
    # from the inventory gc already made, so callers need no second walk.
    checkouts_after: int | None = None
    bytes_after: int | None = None
    spares_after: int | None = None
    spare_bytes_after: int | None = None

    @property
    def bytes_freed(self) -> int:
        return sum(r.bytes for r in self.removed)

    def to_json(self) -> dict:
        return {
            "dry_run": self.dry_run, "skipped": self.skipped,
            "removed": [attrs.asdict(r) for r in self.removed],
            "kept_over_limit": [attrs.asdict(k) for k in self.kept],
            "unmet": self.unmet, "mirrors": self.mirrors, "bytes_freed": self.bytes_freed,
            "unremovable": self.unremovable, "clock_repaired": self.clock_repaired, "problems": self.problems,
            "workspaces": self.workspaces,
            "disk_before": self.disk_before, "disk_after": self.disk_after,
            "totals_after": {"checkouts": self.checkouts_after, "bytes": self.bytes_after,
                             "spares": self.spares_after, "spare_bytes": self.spare_bytes_after},
        }
