"""gc's part in a repository's history (clone/history.py): the background history of a
shallow mirror started again when it died (every gc run: cron's and serve's schedule),
and what a finished one or a gone checkout leaves tidied.

For each repository, after its mirror maintenance (a mirror it could not lock is left for
the next run):
- a shallow mirror with no history running and its last failure's back-off passed: the
  history starts (a fresh process: gc may run in serve, whose threads must not fork), with
  the credential the environment binds to the repository's host (one that came only in a
  request's URL is not known to gc: the next clone of that repository starts it);
- a complete mirror with a history.git left by a history killed after it completed the
  mirror and before it removed its own repository: removed, under locks/history.lock
  (tried: a running history keeps it); its history's last failure, if any, goes (the
  commits it held for were pruned with their checkouts);
- the merge-base records of checkouts that are gone.
What it did is in the repository's entry of the report's `mirrors` (`history`).
"""

from __future__ import annotations

import os
import time

from checkoutcache.config import Config
from checkoutcache.credentials import credential_for
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.store import locks, records, tree
from checkoutcache.store.checkouts import remove_tree, to_trash
from checkoutcache.store.layout import RepoPaths


def follow_history(paths: RepoPaths, config: Config, entry: dict | None, dry_run: bool) -> None:
    """entry: the repository's entry in gc's report of mirrors (None: none was made)."""
    from checkoutcache.clone import history

    for name in paths.bases_record_names():
        if not tree.lexists(paths.checkout(name)) and not locks.base_search_running(paths, name) and not dry_run:
            records.remove_quietly(paths.bases_record(name))
    if not os.path.isdir(paths.mirror):
        return
    state = history.history_state(paths)
    if entry is not None:
        entry["history"] = state
    if state == "complete":
        if not dry_run:
            # A failure for commits whose boundary gc's prune dropped since (their checkouts gone):
            # nothing is left for it to hold for.
            records.remove_quietly(paths.history_failure)
        if tree.lexists(paths.history_repo) and not dry_run:
            held = locks.history_of(paths)
            if held is not None:
                with held:
                    slot = to_trash(paths, paths.history_repo, "history")
                    if slot is not None:
                        remove_tree(slot)
        return
    if locks.history_running(paths):
        note(entry, "running")
        return
    failure = history.history_failure(paths)
    if failure is not None and time.time() < failure.retry_at:
        note(entry, f"backing off after {failure.code} until {failure.retry_at:.0f}")
        return
    if dry_run:
        note(entry, "would start")
        return
    info = records.read_json(paths.repo_json, records.REPO) or {}
    try:
        pid = history.start_history(paths, config, credential_for(info.get("url", ""), None, os.environ))
    except (OSError, CheckoutCacheError) as exc:
        note(entry, f"could not start: {exc}")
        return
    note(entry, f"started (pid {pid})" if pid is not None else "running")


def note(entry: dict | None, what: str) -> None:
    if entry is not None:
        entry["history_process"] = what
