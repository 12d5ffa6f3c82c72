"""The library API: `Cache(root).ensure(repo, commit, wait=..., scope=...)`.

The ready path (validate, check the marker, touch it, answer) imports no git
library and nothing beyond the standard library, attrs and this package's
small pure modules; the slow path (coordinator, worker start, psutil) is
imported only when a checkout is not ready. Keep it that way: this is the call
made on every tool call of every review.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, NamedTuple, Sequence

import attrs

from checkoutcache.answers import Answer, State
from checkoutcache.cones import Cone, cone_digest, parse_cone
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.repospec import (DEFAULT_SCOPE, LFS_ON, LFS_SETTING_VAR, SUBMODULES_RECURSIVE,
                                    SUBMODULES_SETTING_VAR, RepoSpec, parse_commit, parse_repo)
from checkoutcache.store.create import store_key
from checkoutcache.store.layout import LAYOUT_VERSION, RepoPaths, RootPaths, checkout_name, default_root
from checkoutcache.handoff import record_use as record_use_by_writer
from checkoutcache.store.ready import (SHARED_LOCK_WAIT, history_of, layout_version_of, lfs_of,
                                      open_marker_shared, ready_record, record_use, submodules_of)

MAX_WAIT = 24 * 3600.0
HISTORY_CHOICES = ("any", "full")


def parse_history(value: object) -> str | None:
    """What a request asks of the checkout's history: None (any: what is there) or "full"."""
    if value is None or value == "any":
        return None
    if value == "full":
        return "full"
    raise CheckoutCacheError("BAD_ARGUMENT", what=f"history must be any or full, got {str(value)[:40]!r}")


def parse_base(value: object) -> str | None:
    """A base commit id (40 or 64 hex digits, as the commit), or None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise CheckoutCacheError("BAD_ARGUMENT", what="base must be a commit id")
    try:
        return parse_commit(value)
    except CheckoutCacheError:
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"base must be a full commit id (40 hex digits), got "
                                                      f"{value[:80]!r}") from None


class Want(NamedTuple):
    """One validated request: the repository (with its store key), the commit, the cone."""

    spec: RepoSpec
    sha: str
    cone: Cone = ()

    @property
    def name(self) -> str:
        """The checkout's name in the store (store/layout.py checkout_name)."""
        return checkout_name(self.sha, cone_digest(self.cone) if self.cone else None)




class Hold:
    """A ready checkout held against eviction (the marker's shared lock) until
    released; releasing records the end of the use. `held` is False when the
    checkout could not be made ready: see `answer`.

    A bare shared lock protects within gc's bounds on readers' locks (max-held,
    max-hold-age); a hold is registered too, so that gc keeps it whatever those say
    (DESIGN invariant 4): the writer's in <root>/holds/ (store/holds.py), a read-only
    reader's as a hold of the writer's (/v1/hold, renewed while it lasts: WriterHold)."""

    def __init__(self, answer: Answer, fd: int | None, on_unrecorded: Callable[[], object] | None = None,
                 registration=None):
        self.answer = answer
        self._fd = fd
        self._on_unrecorded = on_unrecorded  # a reader's: the writer records the end of the use
        self._registration = registration  # store/holds.Registration or a WriterHold, if registered

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def registered(self) -> bool:
        return self._registration is not None

    def descriptors(self) -> tuple[int, ...]:
        """What a child process must inherit to hold the checkout as long as it runs."""
        if self._fd is None:
            return ()
        extra = getattr(self._registration, "fd", -1)
        return (self._fd, extra) if extra >= 0 else (self._fd,)

    def unregister(self) -> None:
        """Keep the marker's lock, drop the registration (a workspace once copied: its source
        is then held like any reader's)."""
        if self._registration is not None:
            registration, self._registration = self._registration, None
            registration.release()

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                if not record_use(fd) and self._on_unrecorded is not None:
                    self._on_unrecorded()
            finally:
                self.unregister()
                os.close(fd)

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# How long the CLI's wait for a clone polls before it watches (store/watch.py).
POLL_FIRST = 1.0
# A writer's ready answers for a checkout not ready in this reader's view of the root, at
# most, before the reader says NO_WRITER (each asked after a pause, never at once).
READY_NOT_HERE = 3


