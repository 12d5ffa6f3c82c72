"""How many clones serve runs at once, and whose go first (DESIGN invariant 18: "clones
are bounded however many are asked for"; issue 33, "Nothing bounds concurrent clone
workers").

Every new commit asked over the API used to start a detached worker at once: 24 scopes
of one token were 24 workers, 24 fetches and 24 mirrors, each living up to the clone
timeout. Now serve's starts go through one CloneQueue:

- at most `max_clones` workers of this serve run at once, at most
  `max_clones_per_token` of them started for one caller (a token's name; the Unix
  socket's callers are one caller);
- a clone past either bound waits in its caller's queue, and the queues are served
  round robin (the next free slot goes to the next caller with a clone waiting, not to
  whoever asked most), so one caller's flood delays its own clones, never another's;
- a queued clone is owned by serve itself: serve keeps the commit's clone lock (a dup
  of the descriptor the coordinator passes; the lock passes to the worker when it
  starts, never free in between: invariant 2) and writes the clone record naming its
  own pid, with `progress.phase: queued` and `queue` (its place in its caller's queue,
  how many wait, how many run): a `cloning` answer says it is queued and where, and
  names a live owner (if serve dies, the lock goes with it and the commit is absent); the
  record is rewritten only when that place moves (every write wakes the repository's waiters);
- queues are bounded too (`max_queued`, `max_queued_per_token`): past them the
  request is answered SERVER_BUSY, and nothing is recorded.

The decisions (`next_caller`, `room_for`) are pure; the rest holds descriptors.
"""

from __future__ import annotations

import collections
import os
import select
import threading
import time
from typing import Callable

import attrs

from checkoutcache.errors import CheckoutCacheError
from checkoutcache.store import records
from checkoutcache.store.layout import RepoPaths

@attrs.frozen
class Bounds:
    max_clones: int
    max_clones_per_caller: int
    max_queued: int
    max_queued_per_caller: int


def room_for(caller: str, running: dict[str, int], bounds: Bounds) -> bool:
    """Whether a clone of caller's may start now (running: workers running per caller)."""
    return sum(running.values()) < bounds.max_clones and running.get(caller, 0) < bounds.max_clones_per_caller


def next_caller(order: list[str], queued: dict[str, int], running: dict[str, int], bounds: Bounds) -> str | None:
    """The caller whose oldest queued clone starts next: the first in round-robin order with
    a clone waiting and room under its own bound (None: none may start now)."""
    if sum(running.values()) >= bounds.max_clones:
        return None
    for caller in order:
        if queued.get(caller, 0) and running.get(caller, 0) < bounds.max_clones_per_caller:
            return caller
    return None


@attrs.define
class Waiting:
    """A queued clone: what its worker will be started with, and serve's hold of its lock."""

    caller: str
    paths: RepoPaths
    name: str
    lock_fd: int  # serve's own descriptor of the commit's clone lock (a dup)
    config: object
    credential: object
    deaths: int
    cone: tuple
    since: float
    record: dict


# start(paths, name, lock fd, config, credential, deaths, cone) -> the worker's pid (spawn.py's Start)
StartWorker = Callable[..., int]


