"""status: what the store holds, per repository, against the limits.

Read-only (a reader of a read-only root runs it): built from the same
inventory gc plans from. The limits it shows, and judges protection by, are
those the writer recorded in the root (upkeep/limits.py), else the caller's
own. How it reads to a person is cli/output.py's business.
"""

from __future__ import annotations

import os
import time

import attrs

from checkoutcache.config import Config
from checkoutcache.git.transport import pick_backend
from checkoutcache.repospec import LFS_OFF, LFS_ON
from checkoutcache.store import records, tree
from checkoutcache.store.inventory import RepoInfo, inventory
from checkoutcache.store.layout import RootPaths, commit_of
from checkoutcache.store.ready import history_of, lfs_of
from checkoutcache.store.spares import list_spares
from checkoutcache.units import iso
from checkoutcache.upkeep.eviction import Entry, idle_seconds, protection
from checkoutcache.upkeep.gc import disk_of
from checkoutcache.upkeep.limits import in_force


def lfs_status(info: RepoInfo, config: Config, checkouts: list[dict]) -> dict:
    """The repository's Git LFS state: its setting, what its checkouts hold, the store,
    and why LFS content is absent when it is (docs/repositories.md "Git LFS")."""
    setting = info.meta.get("lfs", LFS_ON)
    if setting == LFS_OFF:
        why = "CHECKOUTCACHE_LFS=off: LFS files are checked out as pointer files"
    else:
        reason = pick_backend(config.transport).lfs_unsupported()
        why = f"LFS files are checked out as pointer files: {reason}" if reason else None
    counts = {value: sum(1 for c in checkouts if c.get("lfs") == value) for value in ("content", "pointers", "off")}
    oids = info.paths.lfs_object_oids()
    size = 0
    for oid in oids:
        try:
            size += tree.lstat(info.paths.lfs_object(oid)).st_size
        except OSError:
            pass
    return {"setting": setting, "why": why, "checkouts": counts, "objects": len(oids), "bytes": size,
            "store": info.paths.lfs_store}


def repo_status(info: RepoInfo, config: Config, now: float) -> dict:
    if info.refused:  # a symlink where a store directory should be: nothing is read through it
        return {"key": info.key, "repo": info.url, "scope": info.scope, "checkouts": [], "clones": [], "failures": [],
                "scratch": [], "spares": [], "stuck_in_trash": [], "lfs": None, "seed": None, "filter": None,
                "refused": info.refused, "problems": info.problems}
    checkouts = []
    for c in info.checkouts:
        entry = Entry(repo=info.key, name=c.name, last_used=c.last_used or 0.0, size=c.size, held=c.held)
        marker = c.marker
        checkouts.append({
            "commit": c.sha, "name": c.name, **({"sparse": list(c.sparse)} if c.sparse else {}),
            "path": c.path, "ready": c.ready, "intact": c.intact, "size": c.size,
            "lfs": lfs_of(marker), "lfs_why": marker.get("lfs_why"),
            "last_used": iso(c.last_used), "idle_seconds": None if c.last_used is None else round(idle_seconds(c.last_used, now)),
            "held": c.held, "protected": protection(entry, config.grace, now) if c.ready else None,
            **({"history": history_of(c.path)} if c.ready else {}),
            **({"unreadable": c.unreadable} if c.unreadable else {}),
        })
    clones = [{"commit": c.sha, "name": c.name, "pid": c.pid, "alive": c.alive, "started_at": iso(c.started_at),
               "progress": c.progress} for c in info.clones]
    failures = [{"commit": commit_of(name), "name": name, "error": f.code, "message": f.message,
                 "attempts": f.attempts, "failed_at": iso(f.failed_at), "retry_after": max(0, round(f.retry_at - now)),
                 "log": info.paths.clone_log(name)} for name, f in info.failures.items()]
    scratch = [{"name": s.name, "pid": s.pid, "commit": s.commit, "owner_alive": s.owner_alive or s.lock_held}
               for s in info.scratch]
    return {"key": info.key, "repo": info.url, "scope": info.scope, "checkouts": checkouts,
            "clones": clones, "failures": failures, "scratch": scratch, "spares": spare_status(info),
            "stuck_in_trash": stuck_in_trash(info),
            "lfs": lfs_status(info, config, checkouts), "seed": seed_status(info), "filter": filter_status(info),
            "history": history_status(info, now), "problems": info.problems}


def history_status(info: RepoInfo, now: float) -> dict | None:
    """The mirror's history (clone/history.py): shallow or complete, and the background fetch
    of it: running (its pid and progress), failed (why, and when it is retried), or done (when)."""
    from checkoutcache.git.shallow import read_shallow
    from checkoutcache.store import locks

    paths = info.paths
    if not os.path.isdir(paths.mirror):
        return None
    boundary = read_shallow(paths.mirror)
    reader = records.Reader(paths.root)
    record = reader.read(paths.history_record, records.HISTORY) or {}
    failure_record = reader.read(paths.history_failure, records.FAILURE)
    failure = records.Failure.from_record(failure_record)
    try:
        running = locks.history_running(paths)
    except PermissionError:  # a reader: the lock is the writers' (store/modes.py); its record says
        running = "pid" in record and record.get("completed_at") is None
    status = {"state": "shallow" if boundary else "complete", "boundary_commits": len(boundary),
              "running": running, "log": paths.clone_log("history")}
    if running:
        status.update(pid=record.get("pid"), started_at=iso(record.get("started_at")),
                      progress=record.get("progress") or {})
    elif record.get("completed_at") is not None:
        status.update(completed_at=iso(record.get("completed_at")), seconds=record.get("seconds"))
    if failure is not None:
        status["failure"] = {"error": failure.code, "message": failure.message, "attempts": failure.attempts,
                             "failed_at": iso(failure.failed_at), "retry_after": max(0, round(failure.retry_at - now))}
        if isinstance(failure_record.get("boundary"), list):
            # It completed every other commit: it holds for the commits behind these alone.
            status["failure"]["boundary_commits"] = len(failure_record["boundary"])
    return status


