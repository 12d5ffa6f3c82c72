"""serve's service: everything the HTTP layer calls, one per serve process.

It owns no state the CLI cannot read: every answer comes from the same Cache,
coordinator and gc as the CLI, on the same root, side by side. Holds (for
callers that run commands themselves) are the marker's shared lock, held by
this process, with a lease: a hold not released within its TTL is dropped, so
a client that died cannot pin a checkout forever.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import threading
import time
import uuid

import attrs

from checkoutcache.answers import Answer, State
from checkoutcache.cache import Cache, Hold
from checkoutcache.config import Config
from checkoutcache.errors import CODES, CheckoutCacheError
from checkoutcache.serve.metrics import Metrics
from checkoutcache.store import locks
from checkoutcache.store.create import init_root
from checkoutcache.units import parse_duration
from checkoutcache.upkeep.gc import run_gc
from checkoutcache.upkeep.status import build_status

log = logging.getLogger("checkoutcache.serve")

MAX_HOLD_TTL = 24 * 3600.0
DEFAULT_HOLD_TTL = 3600.0
GC_SETTINGS = ("max_checkouts", "max_bytes", "min_free", "free_headroom", "max_age", "grace")
JOURNAL_ROTATE_BYTES = 1 << 20
_PROBES = itertools.count()
HTTP_STATUS = {State.READY: 200, State.CLONING: 202}


@attrs.define
class HeldCheckout:
    hold: Hold
    expires_at: float


class Service:
    """Everything the HTTP layer calls; one per serve process."""

    def __init__(self, cache: Cache, config: Config, gc_interval: float, journal: str):
        self.cache = cache
        self.config = config
        self.gc_interval = gc_interval
        self.journal = journal
        self.metrics = Metrics()
        self.holds: dict[str, HeldCheckout] = {}
        self.holds_lock = threading.Lock()
        self.stopping = threading.Event()
        for name in ("max_checkouts", "max_bytes"):
            value = getattr(config, name)
            if value is not None:
                self.metrics.limit.labels(name).set(value)

    # ---------------------------------------------------------------- API
    def ensure(self, params: dict) -> Answer:
        wait = parse_duration(params.get("wait", 0), "wait")
        answer = self.cache.ensure(str(params.get("repo", "")), str(params.get("commit", "")), wait=wait,
                                   scope=str(params.get("scope", "default")))
        self.metrics.answers.labels(answer.state, answer.error or "").inc()
        return answer

    def hold(self, params: dict) -> tuple[int, dict]:
        ttl = parse_duration(params.get("ttl", DEFAULT_HOLD_TTL), "ttl")
        if not 0 < ttl <= MAX_HOLD_TTL:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"ttl must be 0 to {MAX_HOLD_TTL:g} seconds")
        held = self.cache.hold(str(params.get("repo", "")), str(params.get("commit", "")),
                               wait=parse_duration(params.get("wait", 0), "wait"),
                               scope=str(params.get("scope", "default")))
        if not held.held:
            return http_status(held.answer), held.answer.to_json()
        hold_id = uuid.uuid4().hex
        with self.holds_lock:
            self.holds[hold_id] = HeldCheckout(held, time.monotonic() + ttl)
            self.metrics.holds.set(len(self.holds))
        return 200, {"hold": hold_id, "expires_in": ttl, **held.answer.to_json()}

    def release(self, params: dict) -> tuple[int, dict]:
        with self.holds_lock:
            held = self.holds.pop(str(params.get("hold", "")), None)
            self.metrics.holds.set(len(self.holds))
        if held is None:
            raise CheckoutCacheError("UNKNOWN_HOLD")
        held.hold.release()
        return 200, {"released": True}

    def expire_holds(self) -> None:
        now = time.monotonic()
        with self.holds_lock:
            expired = [k for k, v in self.holds.items() if v.expires_at <= now]
            for key in expired:
                self.holds.pop(key).hold.release()
            self.metrics.holds.set(len(self.holds))

    def release_all(self) -> None:
        with self.holds_lock:
            for held in self.holds.values():
                held.hold.release()
            self.holds.clear()

    def gc(self, params: dict) -> dict:
        config = self.config.with_overrides(**{k: params.get(k) for k in GC_SETTINGS})
        started = time.monotonic()
        try:
            report = run_gc(self.cache.paths, config, dry_run=bool(params.get("dry_run")))
        except Exception:
            self.metrics.gc_runs.labels("error").inc()
            raise
        self.metrics.gc_seconds.observe(time.monotonic() - started)
        self.metrics.gc_runs.labels("skipped" if report.skipped else "ok").inc()
        for removed in report.removed:
            self.metrics.evictions.labels(removed.reason).inc()
        if report.disk_after:
            self.metrics.disk_free.set(report.disk_after["free"])
        if report.checkouts_after is not None:
            self.metrics.checkouts.set(report.checkouts_after)
            self.metrics.bytes.set(report.bytes_after)
        return report.to_json()

    def status(self) -> dict:
        return build_status(self.cache.paths, self.config)

    def health(self) -> tuple[bool, dict]:
        checks = {}
        try:
            init_root(self.cache.paths)
            # One probe file per call: concurrent probes never race on one name.
            probe = self.cache.paths.health_probe(f"{os.getpid()}-{next(_PROBES)}")
            with open(probe, "w") as handle:
                handle.write("ok")
            os.unlink(probe)
            checks["root_writable"] = True
        except (OSError, CheckoutCacheError) as exc:
            checks["root_writable"] = False
            checks["root_error"] = getattr(exc, "message", str(exc))
        try:
            # Another probe may hold it this instant: that too proves locks work.
            held = locks.try_lock(self.cache.paths.health_lock)
            checks["locks_work"] = held is not None or locks.is_locked(self.cache.paths.health_lock)
            if held is not None:
                held.release()
        except (OSError, CheckoutCacheError):
            checks["locks_work"] = False
        checks["git"] = shutil.which("git") is not None
        try:
            import pygit2  # noqa: F401  (importable is the check)

            checks["pygit2"] = True
        except ImportError:
            checks["pygit2"] = False
        ok = checks["root_writable"] and checks["locks_work"] and (checks["git"] or checks["pygit2"])
        return ok, {"ok": ok, "checks": checks}

    # ---------------------------------------------------------------- background
    def follow_journal(self) -> None:
        """Count the clones this sidecar's workers report in their journal."""
        offset = 0
        while not self.stopping.wait(0.5):
            try:
                if offset > JOURNAL_ROTATE_BYTES:  # workers append with O_APPEND: they go on at the new end
                    os.truncate(self.journal, 0)
                    offset = 0
                with open(self.journal) as handle:
                    handle.seek(offset)
                    for line in handle:
                        offset += len(line.encode())
                        event = json.loads(line)
                        if event["event"] == "published":
                            self.metrics.clones.labels("published", "").inc()
                            self.metrics.clone_seconds.observe(event.get("seconds", 0))
                        elif event["event"] == "failed":
                            self.metrics.clones.labels("failed", event.get("error", "")).inc()
                        elif event["event"] == "started":
                            self.metrics.clones.labels("started", "").inc()
            except (OSError, ValueError, KeyError):
                continue

    def maintain(self) -> None:
        next_gc = time.monotonic() + self.gc_interval
        while not self.stopping.wait(1.0):
            self.expire_holds()
            if self.gc_interval > 0 and time.monotonic() >= next_gc:
                next_gc = time.monotonic() + self.gc_interval
                try:
                    self.gc({})
                except Exception:  # a failed scheduled gc is counted and retried next interval
                    log.exception("scheduled gc failed")


def http_status(answer: Answer) -> int:
    if answer.state in HTTP_STATUS:
        return HTTP_STATUS[answer.state]
    return CODES[answer.error].http_status if answer.error in CODES else 503
