"""The slow path of `ensure`: when the checkout is not ready, decide what the
commit's state is, start exactly one clone if it is absent, and wait for it
within the caller's limit.

Single flight (invariant 2) rests on one step: taking the commit's clone lock
without waiting. Whoever gets it re-checks (another process may have already
published or failed meanwhile: double-checked locking) and, if the commit is
still absent, starts the clone and hands it the lock. Everyone else sees the
lock held and answers `cloning` with the record of the live owner.

How a clone starts is the caller's `Start`: a detached worker (spawn.py's
`worker_starter`, for the CLI, the library and serve), or the clone run to its
end in this very process (worker.py's `run_inline`, for a submodule's commit
in its superproject's worker). The coordinator imports neither, so the worker
can coordinate its submodules' clones without an import cycle.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, NamedTuple

import attrs

from checkoutcache.answers import Answer, State
from checkoutcache.clone.decide import Step, next_failure, next_step_for_not_ready
from checkoutcache.cones import Cone, cone_digest
from checkoutcache.config import Config
from checkoutcache.credentials import Credential, credential_for, unbound_credential_note
from checkoutcache.errors import CheckoutCacheError, describe
from checkoutcache.git.transport import pick_backend
from checkoutcache.repospec import RepoSpec
from checkoutcache.store import locks, records
from checkoutcache.store.create import init_repo_store, make_dirs, refuse_newer_layout, root_error, store_exists
from checkoutcache.store.layout import RepoPaths, RootPaths, checkout_name
from checkoutcache.store.ready import history_of, lfs_of, submodules_of, touch_if_ready
from checkoutcache.store.watch import StateWatch
from checkoutcache.store.records import Failure, read_failure
from checkoutcache.units import iso

# A waiter wakes on every change in the repository's state/ (store/watch.py): a
# publish or a failure at once. A worker's death writes nothing; it is seen by
# looking again after this long at most (the clone lock is then free).
LOOK_AGAIN = 0.1
# How many times an asker looks again when the clone lock goes free under it.
LOOKS_WHILE_LOCK_FLAPS = 3
# How long an asker that finds the clone lock held waits for the owner's record
# to appear (the starter writes it within milliseconds of taking the lock).
RECORD_GRACE = 0.5


class Incomplete(NamedTuple):
    """A repository whose history a checkout waits for: the boundary commits its commit reaches."""

    paths: RepoPaths
    url: str
    reached: frozenset[str]


# start(paths, checkout name, clone lock fd, config, credential, deaths, cone) -> the pid of a
# worker that runs on (holding the lock it inherited), or None when the clone ran to its end here.
Start = Callable[[RepoPaths, str, int, Config, Credential | None, int, Cone], int | None]


# boundary_reached's answers in this process (serve asks on each tool call of a review that
# wants the full history: one walk of a long history is 0.2 s at 60,000 commits), each by the
# shallow file it read: a new file (every install renames one in) is walked again.
REACHED: dict[tuple[str, tuple[str, ...]], tuple[tuple, frozenset[str]]] = {}
REACHED_KEPT = 1024
REACHED_LOCK = threading.Lock()


class Coordinator:
    def __init__(self, root_paths: RootPaths, config: Config, spec: RepoSpec, sha: str, start: Start,
                 cone: Cone = (), poll_first: float = 0.0, history: str | None = None, base: str | None = None,
                 fork: bool = False):
        """poll_first: how long a wait polls before it watches state/ (store/watch.py).
        history "full": a ready checkout counts once its history is complete (the background
        history's progress is answered as `cloning` meanwhile). base: the ready answer carries the
        merge base of the commit and it (clone/history.py). fork: this process may fork the
        history's process (the CLI)."""
        self.poll_first = poll_first
        self.history = history
        self.base = base
        self.fork = fork
        self.started_histories: dict[str, dict] = {}  # repository key -> the history process it started: pid
        self.started_search: dict | None = None  # the merge-base search it started: pid
        self.root_paths = root_paths
        self.start = start
        self.config = config
        self.spec = spec
        self.sha = sha  # the commit, for git and the answers
        self.cone = cone
        self.name = checkout_name(sha, cone_digest(cone) if cone else None)  # the checkout, for the store
        self.paths = root_paths.repo(spec.key)
        self.credential = credential_for(spec.url, spec.credential, os.environ)
        self.started: dict | None = None  # the worker this coordinator started: pid, pidns

    # ------------------------------------------------------------ answers
    def ready(self) -> Answer:
        record = records.read_json(self.paths.ready_marker(self.name), records.MARKER) or {}
        path = self.paths.checkout(self.name)
        return Answer(state=State.READY, commit=self.sha, repo=self.spec.url, path=path,
                      lfs=lfs_of(record), submodules=submodules_of(record), sparse=list(self.cone) or None,
                      history=history_of(path))

    # ------------------------------------------------------------ after ready: history, merge base
    def after_ready(self, answer: Answer) -> Answer:
        """A ready checkout, as the request wants it: with its whole history (history "full":
        the commit's own history and its submodules' complete, whatever other commits of their
        repositories still lack), with the merge base of a base (base); else cloning (a
        history, or the search, runs)."""
        if self.history == "full":
            waiting = self.incomplete_histories()
            if waiting:
                return self.history_step(waiting)
            answer = attrs.evolve(answer, history="complete")
        if self.base is not None:
            return self.base_step(answer)
        return answer

    def incomplete_histories(self) -> list[Incomplete]:
        """The histories this checkout still misses: the commit's (it reaches a boundary commit of
        the mirror: one rev-list) and each submodule commit's its marker lists (borrows)."""
        marker = records.read_json(self.paths.ready_marker(self.name), records.MARKER) or {}
        wanted = [(self.paths, self.sha, self.spec.url)]
        for key, sha in marker.get("borrows") or []:
            sub = self.root_paths.repo(key)
            wanted.append((sub, sha, (records.read_json(sub.repo_json, records.REPO) or {}).get("url", "")))
        missing = []
        for paths, sha, url in wanted:
            reached = self.boundary_reached(paths, [sha])
            if reached:
                missing.append(Incomplete(paths, url, reached))
        return missing

    def boundary_reached(self, paths: RepoPaths, tips: list[str]) -> frozenset[str]:
        """The boundary commits of the repository's mirror the tips' history reaches (none: it is
        complete there). A mirror the git CLI cannot walk (a tip gone from it) counts as shallow
        as a whole, as the repository's answer says. Walked again only when the mirror's shallow
        file changed (every install renames a new one in): a wait looks every LOOK_AGAIN."""
        from checkoutcache.git.boundary import read_shallow

        try:
            info = os.stat(paths.mirror_shallow)
        except (FileNotFoundError, NotADirectoryError):
            return frozenset()
        if info.st_size == 0:
            return frozenset()
        seen = (info.st_ino, info.st_mtime_ns, info.st_size)
        memo = (paths.mirror, tuple(tips))
        known = REACHED.get(memo)
        if known is not None and known[0] == seen:
            return known[1]
        backend = pick_backend(self.config.transport)
        try:
            reached = backend.boundary_reached(paths.mirror, tips)
        except (AttributeError, CheckoutCacheError):
            reached = read_shallow(paths.mirror)
        with REACHED_LOCK:
            REACHED[memo] = (seen, reached)
            while len(REACHED) > REACHED_KEPT:
                REACHED.pop(next(iter(REACHED)))
        return reached

    def history_step(self, waiting: list[Incomplete], history: str = "shallow") -> Answer:
        """cloning, with the progress of the first history that runs among those this checkout
        waits for (each started when none runs); failed when one of them failed, and its failure
        holds for what this checkout waits for (clone/history.py failure_covers), within its
        back-off."""
        from checkoutcache.clone import history as histories

        now = time.time()
        shown: tuple[dict, dict | None] | None = None
        for item in waiting:
            if not locks.history_running(item.paths):
                failure = histories.history_failure(item.paths)
                force = False
                if failure is not None and now < failure.retry_at:
                    if histories.failure_covers(item.paths, item.reached):
                        return self.failed(self.history_failure(failure, item), now)
                    force = True  # it failed on other commits' history: this one's is tried now
                pid = histories.start_history(item.paths, self.config, self.credential_of(item.url), fork=self.fork,
                                              force=force)
                if pid is not None:
                    self.started_histories[item.paths.key] = {"pid": pid}
            if shown is None:
                shown = (self.history_record(item.paths), self.started_histories.get(item.paths.key))
        record, started = shown if shown is not None else ({}, None)
        return self.owned_cloning(record, started, history=history, phase=histories.HISTORY_PHASE)

    def history_record(self, paths: RepoPaths) -> dict:
        """A history's record: its starter's first, then the process's own (with its pid), moments apart."""
        deadline = time.monotonic() + RECORD_GRACE
        while True:
            record = records.read_json(paths.history_record, records.HISTORY) or {}
            if record.get("pid") or paths.key in self.started_histories or time.monotonic() >= deadline or \
                    not locks.history_running(paths):
                return record
            time.sleep(0.005)

    def history_failure(self, failure: Failure, item: Incomplete) -> Failure:
        """A history's failure as this checkout's answer says it: HISTORY_FAILED (said once), and
        whose history it is when a submodule's."""
        whose = "" if item.paths.key == self.paths.key else f" (the history of submodule repository {item.url})"
        if failure.code == "HISTORY_FAILED":
            return attrs.evolve(failure, message=failure.message + whose)
        message, next_step = describe("HISTORY_FAILED", detail=f"{failure.code}: {failure.message}{whose}")
        return attrs.evolve(failure, code="HISTORY_FAILED", message=message, next=next_step)

    def credential_of(self, url: str) -> Credential | None:
        """The credential a history of url may use: the request's where it applies there."""
        if url == self.spec.url:
            return self.credential
        if self.credential is not None and self.credential.applies_to(url):
            return self.credential
        return credential_for(url, None, os.environ)

    def base_step(self, answer: Answer) -> Answer:
        from checkoutcache.clone import history

        found = history.merge_base_of(self.paths, self.name, self.base)
        if found == "":
            return self.error(CheckoutCacheError("NO_MERGE_BASE", commit=self.sha, base=self.base))
        if found is not None:
            return attrs.evolve(answer, base=self.base, merge_base=found)
        if history.base_handed_over(self.paths, self.name, self.base):
            # The search deepened as far as it may: the background history completes the two
            # commits' histories (BASE's ref is the mirror's), then the search answers at once.
            reached = self.boundary_reached(self.paths, [self.sha, self.base])
            if reached:
                return self.history_step([Incomplete(self.paths, self.spec.url, reached)], history=answer.history)
        now = time.time()
        if not locks.base_search_running(self.paths, self.name):
            failure = history.base_failure(self.paths, self.name, self.base)
            if failure is not None and now < failure.retry_at:
                return self.failed(failure, now)
            pid = history.start_base_search(self.paths, self.name, self.base, self.config, self.credential,
                                            fork=self.fork)
            if pid is not None:
                self.started_search = {"pid": pid}
        searching = history.bases_of(self.paths, self.name).get("searching") or {}
        if searching.get("base") != self.base:
            searching = {}  # another base's search runs: ours starts after it
        return self.owned_cloning(searching, self.started_search, history=answer.history,
                                  phase=history.BASE_PHASE)

    def owned_cloning(self, record: dict, started: dict | None, history: str | None, phase: str) -> Answer:
        """cloning, owned by the process of a record (the history's, a search's) or the one we started."""
        if not record.get("pid") and started is not None:
            record = {**record, **started}
        return Answer(state=State.CLONING, commit=self.sha, repo=self.spec.url, sparse=list(self.cone) or None,
                      pid=record.get("pid"), pid_namespace=record.get("pidns"),
                      started_at=iso(record.get("started_at")),
                      progress=record.get("progress") or {"phase": phase}, history=history, base=self.base)

    def failed(self, failure: Failure, now: float) -> Answer:
        return Answer(state=State.FAILED, commit=self.sha, repo=self.spec.url, sparse=list(self.cone) or None,
                      error=failure.code,
                      message=failure.message, next=failure.next,
                      retry_after=max(1, int(failure.retry_at - now + 0.999)))

    def cloning(self, record: dict | None) -> Answer:
        record = record or {}
        if not record.get("pid") and self.started is not None and _owner_lives(self.started):
            # Our own worker, slow to write its record (a loaded machine): we know its pid.
            record = {**record, **self.started}
        return Answer(state=State.CLONING, commit=self.sha, repo=self.spec.url, sparse=list(self.cone) or None,
                      pid=record.get("pid"),
                      pid_namespace=record.get("pidns"),
                      started_at=iso(record.get("started_at")), progress=record.get("progress") or {},
                      queue=record.get("queue") if isinstance(record.get("queue"), dict) else None)

    def error(self, exc: CheckoutCacheError) -> Answer:
        return Answer.from_error(exc, commit=self.sha, repo=self.spec.url)

    # ------------------------------------------------------------ steps
    def failure(self) -> Failure | None:
        return read_failure(self.paths.failure_record(self.name))

    def owner_record(self) -> dict | None:
        """The clone record of the live owner, or None once the clone lock is free.

        The lock held is not enough: gc holds it for a moment to tidy (with no
        record, or a dead owner's), and a starter writes its record a moment before
        its worker's. So this waits, briefly, for a record naming a live owner
        (by pid and start time where it shares our PID namespace; elsewhere the
        lock is the only evidence) or for the lock to go free."""
        deadline = time.monotonic() + RECORD_GRACE
        while True:
            record = records.read_json(self.paths.clone_record(self.name), records.CLONE)
            if record and record.get("pid") and _owner_lives(record):
                return record
            if not locks.clone_running(self.paths, self.name):
                return None
            if time.monotonic() >= deadline:
                return record or {}
            time.sleep(0.005)

    def first_contact(self) -> Answer | None:
        """Reach a repository never seen before, before writing anything for it.

        An unreachable one (no answer within the probe timeout, refused, unknown
        host) is recorded in unreachable/<key>.failed.json and answered from there,
        at once, until its back-off has passed: a tarpit costs one probe timeout
        per back-off, not one per ask. Returns that failed answer, or None once the
        store exists."""
        if store_exists(self.paths):
            refuse_newer_layout(self.paths, self.spec.url)  # nothing of ours goes into a newer store
            return None
        record_path = self.root_paths.unreachable_record(self.spec.key)
        previous = read_failure(record_path)
        now = time.time()
        if previous is not None and now < previous.retry_at:
            return self.failed(previous, now)
        try:
            pick_backend(self.config.transport).probe(self.spec.url, self.spec.is_local, self.credential,
                                                      self.config.probe_timeout)
        except CheckoutCacheError as exc:
            if exc.code != "UNREACHABLE":
                raise  # the caller's input (not a repository): nothing is written
            note = unbound_credential_note(self.spec.url, os.environ)
            if note:
                exc = CheckoutCacheError(exc.code, detail=exc.detail + note)
            now = time.time()
            failure = next_failure(previous, exc.code, exc.message, exc.next, now,
                                   self.config.backoff, self.config.backoff_max)
            try:  # the one thing written for a repository never reached
                make_dirs(self.root_paths.unreachable_dir)
                records.write_json(record_path, {**failure.to_record(), "repo": self.spec.url,
                                                 "scope": self.spec.scope})
            except OSError as write_error:
                raise root_error(self.root_paths.root, write_error) from None
            return self.failed(failure, now)
        init_repo_store(self.root_paths, self.paths, self.spec)
        records.remove_quietly(record_path)
        return None

    def step(self) -> Answer:
        """One look at the commit; starts the clone if it is absent."""
        marker = self.paths.ready_marker(self.name)
        if touch_if_ready(marker):
            return self.ready()
        clone_lock = locks.clone_of(self.paths, self.name)
        for _ in range(LOOKS_WHILE_LOCK_FLAPS):
            if clone_lock is not None:
                break
            owner = self.owner_record()
            if owner is not None:
                return self.cloning(owner)
            # The lock went free while we waited for its owner (gc let go, a worker ended).
            if touch_if_ready(marker):
                return self.ready()
            clone_lock = locks.clone_of(self.paths, self.name)
        if clone_lock is None:
            return self.cloning(records.read_json(self.paths.clone_record(self.name), records.CLONE) or {})
        # A worker may have published since our first look: look again under the lock.
        with locks.rechecked(clone_lock, lambda: not touch_if_ready(marker)) as still_absent:
            if still_absent is None:
                return self.ready()
            now = time.time()
            failure = self.failure()
            # A clone record while we hold the lock is a dead owner's: it carries the deaths so far
            # (once gc has tidied the dead record away, its count is in the deaths record).
            dead = records.read_json(self.paths.clone_record(self.name), records.CLONE) or \
                records.read_json(self.paths.deaths_record(self.name), records.DEATHS)
            # A dead owner that only queued the clone (serve's CloneQueue, serve then killed) ran no
            # worker: no death is counted for it.
            decision = next_step_for_not_ready(failure, _deaths(dead), now, queued=was_queued(dead))
            if decision.step is Step.BACK_OFF:
                return self.failed(failure, now)
            if decision.step is Step.GIVE_UP:
                return self.failed(self.record_deaths(failure, decision.deaths, now), now)
            return self.start_clone(clone_lock, decision.deaths)

    def record_deaths(self, previous: Failure | None, deaths: int, now: float) -> Failure:
        message, next_step = describe("WORKER_DIED", deaths=deaths)
        failure = next_failure(previous, "WORKER_DIED", message, next_step, now,
                               self.config.backoff, self.config.backoff_max)
        # The dead owner's record goes first: killed in between, the commit is merely
        # absent (a fresh count); the other order would fail it again after the back-off.
        records.remove_quietly(self.paths.clone_record(self.name))
        records.remove_quietly(self.paths.deaths_record(self.name))
        records.write_json(self.paths.failure_record(self.name), failure.to_record())
        return failure

    def start_clone(self, clone_lock: locks.Lock, deaths: int = 0) -> Answer:
        # The record is written before the worker starts, never after: a fast worker
        # removes its own record when it ends, and a starter's record written later
        # would outlive it and count as a death. The worker rewrites it with its pid.
        record = {"started_at": time.time(), "commit": self.sha, "progress": {"phase": "starting"},
                  "deaths": deaths}
        records.write_json(self.paths.clone_record(self.name), record)
        records.remove_quietly(self.paths.deaths_record(self.name))  # the count is in the clone record now
        try:
            pid = self.start(self.paths, self.name, clone_lock.fileno(), self.config, self.credential, deaths,
                             self.cone)
        except OSError as exc:
            records.remove_quietly(self.paths.clone_record(self.name))
            raise CheckoutCacheError("WORKER_START_FAILED", detail=exc.strerror or str(exc)) from None
        except CheckoutCacheError:  # refused (serve's clone queue is full): nothing started, nothing kept
            records.remove_quietly(self.paths.clone_record(self.name))
            raise
        if pid is None:
            return self.outcome()
        from checkoutcache.store.liveness import pid_namespace, process_start_time  # psutil only off the ready path

        self.started = {"pid": pid, "pid_start": process_start_time(pid), "pidns": pid_namespace()}
        # A start may have queued the clone (serve's CloneQueue): its record then says so and where.
        return self.cloning(records.read_json(self.paths.clone_record(self.name), records.CLONE) or record)

    def outcome(self) -> Answer:
        """What a clone that ran to its end here left: ready, or its failure."""
        if touch_if_ready(self.paths.ready_marker(self.name)):
            return self.ready()
        failure = self.failure()
        if failure is None:
            return self.error(CheckoutCacheError("CLONE_FAILED", detail="the clone ended without an outcome"))
        return self.failed(failure, time.time())

    def run(self, wait: float, on_progress: Callable[[Answer], None] | None = None) -> Answer:
        try:
            return self._run(wait, on_progress)
        except OSError as exc:
            # A record or lock that found no room, or an entry of a peer's we may not read:
            # answered with what and where, never a traceback; nothing is left half-made.
            return self.error(root_error(self.root_paths.root, exc))

    def _run(self, wait: float, on_progress: Callable[[Answer], None] | None) -> Answer:
        if self.cone and not pick_backend(self.config.transport).supports_sparse:
            return self.error(CheckoutCacheError("BAD_ARGUMENT", what="sparse checkouts need the git CLI transport "
                                                                      "(CHECKOUTCACHE_TRANSPORT=cli, or auto with "
                                                                      "git installed)"))
        try:
            unreachable = self.first_contact()
        except CheckoutCacheError as exc:
            return self.error(exc)
        if unreachable is not None:
            return unreachable
        deadline = time.monotonic() + wait
        # Watch before the first look: an event between our look and our wait is never missed.
        # A host process (no polling: serve's many waiters) answers before its watch is closed.
        with StateWatch(self.paths.state_dir, self.poll_first, close_aside=not self.poll_first) as watch:
            while True:
                try:
                    # gc or `evict` may drop a whole idle repository between our first look and
                    # this one: begin it again (no lock of its would ever be held: `cloning`
                    # with no owner until the wait ran out).
                    gone = self.first_contact() if not store_exists(self.paths) else None
                    if gone is not None:
                        return gone
                    answer = self.step()
                    if answer.state == State.READY:
                        answer = self.after_ready(answer)
                except CheckoutCacheError as exc:
                    return self.error(exc)
                if answer.state != State.CLONING or time.monotonic() >= deadline:
                    return answer
                if on_progress is not None:
                    on_progress(answer)
                watch.wait(min(LOOK_AGAIN, deadline - time.monotonic()))


def was_queued(dead_record: dict | None) -> bool:
    progress = (dead_record or {}).get("progress")
    return isinstance(progress, dict) and progress.get("phase") == "queued"


def _deaths(dead_record: dict | None) -> int | None:
    if dead_record is None:
        return None
    try:
        return max(0, int(dead_record.get("deaths", 0)))
    except (TypeError, ValueError):
        return 0


def _owner_lives(record: dict) -> bool:
    from checkoutcache.store.liveness import is_alive, same_pid_namespace

    if not same_pid_namespace(record.get("pidns")):
        return True  # its pid means nothing here: the held lock is the evidence
    return is_alive(record.get("pid"), record.get("pid_start"))