def spare_status(info: RepoInfo) -> list[dict]:
    """The repository's spares (store/spares.py): evicted trees kept to be updated in place;
    never served, but their bytes count against max-bytes and min-free."""
    try:
        spares = list_spares(info.paths)
    except OSError:
        return []
    return [{"commit": s.sha, "name": s.name, "entry": s.entry, "size": s.bytes,
             "spared_at": iso(s.spared_at) if s.record else None, **({"sparse": s.record["sparse"]}
                                                                   if s.record.get("sparse") else {})}
            for s in spares]


def filter_status(info: RepoInfo) -> dict | None:
    """Whether the mirror is a partial clone, when CHECKOUTCACHE_FILTER asked for one
    (state/mirror-filter.json): the filter, and why it is a full one instead."""
    record = records.Reader(info.paths.root).read(info.paths.filter_record, records.MIRROR_FILTER)
    if record is None:
        return None
    return {"filter": record.get("filter"), "partial": bool(record.get("partial")), "note": record.get("note"),
            "at": iso(record.get("at"))}


def seed_status(info: RepoInfo) -> dict | None:
    """How the mirror began, when CHECKOUTCACHE_BUNDLE_URI was set (state/mirror-seed.json)."""
    record = records.Reader(info.paths.root).read(info.paths.seed_record, records.SEED)
    if record is None:
        return None
    upstream = record.get("upstream") if isinstance(record.get("upstream"), dict) else None
    return {"seeded": bool(record.get("seeded")), "bundles": list(record.get("bundles") or []),
            "store": record.get("store"), "why": record.get("why"), "reason": record.get("reason"),
            "at": iso(record.get("at")),
            "bundle_bytes": record.get("bundle_bytes"), "upstream_since": upstream}


def stuck_in_trash(info: RepoInfo) -> list[dict]:
    """What gc's last run could not delete (state/unremovable.json), as long as it is still there."""
    record = records.Reader(info.paths.root).read(info.paths.unremovable_record, records.UNREMOVABLE) or {}
    return [{"path": e.get("path"), "error": e.get("error"), "since": iso(e.get("since"))}
            for e in record.get("entries", [])
            if os.path.lexists(info.paths.trash_entry(os.path.basename(str(e.get("entry", "")))))]


def build_status(root_paths: RootPaths, config: Config, repo_key: str | None = None) -> dict:
    now = time.time()
    config, limits_from = in_force(root_paths, config)
    repos = [repo_status(info, config, now) for info in inventory(root_paths)
             if repo_key is None or info.key == repo_key]
    count = sum(1 for r in repos for c in r["checkouts"] if c["ready"])
    size = sum(c["size"] for r in repos for c in r["checkouts"])
    spares = [s for r in repos for s in r["spares"]]
    totals = {"checkouts": count, "bytes": size, "spares": len(spares), "spare_bytes": sum(s["size"] for s in spares),
              "max_spares": config.max_spares, "max_checkouts": config.max_checkouts,
              "max_bytes": config.max_bytes, "grace_seconds": config.grace,
              "min_free": str(config.min_free) if config.min_free else None,
              "free_headroom": str(config.free_headroom), "max_age_seconds": config.max_age,
              "clone_timeout_seconds": config.clone_timeout, "limits_from": limits_from}
    try:
        disk = disk_of(root_paths.root)
        totals["disk"] = attrs.asdict(disk)
    except FileNotFoundError:
        totals["disk"] = None
    workspaces = workspace_status(root_paths, config)
    totals["workspaces"] = sum(1 for w in workspaces["workspaces"] if w["alive"])
    return {"root": root_paths.root, "repos": repos, "unreachable": unreachable(root_paths, now),
            "totals": totals, "workspaces": workspaces}


def workspace_status(root_paths: RootPaths, config: Config) -> dict:
    """The workspaces directory as this process sees it (CHECKOUTCACHE_WORKSPACES), live and
    dead ones, without sizes (status never walks a tree; gc's report has their bytes)."""
    from checkoutcache.workspaces import list_workspaces, workspaces_dir_of

    paths = workspaces_dir_of(root_paths.root, config)
    try:
        return {"dir": paths.base, "workspaces": list_workspaces(paths)}
    except OSError as exc:  # a directory this process may not read: said, never the report's end
        return {"dir": paths.base, "workspaces": [], "error": exc.strerror or type(exc).__name__}


def unreachable(root_paths: RootPaths, now: float) -> list[dict]:
    """Repositories never reached (their first contact failed), from unreachable/<key>.failed.json."""
    found = []
    for key, path in root_paths.unreachable_records():
        try:
            meta = records.read_json(path, records.FAILURE) or {}
        except OSError:
            continue  # a peer's record we may not read: that repository is simply not listed
        failure = records.Failure.from_record(meta)
        if failure is None:
            continue
        found.append({"key": key, "repo": meta.get("repo"), "scope": meta.get("scope"),
                      "error": failure.code, "message": failure.message, "attempts": failure.attempts,
                      "failed_at": iso(failure.failed_at), "retry_after": max(0, round(failure.retry_at - now))})
    return found