class CloneQueue:
    def __init__(self, bounds: Bounds, start_worker: StartWorker, own_identity: dict,
                 on_change: Callable[[], None] | None = None):
        """own_identity: serve's pid, start time and PID namespace (a queued clone's owner)."""
        self.bounds = bounds
        self.start_worker = start_worker
        self.own = own_identity
        self.on_change = on_change
        self.lock = threading.Lock()
        self.running: dict[str, list[int]] = collections.defaultdict(list)  # caller -> pidfds of its workers
        self.waiting: dict[str, collections.deque[Waiting]] = collections.defaultdict(collections.deque)
        self.order: list[str] = []  # round robin: the caller served last goes to the end
        self.started = 0

    # ------------------------------------------------------------ the coordinator's Start
    def starter(self, caller: str, repos: tuple[str, ...] = ()):
        """The coordinator's Start for one caller's request (clone/coordinator.py). repos: the
        caller's own repository patterns (a token's repos=): its clone's submodules must match
        them too (config.submodule_repos)."""
        def start(paths: RepoPaths, name: str, lock_fd: int, config, credential, deaths: int, cone=()) -> int:
            if repos:
                config = attrs.evolve(config, submodule_repos=tuple(repos))
            return self.admit(caller, paths, name, lock_fd, config, credential, deaths, tuple(cone))

        return start

    def admit(self, caller: str, paths: RepoPaths, name: str, lock_fd: int, config, credential, deaths: int,
              cone: tuple) -> int:
        """Start the worker now (its pid), or queue the clone (serve's own pid: it owns it);
        SERVER_BUSY past the queues' bounds (nothing kept)."""
        with self.lock:
            self.prune()
            counts = self.counts()
            if room_for(caller, counts, self.bounds) and not self.waiting.get(caller):
                return self.launch(caller, paths, name, lock_fd, config, credential, deaths, cone)
            queued = sum(len(q) for q in self.waiting.values())
            mine = len(self.waiting.get(caller, ()))
            if queued >= self.bounds.max_queued or mine >= self.bounds.max_queued_per_caller:
                whose = "in all" if queued >= self.bounds.max_queued else "for this token"
                raise CheckoutCacheError("SERVER_BUSY", why=f"{max(queued, mine)} clones are queued {whose} "
                                                            f"already ({self.bounds.max_clones} run at once)")
            record = records.read_json(paths.clone_record(name), records.CLONE) or {}
            entry = Waiting(caller, paths, name, os.dup(lock_fd), config, credential, deaths, cone,
                            time.monotonic(), record)
            self.waiting[caller].append(entry)
            if caller not in self.order:
                self.order.append(caller)
            self.write_records()
        return self.own["pid"]

    def adopt(self, pids: list[int], caller: str = "earlier serve") -> None:
        """Workers an earlier serve of this root started (killed, its workers live on, ours now by
        the subreaper): they take slots until they end, so a crash loop never runs more than
        max_clones at once."""
        with self.lock:
            for pid in pids:
                try:
                    self.running[caller].append(os.pidfd_open(pid))
                except OSError:
                    continue  # gone already

    def could_take(self, caller: str) -> bool:
        """Whether a new clone of caller's would be started or queued now (not SERVER_BUSY)."""
        with self.lock:
            self.prune()
            if room_for(caller, self.counts(), self.bounds) and not self.waiting.get(caller):
                return True
            queued = sum(len(q) for q in self.waiting.values())
            return queued < self.bounds.max_queued and len(self.waiting.get(caller, ())) < \
                self.bounds.max_queued_per_caller

    def interest(self, caller: str, paths: RepoPaths, name: str) -> bool:
        """Another caller asks for a clone that waits in someone's queue: it starts now, counted
        as that caller's, when that caller has room (a commit one token queued is never cloned
        at that token's pace for another). Whether it started."""
        with self.lock:
            self.prune()
            if self.waiting.get(caller) or not room_for(caller, self.counts(), self.bounds):
                return False
            for owner, queue in self.waiting.items():
                for entry in queue:
                    if entry.paths.key == paths.key and entry.name == name and owner != caller:
                        queue.remove(entry)
                        if not queue and owner in self.order:
                            self.order.remove(owner)
                        self.launch_queued(caller, entry)
                        self.write_records()
                        return True
        return False

    # ------------------------------------------------------------ bookkeeping
    def counts(self) -> dict[str, int]:
        return {caller: len(fds) for caller, fds in self.running.items() if fds}

    def prune(self) -> None:
        """Forget workers that ended (their pidfd is readable). Caller holds self.lock."""
        for caller, fds in self.running.items():
            alive = []
            for fd in fds:
                if select.select([fd], [], [], 0)[0]:
                    os.close(fd)
                else:
                    alive.append(fd)
            fds[:] = alive

    def launch_queued(self, caller: str, entry: Waiting) -> None:
        """Start a queued clone's worker, counted for caller, and say so in its record at once
        (until the worker writes its own, an asker would read serve's queued record). Its lock
        goes to the worker (serve's descriptor is closed). Caller holds self.lock."""
        try:
            pid = self.launch(caller, entry.paths, entry.name, entry.lock_fd, entry.config, entry.credential,
                              entry.deaths, entry.cone)
            from checkoutcache.store.liveness import pid_namespace, process_start_time

            record = {k: v for k, v in entry.record.items() if k != "queue"}
            records.write_json(entry.paths.clone_record(entry.name),
                               {**record, "pid": pid, "pid_start": process_start_time(pid), "pidns": pid_namespace(),
                                "progress": {"phase": "starting"}})
        except (OSError, CheckoutCacheError):
            # Not started: the commit turns absent (its record a queued owner's, never a death).
            records.remove_quietly(entry.paths.clone_record(entry.name))
        finally:
            os.close(entry.lock_fd)

    def launch(self, caller: str, paths: RepoPaths, name: str, lock_fd: int, config, credential, deaths: int,
               cone: tuple) -> int:
        """Start a worker, counted for caller. Caller holds self.lock."""
        pid = self.start_worker(paths, name, lock_fd, config, credential, deaths, cone)
        self.started += 1
        try:
            self.running[caller].append(os.pidfd_open(pid))
        except OSError:
            pass  # it ended already: it holds no slot
        return pid

    def write_records(self) -> None:
        """Each queued clone's record: owned by serve, with its place in its caller's queue,
        rewritten only when that place moved (each write wakes every waiter of the repository:
        store/watch.py). Caller holds self.lock."""
        for queue in self.waiting.values():
            for position, entry in enumerate(queue, 1):
                place = {"position": position, "max_clones": self.bounds.max_clones,
                         "max_clones_per_token": self.bounds.max_clones_per_caller}
                if entry.record.get("queue") == place:
                    continue
                record = {**entry.record, "pid": self.own["pid"], "pid_start": self.own["pid_start"],
                          "pidns": self.own["pidns"], "progress": {"phase": "queued"}, "queue": place}
                try:
                    records.write_json(entry.paths.clone_record(entry.name), record)
                    entry.record = record
                except OSError:
                    pass  # the place is what an answer shows: never the reason a clone is lost

    # ------------------------------------------------------------ the dispatcher
    def dispatch(self) -> int:
        """Start every queued clone that may start now, round robin; how many started."""
        started = 0
        with self.lock:
            self.prune()
            while True:
                caller = next_caller(self.order, {c: len(q) for c, q in self.waiting.items()}, self.counts(),
                                     self.bounds)
                if caller is None:
                    break
                entry = self.waiting[caller].popleft()
                self.order.remove(caller)
                if self.waiting[caller]:
                    self.order.append(caller)
                self.launch_queued(caller, entry)
                started += 1
            if started:
                self.write_records()
        if started and self.on_change is not None:
            self.on_change()
        return started

    def run(self, stopping: threading.Event, every: float = 0.05) -> None:
        """The dispatcher's loop, until serve stops; then every queued clone is let go."""
        while not stopping.wait(every):
            if any(self.waiting.values()):
                self.dispatch()
        self.drop_all()

    def drop_all(self) -> None:
        """serve stops: queued clones are let go (their records removed, then their locks),
        so each commit is absent for the next ask, with no death counted."""
        with self.lock:
            for queue in self.waiting.values():
                while queue:
                    entry = queue.popleft()
                    records.remove_quietly(entry.paths.clone_record(entry.name))
                    os.close(entry.lock_fd)
            self.order.clear()

    def figures(self) -> dict:
        with self.lock:
            self.prune()
            return {"running": sum(self.counts().values()), "queued": sum(len(q) for q in self.waiting.values())}
