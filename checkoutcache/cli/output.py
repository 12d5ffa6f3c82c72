"""How answers reach a person or a program: one JSON object on stdout (with
--json, or whenever stdout is not a terminal), short text otherwise, and a
progress bar on stderr while a person waits on a clone."""

from __future__ import annotations

import json
import os
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
    done, total, unit = _counts(progress)
    if not total:
        return phase
    text = f"{phase} {done}/{total}{unit}"
    if "receiving" in phase and progress.get("bytes"):
        text += f", {progress['bytes'] / 1048576:.1f} MiB"
    return text


# Where each phase of a clone sits on the bar: (start, end) of its band.
_BANDS = (("counting", 0.0, 0.05), ("compressing", 0.05, 0.15), ("receiving", 0.15, 0.65),
          ("resolving", 0.65, 0.75), ("fetching blobs", 0.15, 0.65), ("checking out", 0.75, 1.0))


def fraction(progress: dict | None) -> float:
    """How far along the bar a clone is: each phase of git's fills its own band."""
    progress = progress or {}
    phase = str(progress.get("phase", ""))
    done, total, _unit = _counts(progress)
    for name, start, end in _BANDS:
        if name in phase:
            return start + (end - start) * (min(done, total) / total if total else 0.0)
    return 0.0


def _counts(progress: dict) -> tuple[int, int, str]:
    """(done, total, unit) of the clone's current phase (a record keeps the counts of phases
    gone by: only the phase's own are read)."""
    phase = str(progress.get("phase", ""))
    if phase == "checking out":
        keys = ("files", "total_files", " files")
    elif "receiving" in phase or phase == "fetching blobs":
        keys = ("objects", "total_objects", " objects")
    elif "resolving" in phase:
        keys = ("deltas", "total_deltas", "")
    else:
        keys = ("done", "total", "")
    total = progress.get(keys[1])
    return (int(progress.get(keys[0]) or 0), int(total), keys[2]) if total else (0, 0, "")


def answer_text(answer: Answer) -> str:
    if answer.state == State.READY:
        lines = [f"ready {answer.path}"]
        if answer.merge_base:
            lines.append(f"merge base {answer.merge_base} (with {answer.base})")
        if answer.lfs in ("pointers", "off"):
            lines.append(f"(LFS files are pointer files: lfs={answer.lfs}; see `checkoutcache status`)")
        return "\n".join(lines)
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
    for w in (report.get("workspaces") or {}).get("partial", []):
        lines.append(f"workspace {w['workspace']} measured in part ({', '.join(w['why'])}): "
                     f"at least {format_bytes(w['bytes'])} counted")
    freed = format_bytes(report["bytes_freed"])
    after = report["disk_after"] or report["disk_before"]
    free = f"; disk free {format_bytes(after['free'])}" if after else ""
    lines.append(f"{verb} {len(report['removed'])} item(s), {freed}{free}")
    return "\n".join(lines)


class ProgressBar:
    """A one-line bar on stderr, redrawn in place; only used when stderr is a terminal.
    It fits the terminal's width as it is at each redraw (a pane resized meanwhile), so it
    never wraps: a wrapped line cannot be redrawn and scrolls instead."""

    MAX_BAR = 30

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.drawn = 0

    def columns(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            return 80

    def __call__(self, answer: Answer) -> None:
        columns = self.columns() - 1  # the last column would wrap on some terminals
        width = max(0, min(self.MAX_BAR, columns // 3))
        done = int(width * fraction(answer.progress))
        bar = f"[{'#' * done}{'-' * (width - done)}] " if width >= 5 else ""
        text = (bar + describe_progress(answer.progress))[:max(0, columns)]
        self.stream.write("\r" + text.ljust(self.drawn) + "\r" + text)
        self.stream.flush()
        self.drawn = len(text)

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r" + " " * self.drawn + "\r")
            self.stream.flush()
            self.drawn = 0


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
        history = repo.get("history")
        if history and history["state"] == "shallow":
            doing = (f"being fetched (pid {history.get('pid')}): {describe_progress(history.get('progress'))}"
                     if history["running"] else "not being fetched (gc starts it)")
            lines.append(f"  history shallow ({history['boundary_commits']} boundary commit(s)), {doing}")
            if history.get("failure"):
                f = history["failure"]
                lines.append(f"  history failed {f['error']} (attempt {f['attempts']}, retry in {f['retry_after']}s): "
                             f"{f['message']}")
        for t in repo.get("stuck_in_trash", []):
            lines.append(f"  cannot delete {t['path']!r}: {t['error']} (since {t['since']}; gc retries)")
        if repo.get("refused"):  # a symlink where a store directory should be: gc leaves it alone
            lines.append(f"  REFUSED: {repo['refused']}")
    spaces = status.get("workspaces") or {}
    if spaces.get("workspaces"):
        lines.append(f"\nworkspaces in {spaces['dir']}")
        for w in spaces["workspaces"]:
            lines.append(f"  {(w['commit'] or '?')[:12]:<12}  {'live' if w['alive'] else 'dead':<4}  pid {w['pid']}  "
                         f"{w['path']}")
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
    source = t.get("limits_from") or {}
    if source.get("from") in ("serve", "gc"):
        lines.append(f"limits as enforced by {source['from']} (pid {source.get('pid')}, recorded {source.get('at')})")
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


def evict_text(report: dict) -> str:
    lines = [f"removed {r['name'][:52]:<52} {format_bytes(r['bytes']):>8}" for r in report["removed"]]
    lines += [f"kept    {k['name'][:52]:<52} {k['why']}" for k in report["kept"]]
    if report.get("note"):
        lines.append(report["note"])
    if report.get("error"):
        lines.append(f"{report['message']}\nnext: {report['next']}")
    lines.append(f"freed {format_bytes(report['bytes_freed'])}"
                 + ("; the whole repository is gone" if report["repository_removed"] else ""))
    return "\n".join(lines)
