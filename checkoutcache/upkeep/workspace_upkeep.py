"""gc's part in the review workspaces (store/workspaces.py; the directory is
CHECKOUTCACHE_WORKSPACES as this gc sees it, workspaces.py workspaces_dir_of), called by
gc.py before it plans eviction:

- dead workspaces are reaped where gc may delete them (its own uid's, or as root); the
  others are listed (the report's workspaces.dead_left) for their uid's next call;
- the bytes of live ones count against max-bytes (their source checkouts stay held
  meanwhile): each is measured by a walk bounded in entries and time (store/sizes.py
  WORKSPACE_BOUNDS), and all of them in one run within WORKSPACES_BUDGET (one not walked
  at all once it is spent: "budget"); past a bound what it counted is its bytes, a lower
  bound the report says (workspaces.partial and a SIZE_AT_LEAST problem);
- the commit a live workspace borrows objects from keeps its keep-ref and its repository
  even once the source checkout went, but only when the workspace's git really borrows from
  that mirror (its alternates, never its owner.json alone: that is the review's word), and
  only within the bounds readers' locks have (max-held, max-hold-age as gc's runs saw them:
  bounded_pins), since a review makes these pins as it likes.

The directory is the reviews' to write: whatever they made there that is no lock or record
costs that entry (a problem in the report), never the run. With dry_run nothing is reaped.
"""

from __future__ import annotations

import os

from checkoutcache.config import Config
from checkoutcache.store import tree
from checkoutcache.store.layout import RootPaths
from checkoutcache.store.sizes import BUDGET, WORKSPACE_BOUNDS, WORKSPACES_BUDGET, Budget, Usage, measure
from checkoutcache.units import format_bytes
from checkoutcache.upkeep.report import GcReport, Removed


def workspace_upkeep(root_paths: RootPaths, config: Config, report: GcReport, problems: list[dict],
                     borrows: set[tuple[str, str, str]]) -> int:
    """Reap dead workspaces gc may delete; the bytes live ones hold (what max-bytes counts).
    What could not be read there goes to problems; the (key, commit, workspace) whose objects
    each live workspace borrows, to borrows: their keep-refs stay even once the source checkout
    went (a workspace's hold of its source is bounded like any reader's; so are these pins:
    bounded_pins). A live workspace measured only in part (sizes.WORKSPACE_BOUNDS met, or
    entries it may not read) counts what was measured and is listed under the report's
    workspaces.partial and in problems."""
    from checkoutcache.store import workspaces
    from checkoutcache.workspaces import workspaces_dir_of

    paths = workspaces_dir_of(root_paths.root, config)
    seen = {"dir": paths.base, "live": 0, "bytes": 0, "dead_left": [], "partial": []}
    report.workspaces = seen
    if not os.path.isdir(paths.base):
        return 0
    # The directory is the reviews' to write: whatever they made there that is no lock or record
    # (a FIFO where owner.lock should be) costs that entry, counted in problems, never the run.
    found: list[dict] = []
    if not report.dry_run:
        reaped, left = workspaces.reap_dead(paths, problems=found)
        report.removed += [Removed("dead-workspace", "", r.name, r.bytes) for r in reaped]
        seen["dead_left"] = [{"workspace": n.name, "uid": n.uid, "why": n.why} for n in left]
    facts = workspaces.workspace_facts(paths, problems=found)
    problems += list({(p["path"], p["error"]): p for p in found}.values())  # each entry once
    budget = Budget(WORKSPACES_BUDGET)
    for fact in facts:
        if fact.alive:
            seen["live"] += 1
            # The review's own tree, walked as it changes it: bounded, each and all of them in
            # one run (a review makes as many as it likes), and past a bound what was counted
            # stands as its bytes (a lower bound, said so).
            bounds = budget.next(WORKSPACE_BOUNDS)
            usage = Usage(0, partial=(BUDGET,)) if bounds is None else measure(fact.path, bounds=bounds)
            budget.spend(usage)
            seen["bytes"] += usage.bytes
            if usage.partial:
                seen["partial"].append({"workspace": fact.name, "bytes": usage.bytes, "entries": usage.entries,
                                        "why": list(usage.partial)})
                problems.append({"path": fact.path, "error": "SIZE_AT_LEAST",
                                 "why": f"its size walk stopped short ({', '.join(usage.partial)}; "
                                        f"{usage.entries} entries): at least {format_bytes(usage.bytes)} counted"})
            key, commit = fact.record.get("key"), fact.record.get("commit")
            if key and commit and borrows_from(fact, key):  # its git borrows that commit's objects
                borrows.add((key, commit, fact.name))
    return seen["bytes"]


def borrows_from(fact, key: str) -> bool:
    """Whether a live workspace's git really borrows from repository KEY's mirror: its tree's
    .git/objects/info/alternates names that mirror's objects (an owner.json alone is the
    review's word: it could name any repository to pin it)."""
    # The review's own tree: every component beneath its workspace is opened without following
    # a link (a `tree` made a symlink to a directory of the writer's was read through), and
    # the file never blocks (a FIFO) and must be a regular one.
    from checkoutcache.store.beneath import Escape, open_dir_beneath
    from checkoutcache.store.layout import refuse_unless_regular

    inside = os.path.relpath(fact.tree, fact.path).encode() + b"/.git/objects/info"
    try:
        workspace = tree.open_dir(fact.path)
        try:
            info = open_dir_beneath(workspace, inside)
        finally:
            os.close(workspace)
        try:
            fd = os.open("alternates", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=info)
        finally:
            os.close(info)
        try:
            refuse_unless_regular(fd, os.path.join(fact.tree, ".git", "objects", "info", "alternates"))
        except OSError:
            os.close(fd)
            raise
    except (OSError, Escape):
        return False
    with os.fdopen(fd, "rb") as handle:
        lines = handle.read(1 << 14).decode("utf-8", "replace").splitlines()
    return any(line.rstrip("/").endswith(f"/repos/{key}/mirror.git/objects") for line in lines)


def bounded_pins(pins: set[tuple[str, str, str]], since: dict[str, float], config: Config,
                 now: float) -> set[tuple[str, str]]:
    """Of live workspaces' pins (key, commit, workspace), those gc keeps: bounded as readers'
    locks are (max-held, the most recently seen first; max-hold-age, as gc's runs saw them:
    since, workspace -> first sighting), since a review makes them as it likes."""
    kept = [(key, commit, name) for key, commit, name in pins
            if now - since.get(name, now) <= config.max_hold_age]
    kept.sort(key=lambda pin: -since.get(pin[2], now))
    return {(key, commit) for key, commit, _name in kept[:config.max_held]}
