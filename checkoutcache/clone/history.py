"""A repository's history after its first answer (issue 34): the background history,
and the merge base a review asks for.

A cold node's first answer comes from a depth-1 fetch of the commit alone (worker.py,
git/shallow.py): the mirror is shallow, and every checkout's git sees the mirror's
boundary through its `.git/shallow` link. This module owns what follows.

The background history (`History`) is a detached process of its own, one per
repository: its starter takes locks/history.lock without waiting and hands it over (as
a clone's lock: the process holds it for its whole life, and its death frees it at
once). It is started after a publish into a shallow mirror (the clone worker), and
started again, when it died, by gc (every run, so serve's schedule and cron alike) and by
`ensure --history full`; a failure backs off (state/history.failed.json) as a clone's
does. It runs at a lower CPU and IO priority (CHECKOUTCACHE_HISTORY_NICE, IO
best-effort 7), waits while the repository's clones are fetching (YIELD_TO_CLONES at
most) and under CHECKOUTCACHE_HISTORY_TIMEOUT. Its steps, each a kill point of the
fault tests (testhooks.py, named in brackets):

1. [history-start] the mirror is still shallow, and there is room: free space above
   the reserve (min-free, else 5% of the disk) by HISTORY_ROOM at least, watched
   through the fetch (a fetch that would take the disk below the reserve is stopped:
   DISK_FULL);
2. [history-before-seed] bundles (CHECKOUTCACHE_BUNDLE_URI) into history.git, once;
3. [history-before-fetch] [history-during-fetch] fetch, into <key>/history.git, every
   commit the mirror's refs name and history.git does not prove yet, by id (every branch
   and tag when the server refuses ids, then each commit still missing alone: one the
   server no longer has keeps no other out), as a clone would: a repository of its own, no
   alternates, no shallow boundary, so the server answers from its bitmaps and sends
   each object once (a deepening of the shallow mirror costs 1.7x a clone: the server's
   shallow walk). What arrives stays a pack however small (`fetch.unpackLimit=1`: the
   install links packs only). git's fsck choices apply (git/env.py); a partial mirror's
   history is fetched with its filter and, where git cannot check a partial fetch with
   our choices, checked by fsck after (git/quarantine.py); for a partial one every commit
   and tree its refs reach is walked (git takes a missing one for promised);
4. [history-after-fetch] what history.git proves: every commit its refs reach (git
   checked each ref's history connected, in a repository with nothing else);
5. under locks/mirror.lock, for milliseconds: history.git's packs hard-linked into the
   mirror (`.idx` last; loose objects, which an older version's fetch left, packed first:
   none is ever left behind) [history-during-install], then [history-after-packs] the
   mirror's shallow file loses every entry history.git proves and every one no ref of the
   mirror reaches any more (git's own prune would drop those);
6. [history-after-install] new refs came meanwhile (clones of new commits, fetched at
   depth 1): again from 3, fetching only what they add; complete: history.git goes, and
   state/history.json says when. Nothing moved and the mirror still shallow: the commits
   left are those the server no longer gives (force-pushed away): HISTORY_FAILED, backing
   off, naming them, with the boundary left (state/history.failed.json `boundary`): the
   failure holds for the commits behind those entries alone (`--history full` of any
   other commit answers complete, a commit fetched later starts the history at once),
   and once their checkouts are evicted gc's prune drops the entries.

Killed at any step, the store is consistent (the mirror's file claims at most less
history than it has) and the next start resumes: history.git keeps what was fetched
whole (a fetch killed mid-pack is fetched again: git cannot resume a pack), links
already made are skipped, the shallow file is computed anew.

The merge base (`BaseSearch`, `ensure HEAD --base BASE`): a detached process too, under
locks/base-<name>.lock (one search per checkout at a time), at the answers' priority.
BASE is kept in the mirror by refs/bases/<BASE> (so the checkout's git reads it, and the
history completes it too) until gc drops it with the last checkout whose record names it.
With a complete mirror, BASE is fetched as any new commit and `git merge-base` answers.
With a shallow one, in a private view of the mirror (HEAD's keep-ref and BASE as its
refs, the boundary their histories reach as its shallow file, objects in its scratch):
BASE at depth 1, then `--deepen` 1, 2, 4, ... commits (the view's boundary alone moves)
until git's merge base is proven: every boundary commit the two reach is an ancestor of
every merge base git finds (nothing hidden below can then be a better one), or the two
histories are complete. The deepening stops at CHECKOUTCACHE_BASE_DEEPEN commits: the
search then hands over to the background history (the answer is the history's progress,
and the merge base is searched again, without a fetch, once the two histories are
complete). Either way its objects go into the mirror with every boundary entry they need,
HEAD's side and BASE's, unless the mirror's history completed meanwhile (nothing of the
view goes in: the complete mirror is searched instead), and state/<name>.bases.json
records the merge base (the ready answer with `--base` reads it; a record of an older
version, whose merge bases were never proven, is not read).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from typing import Callable

from checkoutcache.clone.decide import next_failure
from checkoutcache.clone.process import become_detached, count_upstream, fork_detached, open_attempt_log, \
    stop_on_sigterm, tracking
from checkoutcache.config import Config
from checkoutcache.credentials import (
    Credential,
    credential_env,
    credential_from_env,
    redact,
    secrets_of,
    without_credentials,
)
from checkoutcache.errors import CheckoutCacheError, describe, is_disk_full
from checkoutcache.git import mirror as mirror_module
from checkoutcache.git.backend import ALL_BRANCHES_AND_TAGS, GitKilled, base_ref, keep_ref
from checkoutcache.git.shallow import is_shallow, read_shallow, write_shallow
from checkoutcache.git.transport import pick_backend
from checkoutcache.store import locks, records, tree
from checkoutcache.store.checkouts import remove_tree, to_trash
from checkoutcache.store.layout import RepoPaths, RootPaths, commit_of
from checkoutcache.store.liveness import own_identity, pid_namespace
from checkoutcache.store.modes import set_store_umask
from checkoutcache.store.records import read_failure
from checkoutcache.testhooks import checkpoint

HISTORY_LOG = "history"  # logs/history.log (clone logs are named by checkout: never this)
HISTORY_PHASE = "fetching history"
BASE_PHASE = "finding the merge base"
PROGRESS_INTERVAL = 0.5
# How long the history waits for the repository's clones in flight before it fetches:
# answers first (a clone's fetch and the history's share the link and the server).
YIELD_TO_CLONES = 60.0
# Free space the history wants beyond the reserve before it starts (its size is unknown
# until it arrives: the watch during the fetch is the real bound).
HISTORY_ROOM = 8 << 20
# The reserve when no min-free is set: as gc keeps for a repack (upkeep/mirror_upkeep.py REPACK_RESERVE).
RESERVE_SHARE = 0.05
SPACE_CHECK_EVERY = 0.5
EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT, EXIT_STOPPED = 0, 1, 3, 143
# Pack files a history links into the mirror, the index last (git sees a pack by its index).
_PACK_ORDER = {"pack": 0, "rev": 1, "promisor": 2, "idx": 3}
# Processes spawned (not forked) by this process: waited for once they end.
_STARTED: list = []
# The most bases one checkout's record keeps (the newest).
MAX_BASES = 64


def history_state(paths: RepoPaths) -> str:
    """What the mirror's history is: "shallow" (a boundary) or "complete"."""
    return "shallow" if is_shallow(paths.mirror) else "complete"


