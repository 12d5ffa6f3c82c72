"""How answers reach a person or a program: one JSON object on stdout (with
--json, or whenever stdout is not a terminal), short text otherwise, and a
progress bar on stderr while a person waits on a clone."""

from __future__ import annotations

import json
import sys

from .answers import CLONING, READY, Answer


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
    if answer.state == READY:
        return f"ready {answer.path}"
    if answer.state == CLONING:
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
    from .units import format_bytes

    if report["skipped"]:
        return f"gc skipped: {report['skipped']}"
    lines = []
    verb = "would remove" if report["dry_run"] else "removed"
    for r in report["removed"]:
        why = f"{r['reason']}" + (f" ({r['limit']})" if r.get("limit") else "")
        lines.append(f"{verb} {r['name'][:40]:<40} {format_bytes(r['bytes']):>8}  {why}")
    for k in report["kept_over_limit"]:
        lines.append(f"kept    {k['commit'][:40]:<40} over {k['limit']}: {k['why']}")
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
