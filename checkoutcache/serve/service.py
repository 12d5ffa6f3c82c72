"""serve's service: everything the HTTP layer calls, one per serve process.

It owns no state the CLI cannot read: every answer comes from the same Cache,
coordinator and gc as the CLI, on the same root, side by side. Holds (for
callers that run commands themselves) are the marker's shared lock, held by
this process, with a lease: a hold not released within its TTL is dropped, so
a client that died cannot pin a checkout forever. Holds and their quotas
belong to a token's identity (policy.Grant.name, a digest of the token).

Methods here block (locks, git, waits): the HTTP layer calls them from its
thread pools, except `ready_now`, the ready answer that never blocks, which it
calls on its event loop.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
import uuid
from typing import Callable

import attrs

from checkoutcache.answers import Answer, State
from checkoutcache.cache import Cache, Hold, Want
from checkoutcache.cones import Cone, parse_cone
from checkoutcache.config import Config, ServeSettings
from checkoutcache.credentials import strip_userinfo
from checkoutcache.errors import CODES, CheckoutCacheError
from checkoutcache.repospec import DEFAULT_SCOPE
from checkoutcache.serve.metrics import SEED_OUTCOMES, SEED_REASONS, Metrics
from checkoutcache.serve.policy import ANONYMOUS, ApiPolicy, Grant, tightened
from checkoutcache.store import locks, records
from checkoutcache.store.create import init_root
from checkoutcache.store.inventory import inventory
from checkoutcache.units import parse_duration
from checkoutcache.upkeep.gc import disk_of, run_gc
from checkoutcache.upkeep.status import build_status

log = logging.getLogger("checkoutcache.serve")
events = logging.getLogger("checkoutcache.events")

MAX_HOLD_TTL = 24 * 3600.0
DEFAULT_HOLD_TTL = 3600.0
GC_SETTINGS = ("max_checkouts", "max_bytes", "min_free", "free_headroom", "max_age", "grace")
JOURNAL_ROTATE_BYTES = 1 << 20
HTTP_STATUS = {State.READY: 200, State.CLONING: 202}
MAX_RECENT_USES = 100_000
# How long a parsed, allowed request is remembered (a local path's real path may move), and how many.
RESOLVED_FOR = 60.0
RESOLVED_MAX = 4096
# Scheduled gc runs failed in a row before /readyz says the sidecar is not ready.
GC_FAILURES_NOT_READY = 3


class Stopping(Exception):
    """serve is stopping: a request waiting on a clone is answered SHUTTING_DOWN."""


@attrs.define
class HeldCheckout:
    hold: Hold
    expires_at: float
    owner: str  # the grant's name: a caller sees and releases only its own holds


class Service:
    """Everything the HTTP layer calls; one per serve process."""

    def __init__(self, cache: Cache, config: Config, settings: ServeSettings, journal: str,
                 policy: ApiPolicy | None = None, version: str = "unknown"):
        self.cache = cache
        self.config = config
        self.settings = settings
        self.policy = policy or ApiPolicy()
        self.journal = journal
        self.metrics = Metrics(cache.paths, version)
        self.holds: dict[str, HeldCheckout] = {}
        # (repository key, commit) -> time.monotonic() of this process's last ready
        # answer for it: a forward jump of the wall clock cannot make our own gc evict
        # what we served within the grace window (the markers' mtimes are wall-clock).
        self.recent_uses: dict[tuple[str, str], float] = {}
        self.recent_lock = threading.Lock()
        self.holds_lock = threading.Lock()
        self.stopping = threading.Event()
        self.resolved: dict[tuple[str, str, str], tuple[float, tuple]] = {}  # see resolve()
        self.gc_failures = 0  # scheduled runs failed in a row
        self.gc_last_error: str | None = None
        for name in ("max_checkouts", "max_bytes"):
            value = getattr(config, name)
            if value is not None:
                self.metrics.limit.labels(name).set(value)

    # ---------------------------------------------------------------- API
    def request(self, params: dict, grant: Grant) -> tuple[str, str, float, str, Cone]:
        """(repo, commit, wait, scope, cone) of an ensure or hold, checked against the policy."""
        repo, commit, wait, scope, cone = self.fields(params)
        self.policy.check_scope(grant, scope)
        self.resolve(repo, commit, scope, cone)
        return repo, commit, wait, scope, cone

    def fields(self, params: dict) -> tuple[str, str, float, str, Cone]:
        repo, commit = params.get("repo", ""), params.get("commit", "")
        scope = params.get("scope", DEFAULT_SCOPE)
        if not all(isinstance(v, str) for v in (repo, commit, scope)):
            raise CheckoutCacheError("BAD_ARGUMENT", what="repo, commit and scope must be strings")
        wait = params.get("wait", 0)
        wait = 0.0 if wait == 0 else min(parse_duration(wait, "wait"), self.settings.max_wait)
        # The cone is validated here, before anything: a path out of the checkout is BAD_ARGUMENT.
        return repo, commit, wait, scope, parse_cone(params.get("sparse"))

    def resolve(self, repo: str, commit: str, scope: str, cone: Cone = ()) -> Want:
        """The request the policy allows; remembered for RESOLVED_FOR seconds, so a ready
        answer parses a repository once, not at every tool call."""
        key = (repo, commit, scope, cone)
        now = time.monotonic()
        hit = self.resolved.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        self.policy.check_repo_argument(repo)
        want = self.cache.request(repo, commit, scope, cone)
        self.policy.check_repo(want.spec)
        if len(self.resolved) >= RESOLVED_MAX:
            self.resolved.clear()  # a flood of distinct requests: start over, bounded
        self.resolved[key] = (now + RESOLVED_FOR, want)
        return want

    def ready_now(self, params: dict, grant: Grant = ANONYMOUS) -> tuple[Answer | None, float]:
        """(the ready answer, the wait asked) when the checkout is published, without ever
        blocking (the evictor's exclusive lock held: not now); (None, wait) when the
        request must go to a thread. Input errors raise."""
        repo, commit, wait, scope, cone = self.fields(params)
        self.policy.check_scope(grant, scope)
        want = self.resolve(repo, commit, scope, cone)
        answer = self.cache.ready_answer(want, lock_wait=0.0)
        if answer is not None:
            self.metrics.answer(answer.state, "")
            with self.recent_lock:
                self.recent_uses[(want.spec.key, want.name)] = time.monotonic()
        return answer, wait

    def ensure(self, params: dict, grant: Grant = ANONYMOUS) -> Answer:
        repo, commit, wait, scope, cone = self.request(params, grant)
        answer = self.cache.ensure(repo, commit, wait=wait, scope=scope, on_progress=self.unless_stopping,
                                   sparse=cone)
        self.answered(answer)
        return answer

    def unless_stopping(self, _answer: Answer) -> None:
        """The progress callback of a waiting request: serve stopping ends the wait."""
        if self.stopping.is_set():
            raise Stopping()

    def answered(self, answer: Answer) -> None:
        self.metrics.answer(answer.state, answer.error or "")
        self.note_use(answer)

    def note_use(self, answer: Answer) -> None:
        if answer.state != State.READY or not answer.path:
            return
        # <root>/repos/<key>/checkouts/<name>: the key and the checkout's name (layout.py)
        key = os.path.basename(os.path.dirname(os.path.dirname(answer.path)))
        with self.recent_lock:
            if len(self.recent_uses) >= MAX_RECENT_USES:
                self.forget_old_uses(time.monotonic())
            self.recent_uses[(key, os.path.basename(answer.path))] = time.monotonic()

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
        repo, commit, wait, scope, cone = self.request(params, grant)
        with self.holds_lock:
            self.check_hold_room(grant)
        held = self.cache.hold(repo, commit, wait=wait, scope=scope, on_progress=self.unless_stopping, sparse=cone)
        self.answered(held.answer)
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
        """Each hold keeps a descriptor open: bounded in total and per caller. Caller holds holds_lock."""
        held = len(self.holds)
        mine = sum(1 for h in self.holds.values() if h.owner == grant.name)
        if held >= self.settings.max_holds:
            raise CheckoutCacheError("TOO_MANY_HOLDS", held=held, limit=self.settings.max_holds, whose="in all")
        if mine >= self.settings.max_holds_per_token:
            raise CheckoutCacheError("TOO_MANY_HOLDS", held=mine, limit=self.settings.max_holds_per_token,
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
        dry_run = params.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise CheckoutCacheError("BAD_ARGUMENT", what="dry_run must be true or false")
        started = time.monotonic()
        try:
            report = run_gc(self.cache.paths, config, dry_run=dry_run, used_within_grace=self.used_within_grace())
        except Exception:
            self.metrics.gc_runs.labels("error").inc()
            raise
        seconds = time.monotonic() - started
        self.metrics.gc_seconds.observe(seconds)
        self.metrics.gc_runs.labels("skipped" if report.skipped else "ok").inc()
        for removed in report.removed:
            self.metrics.evictions.labels(removed.reason).inc()
        if report.disk_after:
            self.metrics.disk_free.set(report.disk_after["free"])
            self.metrics.disk_total.set(report.disk_after["total"])
        if report.checkouts_after is not None:
            self.metrics.checkouts.set(report.checkouts_after)
            self.metrics.bytes.set(report.bytes_after)
        events.info("gc %s", "skipped: " + report.skipped if report.skipped else "ran", extra={
            "event": "gc", "trigger": "api" if from_api else "schedule", "dry_run": dry_run,
            "seconds": round(seconds, 3), "removed": len(report.removed), "bytes_freed": report.bytes_freed,
            "checkouts_after": report.checkouts_after, "problems": len(report.problems),
            "unmet": [u["limit"] for u in report.unmet]})
        return report.to_json()

    def status(self, grant: Grant = ANONYMOUS) -> dict:
        report = build_status(self.cache.paths, self.config)
        if grant.scopes is not None:  # a caller sees only the repositories of its scopes
            report["repos"] = [r for r in report["repos"] if r["scope"] in grant.scopes]
            report["unreachable"] = [r for r in report.get("unreachable", []) if r.get("scope") in grant.scopes]
            visible = [c for r in report["repos"] for c in r["checkouts"] if c["ready"]]
            report["totals"].update(checkouts=len(visible), bytes=sum(c["size"] for c in visible))
        return report

    # ---------------------------------------------------------------- health
    def health(self) -> tuple[bool, dict]:
        """/healthz: alive (the process answers). Nothing of the disk: a kubelet restarting
        serve for a full disk would only lose its holds."""
        return True, {"ok": True, "stopping": self.stopping.is_set()}

    def readiness(self) -> tuple[bool, dict]:
        """/readyz: the root is usable (created, written, locked), git is there, scheduled gc
        is not failing, and serve is not stopping."""
        checks: dict[str, object] = {"root_writable": False, "locks_work": False}
        # One probe file per call, locked and removed: concurrent probes never share a name or a
        # lock, nor do serves of the same pid in other PID namespaces on this root (a nonce).
        probe = self.cache.paths.health_probe(uuid.uuid4().hex)
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
            try:
                records.remove_quietly(probe)
            except OSError:
                pass
        checks["git"] = shutil.which("git") is not None
        checks["scheduled_gc_failures"] = self.gc_failures
        if self.gc_last_error:
            checks["scheduled_gc_error"] = self.gc_last_error
        checks["stopping"] = self.stopping.is_set()
        ok = bool(checks["root_writable"] and checks["locks_work"] and checks["git"]
                  and self.gc_failures < GC_FAILURES_NOT_READY and not checks["stopping"])
        return ok, {"ok": ok, "checks": checks}

    # ---------------------------------------------------------------- background
    def refresh_gauges(self) -> None:
        """The store's gauges from the inventory (recorded sizes: no tree walk): at start,
        so a free-disk alert never sees a restart as an empty disk."""
        try:
            disk = disk_of(self.cache.paths.root)
            self.metrics.disk_free.set(disk.free)
            self.metrics.disk_total.set(disk.total)
            ready = [c for info in inventory(self.cache.paths) for c in info.checkouts if c.ready and c.intact]
            self.metrics.checkouts.set(len(ready))
            self.metrics.bytes.set(sum(c.size for c in ready))
        except (OSError, CheckoutCacheError) as exc:
            log.warning("could not read the store's figures: %s", exc)

    def follow_journal(self) -> None:
        """Count and log the clones this sidecar's workers report in their journal. A line
        that is not what a worker writes is skipped: it never stops the follower."""
        offset = 0
        while not self.stopping.wait(0.5):
            try:
                # Never through a planted symlink; rotated in place (workers append with
                # O_APPEND, so they go on at the new end).
                fd = os.open(self.journal, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                with os.fdopen(fd, "rb") as handle:
                    if offset > JOURNAL_ROTATE_BYTES:
                        os.ftruncate(fd, 0)
                        offset = 0
                    handle.seek(offset)
                    for line in handle:
                        offset += len(line)
                        self.journal_event(line)
            except OSError as exc:
                log.warning("the clone journal could not be read: %s", exc)

    def journal_event(self, line: bytes) -> None:
        try:
            event = json.loads(line)
            if not isinstance(event, dict) or not isinstance(event.get("event"), str):
                return
            self.count_journal_event(event)
        except Exception as exc:  # one odd line (a peer's, a bug's) is skipped, never the end of the follower
            log.debug("journal line skipped (%s): %r", type(exc).__name__, line[:200])

    def count_journal_event(self, event: dict) -> None:
        kind = event["event"]
        seconds = event.get("seconds")
        seconds = seconds if isinstance(seconds, (int, float)) and math.isfinite(seconds) else None
        error = event.get("error") if isinstance(event.get("error"), str) and event.get("error") in CODES else None
        if kind == "published":
            self.metrics.clones.labels("published", "").inc()
            if seconds is not None:
                self.metrics.clone_seconds.observe(seconds)
        elif kind == "failed":
            self.metrics.clones.labels("failed", error or "other").inc()
        elif kind == "started":
            self.metrics.clones.labels("started", "").inc()
        elif kind in ("died", "stopped"):
            self.metrics.clones.labels(kind, "").inc()
        elif kind == "seeded":
            outcome, reason = event.get("outcome"), event.get("reason") or ""
            self.metrics.seeds.labels(outcome if outcome in SEED_OUTCOMES else "other",
                                      reason if reason in SEED_REASONS else "other").inc()
        else:
            return
        fields = {"event": f"clone_{kind}" if kind != "seeded" else "seeded",
                  "commit": event.get("commit") if isinstance(event.get("commit"), str) else None,
                  "repo": self.repo_url(event.get("repo")), "seconds": seconds, "error": error}
        if kind == "seeded":
            fields.update(outcome=event.get("outcome"), reason=event.get("reason"), bundles=event.get("bundles"))
        events.info("%s %s", fields["event"], fields["commit"], extra={k: v for k, v in fields.items()
                                                                       if v is not None})

    def repo_url(self, key: object) -> str | None:
        """A repository's URL (credentials never stored: repo.json has none) from its key."""
        if not isinstance(key, str) or not key.isalnum():
            return None
        try:
            meta = records.read_json(self.cache.paths.repo(key).repo_json, records.REPO) or {}
        except OSError:
            return None
        url = meta.get("url")
        return strip_userinfo(url) if isinstance(url, str) else None

    def maintain(self, on_tick: Callable[[], None] | None = None) -> None:
        """Expire holds every second; run gc every gc_interval (counting failures in a row,
        which /readyz and a metric show)."""
        next_gc = time.monotonic() + self.settings.gc_interval
        while not self.stopping.wait(1.0):
            self.expire_holds()
            if on_tick is not None:
                on_tick()
            if self.settings.gc_interval > 0 and time.monotonic() >= next_gc:
                next_gc = time.monotonic() + self.settings.gc_interval
                try:
                    self.gc({}, from_api=False)
                    self.gc_failures, self.gc_last_error = 0, None
                except Exception as exc:  # counted, said, and tried again next interval
                    self.gc_failures += 1
                    self.gc_last_error = f"{type(exc).__name__}: {exc}"[:300]
                    log.error("scheduled gc failed (%d in a row): %s", self.gc_failures, self.gc_last_error)
                self.metrics.gc_failing.set(self.gc_failures)


def http_status(answer: Answer) -> int:
    if answer.state in HTTP_STATUS:
        return HTTP_STATUS[answer.state]
    return CODES[answer.error].http_status if answer.error in CODES else 503