def reserve_bytes(config: Config, total: int) -> int:
    return config.min_free.bytes_of(total) if config.min_free else int(total * RESERVE_SHARE)


def history_failure(paths: RepoPaths):
    return read_failure(paths.history_failure)


def failure_covers(paths: RepoPaths, reached: frozenset[str]) -> bool:
    """Whether the history's last failure holds for these boundary commits: it does for a failure
    of the repository's whole history (the server down, a refused object, no room), and for one
    that completed every commit but those the server no longer has only when these are among
    the boundary commits it left (a commit fetched since is not kept waiting behind it)."""
    record = records.read_json(paths.history_failure) or {}
    left = record.get("boundary")
    if not isinstance(left, list):
        return True
    return reached <= frozenset(left)


# ---------------------------------------------------------------- starting
def start_history(paths: RepoPaths, config: Config, credential: Credential | None, fork: bool = False,
                  force: bool = False) -> int | None:
    """Start the repository's background history when its mirror is shallow, none runs and
    its last failure's back-off has passed (force: whatever the back-off, as a review that
    asked for the history does after the back-off it was answered); the pid, or None."""
    backend = pick_backend(config.transport)
    if not getattr(backend, "supports_shallow", False) or not is_shallow(paths.mirror):
        return None
    failure = history_failure(paths)
    if failure is not None and time.time() < failure.retry_at and not force and failure_covers(paths, read_shallow(
            paths.mirror)):
        return None  # backing off (a commit fetched since at depth 1 is not kept waiting by it)
    held = locks.history_of(paths)
    if held is None:
        return None  # one runs
    with held:
        if not is_shallow(paths.mirror):
            return None  # it completed while we looked
        records.write_json(paths.history_record, {"started_at": time.time(), "progress": {"phase": "starting"}})
        try:
            return start_detached(paths, ["--history"], held.fileno(), config, credential, fork, HISTORY_LOG)
        except OSError:
            records.remove_quietly(paths.history_record)
            raise


def start_base_search(paths: RepoPaths, name: str, base: str, config: Config, credential: Credential | None,
                      fork: bool = False) -> int | None:
    """Start the merge-base search of checkout NAME's commit and BASE unless one runs for the
    checkout (its pid, or None)."""
    held = locks.base_search_of(paths, name)
    if held is None:
        return None
    with held:
        if merge_base_of(paths, name, base) is not None:
            return None
        note_search(paths, name, base, {"started_at": time.time(), "progress": {"phase": "starting"}})
        return start_detached(paths, ["--checkout", name, "--base", base], held.fileno(), config, credential,
                              fork, name)


def start_detached(paths: RepoPaths, args: list[str], lock_fd: int, config: Config,
                   credential: Credential | None, fork: bool, log_name: str) -> int:
    """A process of this module, in a session of its own, holding the lock it inherits (as a
    clone worker: clone/spawn.py): forked from this process (fork: one we own entirely, the
    CLI or a clone worker), else a fresh Python. Credentials go by environment only."""
    if fork:
        return _fork(paths, args, lock_fd, config, credential, log_name)
    import subprocess

    env = without_credentials(os.environ)
    env.update(config.to_env())
    env.update(credential_env(credential))
    parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (parent, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "checkoutcache.clone.history", "--root", paths.root, "--key", paths.key,
           "--lock-fd", str(lock_fd), *args]
    log_fd = tree.open_file(paths.clone_log(log_name), os.O_WRONLY | os.O_APPEND, create=True)
    with os.fdopen(log_fd, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                pass_fds=(lock_fd,), start_new_session=True, cwd="/", env=env)
    _STARTED[:] = [p for p in _STARTED if p.poll() is None]  # waited for: no zombie of a long-lived caller
    _STARTED.append(proc)
    return proc.pid


def _fork(paths: RepoPaths, args: list[str], lock_fd: int, config: Config, credential: Credential | None,
          log_name: str) -> int:
    import setproctitle

    # Our argv may carry a token in a URL: no instant of a child shows it (as clone/spawn.py).
    setproctitle.setproctitle(redact(" ".join(sys.argv)))
    return fork_detached(lambda: _become(paths, args, lock_fd, config, credential, log_name), "history process")