class Cache:
    """fork_workers: start clone workers by forking this process (the CLI does:
    cheaper by the cost of starting Python). Leave it off in a host process you
    do not own entirely: the forked worker closes every inherited descriptor."""

    def __init__(self, root: str | None = None, config=None, fork_workers: bool = False):
        self.root = os.path.realpath(os.path.expanduser(root)) if root else default_root()
        self.paths = RootPaths(self.root)
        self._config = config
        self.fork_workers = fork_workers
        # serve's clone queue (serve/admission.py): caller -> the coordinator's Start for it; None:
        # a worker is started at once for whoever asks (the CLI, the library).
        self.clone_starter: Callable[[str], object] | None = None
        self._layouts: dict[str, tuple[tuple[int, int, int], int | None]] = {}  # newer_layout's memo

    @property
    def config(self):
        if self._config is None:
            from checkoutcache.config import Config

            self._config = Config.from_env()
        return self._config

    def lfs_setting(self) -> str:
        """CHECKOUTCACHE_LFS, read without loading the whole Config on the ready path."""
        if self._config is not None:
            return self._config.lfs
        return os.environ.get(LFS_SETTING_VAR) or LFS_ON

    def submodules_setting(self) -> str:
        """CHECKOUTCACHE_SUBMODULES, read as CHECKOUTCACHE_LFS is."""
        if self._config is not None:
            return self._config.submodules
        return os.environ.get(SUBMODULES_SETTING_VAR) or SUBMODULES_RECURSIVE

    def ensure(self, repo: str, commit: str, wait: float = 0.0, scope: str = DEFAULT_SCOPE,
               on_progress: Callable[[Answer], None] | None = None, sparse: Sequence[str] | None = None,
               caller: str = "", history: str | None = None, base: str | None = None) -> Answer:
        """The commit's checkout: ready (with its path), cloning, or failed.

        wait: seconds to wait for a clone to finish (0: answer at once).
        sparse: directories of a sparse checkout in cone mode (cones.py); none: the whole tree.
        caller: who asks, for a clone queue's fairness (clone_starter; serve's tokens).
        history: "full" waits (within wait) until the checkout's history is complete (a cold
        node's first answer has the commit alone: `history` "shallow"), answering cloning with
        the history's progress meanwhile; "any" (the default) takes what is there.
        base: a commit id; the ready answer then carries `merge_base`, that of the commit and
        base (the history is deepened as far as the two need).
        Bad input answers `failed` with an input error code (exit_code 2) and writes nothing.
        """
        try:
            want = self.request(repo, commit, scope, sparse)
            if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= MAX_WAIT \
                    or math.isnan(wait):
                raise CheckoutCacheError("BAD_ARGUMENT", what=f"wait must be 0 to {MAX_WAIT:g} seconds")
            history = parse_history(history)
            base = parse_base(base)
        except CheckoutCacheError as exc:
            return Answer.from_error(exc)
        ready = self.ready_answer(want)
        if ready is not None:
            ready = self.as_wanted(want, ready, history, base)
            if ready is not None:
                return ready
        if self.is_reader():
            return self.ensure_through_writer(want, float(wait), on_progress, history, base)
        from checkoutcache.clone.coordinator import Coordinator
        from checkoutcache.clone.spawn import worker_starter

        try:
            config = self.config  # a malformed setting is the caller's input: answered, nothing written
        except CheckoutCacheError as exc:
            return Answer.from_error(exc)
        # The CLI (it forks its workers) waits once and exits: it polls its first second rather
        # than pay a watch's close at the end of every answer (store/watch.py). A host
        # process's waiters (serve's many) watch from the start.
        start = self.clone_starter(caller) if self.clone_starter is not None else worker_starter(self.fork_workers)
        return Coordinator(self.paths, config, want.spec, want.sha, start,
                           cone=want.cone, poll_first=POLL_FIRST if self.fork_workers else 0.0,
                           history=history, base=base, fork=self.fork_workers).run(float(wait), on_progress)

    def as_wanted(self, want: Want, ready: Answer, history: str | None, base: str | None) -> Answer | None:
        """A ready answer as the request wants it, or None when that needs the slow path ("full"
        was asked and the repository's mirror, or a submodule's its marker lists, is shallow:
        the coordinator asks git whether the commit's own history is complete; the merge base is
        not known yet). No git here: a stat per mirror."""
        if history == "full" and (ready.history == "shallow" or self.submodule_shallow(want, ready)):
            return None
        if base is None:
            return ready
        from checkoutcache.clone.history import merge_base_of  # only with a base: never the plain ready path

        found = merge_base_of(self.paths.repo(want.spec.key), want.name, base)
        if not found:
            return None  # not searched yet, or none: the coordinator answers
        return attrs.evolve(ready, base=base, merge_base=found)

    def submodule_shallow(self, want: Want, ready: Answer) -> bool:
        """Whether a repository the checkout's submodules come from (its marker lists them:
        borrows) has a shallow mirror: the marker read and a stat per repository."""
        if ready.submodules != "included":
            return False
        from checkoutcache.store import records

        marker = records.read_json(self.paths.repo(want.spec.key).ready_marker(want.name), records.MARKER) or {}
        for key, _sha in marker.get("borrows") or []:
            try:
                if os.stat(self.paths.repo(key).mirror_shallow).st_size > 0:
                    return True
            except (FileNotFoundError, NotADirectoryError):
                pass
            except OSError:
                return True  # there, but not for us to read: never claim more history than there is
        return False

    def request(self, repo: str, commit: str, scope: str = DEFAULT_SCOPE,
                sparse: Sequence[str] | None = None) -> Want:
        """The validated request, with the key of the store to use; CheckoutCacheError (an
        input error) when it is malformed."""
        sha = parse_commit(commit)
        cone = parse_cone(sparse)
        spec = parse_repo(repo, scope, lfs=self.lfs_setting(), submodules=self.submodules_setting())
        return Want(store_key(self.paths, spec), sha, cone)

    def ready_answer(self, want: Want, lock_wait: float = SHARED_LOCK_WAIT) -> Answer | None:
        """The ready answer when the checkout is published (its use recorded), else None.
        lock_wait 0: never block (a sidecar's event loop asks so, and on None hands the
        request to a thread that may wait)."""
        paths = self.paths.repo(want.spec.key)
        name = want.name
        newer = self.newer_layout(paths)
        if newer is not None:  # before the marker is touched: nothing is written in such a store
            return Answer.from_error(CheckoutCacheError("NEWER_LAYOUT", repo=want.spec.url, found=newer,
                                                        known=LAYOUT_VERSION))

        def through_writer() -> bool:  # a reader (store/ready.py record_use): the writer records it
            why = record_use_by_writer(self.root, paths.checkout(name), want.spec.url, want.sha, want.spec.scope,
                                       want.cone, want.spec.lfs, want.spec.submodules)
            if why:
                import logging

                logging.getLogger("checkoutcache").warning("this use of %s was not recorded: %s",
                                                           paths.checkout(name), why)
            return not getattr(why, "not_ready", False)

        try:
            record = ready_record(paths.ready_marker(name), lock_wait, on_unrecorded=through_writer)
        except OSError:
            record = None  # a marker we may not open: the coordinator answers what and where
        if record is None:
            return None
        path = paths.checkout(name)
        return Answer(state=State.READY, commit=want.sha, repo=want.spec.url, path=path,
                      lfs=lfs_of(record), submodules=submodules_of(record), sparse=list(want.cone) or None,
                      history=history_of(path))

    def newer_layout(self, paths: RepoPaths) -> int | None:
        """The layout version of a repository's store when it is newer than this version's.
        repo.json is written once (temp file + rename), so it is read again only when the
        file at its path changes (a stat, not a read, on a long-lived process's ready path)."""
        try:
            info = os.stat(paths.repo_json)
        except OSError:
            return None
        seen = (info.st_ino, info.st_mtime_ns, info.st_size)
        known = self._layouts.get(paths.repo_json)
        if known is None or known[0] != seen:
            if len(self._layouts) > 4096:
                self._layouts.clear()
            known = self._layouts[paths.repo_json] = (seen, layout_version_of(paths.repo_json))
        version = known[1]
        return version if version is not None and version > LAYOUT_VERSION else None

    def is_reader(self) -> bool:
        """True when this process may read the root but not write it (a read-only mount, or
        another uid than the one writer, DESIGN invariant 16): what needs a write is asked of
        the writer."""
        return os.path.isdir(self.root) and not os.access(self.root, os.W_OK | os.X_OK)

    def ensure_through_writer(self, want: Want, wait: float, on_progress: Callable[[Answer], None] | None,
                              history: str | None = None, base: str | None = None) -> Answer:
        """A reader's new commit: the writer clones it (serve's /v1/ensure over the root's
        socket or CHECKOUTCACHE_API_URL), and only a checkout ready on this process's own view
        of the root counts. With on_progress, the writer is asked at most a second at a time
        so each cloning answer reaches it."""
        from checkoutcache.handoff import HANDOFF_SLACK, NoWriter, post

        deadline = time.monotonic() + wait
        request = {"repo": want.spec.url, "commit": want.sha, "scope": want.spec.scope,
                   # what makes the store's key: a writer keyed otherwise says SETTINGS_MISMATCH
                   "lfs": self.lfs_setting(), "submodules": self.submodules_setting(),
                   **({"sparse": list(want.cone)} if want.cone else {}),
                   **({"history": history} if history else {}), **({"base": base} if base else {})}
        not_here = 0
        while True:
            left = max(0.0, deadline - time.monotonic())
            step = min(left, 1.0) if on_progress is not None else left
            asked = time.monotonic()
            try:
                _, body = post(self.root, "/v1/ensure", {**request, "wait": round(step, 3)}, step + HANDOFF_SLACK)
            except NoWriter as exc:
                return Answer.from_error(CheckoutCacheError("NO_WRITER", root=self.root, why=str(exc)),
                                         want.sha, want.spec.url)
            except Exception as exc:  # reached, but no answer in the API's shape
                return Answer.from_error(CheckoutCacheError("NO_WRITER", root=self.root,
                                                            why=f"its answer failed ({type(exc).__name__})"),
                                         want.sha, want.spec.url)
            answer = Answer.from_json(body)
            if answer.state == State.READY:
                # Checked on our own disk: the writer's path is its view of the root.
                mine = self.ready_answer(want)
                if mine is not None:
                    return attrs.evolve(mine, base=answer.base, merge_base=answer.merge_base) if base else mine
                not_here += 1
                if time.monotonic() >= deadline or not_here >= READY_NOT_HERE:
                    return Answer.from_error(CheckoutCacheError(
                        "NO_WRITER", root=self.root, why=f"it answered ready at {answer.path}, which is not "
                                                         f"ready here (is it the writer of this root?)"),
                        want.sha, want.spec.url)
                # Never at once: a writer that is not this root's answers ready for ever.
                time.sleep(min(0.2 * 2 ** not_here, max(0.0, deadline - time.monotonic())))
                continue
            if answer.state != State.CLONING or time.monotonic() >= deadline:
                return answer
            if on_progress is not None:
                on_progress(answer)
            # A writer answers `cloning` when the wait it was given ends (or at its own cap): one
            # that answers sooner is asked again only after a pause, never in a loop.
            early = min(step, 1.0) - (time.monotonic() - asked)
            if early > 0:
                time.sleep(min(early, max(0.0, deadline - time.monotonic())))

    def register_hold(self, want: Want):
        """The registration of a hold of want's checkout (see Hold), or None where none could be
        made (no writer to ask: the shared lock alone then protects, within its bounds)."""
        if not self.is_reader():
            from checkoutcache.store import holds

            try:
                return holds.register(self.paths, want.spec.key, want.name)
            except OSError:
                return None
        from checkoutcache.handoff import WriterHold

        return WriterHold.start(self.root, {"repo": want.spec.url, "commit": want.sha, "scope": want.spec.scope,
                                            "lfs": want.spec.lfs, "submodules": want.spec.submodules,
                                            **({"sparse": list(want.cone)} if want.cone else {})})

    def hold(self, repo: str, commit: str, wait: float = 0.0, scope: str = DEFAULT_SCOPE,
             on_progress: Callable[[Answer], None] | None = None, sparse: Sequence[str] | None = None,
             caller: str = "") -> Hold:
        """ensure, then hold the checkout so that gc cannot evict it until release().

        A checkout evicted between the answer and the hold is simply asked for
        again (it is re-cloned), within the same wait.
        """
        deadline = time.monotonic() + (wait if isinstance(wait, (int, float)) else 0)
        while True:
            answer = self.ensure(repo, commit, wait=wait, scope=scope, on_progress=on_progress, sparse=sparse,
                                 caller=caller)
            if answer.state != State.READY:
                return Hold(answer, None)
            fd = open_marker_shared(RepoPaths.ready_marker_in(answer.path))
            if fd is not None:
                want = self.request(repo, commit, scope, sparse)  # valid: it was answered ready
                return Hold(answer, fd, lambda: record_use_by_writer(self.root, answer.path, want.spec.url, want.sha,
                                                                     want.spec.scope, want.cone, want.spec.lfs,
                                                                     want.spec.submodules),
                            registration=self.register_hold(want))
            wait = max(0.0, deadline - time.monotonic())
