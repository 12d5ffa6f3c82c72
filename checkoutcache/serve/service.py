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

import contextlib
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

from checkoutcache import signing
from checkoutcache.answers import Answer, State
from checkoutcache.cache import Cache, Hold, Want
from checkoutcache.cones import Cone, parse_cone
from checkoutcache.config import Config, ServeSettings
from checkoutcache.credentials import strip_userinfo
from checkoutcache.errors import CODES, CheckoutCacheError
from checkoutcache.repospec import DEFAULT_SCOPE
from checkoutcache.serve.metrics import SEED_OUTCOMES, SEED_REASONS, Metrics
from checkoutcache.serve.policy import ANONYMOUS, ApiPolicy, Grant, NonceBook, load_tokens, tightened
from checkoutcache.store import locks, records
from checkoutcache.store.create import init_root
from checkoutcache.store.inventory import inventory
from checkoutcache.units import parse_duration
from checkoutcache.upkeep.gc import disk_of, run_gc
from checkoutcache.upkeep.limits import record_limits
from checkoutcache.upkeep.status import build_status

log = logging.getLogger("checkoutcache.serve")
# Clone failures an operator must act on (logged at WARNING): the disk, the store, a worker
# killed or stuck, a bug. The rest (an unknown commit, an unreachable server) are callers'.
OPERATOR_FAILURES = frozenset({"DISK_FULL", "ROOT_UNUSABLE", "TIMEOUT", "WORKER_DIED", "WORKER_START_FAILED",
                               "INTERNAL_ERROR"})
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
# keep_leases beats every second; this long without a beat, /healthz says the process is stuck.
LEASES_STALLED_AFTER = 30.0
UNMET_LIMITS = ("max-checkouts", "max-bytes", "min-free")  # eviction.Unmet's names
# Signed requests' nonces remembered at once (each for the signature window), per token and in
# all: a token past its own bound (about 800 requests a second for a minute) is refused alone.
MAX_NONCES_PER_TOKEN = 50_000
MAX_NONCES = 400_000


# Requests that wait on another's first contact with a repository new here (reviews of one
# repository arriving together): each holds its thread for at most the probe timeout and this.
FOLLOWERS_PER_REPOSITORY = 8
FIRST_CONTACT_SLACK = 5.0


class NewRepository:
    """A first contact in progress: whose request makes it, when it is done, who waits on it."""

    def __init__(self, caller: str):
        self.caller = caller
        self.done = threading.Event()
        self.followers = 0