def _become(paths: RepoPaths, args: list[str], lock_fd: int, config: Config, credential: Credential | None,
            log_name: str) -> None:
    become_detached(paths, log_name, lock_fd, credential, f"checkoutcache-history {paths.key} {' '.join(args)}",
                    lambda: run(paths.root, paths.key, config, credential, args))


def run(root: str, key: str, config: Config, credential: Credential | None, args: list[str]) -> int:
    set_store_umask()
    paths = RootPaths(root).repo(key)
    if args and args[0] == "--history":
        job: Job = History(paths, config, credential)
    else:
        job = BaseSearch(paths, config, credential, name=args[1], base=args[3])
    stop_on_sigterm(job.on_stop)
    return job.run()


def lower_priority(nice: int) -> None:
    """This process (and the git it starts) below the answers: CPU niceness, IO best-effort 7."""
    if nice <= 0:
        return
    try:
        os.nice(nice)
    except OSError:
        pass
    try:
        import psutil

        psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (OSError, AttributeError, ValueError, ImportError):
        pass  # not Linux, or not allowed: the CPU niceness alone


# ---------------------------------------------------------------- a detached job
class NoVerdict(Exception):
    """A job that ends with nothing to record (its subject went while it ran)."""


def marker_identity(paths: RepoPaths, name: str) -> tuple[int, int] | None:
    """Which published checkout NAME is (its marker's inode): an evicted and remade one differs."""
    try:
        info = tree.lstat(paths.ready_marker(name))
    except OSError:
        return None
    return info.st_dev, info.st_ino


class Job:
    """What the background history and a merge-base search share: a log, a record with
    the owner and progress, a time limit, SIGTERM, and failures that back off."""

    record_path: str
    failure_path: str | None
    phase: str
    timeout: float

    def __init__(self, paths: RepoPaths, config: Config, credential: Credential | None, log_name: str):
        self.paths = paths
        self.config = config
        self.credential = credential
        self.secrets = secrets_of(credential)
        info = records.read_json(paths.repo_json, records.REPO) or {}
        self.url = info.get("url", "")
        self.is_local = bool(info.get("is_local", False))
        self.scope = info.get("scope", "default")
        self.backend = pick_backend(config.transport)
        self.pid, self.pid_start = own_identity()
        self.started_at = time.time()
        self.progress: dict = {}
        self._last_write = 0.0
        self._finishing = threading.Lock()
        self._timer: threading.Timer | None = None
        self._log = open_attempt_log(paths, log_name)

    def log(self, line: str) -> None:
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
        try:
            self._log.write(f"{stamp} {redact(line[:4096], self.secrets)}\n")
        except (OSError, ValueError):
            pass

    def journal(self, event: str, **fields) -> None:
        """One line in serve's clone journal (CHECKOUTCACHE_CLONE_JOURNAL), as a worker writes."""
        import json

        path = os.environ.get("CHECKOUTCACHE_CLONE_JOURNAL")
        if not path:
            return
        line = json.dumps({"event": event, "repo": self.paths.key, "pid": self.pid, "at": time.time(), **fields})
        try:
            fd = tree.open_file(path, os.O_WRONLY | os.O_APPEND, create=True)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            pass  # observability only

    def owner(self) -> dict:
        return {"pid": self.pid, "pid_start": self.pid_start, "pidns": pid_namespace(),
                "started_at": self.started_at, "progress": self.progress}

    def write_record(self) -> None:  # pragma: no cover - each job writes its own
        raise NotImplementedError

    def on_progress(self, update: dict) -> None:
        phase_changed = update.get("phase") != self.progress.get("phase")
        self.progress.update(update)
        if phase_changed or time.monotonic() - self._last_write >= PROGRESS_INTERVAL:
            self._last_write = time.monotonic()
            try:
                self.write_record()
            except OSError:
                pass
        self.during_fetch()

    def during_fetch(self) -> None:
        pass

    def run(self) -> int:
        self.write_record()
        self._timer = threading.Timer(self.timeout, self.on_timeout)
        self._timer.daemon = True
        self._timer.start()
        try:
            self.work()
        except NoVerdict as exc:  # the job's subject went meanwhile: nothing to say of it
            with self._finishing:
                self.log(str(exc))
                self.forget_record()
            return EXIT_FAILED
        except BaseException as exc:  # every failure is recorded; SIGKILL is the only exception
            with self._finishing:
                self.failed(*self.explain(exc))
            return EXIT_FAILED
        finally:
            self._timer.cancel()
            self._log.close()
        return EXIT_OK

    def work(self) -> None:  # pragma: no cover
        raise NotImplementedError

    def explain(self, exc: BaseException) -> tuple[str, str, str]:
        if isinstance(exc, CheckoutCacheError):
            return exc.code, redact(exc.message, self.secrets), exc.next
        if isinstance(exc, GitKilled):
            return ("CLONE_FAILED", *describe("CLONE_FAILED", detail=redact(str(exc), self.secrets)))
        if is_disk_full(exc):
            return ("DISK_FULL", *describe("DISK_FULL", detail=str(exc)))
        if isinstance(exc, locks.LockTimeout):
            return ("TIMEOUT", *describe("TIMEOUT", limit="the mirror lock's wait"))
        self.log(f"unexpected {type(exc).__name__}: {exc}")
        return ("CLONE_FAILED", *describe("CLONE_FAILED", detail=f"{type(exc).__name__}: {exc}"))

    def failed(self, code: str, message: str, next_step: str) -> None:  # pragma: no cover
        raise NotImplementedError

    def stop_git(self) -> None:
        from checkoutcache.git.cli import RUNNING

        RUNNING.kill_all()

    def on_stop(self) -> None:
        """SIGTERM: no verdict, nothing recorded against the repository; started again later."""
        if not self._finishing.acquire(blocking=False):
            return
        self.stop_git()
        self.log("stopped by SIGTERM: nothing is recorded; it starts again later")
        self.forget_record()
        os._exit(EXIT_STOPPED)

    def on_timeout(self) -> None:
        if not self._finishing.acquire(blocking=False):
            return
        self.stop_git()
        self.failed("TIMEOUT", f"the {self.phase} did not finish within {self.timeout:g}s",
                    "raise CHECKOUTCACHE_HISTORY_TIMEOUT if the history is that large; retried after the back-off")
        os._exit(EXIT_TIMEOUT)

    def forget_record(self) -> None:  # pragma: no cover
        raise NotImplementedError


