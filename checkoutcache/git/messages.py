"""What git's output says, read from its lines (under LC_ALL=C): a progress line's counts,
the line that explains a failure, a server ignoring a filter. Shared by the git CLI backend
(git/cli.py), its shallow half (git/shallow.py) and bundles."""

from __future__ import annotations

import re

_PROGRESS = re.compile(r"^(?:remote: )?(?P<phase>[A-Za-z ]+):\s+(?P<pct>[0-9]{1,3})% "
                       r"\((?P<done>[0-9]{1,12})/(?P<total>[0-9]{1,12})\)"
                       r"(?:, (?P<size>[0-9]{1,12}(?:\.[0-9]{1,6})?) (?P<unit>[KMG]i?B|bytes))?")
_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
SENT = re.compile(r"^remote: Total ([0-9]{1,12}) \(delta [0-9]+\)")
_UPDATING = re.compile(r"^Updating files:\s+([0-9]{1,3})% \(([0-9]{1,12})/([0-9]{1,12})\)")
# What a git run's output may cost in memory: its last lines, each cut at a length.
KEPT_LINES = 200
KEPT_ERRORS = 20
MAX_LINE = 8192


# fatal lines that only say that something else failed: the line before says what.
_WRAPPERS = re.compile(r"index-pack failed|fsck error in packed object|fetch-pack: invalid index-pack output|"
                       r"the remote end hung up unexpectedly", re.I)


# git's line after a transport (ssh, a remote helper) failed: the cause is the line the
# transport printed before it ("Host key verification failed.", "Permission denied ...").
_TRANSPORT_WRAPPER = re.compile(r"could not read from remote repository", re.I)


# What git says when the server ignores --filter (it then sends every object).
FILTER_REFUSED = "filtering not recognized by server"


def last_meaningful_line(text: str) -> str:
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]
    lines = [ln for ln in lines if not _PROGRESS.match(ln) and not ln.startswith("From ")]
    errors = [ln for ln in lines if ln.lower().startswith(("fatal:", "error:"))]
    telling = [ln for ln in errors if not _WRAPPERS.search(ln)]
    chosen = (telling or errors or lines or ["(git printed nothing)"])[-1]
    if chosen.endswith(":") and chosen in lines:
        # git's sentence goes on on the next line ("unable to connect to HOST:" then
        # "HOST[0: ADDR]: errno=Connection refused"): the cause is there.
        after = lines[lines.index(chosen) + 1:lines.index(chosen) + 2]
        if after and not after[0].lower().startswith(("fatal:", "error:")):
            chosen = f"{chosen} {after[0]}"
    if _TRANSPORT_WRAPPER.search(chosen):
        causes = [ln for ln in lines[:lines.index(chosen)] if not ln.lower().startswith(("fatal:", "error:"))]
        if causes:
            chosen = f"{causes[-1]} ({chosen})"
    return chosen[:300]


def parse_progress(line: str) -> dict | None:
    total = SENT.match(line.strip())
    if total:  # the upstream's own count of what its pack holds (a small pack's only mention)
        return {"phase": "receiving objects", "total_objects": int(total.group(1))}
    updating = _UPDATING.match(line.strip())
    if updating:
        return {"phase": "checking out", "files": int(updating.group(2)), "total_files": int(updating.group(3))}
    match = _PROGRESS.match(line.strip())
    if not match:
        return None
    phase = match.group("phase").strip().lower()
    update = {"phase": phase}
    if phase.endswith("receiving objects"):
        update.update(objects=int(match.group("done")), total_objects=int(match.group("total")))
        if match.group("size"):
            update["bytes"] = int(float(match.group("size")) * _UNITS[match.group("unit")])
    elif phase.endswith("resolving deltas"):
        update.update(deltas=int(match.group("done")), total_deltas=int(match.group("total")))
    else:  # the server counting and compressing, ...: how far along, for the progress bar
        update.update(done=int(match.group("done")), total=int(match.group("total")))
    return update
