"""The limits in force: what the writer that enforces them (serve, gc) records in
the root (`<root>/limits.json`, layout.py), so that `status` anywhere, a
read-only review container included, shows the writer's limits rather than
its own environment's (which has none).

serve records its limits when it starts and gc at each run (not a dry run),
under its gc lock; the last writer wins (in the shipped topology they are the
same sidecar). status only reads: a reader that cannot write the root never
tries. A record is a peer's file: read through its schema, each value checked
again here, and what does not fit is left out (the caller's own then stands).
"""

from __future__ import annotations

import math
import os
import time

import attrs

from checkoutcache.config import Config
from checkoutcache.store import records
from checkoutcache.store.layout import RootPaths
from checkoutcache.units import iso, parse_free

# Each recorded limit: (its Config field, the record's field, a check of the recorded value).
COUNTS = ("max_checkouts", "max_bytes")
SECONDS = ("grace", "max_age", "clone_timeout")
FREE = ("min_free", "free_headroom")


def limits_of(config: Config) -> dict:
    """What the record holds of a Config: counts and seconds as numbers, free targets as
    their text (`10%`, `5G`); None where a limit is off."""
    found: dict = {}
    for name in COUNTS + SECONDS:
        found[name] = getattr(config, name)
    for name in FREE:
        value = getattr(config, name)
        found[name] = None if value is None else str(value)
    return found


def record_limits(root_paths: RootPaths, config: Config, writer: str, version: str | None = None) -> None:
    """Write the limits `writer` (serve or gc) enforces; OSError to the caller."""
    value = {"limits": limits_of(config), "writer": writer, "pid": os.getpid(), "at": time.time()}
    if version:
        value["version"] = version
    records.write_json(root_paths.limits_record, value)


def read_limits(root_paths: RootPaths) -> dict | None:
    """The record, its limits checked one by one; None when absent, unreadable or malformed."""
    try:
        record = records.read_json(root_paths.limits_record, records.LIMITS)
    except OSError:
        return None  # one we may not read costs the record, never status
    if record is None:
        return None
    limits = {}
    for name, value in record["limits"].items():
        if value is None and name in COUNTS + SECONDS + FREE:
            limits[name] = None
        elif name in COUNTS and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            limits[name] = value
        elif name in SECONDS and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value) and value >= 0:
            limits[name] = float(value)
        elif name in FREE and isinstance(value, str) and len(value) <= 40:
            try:
                parse_free(value)
            except Exception:
                continue
            limits[name] = value
    return {**record, "limits": limits}


def in_force(root_paths: RootPaths, config: Config) -> tuple[Config, dict]:
    """(the limits status shows and judges protection by, where they came from): the
    writer's recorded ones over the caller's own, field by field."""
    record = read_limits(root_paths)
    if record is None:
        return config, {"from": "this command's settings"}
    changes = {}
    for name, value in record["limits"].items():
        changes[name] = parse_free(value) if name in FREE and value is not None else value
    if changes.get("free_headroom") is None:
        changes.pop("free_headroom", None)  # never off: the caller's own stands
    for name in ("grace", "clone_timeout"):
        if changes.get(name) is None:
            changes.pop(name, None)
    source = {"from": record["writer"], "pid": record.get("pid"), "at": iso(record["at"])}
    if record.get("version"):
        source["version"] = record["version"]
    return attrs.evolve(config, **changes), source