# ---------------------------------------------------------------- the background history
class History(Job):
    phase = HISTORY_PHASE

    def __init__(self, paths: RepoPaths, config: Config, credential: Credential | None):
        super().__init__(paths, config, credential, HISTORY_LOG)
        self.timeout = config.history_timeout
        self.rounds = 0
        self.seeded: bool | None = None
        self.space_short: str | None = None  # set by the watch when the disk went below the reserve
        self.filter = None
        # Commits the server no longer gives (refused by id, and on no branch or tag): not asked
        # for again in this run.
        self.unfetchable: set[str] = set()
        # The boundary left when only such commits' histories were missing (the failure says so).
        self.left: frozenset[str] | None = None

    @property
    def repo(self) -> str:
        return self.paths.history_repo

    def write_record(self) -> None:
        records.write_json(self.paths.history_record, {**self.owner(), "rounds": self.rounds})

    def forget_record(self) -> None:
        records.remove_quietly(self.paths.history_record)

    def failed(self, code: str, message: str, next_step: str) -> None:
        if self.filter is not None and code != "TIMEOUT" and tree.lexists(self.repo):
            # A partial repository takes what it lacks for promised: after a failure nothing
            # in it is trusted to resume from (a full one's own checks refetch what is missing).
            slot = to_trash(self.paths, self.repo, "history")
            if slot is not None:
                remove_tree(slot)
        previous = read_failure(self.paths.history_failure)
        failure = next_failure(previous, code, message, next_step, time.time(), self.config.backoff,
                               self.config.backoff_max)
        left = {"boundary": sorted(self.left)} if self.left is not None and code == "HISTORY_FAILED" else {}
        records.write_json(self.paths.history_failure, {**failure.to_record(), **left})
        self.forget_record()
        self.log(f"failed: {code}: {message} (attempt {failure.attempts}, retried in "
                 f"{failure.retry_at - failure.failed_at:.0f}s)")

    def during_fetch(self) -> None:
        checkpoint("history-during-fetch")

    def work(self) -> None:
        lower_priority(self.config.history_nice)
        self.log(f"history of {self.url} by pid {self.pid} (nice {self.config.history_nice})")
        checkpoint("history-start")
        while self.backend.is_usable(self.paths.mirror) and is_shallow(self.paths.mirror):
            self.filter = self.backend.partial_filter(self.paths.mirror)
            self.prepare_repo()
            proven = self.proven()
            wanted = self.wanted(proven) - self.unfetchable
            if wanted:
                self.check_space()
                self.seed()
                self.yield_to_clones()
                checkpoint("history-before-fetch")
                self.unfetchable |= self.fetch(wanted)
                checkpoint("history-after-fetch")
                proven = self.proven()
            dropped = self.install(proven)
            self.rounds += 1
            checkpoint("history-after-install")
            if not is_shallow(self.paths.mirror):
                break
            if not dropped and not (wanted & proven):
                # Nothing moved: what is left cannot be completed from this server now. Every
                # commit whose history it has is complete (its entries went); the boundary left
                # is that of the commits it cannot fetch, and the failure holds for them alone.
                missing = sorted(self.wanted(proven))
                self.left = read_shallow(self.paths.mirror)
                detail = (f"{len(missing)} commit(s) the mirror keeps are no longer on the server (refused by id, "
                          f"and on no branch or tag: force-pushed away?), e.g. {missing[0]}; their checkouts stay "
                          f"shallow, every other commit's history is complete" if missing else
                          f"{len(self.left)} boundary commit(s) could not be completed")
                raise CheckoutCacheError("HISTORY_FAILED", detail=detail)
        self.finish()

    # -------------------------------------------------------- steps
    def prepare_repo(self) -> None:
        """history.git: made once (a bare repository of its own, the mirror's filter), and tidied
        of what a killed fetch left when resumed (we hold its only writer's lock)."""
        if self.backend.is_usable(self.repo):
            for stale in mirror_module.remove_stale_leftovers(self.repo, min_age=0.0):
                self.log(f"removed {stale} a killed fetch left")
            return
        if tree.lexists(self.repo):
            to_trash(self.paths, self.repo, "history")
        self.backend.init_mirror(self.repo, self.filter)

    def proven(self) -> set[str]:
        """The commits history.git's refs reach: complete (git checked each ref's history there)."""
        if not os.path.isdir(os.path.join(self.repo, "refs")):
            return set()
        return self.backend.reachable_commits(self.repo)

    def wanted(self, proven: set[str]) -> set[str]:
        """The commits the mirror's refs name that history.git does not prove yet."""
        tips = {sha for sha, kind in self.backend.refs_named(self.paths.mirror).values() if kind == "commit"}
        return tips - proven

    def check_space(self) -> None:
        usage = shutil.disk_usage(self.paths.base)
        reserve = reserve_bytes(self.config, usage.total)
        if usage.free - reserve < HISTORY_ROOM:
            raise CheckoutCacheError("DISK_FULL", detail=(
                f"the history needs room: {usage.free >> 20} MiB free, {reserve >> 20} MiB kept free "
                f"(min-free, else 5% of the disk)"))

    def seed(self) -> None:
        """Bundles into history.git, once per history (CHECKOUTCACHE_BUNDLE_URI): only a speed-up."""
        location = self.config.bundle_uri
        if location is None or self.is_local or self.seeded is not None:
            return
        seed = records.read_json(self.paths.seed_record, records.SEED)
        if seed is not None:  # a resumed history: its bundles are in history.git already
            self.seeded = bool(seed.get("seeded"))
            return
        from checkoutcache.bundles.location import bundle_key
        from checkoutcache.bundles.seed import seed_mirror

        checkpoint("history-before-seed")
        self.on_progress({"phase": "seeding from bundles"})
        result = seed_mirror(self.repo, location, bundle_key(self.scope, self.url, self.is_local), self.repo, (),
                             self.config.seed_timeout, self.log, reachable_only=self.backend.name == "pygit2")
        result.write_record(self.paths.seed_record)
        self.seeded = result.seeded
        self.journal("seeded", outcome=result.outcome, reason=result.reason or "", bundles=len(result.bundles))

    def yield_to_clones(self) -> None:
        """Answers first: wait while clones of the repository fetch (YIELD_TO_CLONES at most)."""
        deadline = time.monotonic() + YIELD_TO_CLONES
        while time.monotonic() < deadline and any(locks.clone_running(self.paths, name)
                                                  for name in self.paths.clone_lock_names()):
            self.on_progress({"phase": "waiting for clones"})
            time.sleep(0.2)

    def fetch(self, wanted: set[str]) -> set[str]:
        """Every wanted commit's history into history.git, by id (all branches and tags when the
        server refuses ids), the disk watched. The commits the server no longer gives: refused
        by id and on no branch or tag (each wanted commit still missing is asked for alone, so
        one force-pushed away keeps no other out)."""
        self.on_progress({"phase": HISTORY_PHASE})
        refspecs = [f"+{sha}:{keep_ref(sha)}" for sha in sorted(wanted)]
        self.log(f"fetching the history of {len(refspecs)} commit(s)")
        received: dict[str, int] = {}
        track = tracking(received, self.on_progress)
        unfetchable: set[str] = set()
        try:
            self.watched(lambda: self.backend.fetch(self.repo, self.url, refspecs, self.credential, track, self.log,
                                                    whole_packs=True))
        except CheckoutCacheError as exc:
            if exc.code == "DISK_FULL":
                raise
            self.log(f"fetch by id refused ({exc.detail}); fetching every branch and tag")
            self.watched(lambda: self.backend.fetch(self.repo, self.url, ALL_BRANCHES_AND_TAGS, self.credential,
                                                    track, self.log, whole_packs=True))
            left = sorted(wanted - self.proven())
            for sha in left if len(wanted) > 1 else ():
                try:
                    self.watched(lambda sha=sha: self.backend.fetch(self.repo, self.url, [f"+{sha}:{keep_ref(sha)}"],
                                                                    self.credential, track, self.log,
                                                                    whole_packs=True))
                except CheckoutCacheError as refused:
                    if refused.code == "DISK_FULL":
                        raise
                    unfetchable.add(sha)
            if len(wanted) == 1:
                unfetchable.update(left)
            if unfetchable:
                self.log(f"{len(unfetchable)} commit(s) the server no longer gives: {' '.join(sorted(unfetchable))}")
        if self.filter is not None and not self.backend.is_sound(self.repo):
            # A partial fetch's connectivity check takes a missing commit or tree for promised,
            # and a commit already there (a bundle's stray) for fetched: asked for again as a
            # new clone would, then every commit and tree the refs reach is walked (blobs
            # alone may be promised).
            self.log("the history's commits or trees are not all there; fetching them again whole")
            again = [f"+{sha}:{keep_ref(sha)}" for sha in sorted(wanted - unfetchable)]
            if again:
                self.watched(lambda: self.backend.fetch(self.repo, self.url, again, self.credential, track, self.log,
                                                        refetch=True, whole_packs=True))
            if not self.backend.is_sound(self.repo):
                raise CheckoutCacheError("CLONE_FAILED", detail="the server sent a history with commits or trees "
                                                                "missing")
        count_upstream(self.paths, received)
        return unfetchable

    def watched(self, fetch: Callable[[], object]) -> None:
        """Run a fetch with the disk watched: below the reserve, its git is stopped."""
        stop = threading.Event()
        self.space_short = None

        def watch() -> None:
            while not stop.wait(SPACE_CHECK_EVERY):
                usage = shutil.disk_usage(self.paths.base)
                reserve = reserve_bytes(self.config, usage.total)
                if usage.free < reserve:
                    self.space_short = (f"stopped at {usage.free >> 20} MiB free: the history would take the disk "
                                        f"below the {reserve >> 20} MiB kept free")
                    self.stop_git()
                    return

        watcher = threading.Thread(target=watch, name="cc-history-space", daemon=True)
        watcher.start()
        try:
            fetch()
        except (CheckoutCacheError, GitKilled):
            if self.space_short is not None:
                mirror_module.remove_stale_leftovers(self.repo, min_age=0.0)
                raise CheckoutCacheError("DISK_FULL", detail=self.space_short) from None
            raise
        finally:
            stop.set()
            watcher.join()

    def install(self, proven: set[str]) -> int:
        """history.git's objects into the mirror, then the boundary entries they complete go;
        under the mirror lock. How many entries went.

        Only packs are linked, so history.git must hold nothing else: its fetches keep what
        arrives as a pack (whole_packs), and loose objects (a history.git an older version
        fetched into) are packed first; one left loose and no boundary entry goes."""
        self.pack_loose()
        pack_dir = os.path.join(self.repo, "objects", "pack")
        names = sorted((n for n in _files(pack_dir) if n.startswith("pack-") and n.rsplit(".", 1)[-1] in _PACK_ORDER),
                       key=lambda n: _PACK_ORDER[n.rsplit(".", 1)[1]])
        target_dir = os.path.join(self.paths.mirror, "objects", "pack")
        with locks.mirror_write(self.paths, timeout=max(1.0, min(60.0, self.timeout))):
            self.on_progress({"phase": "installing history"})
            for index, name in enumerate(names):
                target = os.path.join(target_dir, name)
                if not os.path.lexists(target):
                    os.link(os.path.join(pack_dir, name), target)  # one file system: <key>/
                if index == 0:
                    checkpoint("history-during-install")
            if self.filter is not None:
                mirror_module.mark_packs_promisor(self.paths.mirror)  # a bundle's pack is an ordinary one
            self.install_bundle_refs()
            checkpoint("history-after-packs")
            boundary = read_shallow(self.paths.mirror)
            reachable = self.backend.reachable_commits(self.paths.mirror) if boundary else set()
            left = {sha for sha in boundary if sha in reachable and sha not in proven}
            if left != boundary:
                write_shallow(self.paths.mirror, left)
        if len(boundary) != len(left):
            self.log(f"history installed: {len(boundary) - len(left)} of {len(boundary)} boundary commit(s) "
                     f"completed")
        return len(boundary) - len(left)

    def pack_loose(self) -> None:
        """history.git's loose objects into a pack of their own (we hold its only writer's lock)."""
        if not loose_objects_in(self.repo):
            return
        self.log("packing history.git's loose objects (the install links packs only)")
        self.backend.pack_loose_objects(self.repo)
        if loose_objects_in(self.repo):
            raise CheckoutCacheError("HISTORY_FAILED", detail="history.git holds loose objects that could not be "
                                                              "packed: nothing of it is installed")

    def install_bundle_refs(self) -> None:
        """What seeding took in (refs/bundles/ of history.git, each checked connected there) is the
        mirror's too, as when a mirror was seeded itself: its commits count as present, and a
        later fetch offers them as haves; gc drops them once upstream was fetched from (upkeep/mirror_upkeep.py)."""
        from checkoutcache.git.backend import BUNDLE_REFS

        theirs = {ref: sha for ref, (sha, _kind) in self.backend.refs_named(self.repo, BUNDLE_REFS).items()}
        if not theirs:
            return
        ours = set(self.backend.refs_named(self.paths.mirror, BUNDLE_REFS))
        seed = records.read_json(self.paths.seed_record, records.SEED) or {}
        if seed.get("bundle_refs_dropped") or set(theirs) <= ours:
            return  # gc dropped them already (the mirror fetched from upstream since): not again
        self.backend.update_refs(self.paths.mirror, {ref: sha for ref, sha in theirs.items() if ref not in ours})

    def finish(self) -> None:
        """Complete (or the mirror gone): history.git goes, the record says when."""
        if tree.lexists(self.repo):
            slot = to_trash(self.paths, self.repo, "history")
            if slot is not None:
                remove_tree(slot)
        if not self.backend.is_usable(self.paths.mirror):
            return  # the repository was dropped (or its mirror is being rebuilt, complete)
        with self._finishing:
            records.remove_quietly(self.paths.history_failure)
            records.write_json(self.paths.history_record, {
                "started_at": self.started_at, "completed_at": time.time(),
                "seconds": round(time.time() - self.started_at, 3), "rounds": self.rounds,
                **({"seeded": self.seeded} if self.seeded is not None else {})})
        self.log(f"history complete after {self.rounds} round(s), {time.time() - self.started_at:.1f}s")


