"""The clone worker: a detached process that makes one commit's checkout.

Started by `ensure` (see spawn.py) in its own session, it inherits the commit's
clone lock and holds it for its whole life, so exactly one clone runs per
commit and its death (even by SIGKILL) frees the commit at once. Steps:

    scratch  -> mirror (a new, empty or shallow one: the commit alone, depth 1, fetched into
                scratch/incoming without the mirror lock and installed under it (git/shallow.py);
                a complete one, or CHECKOUTCACHE_FIRST_FETCH=full: bundles first for a new one,
                fetch by id, fallback all refs; keep-ref; LFS objects into lfs/)
             -> the tree in scratch (clone/tree.py: a spare updated in place, or a fresh
                checkout; the LFS filter finds every object in lfs/; submodules)
             -> rename scratch tree to checkouts/<name>  -> ready marker (last)
             -> a shallow mirror: its background history started (clone/history.py)

<name> is the checkout's (store/layout.py checkout_name): the commit, or the
commit and a sparse checkout's cone. Records, locks and logs go by the name;
the mirror's keep-ref and every git command by the commit.

On failure it records the code and back-off, removes its scratch and exits; a
wall-clock limit stops it with TIMEOUT. SIGTERM (serve or a container
stopping) ends it cleanly with no verdict at all: its git killed, its scratch
and record removed, nothing counted against the commit; the next ask clones it. Kill points for the fault tests are
named by the test hook CHECKOUTCACHE_TEST_KILL_AT (read by the worker, the history, gc and
`bundle publish` only; see docs/operations.md "Test hooks").
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Iterator

from checkoutcache.clone.decide import next_failure
from checkoutcache.clone.process import count_upstream, open_attempt_log, stop_on_sigterm, tracking
from checkoutcache.clone.tree import TreeBuilder
from checkoutcache.cones import Cone
from checkoutcache.config import Config
from checkoutcache.credentials import (
    Credential,
    credential_from_env,
    redact,
    secrets_of,
)
from checkoutcache.errors import CheckoutCacheError, describe, is_disk_full
from checkoutcache.git import mirror
from checkoutcache.git.backend import (ALL_BRANCHES_AND_TAGS, REVIEW_PREFIX, GitKilled, keep_ref,
                                       lfs_checkout_config, lfs_endpoint, not_a_commit)
from checkoutcache.git.transport import pick_backend
from checkoutcache.git.cli import RUNNING
from checkoutcache.git.shallow import is_shallow, make_incoming, mirror_is_empty
from checkoutcache.repospec import LFS_OFF, LFS_ON, SUBMODULES_RECURSIVE
from checkoutcache.store import locks, records, tree
from checkoutcache.store.checkouts import (
    GONE,
    HELD,
    is_published,
    move_checkout_aside,
    publish,
    remove_tree,
    to_trash,
)
from checkoutcache.store.sizes import record_size
from checkoutcache.store.layout import CLONE_LOG_CAP, RepoPaths, RootPaths, commit_of
from checkoutcache.store.modes import set_store_umask
from checkoutcache.store.liveness import own_identity, pid_namespace
from checkoutcache.store.records import read_failure
from checkoutcache.store.scratch import Scratch, create_scratch
from checkoutcache.testhooks import checkpoint

PROGRESS_INTERVAL = 0.25
# Observability hook: when set, every clone appends one JSON line per event
# (started, published, discarded, failed) to this file, outside the root.
JOURNAL = "CHECKOUTCACHE_CLONE_JOURNAL"
EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT, EXIT_STOPPED, EXIT_DIED = 0, 1, 3, 143, 137
# Review refs fetched per round while looking for a commit (fetch_from_review_refs).
REVIEW_BATCH = 200


def newest_first(refs: dict[str, str]) -> list[str]:
    """Review refs by their numbers, highest (newest) first: refs/pull/1234/head before
    refs/pull/99/head; refs without a number last, by name."""
    def key(ref: str) -> tuple:
        numbers = [int(part) for part in ref.split("/") if part.isdigit()]
        return (0, [-n for n in numbers], ref) if numbers else (1, [], ref)

    return sorted(refs, key=key)


class Worker:
    def __init__(self, paths: RepoPaths, name: str, config: Config, credential: Credential | None, deaths: int = 0,
                 cone: Cone = ()):
        self.paths = paths
        self.name = name  # the checkout, for the store
        self.sha = commit_of(name)  # the commit, for git
        self.cone = cone
        self.config = config
        self.credential = credential
        self.deaths = deaths  # kept in our record: if we die too, the next starter counts on
        self.secrets = secrets_of(credential)
        info = records.read_json(paths.repo_json, records.REPO) or {}
        self.url = info.get("url", "")
        self.is_local = bool(info.get("is_local", False))
        # The store's LFS setting (repo.json; stores made before it existed: on).
        self.lfs_setting = info.get("lfs", LFS_ON)
        self.scope = info.get("scope", "default")
        self.submodules_setting = info.get("submodules", SUBMODULES_RECURSIVE)
        # What the ready answer will say of LFS files (None: the commit has none), why,
        # and the checkout's LFS configuration when their content is there.
        self.lfs_answer: str | None = None
        self.lfs_why: str | None = None
        self.lfs_config: dict[str, str] | None = None
        self.backend = pick_backend(config.transport)
        self.pid, self.pid_start = own_identity()
        self.started_at = time.time()
        self._started = time.monotonic()
        self._paused = 0.0  # seconds spent outside the clone timeout (seeding from bundles)
        self._timer: threading.Timer | None = None
        self._timed = False
        self.progress: dict = {}
        self._last_write = 0.0
        self._finishing = threading.Lock()
        self.scratch: Scratch | None = None
        self.mirror_is_new = False  # made by this attempt: its first fetch may still make it a full one
        self._logged = 0
        self._log = open_attempt_log(paths, name)

    # ------------------------------------------------------------ bookkeeping
    def log(self, line: str, always: bool = False) -> None:
        """One line of this attempt's log; past CLONE_LOG_CAP bytes only the lines that
        say how the attempt ended (always=True) and git's own error lines are kept."""
        always = always or line.lower().startswith(("fatal:", "error:"))
        if self._logged > CLONE_LOG_CAP and not always:
            return
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
        text = f"{stamp} {redact(line[:4096], self.secrets)}\n"
        self._logged += len(text)
        if self._logged > CLONE_LOG_CAP and not always:
            text = f"{stamp} (this attempt's log reached {CLONE_LOG_CAP} bytes: later lines are dropped)\n"
        try:
            self._log.write(text)
        except (OSError, ValueError):
            pass  # a full disk (or a log closed by a finished run) must not turn a clean failure into a crash

    def journal(self, event: str, **fields) -> None:
        path = os.environ.get(JOURNAL)
        if not path:
            return
        line = json.dumps({"event": event, "commit": self.sha, "name": self.name, "repo": self.paths.key,
                           "pid": self.pid,
                           "at": time.time(), **fields})
        try:
            fd = tree.open_file(path, os.O_WRONLY | os.O_APPEND, create=True)  # serve/ beneath the root
            try:
                os.write(fd, (line + "\n").encode())  # one O_APPEND write: lines never interleave
            finally:
                os.close(fd)
        except OSError:
            pass  # observability only: never the reason a clone fails

    def write_record(self) -> None:
        records.write_json(self.paths.clone_record(self.name), {
            "pid": self.pid, "pid_start": self.pid_start, "pidns": pid_namespace(), "started_at": self.started_at,
            "commit": self.sha, "progress": self.progress, "transport": self.backend.name, "deaths": self.deaths})
        self._last_write = time.monotonic()

    def on_progress(self, update: dict) -> None:
        phase_changed = update.get("phase") != self.progress.get("phase")
        self.progress.update(update)
        if phase_changed or time.monotonic() - self._last_write >= PROGRESS_INTERVAL:
            try:
                self.write_record()
            except OSError:
                pass  # a progress report lost to a full disk; git itself reports the failure
            checkpoint("during-" + ("checkout" if update.get("phase") == "checking out" else "fetch"))

    def record_failure(self, code: str, message: str, next_step: str) -> None:
        previous = read_failure(self.paths.failure_record(self.name))
        failure = next_failure(previous, code, redact(message, self.secrets), next_step, time.time(),
                               self.config.backoff, self.config.backoff_max)
        records.write_json(self.paths.failure_record(self.name), failure.to_record())
        self.journal("failed", error=code, seconds=round(time.time() - self.started_at, 3))
        self.log(f"failed: {code}: {failure.message} (attempt {failure.attempts}, retry in "
                 f"{failure.retry_at - failure.failed_at:.0f}s)", always=True)

    def cleanup(self) -> None:
        # We finished (published or failed): the run of deaths on this commit is over.
        records.remove_quietly(self.paths.deaths_record(self.name))
        records.remove_quietly(self.paths.clone_record(self.name))
        if self.scratch is not None:
            self.scratch.discard()

    # ------------------------------------------------------------ the clone
    def run(self, timer: bool = True) -> int:
        """timer: stop the clone at the clone timeout (a worker process of its own); a
        clone run inline (a submodule's, in its superproject's worker) runs under its
        caller's timer instead."""
        cone = f" (sparse: {', '.join(self.cone)})" if self.cone else ""
        self.log(f"clone of {self.sha}{cone} from {self.url} by pid {self.pid} ({self.backend.name})")
        self.write_record()
        self.journal("started")
        self._timed = timer
        self._arm_timer()
        try:
            self.clone()
        except GitKilled as exc:
            if not exc.is_death:
                return self.fail(exc)
            with self._finishing:
                self.die(exc)
            if not timer:
                raise  # a submodule's clone inline: its superproject's attempt died as well
            return EXIT_DIED
        except BaseException as exc:  # every failure is recorded; SIGKILL is the only exception
            return self.fail(exc)
        finally:
            self._disarm_timer()
            self._log.close()
        return EXIT_OK

    def fail(self, exc: BaseException) -> int:
        with self._finishing:
            explained = self.explain(exc)
            self.cleanup()  # first: on a full disk, removing our scratch makes room for the record
            self.record_failure(*explained)
        return EXIT_FAILED

    def die(self, exc: GitKilled) -> None:
        """git was SIGKILLed (the OOM killer): this attempt is a worker's death, as if we had
        been killed with it. Our scratch goes; our clone record stays, so the next asker
        counts the death (WORKER_DIED after three in a row) instead of failing the commit."""
        self.log(f"{exc}: out of memory? This attempt counts as a dead worker "
                 f"({self.deaths + 1} in a row)", always=True)
        self.journal("died", seconds=round(time.time() - self.started_at, 3))
        if self.scratch is not None:
            self.scratch.discard()

    # ------------------------------------------------------------ the clone timeout
    def remaining(self) -> float:
        """What is left of the clone timeout (time spent seeding does not count)."""
        return self.config.clone_timeout - (time.monotonic() - self._started - self._paused)

    def _arm_timer(self) -> None:
        if self._timed:
            self._timer = threading.Timer(max(0.0, self.remaining()), self.on_timeout)
            self._timer.daemon = True
            self._timer.start()

    def _disarm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @contextlib.contextmanager
    def outside_the_clone_timeout(self) -> Iterator[None]:
        """Seeding is bounded by its own budget (CHECKOUTCACHE_SEED_TIMEOUT): a slow bundle
        store can make a clone faster or not, never make it time out."""
        self._disarm_timer()
        paused_at = time.monotonic()
        try:
            yield
        finally:
            self._paused += time.monotonic() - paused_at
            self._arm_timer()

    def clone(self) -> None:
        if is_published(self.paths, self.name):
            self.log("already published by another clone")  # double-check under our lock
            with self._finishing:
                self.cleanup()
            return
        self.scratch = create_scratch(self.paths, self.name)
        checkpoint("after-scratch")
        try:
            self.fetch_into_mirror()
        except CheckoutCacheError as exc:
            # A fetch refused for what git found missing on our side (fsck: "did not receive
            # expected object", the server took the mirror to have it): a mirror whose refs
            # reach objects it lacks is rebuilt once, as for a checkout that cannot read one.
            if exc.code != "CLONE_FAILED" or self.backend.is_sound(self.paths.mirror):
                raise
            self.log(f"the mirror lacks objects its refs reach ({exc.detail}); rebuilding it")
            self.fetch_into_mirror(rebuild=True)
        checkpoint("before-checkout")
        self.on_progress({"phase": "checking out"})
        builder = TreeBuilder(self, run_inline)
        extra = builder.build()
        with self._finishing:
            published = publish(self.paths, self.scratch.tree, self.name, extra)
            # Our record goes at once: its removal is the event a waiter wakes on
            # (store/watch.py); askers find the marker first from now on.
            records.remove_quietly(self.paths.clone_record(self.name))
            records.remove_quietly(self.paths.failure_record(self.name))
            self.log("published" if published else "another clone published first; discarded ours", always=True)
            self.journal("published" if published else "discarded", seconds=round(time.time() - self.started_at, 3))
            if published:  # after the marker: readers never wait for this walk
                record_size(self.paths, self.name, builder.index)
            self.cleanup()
        if published:
            self.start_history()

    def start_history(self) -> None:
        """A shallow mirror's history follows in the background (clone/history.py), one process
        per repository; started here, after the answer, and again by gc if it dies."""
        if not self.fetches_shallow() or not is_shallow(self.paths.mirror):
            return
        from checkoutcache.clone.history import start_history

        try:
            pid = start_history(self.paths, self.config, self.credential, fork=True)
        except (OSError, CheckoutCacheError) as exc:
            self.log(f"the mirror's history could not be started now ({exc}); gc starts it")
            return
        if pid is not None:
            self.log(f"the mirror's history follows in the background (pid {pid})")

    def fetches_shallow(self) -> bool:
        """Whether a first answer comes from the commit alone (CHECKOUTCACHE_FIRST_FETCH)."""
        return self.config.first_fetch == "shallow" and getattr(self.backend, "supports_shallow", False)

    def ensure_mirror(self, keep_fds: tuple[int, ...], rebuild: bool = False, seed: bool = True) -> bool:
        """Create the mirror if missing (built in our scratch, seeded from bundles when
        CHECKOUTCACHE_BUNDLE_URI is set, renamed into place: a worker killed on the way
        leaves no mirror, so the next one seeds again).

        A mirror damaged beyond opening is moved to trash and rebuilt. Returns True
        when the mirror is new, so the caller restores the objects existing
        checkouts borrow.
        """
        if os.path.isdir(self.paths.mirror) and (rebuild or not self.backend.is_usable(self.paths.mirror)):
            self.log("the mirror is damaged: moving it aside and fetching anew")
            to_trash(self.paths, self.paths.mirror, "broken-mirror")
        if os.path.isdir(self.paths.mirror):
            return False
        # Not seeded when rebuilding because objects were unreadable: the store may be where
        # the damage came from, so the new mirror comes from upstream alone.
        skip = "rebuilding a mirror whose objects were unreadable" if rebuild else None
        if not seed:
            records.remove_quietly(self.paths.seed_record)  # an earlier mirror's: the history seeds this one
        # A shallow first answer seeds nothing: the bundles are the history's (clone/history.py).
        mirror.install_new_mirror(self.paths, self.backend, self.scratch.path, self.partial_filter(),
                                  (lambda build: self.seed(build, keep_fds, skip=skip)) if seed else None)
        self.mirror_is_new = True
        return True

    def partial_filter(self) -> str | None:
        """The filter a new mirror is made with (None: a full one), recorded with why not."""
        wanted = self.config.filter
        if wanted is None:
            records.remove_quietly(self.paths.filter_record)
            return None
        if not self.backend.supports_partial:
            self.note_filter(wanted, False, f"the {self.backend.name} transport makes no partial clones: a full "
                                            f"mirror")
            return None
        self.note_filter(wanted, True)
        return wanted

    def note_filter(self, wanted: str, partial: bool, note: str | None = None) -> None:
        if note:
            self.log(note)
        try:
            records.write_json(self.paths.filter_record, {"filter": wanted, "partial": partial, "at": time.time(),
                                                          **({"note": note} if note else {})})
        except OSError:
            pass  # observability only

    def write_mirror(self, operation):
        """Run one write to the mirror; if it fails with git lock files present, clear them once and retry.

        Every git writer we start holds the mirror lock we hold now, so a lock file
        seen here belongs to a killed process, however young it is.
        """
        try:
            return operation()
        except CheckoutCacheError:
            if not mirror.git_lock_files(self.paths.mirror):
                raise
            for stale in mirror.remove_stale_leftovers_of(self.paths, min_age=0.0):
                self.log(f"removed git lock {stale} left by a killed process")
            return operation()

    def fetch(self, refspecs: list[str], keep_fds: tuple[int, ...], refetch: bool = False) -> None:
        received: dict[str, int] = {}
        track = tracking(received, self.on_progress)
        if self.fetches_shallow() and is_shallow(self.paths.mirror):
            self.fetch_whole(refspecs, track, keep_fds)
            count_upstream(self.paths, received)
            return
        try:
            refused = self.write_mirror(lambda: self.backend.fetch(self.paths.mirror, self.url, refspecs,
                                                                   self.credential, track, self.log, keep_fds,
                                                                   refetch=refetch))
            if refused:
                self.filter_refused()
        except CheckoutCacheError:
            # What the failed fetch wrote (a part of a pack, loose objects) goes now: under our
            # mirror lock no other git writes, and on a full disk it is what the retry needs.
            mirror.remove_stale_leftovers_of(self.paths, min_age=0.0)
            raise
        count_upstream(self.paths, received)

    def fetch_whole(self, refspecs: list[str], track, keep_fds: tuple[int, ...]) -> None:
        """A fetch into a shallow mirror that is not a depth-1 one (the fallbacks of a server that
        refuses ids: every branch and tag, review refs): as into an empty mirror, offering no ref
        as a have and no boundary, so the server sends each wanted ref's whole history. A wanted
        tip the mirror holds at its boundary would otherwise count as fetched, and what lies
        behind it never come. Under the mirror lock the caller holds: its objects, then its refs."""
        incoming = make_incoming(RepoPaths.scratch_incoming(self.scratch.path), self.paths.mirror)
        try:
            fetched = self.backend.fetch_privately(self.paths.mirror, incoming, self.url, refspecs, self.credential,
                                                   track, self.log, keep_fds, refs={}, shallow=frozenset())
            self.backend.install_fetched(self.paths.mirror, fetched, keep_fds)
        finally:
            remove_tree(incoming)
        if fetched.filter_refused:
            self.filter_refused()

    def filter_refused(self) -> None:
        """The server ignored a partial mirror's filter: it sent every object. A new mirror
        (this is its first fetch) then holds them all and becomes a full one; an older one
        stays partial (what it lacks is still promised) and fetches blobs as before."""
        wanted = self.config.filter or "?"
        if self.mirror_is_new:
            self.backend.make_full(self.paths.mirror)
            self.note_filter(wanted, False, "the server does not allow filters (uploadpack.allowFilter): a full "
                                            "mirror")
        else:
            self.log("the server ignored the filter this time: every object came")

    def fetch_needed_blobs(self, keep_fds: tuple[int, ...]) -> None:
        """A partial mirror gets the blobs this checkout needs (its cone's, or the whole tree's)
        in one request, under the mirror lock, with the clone's credentials; they stay for
        later checkouts. A server that leaves any out fails the clone (never a half tree)."""
        if not self.backend.supports_partial or not mirror.has_promisor_packs(self.paths.mirror_objects):
            return  # no object is promised: none can be missing (and no git is started to ask)
        filter = self.backend.partial_filter(self.paths.mirror)
        if filter is None:
            return
        missing = self.backend.missing_blobs(self.paths.mirror, self.sha, self.cone)
        if not missing:
            return
        self.on_progress({"phase": "fetching blobs", "total_objects": len(missing)})
        checkpoint("before-blobs")
        self.write_mirror(lambda: self.backend.fetch_blobs(self.paths.mirror, self.url, missing, filter,
                                                           self.credential, self.on_progress, self.log, keep_fds))
        still = self.backend.missing_blobs(self.paths.mirror, self.sha, self.cone)
        if still:
            raise CheckoutCacheError("CLONE_FAILED", detail=f"the server did not send {len(still)} of the "
                                                            f"{len(missing)} blobs the checkout needs, e.g. {still[0]}")
        # What fsck checks of a .gitmodules at a full mirror's fetch (its tree and blob come
        # together there): here its blob came alone, so it is checked now.
        refused = self.backend.gitmodules_refused(self.paths.mirror, self.sha, filter)
        if refused is not None:
            self.backend.drop_keep(self.paths.mirror, self.sha)  # refused as a full mirror's fetch would be
            raise CheckoutCacheError("CLONE_FAILED", detail=refused)
        self.log(f"fetched {len(missing)} blob(s) the checkout needs")

    def seed(self, build: str, keep_fds: tuple[int, ...], skip: str | None = None) -> None:
        """A new mirror takes in the newest usable bundles first (bundles/seed.py): only a
        speed-up, whatever happens. Its record says how it went (status, metrics)."""
        location = self.config.bundle_uri
        records.remove_quietly(self.paths.seed_record)  # a rebuilt mirror: the old record described another
        if location is None or self.is_local:  # a local upstream is as near as any bundle
            return
        # Only with a bundle store: its HTTP and S3 clients cost a clone without one 20 ms.
        from checkoutcache.bundles.seed import REBUILD, SeedResult, seed_mirror
        from checkoutcache.bundles.location import bundle_key

        if skip is not None:
            self.log(f"bundles: not used: {skip}")
            result = SeedResult(False, (), skip, REBUILD, str(location), 0, 0.0)
        else:
            self.on_progress({"phase": "seeding from bundles"})
            checkpoint("before-seed")
            # seed_mirror never raises: whatever the store does costs speed only, within its own budget.
            with self.outside_the_clone_timeout():
                result = seed_mirror(build, location, bundle_key(self.scope, self.url, self.is_local),
                                     self.scratch.path, keep_fds, self.config.seed_timeout, self.log,
                                     reachable_only=self.backend.name == "pygit2")
        result.write_record(self.paths.seed_record)
        self.journal("seeded", outcome=result.outcome, reason=result.reason or "", bundles=len(result.bundles))

    def keep(self, sha: str, keep_fds: tuple[int, ...]) -> None:
        self.write_mirror(lambda: self.backend.keep(self.paths.mirror, sha, keep_fds))

    def restore_borrowed_objects(self, keep_fds: tuple[int, ...]) -> None:
        """After a rebuild, fetch back the commits existing checkouts borrow from the
        mirror: our own repository's, and other repositories' whose submodules
        borrow from it (their markers list them)."""
        from checkoutcache.store.inventory import NO_SIZES, inventory

        names = self.paths.checkout_names()
        own = sorted({commit_of(name) for name in names} - {self.sha})
        borrowed = sorted({sha for info in inventory(RootPaths(self.paths.root), sizes=NO_SIZES)
                           for c in info.checkouts if c.ready for key, sha in c.borrows
                           if key == self.paths.key and sha != self.sha} - set(own))
        shas = own + borrowed
        if not shas:
            return
        self.log(f"restoring the objects of {len(shas)} existing commit(s)")
        try:
            self.fetch(shas, keep_fds)
        except CheckoutCacheError as exc:
            self.log(f"could not fetch them by id ({exc.detail}); fetching all refs")
            self.fetch(ALL_BRANCHES_AND_TAGS, keep_fds)
        for sha in shas:
            # Kept only with its whole history: a stray commit's keep-ref would offer the
            # upstream a "have" it cannot back, and the next fetch would lack its parents.
            if self.backend.has_commit(self.paths.mirror, sha) and self.backend.is_connected(self.paths.mirror, sha):
                self.keep(sha, keep_fds)
                self.restore_blobs(sha, [n for n in names if commit_of(n) == sha], keep_fds)
                continue
            if sha in borrowed:  # verify finds the borrowing checkout broken; it is made anew
                self.log(f"commit {sha}, which another repository's checkout borrows, is gone upstream")
                continue
            # It can no longer be served whole: its checkouts go, each cloned again when asked.
            for name in (n for n in names if commit_of(n) == sha):
                moved = move_checkout_aside(self.paths, name, "orphaned")
                if moved.kept == HELD:  # verify and gc find it broken once the command ends
                    self.log(f"checkout {name} lost its objects; a running command holds it, kept for now")
                elif moved.kept != GONE:
                    self.log(f"checkout {name} lost its objects; removed")

    def restore_blobs(self, sha: str, names: list[str], keep_fds: tuple[int, ...]) -> None:
        """A rebuilt partial mirror fetches back the blobs the commit's checkouts use (each
        one's cone, from its marker): they read them through the mirror's objects."""
        filter = self.backend.partial_filter(self.paths.mirror) if self.backend.supports_partial else None
        if filter is None:
            return
        for name in names:
            marker = records.read_json(self.paths.ready_marker(name), records.MARKER) or {}
            missing = self.backend.missing_blobs(self.paths.mirror, sha, tuple(marker.get("sparse") or ()))
            if missing:
                self.write_mirror(lambda: self.backend.fetch_blobs(self.paths.mirror, self.url, missing, filter,
                                                                   self.credential, self.on_progress, self.log,
                                                                   keep_fds))

    def fetch_shallow(self) -> bool:
        """The commit alone (depth 1, with a partial mirror's filter) into a new, empty or shallow
        mirror, fetched privately (git/shallow.py) so first answers of different commits fetch
        side by side; installed under the mirror lock. False: not this way (a complete mirror,
        the server refused, the mirror changed under us): the caller fetches as a full mirror."""
        with locks.mirror_write(self.paths, timeout=max(1.0, self.remaining())) as mirror_lock:
            keep_fds = (mirror_lock.fileno(),)
            mirror_dir = self.paths.mirror
            if not self.backend.is_usable(mirror_dir) and self.paths.checkout_names():
                # A mirror gone or damaged under existing checkouts: it is rebuilt whole, with the
                # objects they borrow fetched back (restore_borrowed_objects), as before.
                return False
            made = self.ensure_mirror(keep_fds, seed=False)
            if not (made or is_shallow(mirror_dir) or mirror_is_empty(mirror_dir)):
                return False  # a complete mirror: a new commit costs what changed, fetched there
            if self.commit_present(mirror_dir):
                self.keep(self.sha, keep_fds)
                self.mirror_has_commit(keep_fds)
                return True
            for stale in mirror.remove_stale_leftovers_of(self.paths):
                self.log(f"removed stale git lock {stale}")
            identity = self.mirror_identity()
            # Every ref of the mirror is a have (none in an empty one: no git to ask).
            haves = {} if mirror_is_empty(mirror_dir) else None
        incoming = make_incoming(RepoPaths.scratch_incoming(self.scratch.path), mirror_dir)
        self.on_progress({"phase": "fetching"})
        checkpoint("before-fetch")
        received: dict[str, int] = {}
        try:
            fetched = self.backend.fetch_privately(mirror_dir, incoming, self.url, [f"+{self.sha}:{keep_ref(self.sha)}"],
                                                   self.credential, tracking(received, self.on_progress), self.log,
                                                   depth=1, refs=haves, refs_after=False)
        except CheckoutCacheError as exc:
            if exc.code == "DISK_FULL":
                raise
            self.log(f"the commit alone could not be fetched ({exc.detail}); fetching it as a full mirror does")
            remove_tree(incoming)
            return False
        checkpoint("after-fetch")
        if fetched.complained and not self.backend.is_sound(mirror_dir):
            # What the mirror holds cannot all be read (a damaged pack): the clone rebuilds it,
            # fetching back what its checkouts borrow (clone() on CLONE_FAILED).
            remove_tree(incoming)
            raise CheckoutCacheError("CLONE_FAILED", detail="the mirror's objects cannot all be read")
        with locks.mirror_write(self.paths, timeout=max(1.0, self.remaining())) as mirror_lock:
            keep_fds = (mirror_lock.fileno(),)
            moved = identity != self.mirror_identity()  # repacked (objects it relied on pruned?) or rebuilt
            boundary = None
            if not is_shallow(mirror_dir) and not mirror_is_empty(mirror_dir):
                # The history completed while we fetched: the commit joins it if its parents are in
                # the history the refs reach (objects merely there are no history).
                self.backend.install_fetched(mirror_dir, fetched._replace(shallow_after=fetched.shallow_before),
                                             keep_fds, refs=[])
                if not self.backend.parents_reached(mirror_dir, self.sha):
                    return False  # fetched as a new commit of a complete mirror is, by the caller
                boundary = frozenset()
            self.backend.install_fetched(mirror_dir, fetched, keep_fds, refs=[], boundary=boundary)
            self.keep(self.sha, keep_fds)
            try:
                found = self.refuse_non_commit(mirror_dir)
                # git's fetch checked the commit's history connected down to its new boundary
                # in the view; walked again where that check may not hold in the mirror: a
                # partial one (a missing tree counts as promised there), or one repacked or
                # rebuilt meanwhile.
                trusted = not moved and self.backend.partial_filter(mirror_dir) is None
                present = found is not None if trusted else self.commit_present(mirror_dir)
            except CheckoutCacheError:
                self.backend.drop_keep(mirror_dir, self.sha)
                raise
            if not present:
                self.backend.drop_keep(mirror_dir, self.sha)
                if found is None:
                    raise CheckoutCacheError("UNKNOWN_COMMIT", commit=self.sha, detail="the server did not send it")
                raise CheckoutCacheError("CLONE_FAILED", detail=f"the server sent commit {self.sha} without its tree")
            if fetched.filter_refused:
                self.filter_refused()
            count_upstream(self.paths, received)
            self.mirror_has_commit(keep_fds)
        return True

    def mirror_identity(self) -> tuple:
        """What changes when the mirror is rebuilt or repacked (its directory, gc's repack stamp)."""
        try:
            inode = os.stat(self.paths.mirror).st_ino
        except OSError:
            inode = None
        stamp = records.read_json(self.paths.mirror_gc_stamp, records.MIRROR_GC) or {}
        return inode, stamp.get("at")

    def mirror_has_commit(self, keep_fds: tuple[int, ...]) -> None:
        """The commit is kept in the mirror: what its checkout needs besides (blobs, LFS objects)."""
        self.fetch_needed_blobs(keep_fds)
        self.log("mirror has the commit" + (" (shallow: its history follows)" if is_shallow(self.paths.mirror)
                                             else ""))
        # Under the mirror lock: gc prunes lfs/ under it too, by the commits kept.
        self.prepare_lfs(keep_fds)

    def fetch_into_mirror(self, rebuild: bool = False) -> None:
        if not rebuild and self.fetches_shallow() and self.fetch_shallow():
            return
        with locks.mirror_write(self.paths, timeout=max(1.0, self.remaining())) as mirror_lock:
            keep_fds = (mirror_lock.fileno(),)
            rebuilt = self.ensure_mirror(keep_fds, rebuild)
            mirror_dir = self.paths.mirror
            kept = False
            if not self.commit_present(mirror_dir):  # absent, or there without its history: fetch it
                # There without its history (a server once left a parent out): in a partial
                # mirror git takes it for fetched (the parent counts as promised) and sends
                # nothing, so it is asked for as a new clone would (a full mirror's git
                # sees the gap itself and fetches only what is missing).
                refetch = self.backend.partial_filter(mirror_dir) is not None and \
                    self.backend.object_kind(mirror_dir, self.sha) is not None
                for stale in mirror.remove_stale_leftovers_of(self.paths):
                    self.log(f"removed stale git lock {stale}")
                self.on_progress({"phase": "fetching"})
                checkpoint("before-fetch")
                # Fetched straight into its keep-ref where the backend can: one git execution less.
                by_id = f"+{self.sha}:{keep_ref(self.sha)}" if self.backend.fetches_into_refs else self.sha
                try:
                    self.fetch([by_id], keep_fds, refetch=refetch)
                    kept = self.backend.fetches_into_refs
                except CheckoutCacheError as exc:
                    self.log(f"fetch by id refused ({exc.detail}); fetching all refs")
                    self.fetch(ALL_BRANCHES_AND_TAGS, keep_fds, refetch=refetch)
                    if not self.commit_present(mirror_dir):
                        kept = self.fetch_from_review_refs(keep_fds)
                checkpoint("after-fetch")
                try:
                    # git's fetch by id into the keep-ref checked that ref's whole history (its
                    # connectivity check of every updated ref): walking it again costs seconds on
                    # a big history (165k objects: 3.7 s). Any other way in is walked, and so is
                    # every fetch into a partial mirror: there git takes a missing parent or tree
                    # for a promised one, and only blobs may be promised.
                    trusted = kept and self.backend.partial_filter(mirror_dir) is None
                    found = self.refuse_non_commit(mirror_dir)
                    present = found is not None if trusted else self.commit_present(mirror_dir)
                except CheckoutCacheError:
                    if kept:
                        self.backend.drop_keep(mirror_dir, self.sha)  # a tag, tree or blob is never kept
                    raise
                if not present:
                    if kept:
                        self.backend.drop_keep(mirror_dir, self.sha)
                    if found is not None:
                        # CLONE_FAILED, as git says for a full mirror ("did not receive expected
                        # object"): the clone then checks the mirror and rebuilds it if its own
                        # refs reach what is missing (what made the server leave it out).
                        raise CheckoutCacheError("CLONE_FAILED", detail=f"the server sent commit {self.sha} "
                                                                        f"without its whole history")
                    raise CheckoutCacheError("UNKNOWN_COMMIT", commit=self.sha,
                                             detail="the server does not have it (or not its whole history)")
            if not kept:
                self.keep(self.sha, keep_fds)
            if rebuilt:
                self.restore_borrowed_objects(keep_fds)
            self.mirror_has_commit(keep_fds)

    def prepare_lfs(self, keep_fds: tuple[int, ...]) -> None:
        """Decide how the commit's LFS files are checked out, and download their
        objects into the repository's one LFS store (lfs/) first: only those it lacks,
        so an object shared by several commits is downloaded once."""
        self.lfs_config = None
        if self.lfs_setting == LFS_OFF:
            self.lfs_answer, self.lfs_why = LFS_OFF, "CHECKOUTCACHE_LFS=off"
            return
        reason = self.backend.lfs_unsupported()
        if reason is not None:
            self.lfs_answer, self.lfs_why = "pointers", reason
            return
        pointers = self.backend.lfs_pointers(self.paths.mirror, self.sha, self.cone)
        if not pointers:
            self.lfs_answer = self.lfs_why = None
            return
        missing = [p for p in pointers if not self.lfs_in_store(p)]
        self.log(f"{len({p.oid for p in pointers})} LFS object(s), {len({p.oid for p in missing})} not in the "
                 f"store yet")
        if missing:
            self.on_progress({"phase": "fetching lfs objects"})
            checkpoint("before-lfs-fetch")
            failure = None
            try:
                # Exactly the objects this checkout lacks (a cone's: never the whole tree's).
                self.write_mirror(lambda: self.backend.lfs_fetch(
                    self.paths.mirror, self.url, self.is_local, missing, self.paths.lfs_store, self.credential,
                    self.on_progress, self.log, keep_fds))
            except CheckoutCacheError as exc:
                if exc.code == "DISK_FULL":
                    raise
                # Only the objects the checkout needs decide (an operator's fetchexclude may
                # have left one out, which then fails below).
                failure = exc
            finally:
                # What a failed download left (a body longer than its pointer, wrong bytes)
                # goes now, under the mirror lock every download runs under.
                count, freed = mirror.remove_lfs_partials(self.paths, {p.oid for p in missing})
                if count:
                    self.log(f"removed {count} partial LFS download(s), {freed} bytes")
            absent = [p for p in missing if not self.lfs_in_store(p)]
            if absent:
                why = f"{failure.detail}" if failure is not None else "git-lfs did not download it"
                raise CheckoutCacheError("LFS_FAILED", detail=(
                    f"{len(absent)} LFS object(s) the checkout needs are not in the store, e.g. "
                    f"{absent[0].path.decode('utf-8', 'backslashreplace')[:200]!r} ({absent[0].oid[:12]}): {why}"))
        self.lfs_answer, self.lfs_why = "content", None
        self.lfs_config = lfs_checkout_config(self.paths.lfs_store, lfs_endpoint(self.url, self.is_local))

    def lfs_in_store(self, pointer) -> bool:
        try:
            return os.stat(self.paths.lfs_object(pointer.oid)).st_size == pointer.size
        except OSError:
            return False

    def fetch_from_review_refs(self, keep_fds: tuple[int, ...]) -> bool:
        """The commit is on no branch or tag, and the server refuses it by id (a
        review ref's tip is advertised, so fetching it by id already worked): fetch
        the review refs (refs/pull/*, ...) the server has, newest first, in batches of
        REVIEW_BATCH, into a namespace of their own, stopping at the batch that brings
        the commit; keep it, and drop them again. At most config.max_review_refs refs
        per attempt: past them the commit is UNKNOWN_COMMIT, saying how many were
        searched. True when the commit is now kept."""
        patterns = self.config.review_refs
        if not patterns:
            return False
        tips = self.backend.remote_refs(self.url, patterns, self.credential, self.config.probe_timeout)
        if not tips:
            return False
        order = newest_first(tips)
        searched = order[: self.config.max_review_refs]
        self.log(f"searching {len(searched)} of {len(order)} review ref(s) under {', '.join(patterns)}, newest first")
        try:
            for start in range(0, len(searched), REVIEW_BATCH):
                batch = searched[start:start + REVIEW_BATCH]
                self.fetch([f"+{ref}:{REVIEW_PREFIX}{ref[len('refs/'):]}" for ref in batch], keep_fds)
                if self.commit_present(self.paths.mirror):
                    self.log(f"found in review ref batch {start // REVIEW_BATCH + 1} ({start + len(batch)} "
                             f"ref(s) fetched)")
                    self.keep(self.sha, keep_fds)
                    return True
        finally:
            self.backend.drop_refs_under(self.paths.mirror, REVIEW_PREFIX)  # kept by keep-ref, or not needed
        if len(order) > len(searched):
            raise CheckoutCacheError("UNKNOWN_COMMIT", commit=self.sha, detail=(
                f"not in the newest {len(searched)} of the server's {len(order)} review refs (raise "
                f"CHECKOUTCACHE_MAX_REVIEW_REFS to search further)"))
        return False

    def commit_present(self, mirror_dir: str) -> bool:
        """Whether the mirror has the commit with its whole history (DESIGN invariant 13):
        connected down to the mirror's recorded shallow boundary and no further, as git
        reads it (mirror.git/shallow: a listed commit's parents are never walked, so a
        commit at or above the boundary counts once every object down to it is there, and
        nothing below it is ever vouched for: git/shallow.py).
        A commit that is there only as a stray object (a bundle's pack can carry one
        without its parents) counts as absent: it is fetched from upstream, and never
        kept (a keep-ref would offer it to the upstream as a "have" it cannot back)."""
        if self.refuse_non_commit(mirror_dir) is None:
            return False
        if self.backend.is_connected(mirror_dir, self.sha):
            return True
        self.log(f"commit {self.sha} is in the mirror without its whole history; fetching it from upstream")
        return False

    def refuse_non_commit(self, mirror_dir: str) -> tuple[str, str | None] | None:
        """What the id names in the mirror (None: absent). An id naming a tag, tree or
        blob is the caller's mistake (NOT_A_COMMIT), whatever the transport: nothing is
        kept or checked out for it."""
        found = self.backend.object_kind(mirror_dir, self.sha)
        if found is not None and found[0] != "commit":
            raise not_a_commit(self.sha, *found)
        return found

    def explain(self, exc: BaseException) -> tuple[str, str, str]:
        """(code, message, next step) for whatever stopped the clone."""
        if isinstance(exc, CheckoutCacheError):
            return exc.code, redact(exc.message, self.secrets), exc.next
        if isinstance(exc, GitKilled):  # a crash (SIGSEGV, SIGABRT): the clone's own failure
            return ("CLONE_FAILED", *describe("CLONE_FAILED", detail=redact(str(exc), self.secrets)))
        if is_disk_full(exc):
            code, detail = "DISK_FULL", str(exc)
        elif isinstance(exc, locks.LockTimeout):
            return ("TIMEOUT", *describe("TIMEOUT", limit=f"{self.config.clone_timeout:g}s"))
        else:
            self.log(f"unexpected {type(exc).__name__}: {exc}")
            code, detail = "CLONE_FAILED", f"{type(exc).__name__}: {exc}"
        return (code, *describe(code, detail=redact(detail, self.secrets), commit=self.sha))

    def on_stop(self) -> None:
        """SIGTERM (serve stopping, or the container): this attempt ends cleanly and leaves
        no verdict: no failure, no death, no scratch, no record; the next ask clones the
        commit again. A run already publishing or failing finishes that instead (it takes
        milliseconds)."""
        if not self._finishing.acquire(blocking=False):
            return
        RUNNING.kill_all()
        self.log("stopped by SIGTERM before it could finish: nothing is recorded against the commit; "
                 "the next ask clones it again", always=True)
        self.journal("stopped", seconds=round(time.time() - self.started_at, 3))
        records.remove_quietly(self.paths.clone_record(self.name))
        if self.deaths:  # an earlier run of deaths still counts
            records.write_json(self.paths.deaths_record(self.name),
                               {"commit": self.sha, "deaths": self.deaths, "at": time.time()})
        if self.scratch is not None:
            remove_tree(self.scratch.path)
        os._exit(EXIT_STOPPED)

    def on_timeout(self) -> None:
        if not self._finishing.acquire(blocking=False):
            return  # publishing or failing right now: let that finish
        RUNNING.kill_all()
        self.record_failure("TIMEOUT", *describe("TIMEOUT", limit=f"{self.config.clone_timeout:g}s"))
        records.remove_quietly(self.paths.clone_record(self.name))
        if self.scratch is not None:
            remove_tree(self.scratch.path)
        os._exit(EXIT_TIMEOUT)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="checkoutcache-worker")
    parser.add_argument("--root", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--checkout", required=True, help="the checkout's name (store/layout.py checkout_name)")
    parser.add_argument("--lock-fd", type=int, required=True)
    parser.add_argument("--deaths", type=int, default=0)
    parser.add_argument("--sparse", action="append", default=[], help="a directory of the cone (repeated)")
    args = parser.parse_args(argv)
    # The inherited descriptor carries the clone lock: keep it open until we exit.
    os.set_inheritable(args.lock_fd, False)
    return run_worker(args.root, args.key, args.checkout, Config.from_env(), credential_from_env(os.environ),
                      args.deaths, tuple(args.sparse))


def run_inline(paths: RepoPaths, name: str, lock_fd: int, config: Config, credential: Credential | None,
               deaths: int, cone: Cone = ()) -> None:
    """The coordinator's Start for a submodule's commit: its clone runs here, to its end, under
    the clone lock the coordinator holds (lock_fd), and under our own clone timeout."""
    Worker(paths, name, config, credential, deaths, cone).run(timer=False)


def run_worker(root: str, key: str, name: str, config: Config, credential: Credential | None,
               deaths: int = 0, cone: Cone = ()) -> int:
    # What git writes for us is writable by the writer alone (or, in the trusted-peers
    # mode, by the root's group) and never world-writable, whatever the caller's umask was.
    set_store_umask()
    worker = Worker(RootPaths(root).repo(key), name, config, credential, deaths, cone)
    stop_on_sigterm(worker.on_stop)
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
