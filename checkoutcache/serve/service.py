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
import math
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
from checkoutcache.repospec import DEFAULT_SCOPE, parse_repo
from checkoutcache.serve.metrics import SEED_OUTCOMES, SEED_REASONS, Metrics
from checkoutcache.serve.policy import ANONYMOUS, ApiPolicy, Grant, tightened
from checkoutcache.store import locks, records
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
MAX_RECENT_USES = 100_000


@attrs.define
class HeldCheckout:
    hold: Hold
    expires_at: float
    owner: str  # the grant's name: a caller sees and releases only its own holds


@attrs.frozen
class Bounds:
    """What one serve process allows callers, whatever they ask."""

    max_wait: float = 600.0
    max_holds: int = 128
    max_holds_per_token: int = 32


class Service:
    """Everything the HTTP layer calls; one per serve process."""

    def __init__(self, cache: Cache, config: Config, gc_interval: float, journal: str,
                 policy: ApiPolicy | None = None, bounds: Bounds | None = None):
        self.cache = cache
        self.config = config
        self.policy = policy or ApiPolicy()
        self.bounds = bounds or Bounds()
        self.gc_interval = gc_interval
        self.journal = journal
        self.metrics = Metrics(cache.paths)
        self.holds: dict[str, HeldCheckout] = {}
        # (repository key, commit) -> time.monotonic() of this process's last ready
        # answer for it: a forward jump of the wall clock cannot make our own gc evict
        # what we served within the grace window (the markers' mtimes are wall-clock).
        self.recent_uses: dict[tuple[str, str], float] = {}
        self.recent_lock = threading.Lock()
        self.holds_lock = threading.Lock()
        self.stopping = threading.Event()
        for name in ("max_checkouts", "max_bytes"):
            value = getattr(config, name)
            if value is not None:
                self.metrics.limit.labels(name).set(value)

    # ---------------------------------------------------------------- API
    def request(self, params: dict, grant: Grant) -> tuple[str, str, float, str]:
        """(repo, commit, wait, scope) of an ensure or hold, checked against the policy."""
        repo, commit = params.get("repo", ""), params.get("commit", "")
        scope = params.get("scope", DEFAULT_SCOPE)
        if not all(isinstance(v, str) for v in (repo, commit, scope)):
            raise CheckoutCacheError("BAD_ARGUMENT", what="repo, commit and scope must be strings")
        wait = min(parse_duration(params.get("wait", 0), "wait"), self.bounds.max_wait)
        self.policy.check_scope(grant, scope)
        self.policy.check_repo_argument(repo)
        self.policy.check_repo(parse_repo(repo, scope, cwd="/"))
        return repo, commit, wait, scope

    def ensure(self, params: dict, grant: Grant = ANONYMOUS) -> Answer:
        repo, commit, wait, scope = self.request(params, grant)
        answer = self.cache.ensure(repo, commit, wait=wait, scope=scope)
        self.metrics.answers.labels(answer.state, answer.error or "").inc()
        self.note_use(answer)
        return answer

    def note_use(self, answer: Answer) -> None:
        if answer.state != State.READY or not answer.path:
            return
        key = os.path.basename(os.path.dirname(os.path.dirname(answer.path)))
        with self.recent_lock:
            if len(self.recent_uses) >= MAX_RECENT_USES:
                self.forget_old_uses(time.monotonic())
            self.recent_uses[(key, answer.commit)] = time.monotonic()

    def forget_old_uses(self, now: float) -> None:
        """Only uses within the grace window matter; the map stays bounded."""
        old = [k for k, t in self.recent_uses.items() if now - t > self.config.grace]
        for k in old:
            del self.recent_uses[k]
        if len(self.recent_uses) >= MAX_RECENT_USES:  # a flood of distinct commits: keep the newest half
            for k, _t in sorted(self.recent_uses.items(), key=lambda item: item[1])[:MAX_RECENT_USES // 2]:
                del self.recent_uses[k]

    def used_within_grace(self) -> frozenset[tuple[str, str]]:
        now = time.monotonic()
        with self.recent_lock:
            self.forget_old_uses(now)
            return frozenset(self.recent_uses)

    def hold(self, params: dict, grant: Grant = ANONYMOUS) -> tuple[int, dict]:
        ttl = parse_duration(params.get("ttl", DEFAULT_HOLD_TTL), "ttl")
        if not 0 < ttl <= MAX_HOLD_TTL:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"ttl must be 0 to {MAX_HOLD_TTL:g} seconds")
        repo, commit, wait, scope = self.request(params, grant)
        self.check_hold_room(grant)
        held = self.cache.hold(repo, commit, wait=wait, scope=scope)
        self.note_use(held.answer)
        if not held.held:
            return http_status(held.answer), held.answer.to_json()
        hold_id = uuid.uuid4().hex
        with self.holds_lock:
            try:
                self.check_hold_room(grant)  # others may have held meanwhile (we waited unlocked)
            except CheckoutCacheError:
                held.release()
                raise
            self.holds[hold_id] = HeldCheckout(held, time.monotonic() + ttl, grant.name)
            self.metrics.holds.set(len(self.holds))
        return 200, {"hold": hold_id, "expires_in": ttl, **held.answer.to_json()}

    def check_hold_room(self, grant: Grant) -> None:
        """Each hold keeps a descriptor open: bounded in total and per caller."""
        held = len(self.holds)
        mine = sum(1 for h in self.holds.values() if h.owner == grant.name)
        if held >= self.bounds.max_holds:
            raise CheckoutCacheError("TOO_MANY_HOLDS", held=held, limit=self.bounds.max_holds, whose="in all")
        if mine >= self.bounds.max_holds_per_token:
            raise CheckoutCacheError("TOO_MANY_HOLDS", held=mine, limit=self.bounds.max_holds_per_token,
                                     whose="per token")

    def release(self, params: dict, grant: Grant = ANONYMOUS) -> tuple[int, dict]:
        hold_id = params.get("hold")
        with self.holds_lock:
            held = self.holds.get(hold_id) if isinstance(hold_id, str) else None
            if held is None or held.owner != grant.name:
                raise CheckoutCacheError("UNKNOWN_HOLD")
            del self.holds[hold_id]
            self.metrics.holds.set(len(self.holds))
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

    def gc(self, params: dict, from_api: bool = True, grant: Grant = ANONYMOUS) -> dict:
        if from_api and grant.scopes is not None:
            # gc spans every scope's repositories: a token limited to some may not run it.
            raise CheckoutCacheError("FORBIDDEN_SCOPE", scope=",".join(sorted(grant.scopes))[:64] + " (gc runs on all)")
        config = self.config
        if from_api:  # a caller may only tighten the operator's limits
            config = tightened(self.config, self.config.with_overrides(**{k: params.get(k) for k in GC_SETTINGS}))
        started = time.monotonic()
        try:
            dry_run = params.get("dry_run", False)
            if not isinstance(dry_run, bool):
                raise CheckoutCacheError("BAD_ARGUMENT", what="dry_run must be true or false")
            report = run_gc(self.cache.paths, config, dry_run=dry_run, used_within_grace=self.used_within_grace())
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

    def status(self, grant: Grant = ANONYMOUS) -> dict:
        report = build_status(self.cache.paths, self.config)
        if grant.scopes is not None:  # a caller sees only the repositories of its scopes
            report["repos"] = [r for r in report["repos"] if r["scope"] in grant.scopes]
            report["unreachable"] = [r for r in report.get("unreachable", []) if r.get("scope") in grant.scopes]
            visible = [c for r in report["repos"] for c in r["checkouts"] if c["ready"]]
            report["totals"].update(checkouts=len(visible), bytes=sum(c["size"] for c in visible))
        return report

    def health(self) -> tuple[bool, dict]:
        checks = {"root_writable": False, "locks_work": False}
        # One probe file per call, locked, written and removed: concurrent probes
        # never share a name or a lock, so one never fails another.
        probe = self.cache.paths.health_probe(f"{os.getpid()}-{next(_PROBES)}")
        try:
            init_root(self.cache.paths)
            held = locks.try_lock(probe)  # created (the root is writable), then locked
            checks["root_writable"] = True
            if held is not None:
                with held:
                    checks["locks_work"] = True
        except (OSError, CheckoutCacheError) as exc:
            checks["root_error"] = getattr(exc, "message", str(exc))
        finally:
            records.remove_quietly(probe)
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
                # Never through a planted symlink; rotated in place (workers append with
                # O_APPEND, so they go on at the new end).
                fd = os.open(self.journal, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as handle:
                if offset > JOURNAL_ROTATE_BYTES:
                    os.ftruncate(fd, 0)
                    offset = 0
                handle.seek(offset)
                for line in handle:
                    offset += len(line)
                    self.count_journal_event(line)

    def count_journal_event(self, line: bytes) -> None:
        try:
            event = json.loads(line)
            kind = event["event"]
        except (ValueError, KeyError, TypeError):
            return
        if kind == "published":
            self.metrics.clones.labels("published", "").inc()
            seconds = event.get("seconds")
            if isinstance(seconds, (int, float)) and math.isfinite(seconds):
                self.metrics.clone_seconds.observe(seconds)
        elif kind == "failed":
            error = event.get("error")
            self.metrics.clones.labels("failed", error if error in CODES else "other").inc()
        elif kind == "started":
            self.metrics.clones.labels("started", "").inc()
        elif kind == "seeded":
            outcome, reason = event.get("outcome"), event.get("reason") or ""
            self.metrics.seeds.labels(outcome if outcome in SEED_OUTCOMES else "other",
                                      reason if reason in SEED_REASONS else "other").inc()

    def maintain(self) -> None:
        next_gc = time.monotonic() + self.gc_interval
        while not self.stopping.wait(1.0):
            self.expire_holds()
            if self.gc_interval > 0 and time.monotonic() >= next_gc:
                next_gc = time.monotonic() + self.gc_interval
                try:
                    self.gc({}, from_api=False)
                except Exception:  # a failed scheduled gc is counted and retried next interval
                    log.exception("scheduled gc failed")


def http_status(answer: Answer) -> int:
    if answer.state in HTTP_STATUS:
        return HTTP_STATUS[answer.state]
    return CODES[answer.error].http_status if answer.error in CODES else 503