def loose_objects_in(git_dir: str) -> bool:
    """Whether the repository holds an object outside its packs (objects/<2 hex>/...)."""
    objects = os.path.join(git_dir, "objects")
    return any(len(name) == 2 and _files(os.path.join(objects, name)) for name in _files(objects))


def _files(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------- the merge base
# Which version of the search wrote a checkout's bases record: an older one's merge bases are
# never read (it answered the first merge base a shallow view showed, which a boundary may
# have hidden a better one from), so they are searched again.
BASES_VERSION = 2


class _Verdict:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


# What the merge-base search may conclude besides a merge base ("" for none):
NOT_PROVEN = _Verdict("NOT_PROVEN")  # the boundary could still hide a better one: deepen
HAND_OVER = _Verdict("HAND_OVER")  # deepened as far as it may: the background history brings the rest


def bases_of(paths: RepoPaths, name: str) -> dict:
    record = records.read_json(paths.bases_record(name), records.BASES)
    if record is None or record.get("version") != BASES_VERSION:
        return {"bases": {}}
    return record


def merge_base_of(paths: RepoPaths, name: str, base: str) -> str | None:
    """The recorded merge base of checkout NAME's commit and BASE ("" for none: unrelated)."""
    found = bases_of(paths, name).get("bases", {}).get(base)
    return found if isinstance(found, str) else None


def base_handed_over(paths: RepoPaths, name: str, base: str) -> bool:
    """Whether the search of BASE's merge base reached CHECKOUTCACHE_BASE_DEEPEN unproven: it is
    answered once the background history has completed the two commits' histories."""
    handed = bases_of(paths, name).get("handed_over")
    return isinstance(handed, dict) and base in handed


def note_search(paths: RepoPaths, name: str, base: str, search: dict | None,
                result: str | None = None, failure: dict | None = None, handed_over: bool = False) -> None:
    """The checkout's bases record with this search's state (its owner and progress, or its
    result, its failure, or its hand-over to the history). Written whole, by the search's lock
    holder only."""
    record = bases_of(paths, name)
    bases = dict(record.get("bases") or {})
    failures = dict(record.get("failures") or {}) if isinstance(record.get("failures"), dict) else {}
    handed = dict(record.get("handed_over") or {}) if isinstance(record.get("handed_over"), dict) else {}
    if result is not None:
        bases[base] = result
        failures.pop(base, None)
        handed.pop(base, None)
    if failure is not None:
        failures[base] = failure
    if handed_over:
        handed[base] = time.time()
        failures.pop(base, None)
    for kept in (bases, handed):
        while len(kept) > MAX_BASES:
            kept.pop(next(iter(kept)))
    value = {"version": BASES_VERSION, "bases": bases, "at": time.time(), "failures": failures,
             "handed_over": handed}
    if search is not None:
        value["searching"] = {"base": base, **search}
    records.write_json(paths.bases_record(name), value)


def base_failure(paths: RepoPaths, name: str, base: str):
    from checkoutcache.store.records import Failure

    failures = bases_of(paths, name).get("failures")
    return Failure.from_record(failures.get(base)) if isinstance(failures, dict) else None


def bases_in_use(paths: RepoPaths) -> set[str]:
    """The bases whose refs (refs/bases/) the mirror keeps (gc drops the others): every base the
    merge-base record of a checkout that exists names, and the one a running search looks for
    (it writes the ref under the mirror lock, then its record)."""
    used: set[str] = set()
    for name in paths.bases_record_names():
        running = locks.base_search_running(paths, name)
        if not running and not tree.lexists(paths.checkout(name)):
            continue
        record = records.read_json(paths.bases_record(name), records.BASES) or {}
        for field in ("bases", "failures", "handed_over"):
            if isinstance(record.get(field), dict):
                used |= {base for base in record[field] if isinstance(base, str)}
        searching = record.get("searching")
        if running and isinstance(searching, dict) and isinstance(searching.get("base"), str):
            used.add(searching["base"])
    return used


class BaseSearch(Job):
    phase = BASE_PHASE

    def __init__(self, paths: RepoPaths, config: Config, credential: Credential | None, name: str, base: str):
        super().__init__(paths, config, credential, name)
        self.name = name
        self.sha = commit_of(name)
        self.base = base
        self.timeout = config.clone_timeout
        self.checkout_identity = marker_identity(paths, name)

    def write_record(self) -> None:
        note_search(self.paths, self.name, self.base, self.owner())

    def forget_record(self) -> None:
        note_search(self.paths, self.name, self.base, None)

    def same_checkout(self) -> None:
        """A verdict is the checkout's it was searched for: gc may evict the checkout while the
        search runs (its keep-ref dropped, its commit pruned: git's merge-base then finds nothing,
        or a deepening fails) and the commit be asked again meanwhile. Recorded, such a verdict
        would be answered to the new checkout for as long as it lives (NoVerdict: nothing is)."""
        if marker_identity(self.paths, self.name) != self.checkout_identity:
            raise NoVerdict("the checkout was evicted during the search: nothing recorded, the next ask "
                            "searches again")

    def failed(self, code: str, message: str, next_step: str) -> None:
        if marker_identity(self.paths, self.name) != self.checkout_identity:
            self.log(f"merge base of {self.sha} and {self.base} failed ({code}: {message}) after the checkout was "
                     f"evicted: nothing recorded, the next ask searches again")
            self.forget_record()
            return
        previous = base_failure(self.paths, self.name, self.base)
        failure = next_failure(previous, code, message, next_step, time.time(), self.config.backoff,
                               self.config.backoff_max)
        note_search(self.paths, self.name, self.base, None, failure=failure.to_record())
        self.log(f"merge base of {self.sha} and {self.base} failed: {code}: {message}")

    def during_fetch(self) -> None:
        checkpoint("base-during-fetch")

    def work(self) -> None:
        self.log(f"merge base of {self.sha} and {self.base} ({self.url})")
        if not self.backend.has_commit(self.paths.mirror, self.sha):
            raise CheckoutCacheError("CLONE_FAILED", detail=f"the mirror lacks {self.sha}: ask for it again")
        if is_shallow(self.paths.mirror) and getattr(self.backend, "supports_shallow", False):
            found = self.search_shallow()
        else:
            found = self.search_complete()
        self.same_checkout()
        with self._finishing:
            if found is HAND_OVER:
                note_search(self.paths, self.name, self.base, None, handed_over=True)
                self.log(f"no merge base proven within {self.config.base_deepen} commit(s) of deepening: handed "
                         f"over to the background history (the merge base is answered once it is complete)")
                return
            note_search(self.paths, self.name, self.base, None, result=found or "")
        self.log(f"merge base: {found or 'none (the histories are unrelated)'}")

    def found_base(self, kind: tuple[str, str | None] | None) -> None:
        from checkoutcache.git.backend import not_a_commit

        if kind is not None and kind[0] != "commit":
            raise not_a_commit(self.base, *kind)

    def search_complete(self) -> str | None:
        """A complete mirror: BASE fetched as a new commit is (its history connected), kept by its
        ref (refs/bases/: gc drops it with the checkout's record), then git's merge-base."""
        with locks.mirror_write(self.paths, timeout=max(1.0, self.timeout)) as mirror_lock:
            keep_fds = (mirror_lock.fileno(),)
            kind = self.backend.object_kind(self.paths.mirror, self.base)
            self.found_base(kind)
            if kind is None or not self.backend.is_connected(self.paths.mirror, self.base):
                self.on_progress({"phase": BASE_PHASE})
                try:
                    self.backend.fetch(self.paths.mirror, self.url, [self.base], self.credential, self.on_progress,
                                       self.log, keep_fds)
                except CheckoutCacheError as exc:
                    if exc.code == "DISK_FULL":
                        raise
                    raise CheckoutCacheError("UNKNOWN_COMMIT", commit=self.base, detail=f"the base: {exc.detail}")
                self.found_base(self.backend.object_kind(self.paths.mirror, self.base))
            if hasattr(self.backend, "update_refs"):
                self.backend.update_refs(self.paths.mirror, {base_ref(self.base): self.base}, keep_fds)
            return self.backend.merge_base(self.paths.mirror, self.sha, self.base)

    def search_shallow(self) -> str | None | _Verdict:
        """A shallow mirror, in a private view of it (HEAD's keep-ref and BASE's ref as its refs,
        the boundary their histories reach as its shallow file, objects in the scratch): BASE at
        depth 1, then `--deepen` 1, 2, 4, ... (CHECKOUTCACHE_BASE_DEEPEN in all at most) until
        git's merge base is proven (proven_merge_base). What came goes into the mirror with
        every boundary entry it needs, HEAD's side and BASE's, and BASE's ref; a mirror whose
        history completed meanwhile takes none of it (its merge base is searched there)."""
        from checkoutcache.git.shallow import Fetched, make_incoming
        from checkoutcache.git.view import private_view
        from checkoutcache.store.scratch import create_scratch

        mirror = self.paths.mirror
        head_ref, kept_ref = keep_ref(self.sha), base_ref(self.base)
        refs = {head_ref: self.sha}
        if self.backend.refs_named(mirror, kept_ref).get(kept_ref, ("", ""))[0] == self.base:
            refs[kept_ref] = self.base  # an earlier search's (one handed over): here down to the boundary
        start = self.backend.boundary_reached(mirror, list(refs.values()))
        boundary = start
        filter = self.backend.partial_filter(mirror)
        scratch = create_scratch(self.paths, self.sha)
        try:
            incoming = make_incoming(RepoPaths.scratch_incoming(scratch.path), mirror)

            def in_view(operation):
                with private_view(mirror, filter, objects=incoming, refs=refs, shallow=boundary) as view:
                    return operation(view)

            self.on_progress({"phase": BASE_PHASE, "depth": 0})
            if kept_ref not in refs:
                self.found_base(in_view(lambda view: self.backend.object_kind(view, self.base)))
                try:
                    fetched = self.backend.fetch_privately(mirror, incoming, self.url, [f"+{self.base}:{kept_ref}"],
                                                           self.credential, self.on_progress, self.log, depth=1,
                                                           refs=refs, shallow=boundary)
                except CheckoutCacheError as exc:
                    if exc.code == "DISK_FULL":
                        raise
                    raise CheckoutCacheError("UNKNOWN_COMMIT", commit=self.base, detail=f"the base: {exc.detail}")
                refs, boundary = fetched.refs_after, fetched.shallow_after
                if kept_ref not in refs:
                    raise CheckoutCacheError("UNKNOWN_COMMIT", commit=self.base, detail="the base was not sent")
                self.found_base(in_view(lambda view: self.backend.object_kind(view, self.base)))
            depth, step = 0, 1
            found = self.proven_merge_base(in_view, boundary)
            while found is NOT_PROVEN:
                if depth >= self.config.base_deepen:
                    found = HAND_OVER
                    break
                step = min(step, self.config.base_deepen - depth)
                self.on_progress({"phase": BASE_PHASE, "depth": depth})
                fetched = self.backend.fetch_privately(mirror, incoming, self.url, [self.sha, self.base],
                                                       self.credential, self.on_progress, self.log, deepen=step,
                                                       refs=refs, shallow=boundary)
                if fetched.shallow_after == boundary:
                    found = HAND_OVER  # nothing deeper came: only the whole history can tell
                    break
                boundary = fetched.shallow_after
                depth += step
                step *= 2
                found = self.proven_merge_base(in_view, boundary)
            # The view's boundary as git left it, whole: every entry the objects fetched need,
            # BASE's side too (the checkout's git reads BASE, `git merge-base HEAD BASE`, and
            # must stop where its history stops), and none gone but those git deepened past. A
            # narrower one (only what the two commits reach) dropped entries other lines still
            # need; the install keeps no entry above history the mirror has (settled_boundary).
            with locks.mirror_write(self.paths, timeout=max(1.0, self.timeout)) as mirror_lock:
                completed = not is_shallow(mirror)
                if not completed:
                    self.backend.install_fetched(mirror, Fetched(incoming, {}, {kept_ref: self.base}, start, boundary,
                                                                 False), (mirror_lock.fileno(),), refs=[kept_ref])
                    if not self.backend.is_connected(mirror, self.sha):
                        raise CheckoutCacheError("CLONE_FAILED", detail=f"{self.sha}'s deepened history is not all "
                                                                        f"there")
            if completed:
                # Installing a boundary into it would make it shallow again: nothing of the view goes in.
                self.log("the mirror's history completed during the search: the merge base is searched there")
                return self.search_complete()
            return found
        finally:
            scratch.discard()

    def proven_merge_base(self, in_view: Callable, boundary: frozenset[str]) -> str | _Verdict:
        """git's merge base of the two commits as the view shows them, once no commit its boundary
        hides can change it: every boundary commit the two reach is an ancestor of every merge base
        git finds above it (all that lies below is then older than each of them, so none of it is
        a better one, nor joins two of them). "" when both histories are complete and share
        nothing; NOT_PROVEN while the boundary could hide a better one (a short line to an old
        common commit found before a long one to a newer)."""
        candidates = in_view(lambda view: self.backend.merge_bases(view, self.sha, self.base))
        reached = in_view(lambda view: self.backend.boundary_reached(view, [self.sha, self.base]))
        if not reached:
            return candidates[0] if candidates else ""
        if not candidates:
            return NOT_PROVEN
        for candidate in candidates:
            below = in_view(lambda view, candidate=candidate: self.backend.boundary_reached(view, [candidate]))
            if not reached <= below:
                return NOT_PROVEN
        return candidates[0]  # what `git merge-base` answers: the first of `--all`


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="checkoutcache-history")
    parser.add_argument("--root", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--lock-fd", type=int, required=True)
    parser.add_argument("--history", action="store_true")
    parser.add_argument("--checkout")
    parser.add_argument("--base")
    args = parser.parse_args(argv)
    os.set_inheritable(args.lock_fd, False)
    job = ["--history"] if args.history else ["--checkout", args.checkout, "--base", args.base]
    return run(args.root, args.key, Config.from_env(), credential_from_env(os.environ), job)


if __name__ == "__main__":
    sys.exit(main())
