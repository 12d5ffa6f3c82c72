"""status: what the store holds, per repository, against the limits.

Read-only: built from the same inventory gc plans from.
"""

from __future__ import annotations

import time

import attrs

from .config import Config
from .eviction import Entry, protection
from .gc import disk_of
from .inventory import RepoInfo, inventory
from .layout import RootPaths
from .output import describe_progress
from .units import format_bytes, format_duration, iso


def repo_status(info: RepoInfo, config: Config, now: float) -> dict:
    checkouts = []
    for c in info.checkouts:
        entry = Entry(repo=info.key, sha=c.sha, last_used=c.last_used or 0.0, size=c.size, held=c.held)
        checkouts.append({
            "commit": c.sha, "path": c.path, "ready": c.ready, "intact": c.intact, "size": c.size,
            "last_used": iso(c.last_used), "idle_seconds": None if c.last_used is None else round(now - c.last_used),
            "held": c.held, "protected": protection(entry, config.grace, now) if c.ready else None,
        })
    clones = [{"commit": c.sha, "pid": c.pid, "alive": c.alive, "started_at": iso(c.started_at),
               "progress": c.progress} for c in info.clones]
    failures = [{"commit": sha, "error": f.code, "message": f.message, "attempts": f.attempts,
                 "failed_at": iso(f.failed_at), "retry_after": max(0, round(f.retry_at - now)),
                 "log": info.paths.clone_log(sha)} for sha, f in info.failures.items()]
    scratch = [{"name": s.name, "pid": s.pid, "commit": s.commit, "owner_alive": s.owner_alive or s.lock_held}
               for s in info.scratch]
    return {"key": info.key, "repo": info.url, "scope": info.scope, "checkouts": checkouts,
            "clones": clones, "failures": failures, "scratch": scratch}


def build_status(root_paths: RootPaths, config: Config, repo_key: str | None = None) -> dict:
    now = time.time()
    repos = [repo_status(info, config, now) for info in inventory(root_paths)
             if repo_key is None or info.key == repo_key]
    count = sum(1 for r in repos for c in r["checkouts"] if c["ready"])
    size = sum(c["size"] for r in repos for c in r["checkouts"])
    totals = {"checkouts": count, "bytes": size, "max_checkouts": config.max_checkouts,
              "max_bytes": config.max_bytes, "grace_seconds": config.grace,
              "min_free": str(config.min_free) if config.min_free else None}
    try:
        disk = disk_of(root_paths.root)
        totals["disk"] = attrs.asdict(disk)
    except FileNotFoundError:
        totals["disk"] = None
    return {"root": root_paths.root, "repos": repos, "totals": totals}


def status_text(status: dict) -> str:
    lines = [f"root {status['root']}"]
    for repo in status["repos"]:
        lines.append(f"\n{repo['repo']}  (scope {repo['scope']}, key {repo['key']})")
        if repo["checkouts"]:
            lines.append(f"  {'COMMIT':<12}  {'SIZE':>8}  {'IDLE':>6}  {'STATE':<10}  PATH")
            for c in sorted(repo["checkouts"], key=lambda c: c["idle_seconds"] or 0):
                state = "held" if c["held"] else ("ready" if c["ready"] else "unmarked")
                if c["ready"] and not c["intact"]:
                    state = "DAMAGED"
                if c["ready"] and c["protected"] == "grace":
                    state += "*"
                lines.append(f"  {c['commit'][:12]:<12}  {format_bytes(c['size']):>8}  "
                             f"{format_duration(c['idle_seconds']):>6}  {state:<10}  {c['path']}")
        for c in repo["clones"]:
            alive = "running" if c["alive"] else "dead"
            lines.append(f"  clone {c['commit'][:12]} pid {c['pid']} {alive} since {c['started_at']}: "
                         f"{describe_progress(c['progress'])}")
        for f in repo["failures"]:
            lines.append(f"  failed {f['commit'][:12]} {f['error']} (attempt {f['attempts']}, retry in "
                         f"{f['retry_after']}s): {f['message']}")
        for s in repo["scratch"]:
            lines.append(f"  scratch {s['name']} ({'live' if s['owner_alive'] else 'dead'} owner)")
    t = status["totals"]
    limit = t["max_checkouts"] if t["max_checkouts"] is not None else "-"
    disk = t["disk"]
    free = f", disk free {format_bytes(disk['free'])} of {format_bytes(disk['total'])}" if disk else ""
    lines.append(f"\ntotal {t['checkouts']} checkouts (limit {limit}), {format_bytes(t['bytes'])} "
                 f"(limit {format_bytes(t['max_bytes'])}){free}; * = inside the "
                 f"{format_duration(t['grace_seconds'])} grace window")
    return "\n".join(lines)