class Waited:
    """Whether a request waited on a clone (the request latency's kind, metrics.KINDS)."""

    __slots__ = ("waited",)

    def __init__(self) -> None:
        self.waited = False


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
        self.version = version
        self.metrics = Metrics(cache.paths, version, figures=self.store_figures)
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
        self.tokens_lock = threading.Lock()
        # Signed requests' nonces taken, per token (first_use_of).
        self.nonces = NonceBook(MAX_NONCES_PER_TOKEN, MAX_NONCES,
                                signing.SIGNATURE_WINDOW + signing.SIGNATURE_AHEAD + 1.0)
        self.nonces_lock = threading.Lock()
        self.tokens_seen = file_identity(settings.token_file)
        self.gc_last_error: str | None = None
        self.gc_started_at: float | None = None  # time.monotonic() of the scheduled run in progress
        self.leases_beat = time.monotonic()  # keep_leases' last round (/healthz)
        for name in ("max_checkouts", "max_bytes"):
            value = getattr(config, name)
            if value is not None:
                self.metrics.limit.labels(name).set(value)
        self.metrics.clone_timeout.set(config.clone_timeout)
        for name in UNMET_LIMITS:
            self.metrics.unmet.labels(name).set(0)
        # Every clone this serve starts goes through its fair, bounded queue (serve/admission.py).
        from checkoutcache.clone.spawn import worker_starter
        from checkoutcache.serve.admission import Bounds, CloneQueue
        from checkoutcache.store.liveness import own_identity, pid_namespace

        pid, pid_start = own_identity()
        self.clones = CloneQueue(Bounds(settings.max_clones, settings.max_clones_per_token, settings.max_queued,
                                        settings.max_queued_per_token),
                                 worker_starter(False), {"pid": pid, "pid_start": pid_start, "pidns": pid_namespace()})
        cache.clone_starter = lambda caller: self.clones.starter(caller, self.policy.repos_of(caller))
        self.new_repos: dict[str, int] = {}  # caller -> repositories new here it is first to ask, in progress
        self.making: dict[str, NewRepository] = {}  # key -> the first contact in progress, and who waits on it
        self.new_repos_lock = threading.Lock()

    # ---------------------------------------------------------------- API
    def request(self, params: dict, grant: Grant) -> tuple[str, str, float, str, Cone]:
        """(repo, commit, wait, scope, cone) of an ensure or hold, checked against the policy."""
        repo, commit, wait, scope, cone = self.fields(params)
        self.policy.check_scope(grant, scope)
        self.policy.check_grant_repo(grant, self.resolve(repo, commit, scope, cone).spec)
        return repo, commit, wait, scope, cone

    def check_key_settings(self, params: dict) -> None:
        """A reader sends the settings that make a store's key (handoff: `lfs`, `submodules`):
        one keyed otherwise would be answered ready for a path it never finds, and ask again.
        SETTINGS_MISMATCH says so once."""
        for field, setting, ours in (("lfs", "CHECKOUTCACHE_LFS", self.cache.lfs_setting()),
                                     ("submodules", "CHECKOUTCACHE_SUBMODULES", self.cache.submodules_setting())):
            theirs = params.get(field)
            if theirs is not None and theirs != ours:
                raise CheckoutCacheError("SETTINGS_MISMATCH", setting=setting, ours=str(theirs)[:20], theirs=ours)

    def first_use_of(self, token: str, nonce: str) -> bool:
        """Whether a signed request's nonce is new for its token (policy.NonceBook): a request
        seen on its way is answered once, never twice."""
        with self.nonces_lock:
            return self.nonces.first_use(token, nonce, time.monotonic())

    def fields(self, params: dict) -> tuple[str, str, float, str, Cone]:
        self.check_key_settings(params)
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
        self.policy.check_grant_repo(grant, want.spec)
        answer = self.cache.ready_answer(want, lock_wait=0.0)
        if answer is not None and ("history" in params or "base" in params):
            history, base = self.history_and_base(params)
            answer = self.cache.as_wanted(want, answer, history, base)
        if answer is not None:
            self.check_borrows(grant, answer)
            self.metrics.answer(answer.state, "")
            with self.recent_lock:
                self.recent_uses[(want.spec.key, want.name)] = time.monotonic()
        return answer, wait

    def ensure(self, params: dict, grant: Grant = ANONYMOUS, note: "Waited | None" = None) -> Answer:
        """note, when given, learns whether the request waited on a clone (the latency's kind)."""
        repo, commit, wait, scope, cone = self.request(params, grant)
        # Every ensure looks at once first: a repository new here counts against the token's bound
        # while it is probed and its clone started (never for the whole wait), and a clone queued
        # for another token is started for this one if it has room (queued_elsewhere).
        history, base = self.history_and_base(params)
        with self.new_repository(repo, commit, scope, cone, grant):
            answer = self.cache.ensure(repo, commit, scope=scope, sparse=cone, caller=grant.name, history=history,
                                       base=base)
        if self.queued_elsewhere(answer, repo, commit, scope, cone, grant):
            answer = self.cache.ensure(repo, commit, scope=scope, sparse=cone, caller=grant.name, history=history,
                                       base=base)
        if wait and answer.state == State.CLONING:
            answer = self.cache.ensure(repo, commit, wait=wait, scope=scope, on_progress=self.progress_of(note),
                                       sparse=cone, caller=grant.name, history=history, base=base)
        self.check_borrows(grant, answer)
        self.answered(answer)
        return answer

    @staticmethod
    def history_and_base(params: dict) -> tuple[str | None, str | None]:
        """An ensure's `history` ("any", "full") and `base` (a commit id), checked (input errors raise)."""
        from checkoutcache.cache import parse_base, parse_history

        return parse_history(params.get("history")), parse_base(params.get("base"))

    def queued_elsewhere(self, answer: Answer, repo: str, commit: str, scope: str, cone: Cone, grant: Grant) -> bool:
        """A `cloning` answer for a clone this serve queued for another token: started now for
        this one if it has room (admission.CloneQueue.interest). Whether it was."""
        if answer.state != State.CLONING or not answer.queue or answer.pid != self.clones.own["pid"]:
            return False
        want = self.resolve(repo, commit, scope, cone)
        return self.clones.interest(grant.name, self.cache.paths.repo(want.spec.key), want.name)

    def check_borrows(self, grant: Grant, answer: Answer) -> None:
        """A token with repositories of its own (repos=) is never answered a checkout that holds
        another repository it may not name (a submodule: the checkout is shared, and may have
        been made for a caller who may). FORBIDDEN_REPOSITORY naming it."""
        if not grant.repos or answer.state != State.READY or answer.submodules != "included" or not answer.path:
            return
        marker = records.read_json(os.path.join(answer.path, ".git", "checkoutcache-ready"), records.MARKER) or {}
        for key, _sha in marker.get("borrows") or []:
            url = self.repo_url(key)
            if url is None or not grant.may_name(url):
                raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why=f"the checkout holds a submodule of "
                                                                     f"{(url or key)[:200]}, which is not among this "
                                                                     f"token's repositories")

    @contextlib.contextmanager
    def new_repository(self, repo: str, commit: str, scope: str, cone: Cone, grant: Grant):
        """A request naming a repository this store has not made yet probes it first (a tarpit
        costs the probe timeout) and makes a mirror: at most max_new_repos_per_token such
        repositories of one token at once, and max_clones in all (SERVER_BUSY beyond). Requests
        for a repository whose first contact is in progress (reviews of one repository arriving
        together on a cold node, whoever's token) count no further: they wait for that first
        contact (bounded by the probe timeout), FOLLOWERS_PER_REPOSITORY at most, and go on."""
        want = self.resolve(repo, commit, scope, cone)
        key = want.spec.key
        if os.path.isdir(self.cache.paths.repo(key).base):
            yield
            return
        if not self.clones.could_take(grant.name):  # refused before anything is written for it
            raise CheckoutCacheError("SERVER_BUSY", why="this token's clones are queued to their bound already")
        with self.new_repos_lock:
            first = self.making.get(key)
            if first is not None:
                if first.followers >= FOLLOWERS_PER_REPOSITORY:
                    raise CheckoutCacheError("SERVER_BUSY", why=f"{first.followers} requests wait on this "
                                                                f"repository's first contact already")
                first.followers += 1
                self.metrics.first_contact_waiting.inc()
            else:
                mine, everyone = self.new_repos.get(grant.name, 0), len(self.making)
                if mine >= self.settings.max_new_repos_per_token or everyone >= max(1, self.settings.max_clones):
                    raise CheckoutCacheError("SERVER_BUSY", why=f"{mine if mine >= self.settings.max_new_repos_per_token else everyone} "
                                                                f"repositories new to this store are being reached "
                                                                f"{'for this token' if mine else 'in all'}")
                self.new_repos[grant.name] = mine + 1
                self.making[key] = NewRepository(grant.name)
        if first is not None:
            try:
                first.done.wait(self.config.probe_timeout + FIRST_CONTACT_SLACK)
                yield
            finally:
                with self.new_repos_lock:
                    first.followers -= 1
                    self.metrics.first_contact_waiting.dec()
            return
        try:
            yield
        finally:
            with self.new_repos_lock:
                self.making.pop(key).done.set()
                self.new_repos[grant.name] -= 1
                if not self.new_repos[grant.name]:
                    del self.new_repos[grant.name]

    def progress_of(self, note: "Waited | None") -> Callable[[Answer], None]:
        if note is None:
            return self.unless_stopping

        def progress(answer: Answer) -> None:
            note.waited = True  # called only before a wait on a clone (clone/coordinator.py)
            self.unless_stopping(answer)

        return progress

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

    def hold(self, params: dict, grant: Grant = ANONYMOUS, note: "Waited | None" = None) -> tuple[int, dict]:
        ttl = parse_duration(params.get("ttl", DEFAULT_HOLD_TTL), "ttl")
        if not 0 < ttl <= MAX_HOLD_TTL:
            raise CheckoutCacheError("BAD_ARGUMENT", what=f"ttl must be 0 to {MAX_HOLD_TTL:g} seconds")
        repo, commit, wait, scope, cone = self.request(params, grant)
        with self.holds_lock:
            self.check_hold_room(grant)
        with self.new_repository(repo, commit, scope, cone, grant):  # as ensure: a look at once first
            first = self.cache.ensure(repo, commit, scope=scope, sparse=cone, caller=grant.name)
        self.queued_elsewhere(first, repo, commit, scope, cone, grant)
        held = self.cache.hold(repo, commit, wait=wait, scope=scope, on_progress=self.progress_of(note),
                               sparse=cone, caller=grant.name)
        try:
            self.check_borrows(grant, held.answer)
        except CheckoutCacheError:
            held.release()
            raise
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
        if from_api and not grant.everything:
            # gc spans every scope's repositories: a token limited to some may not run it.
            raise CheckoutCacheError("FORBIDDEN_SCOPE", scope=",".join(sorted(grant.scopes or ()))[:64]
                                     + (" (gc runs on all)" if grant.scopes is not None else
                                        "* with its own repositories (gc runs on all)"))
        config = self.config
        if from_api:  # a caller may only tighten the operator's limits
            config = tightened(self.config, self.config.with_overrides(**{k: params.get(k) for k in GC_SETTINGS}))
        dry_run = params.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise CheckoutCacheError("BAD_ARGUMENT", what="dry_run must be true or false")
        started = time.monotonic()
        try:
            # The scheduled run enforces the limits in force (recorded for status); one over
            # the API may have tightened them for once (not recorded).
            report = run_gc(self.cache.paths, config, dry_run=dry_run, used_within_grace=self.used_within_grace(),
                            record_as=None if from_api else "serve")
        except Exception:
            self.metrics.gc_runs.labels("error").inc()
            raise
        seconds = time.monotonic() - started
        self.metrics.gc_seconds.observe(seconds)
        self.metrics.gc_runs.labels("skipped" if report.skipped else "ok").inc()
        for removed in report.removed:
            self.metrics.evictions.labels(removed.reason).inc()
        if not dry_run and not report.skipped:
            unmet = {u["limit"] for u in report.unmet}
            for name in UNMET_LIMITS:
                self.metrics.unmet.labels(name).set(1 if name in unmet else 0)
        events.log(logging.WARNING if report.unmet else logging.INFO,  # a limit gc could not meet
                   "gc %s", "skipped: " + report.skipped if report.skipped else "ran", extra={
            "event": "gc", "trigger": "api" if from_api else "schedule", "dry_run": dry_run,
            "seconds": round(seconds, 3), "removed": len(report.removed), "bytes_freed": report.bytes_freed,
            "checkouts_after": report.checkouts_after, "problems": len(report.problems),
            "unmet": [u["limit"] for u in report.unmet]})
        return report.to_json()

    def status(self, grant: Grant = ANONYMOUS) -> dict:
        report = build_status(self.cache.paths, self.config)
        if not grant.everything:  # a caller sees only the repositories of its scopes and patterns
            def visible(r: dict) -> bool:
                return grant.may_use(r.get("scope") or "") and grant.may_name(r.get("repo") or "")

            report["repos"] = [r for r in report["repos"] if visible(r)]
            report["unreachable"] = [r for r in report.get("unreachable", []) if visible(r)]
            visible = [c for r in report["repos"] for c in r["checkouts"] if c["ready"]]
            report["totals"].update(checkouts=len(visible), bytes=sum(c["size"] for c in visible))
            keys = {r["key"] for r in report["repos"]}
            spaces = report["workspaces"]
            spaces["workspaces"] = [w for w in spaces["workspaces"] if w["key"] in keys]
            report["totals"]["workspaces"] = sum(1 for w in spaces["workspaces"] if w["alive"])
        return report

    def workspaces(self, grant: Grant = ANONYMOUS) -> dict:
        """GET /v1/workspaces: the workspaces directory as this sidecar sees it (read only: it
        makes none, the caller's directory is not its to write), those of the caller's scopes."""
        from checkoutcache.upkeep.status import workspace_status

        report = workspace_status(self.cache.paths, self.config)
        if not grant.everything:
            keys = {r["key"] for r in self.status(grant)["repos"]}
            report["workspaces"] = [w for w in report["workspaces"] if w["key"] in keys]
        return report

    # ---------------------------------------------------------------- health
    def health(self) -> tuple[bool, dict]:
        """/healthz: alive (the process answers, and the thread that expires holds and reads
        the tokens file still beats: it touches no disk, so a stalled beat is a process a
        restart mends). Nothing of the disk: a kubelet restarting serve for a full disk would
        only lose its holds."""
        stalled = time.monotonic() - self.leases_beat
        ok = stalled < LEASES_STALLED_AFTER or self.stopping.is_set()
        body: dict = {"ok": ok, "stopping": self.stopping.is_set()}
        if not ok:
            body["leases_stalled_seconds"] = round(stalled, 1)
        return ok, body

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
        running = self.gc_running_for()
        gc_stuck = running is not None and running > self.settings.gc_deadline
        if running is not None:
            checks["scheduled_gc_running_seconds"] = round(running, 1)
        checks["stopping"] = self.stopping.is_set()
        ok = bool(checks["root_writable"] and checks["locks_work"] and checks["git"]
                  and self.gc_failures < GC_FAILURES_NOT_READY and not gc_stuck and not checks["stopping"])
        return ok, {"ok": ok, "checks": checks}

    # ---------------------------------------------------------------- tokens
    def tokens_changed(self) -> bool:
        """Whether the tokens file is another file, or changed, since last read. os.stat
        follows the links: a kubelet's swap of a Secret's `..data` link is a new inode."""
        return self.settings.token_file is not None and file_identity(self.settings.token_file) != self.tokens_seen

    def reload_tokens(self, trigger: str) -> bool:
        """Read the tokens file again (on a change, or SIGHUP) and put its tokens in force;
        those it no longer holds stay valid for the overlap (policy.rotated). A file that
        cannot be read or holds no token changes nothing (said, counted, tried at its next
        change or signal): a half-written file never locks every client out."""
        path = self.settings.token_file
        if path is None:
            log.warning("SIGHUP: no tokens file to reload (CHECKOUTCACHE_API_TOKEN_FILE)",
                        extra={"event": "tokens_reload_failed", "trigger": trigger})
            return False
        with self.tokens_lock:
            self.tokens_seen = file_identity(path)
            try:
                tokens = load_tokens(path, os.environ)
                if not tokens:
                    raise CheckoutCacheError("BAD_ARGUMENT", what=f"{path} holds no token")
            except (CheckoutCacheError, ValueError) as exc:  # ValueError: not UTF-8 text
                self.metrics.token_reloads.labels("failed").inc()
                log.error("the tokens file could not be reloaded, the tokens in force stay: %s",
                          getattr(exc, "message", type(exc).__name__),
                          extra={"event": "tokens_reload_failed", "trigger": trigger})
                return False
            self.policy = self.policy.rotated(tokens, time.monotonic(), self.settings.token_overlap)
            self.metrics.token_reloads.labels("ok").inc()
            log.info("tokens reloaded: %d in force, %d retiring within %gs", len(tokens), len(self.policy.retiring),
                     self.settings.token_overlap, extra={
                         "event": "tokens_reloaded", "trigger": trigger, "tokens": [g.name for _t, g in tokens],
                         "retiring": [g.name for _t, g, _u in self.policy.retiring]})
            return True

    def watch_tokens(self) -> None:
        if self.tokens_changed():
            self.reload_tokens("change")

    # ---------------------------------------------------------------- background
    def store_figures(self) -> dict:
        """The store's figures at a scrape (metrics.py: the "scrape" metrics): the inventory
        with recorded sizes (no tree walk: O(checkouts)), the disk, running clones, readiness.
        A figure that cannot be read is left out of that scrape (an absent series, never a
        zero an alert would take for an empty store)."""
        figures: dict = {}
        try:
            disk = disk_of(self.cache.paths.root)
            figures.update(checkoutcache_disk_free_bytes=disk.free, checkoutcache_disk_size_bytes=disk.total)
        except OSError as exc:
            log.warning("could not read the disk's figures: %s", exc)
        try:
            repos = inventory(self.cache.paths)
        except (OSError, CheckoutCacheError) as exc:
            log.warning("could not read the store's figures: %s", exc)
        else:
            ready = [c for info in repos for c in info.checkouts if c.ready and c.intact]
            now = time.time()
            started = [c.started_at for info in repos for c in info.clones if c.alive and c.started_at is not None]
            figures.update(checkoutcache_checkouts=len(ready), checkoutcache_checkouts_bytes=sum(c.size for c in ready),
                           checkoutcache_clones_running=sum(1 for info in repos for c in info.clones if c.alive),
                           checkoutcache_oldest_clone_seconds=max(0.0, now - min(started)) if started else 0.0)
        figures["checkoutcache_ready"] = 1 if self.readiness()[0] else 0
        figures["checkoutcache_gc_running_seconds"] = round(self.gc_running_for() or 0.0, 3)
        queue = self.clones.figures()
        figures.update(checkoutcache_clone_slots_busy=queue["running"], checkoutcache_clones_queued=queue["queued"])
        return figures

    def record_limits(self) -> None:
        """The limits this serve enforces, in the root for `status` anywhere (upkeep/limits.py)."""
        try:
            record_limits(self.cache.paths, self.config, "serve", self.version)
        except OSError as exc:
            log.warning("could not record the limits in force in the root: %s", exc)

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
        # What an operator must act on (the disk, a worker killed, a clone stuck) is a WARNING;
        # a commit the server does not have is the caller's business.
        level = logging.WARNING if kind == "died" or (kind == "failed" and error in OPERATOR_FAILURES) \
            else logging.INFO
        events.log(level, "%s %s", fields["event"], fields["commit"], extra={k: v for k, v in fields.items()
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

    def keep_leases(self, on_tick: Callable[[], None] | None = None) -> None:
        """Every second: expire holds, read a changed tokens file, reap our workers (on_tick).
        A thread of its own, touching no store file: nothing gc meets (a store too big to walk,
        a stuck disk, whatever a review put in its volume) may keep a hold past its ttl or a
        revoked token in force. Its beat is what /healthz checks."""
        while not self.stopping.wait(1.0):
            self.expire_holds()
            self.watch_tokens()
            if on_tick is not None:
                on_tick()
            self.leases_beat = time.monotonic()

    def run_gc_schedule(self) -> None:
        """gc every gc_interval on a thread of its own (counting failures in a row, which
        /readyz and a metric show; a run that outlasts gc_deadline makes /readyz 503)."""
        if self.settings.gc_interval <= 0:
            return
        while not self.stopping.wait(self.settings.gc_interval):
            self.gc_started_at = time.monotonic()
            try:
                self.gc({}, from_api=False)
                self.gc_failures, self.gc_last_error = 0, None
            except Exception as exc:  # counted, said, and tried again next interval
                self.gc_failures += 1
                self.gc_last_error = f"{type(exc).__name__}: {exc}"[:300]
                log.error("scheduled gc failed (%d in a row): %s", self.gc_failures, self.gc_last_error)
            finally:
                self.gc_started_at = None
            self.metrics.gc_failing.set(self.gc_failures)

    def gc_running_for(self) -> float | None:
        """How long the scheduled gc run in progress has run (None: none runs)."""
        started = self.gc_started_at
        return None if started is None else time.monotonic() - started


def file_identity(path: str | None) -> tuple | None:
    """What tells a file's versions apart (through symlinks): device, inode, size, mtime."""
    if path is None:
        return None
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def http_status(answer: Answer) -> int:
    if answer.state in HTTP_STATUS:
        return HTTP_STATUS[answer.state]
    return CODES[answer.error].http_status if answer.error in CODES else 503
