"""How answers reach a person or a program: one JSON object on stdout (with
--json, or whenever stdout is not a terminal), short text otherwise, and a
progress bar on stderr while a person waits on a clone."""

from __future__ import annotations

import json
import sys

from checkoutcache.answers import Answer, State
from checkoutcache.units import format_bytes, format_duration


def wants_json(flag: bool) -> bool:
    return flag or not sys.stdout.isatty()


def emit_json(value: dict) -> None:
    sys.stdout.write(json.dumps(value, sort_keys=True) + "\n")
    sys.stdout.flush()


def describe_progress(progress: dict | None) -> str:
    progress = progress or {}
    phase = progress.get("phase", "starting")
    if progress.get("total_files") and phase == "checking out":
        return f"{phase} {progress.get('files', 0)}/{progress['total_files']} files"
    if progress.get("total_objects"):
        text = f"{phase} {progress.get('objects', 0)}/{progress['total_objects']} objects"
        if progress.get("bytes"):
            text += f", {progress['bytes'] / 1048576:.1f} MiB"
        return text
    return phase


def fraction(progress: dict | None) -> float:
    progress = progress or {}
    if progress.get("phase") == "checking out" and progress.get("total_files"):
        return 0.5 + 0.5 * progress.get("files", 0) / progress["total_files"]
    if progress.get("total_objects"):
        return 0.5 * progress.get("objects", 0) / progress["total_objects"]
    return 0.0


def answer_text(answer: Answer) -> str:
    if answer.state == State.READY:
        if answer.lfs in ("pointers", "off"):
            return f"ready {answer.path}\n(LFS files are pointer files: lfs={answer.lfs}; see `checkoutcache status`)"
        return f"ready {answer.path}"
    if answer.state == State.CLONING:
        return (f"cloning {answer.commit} (pid {answer.pid}, since {answer.started_at}): "
                f"{describe_progress(answer.progress)}")
    lines = [f"failed: {answer.error}: {answer.message}", f"next: {answer.next}"]
    if answer.retry_after:
        lines.append(f"retry after: {answer.retry_after}s")
    return "\n".join(lines)


def emit_answer(answer: Answer, as_json: bool, stream=None) -> None:
    if as_json:
        (stream or sys.stdout).write(json.dumps(answer.to_json(), sort_keys=True) + "\n")
    else:
        stream = stream or (sys.stdout if answer.state != "failed" else sys.stderr)
        stream.write(answer_text(answer) + "\n")


def gc_text(report: dict) -> str:
    if report["skipped"]:
        return f"gc skipped: {report['skipped']}"
    lines = []
    verb = "would remove" if report["dry_run"] else "removed"
    for r in report["removed"]:
        why = f"{r['reason']}" + (f" ({r['limit']})" if r.get("limit") else "")
        lines.append(f"{verb} {r['name'][:40]:<40} {format_bytes(r['bytes']):>8}  {why}")
    for k in report["kept_over_limit"]:
        lines.append(f"kept    {k['commit'][:40]:<40} over {k['limit']}: {k['why']}")
    for u in report.get("unremovable", []):
        lines.append(f"cannot delete {u['path']!r}: {u['error']} (retried by the next gc)")
    for u in report["unmet"]:
        lines.append(f"limit {u['limit']} not met: {u['actual']} against {u['target']} (protected checkouts)")
    freed = format_bytes(report["bytes_freed"])
    after = report["disk_after"] or report["disk_before"]
    free = f"; disk free {format_bytes(after['free'])}" if after else ""
    lines.append(f"{verb} {len(report['removed'])} item(s), {freed}{free}")
    return "\n".join(lines)


class ProgressBar:
    """A one-line bar on stderr, redrawn in place; only used when stderr is a terminal."""

    WIDTH = 30

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.drawn = False

    def __call__(self, answer: Answer) -> None:
        done = int(self.WIDTH * fraction(answer.progress))
        bar = "#" * done + "-" * (self.WIDTH - done)
        self.stream.write(f"\r[{bar}] {describe_progress(answer.progress)[:60]:<60}")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r" + " " * (self.WIDTH + 64) + "\r")
            self.stream.flush()


def verify_text(report: dict) -> str:
    lines = []
    for c in report["checkouts"]:
        verdict = "ok" if c["ok"] else "BROKEN: " + "; ".join(c["problems"])
        if c.get("removed"):
            verdict += " (moved to trash)"
        lines.append(f"{c['commit'][:12]}  {verdict}")
    lines.append(f"{len(report['checkouts'])} checkout(s), {report['broken']} broken")
    return "\n".join(lines)


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
        lfs = repo.get("lfs") or {}
        if lfs.get("objects") or lfs.get("why") and any((lfs.get("checkouts") or {}).values()):
            lines.append(f"  lfs {lfs.get('setting')}: {lfs.get('objects')} object(s), "
                         f"{format_bytes(lfs.get('bytes') or 0)} in {lfs.get('store')}"
                         + (f"; {lfs['why']}" if lfs.get("why") else ""))
        seed = repo.get("seed")
        if seed and seed["seeded"]:
            upstream = seed.get("upstream_since") or {}
            lines.append(f"  mirror seeded from {len(seed['bundles'])} bundle(s) at {seed['store']} (newest "
                         f"{seed['bundles'][-1]}); since then from upstream: {upstream.get('objects', 0)} objects, "
                         f"{format_bytes(upstream.get('bytes', 0))}" + (f"; {seed['why']}" if seed.get("why") else ""))
        elif seed:
            lines.append(f"  mirror not seeded: {seed['why']}")
        for t in repo.get("stuck_in_trash", []):
            lines.append(f"  cannot delete {t['path']!r}: {t['error']} (since {t['since']}; gc retries)")
    for u in status.get("unreachable", []):
        lines.append(f"\nunreachable {u['repo']} (scope {u['scope']}): {u['error']} (attempt {u['attempts']}, "
                     f"retry in {u['retry_after']}s): {u['message']}")
    t = status["totals"]
    limit = t["max_checkouts"] if t["max_checkouts"] is not None else "-"
    disk = t["disk"]
    free = f", disk free {format_bytes(disk['free'])} of {format_bytes(disk['total'])}" if disk else ""
    lines.append(f"\ntotal {t['checkouts']} checkouts (limit {limit}), {format_bytes(t['bytes'])} "
                 f"(limit {format_bytes(t['max_bytes'])}){free}; * = inside the "
                 f"{format_duration(t['grace_seconds'])} grace window")
    return "\n".join(lines)


def bundle_text(result: dict) -> str:
    if not result["published"]:
        return f"no repository with a mirror in this root: nothing published to {result['store']}"
    lines = []
    for r in result["published"]:
        if r["action"] == "failed":
            lines.append(f"{r['repo']}: failed {r['error']}: {r['message']} ({r['next']})")
        elif r["action"] == "up to date":
            lines.append(f"{r['repo']}: up to date ({len(r['list'])} bundle(s) listed)")
        else:
            lines.append(f"{r['repo']}: {r['action']} bundle {r['bundle']} ({format_bytes(r['bytes'])}, "
                         f"{r['refs']} refs; {r['why']}); {len(r['list'])} listed, {len(r['pruned'])} pruned")
    return "\n".join(lines)
