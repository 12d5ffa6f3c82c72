"""What a root holds, gathered without changing anything: checkouts (last
use, size, held), clones in flight, failures, scratch. gc plans from it and
status prints it; both see the same facts the same way.

"Held" is probed by trying the checkout marker's exclusive lock without
waiting (and dropping it at once): an exec holds the shared lock for its whole
run, so a held checkout refuses us.

Sizes cost a walk of every file, so they are recorded (state/<name>.size.json,
written whole) when a checkout is published and measured again only for a
checkout used since its last measure (a review's build outputs grow it): the
cost of gc and status grows with the number of checkouts, not of their files.
"""

from __future__ import annotations

import os

import attrs

from checkoutcache.store import locks, records, tree
from checkoutcache.store.layout import RepoPaths, RootPaths, commit_of
from checkoutcache.store.ready import looks_intact
from checkoutcache.store.records import Failure
from checkoutcache.store.scratch import ScratchFacts, scratch_facts
from checkoutcache.store.sizes import record_size


@attrs.frozen
class CheckoutInfo:
    name: str  # store/layout.py checkout_name: the commit, and a sparse checkout's cone digest
    path: str
    ready: bool
    intact: bool
    last_used: float | None
    size: int
    held: bool
    # (key, commit) of other repositories' mirrors whose objects it borrows (submodules)
    borrows: tuple[tuple[str, str], ...] = ()
    marker: dict = attrs.field(factory=dict, eq=False)  # its ready marker's record (validated)
    # errno name when a peer made it unreadable: then it is listed and left alone
    unreadable: str | None = None

    @property
    def sha(self) -> str:
        return commit_of(self.name)

    @property
    def sparse(self) -> tuple[str, ...]:
        """A sparse checkout's cone (its marker says), () for the whole tree."""
        return tuple(self.marker.get("sparse") or ())


@attrs.frozen
class CloneInfo:
    name: str
    pid: int | None
    alive: bool
    started_at: float | None
    progress: dict
    borrows: tuple[tuple[str, str], ...] = ()
    pidns: str | None = None  # the PID namespace its pid is in

    @property
    def sha(self) -> str:
        return commit_of(self.name)


@attrs.frozen
class RepoInfo:
    key: str
    url: str | None
    scope: str | None
    paths: RepoPaths
    checkouts: list[CheckoutInfo]
    clones: list[CloneInfo]
    failures: dict[str, Failure]
    scratch: list[ScratchFacts]
    meta: dict = attrs.field(factory=dict, eq=False)  # repo.json, validated
    # Entries that could not be read or did not fit their schema: {"path", "error", "why"}
    problems: list[dict] = attrs.field(factory=list, eq=False)
    # Why this store is not used at all (repos/<key> or a directory of it is a symlink
    # or a file: store/tree.py refusal), else None. gc leaves a refused store alone.
    refused: str | None = None


NO_SIZES, RECORDED_SIZES, FRESH_SIZES = "none", "recorded", "fresh"


def checkout_size(paths: RepoPaths, name: str, last_used: float | None, sizes: str,
                  reader: records.Reader | None = None) -> int:
    """The recorded size; measured (and recorded) again when there is none, or,
    for FRESH_SIZES, when the checkout was used after its last measure."""
    if sizes == NO_SIZES:
        return 0
    reader = reader or records.Reader(paths.root)
    record = reader.read(paths.size_record(name), records.SIZE) or {}
    size, use = record.get("bytes"), record.get("use_at_measure")
    if size is not None:
        stale = sizes == FRESH_SIZES and last_used is not None and (use is None or last_used > use)
        if not stale:
            return size
    return record_size(paths, name)


def checkout_info(paths: RepoPaths, name: str, sizes: str = RECORDED_SIZES,
                  reader: records.Reader | None = None) -> CheckoutInfo:
    """What one checkout is; a checkout a peer made unreadable says so (its errno) and is
    otherwise taken as it looks: ready, in use, and not ours to judge."""
    reader = reader or records.Reader(paths.root)
    path = paths.checkout(name)
    marker = paths.ready_marker(name)
    try:
        last_used = tree.lstat(marker).st_mtime
        ready = True
        record = records.load_json(marker)
    except (FileNotFoundError, NotADirectoryError):
        last_used, ready, record = None, False, None
    except OSError as exc:
        reader.note(marker, records.errno_name(exc), exc.strerror or "")
        return CheckoutInfo(name=name, path=path, ready=True, intact=True, last_used=None, size=0, held=True,
                            unreadable=records.errno_name(exc))
    if ready and record is not None and records.invalid(record, records.MARKER) is not None:
        reader.note(marker, "INVALID", records.invalid(record, records.MARKER) or "")
        record = None
    record = record or {}
    intact = ready and looks_intact(path, record)
    borrows = tuple((pair[0], pair[1]) for pair in record.get("borrows") or [])
    try:
        held = ready and locks.checkout_held(marker)
    except OSError as exc:
        reader.note(marker, records.errno_name(exc), exc.strerror or "")
        held = True  # cannot tell: never evicted
    return CheckoutInfo(name=name, path=path, ready=ready, intact=intact, last_used=last_used,
                        size=checkout_size(paths, name, last_used, sizes, reader) if ready else 0,
                        held=held, borrows=borrows, marker=record)


def writers_only(exc: OSError, root: str) -> bool:
    """Whether an error is a reader's look into a writers-only directory (store/modes.py
    private_dir_mode): by design, never a problem to report. A writer that may not read
    something there (a peer's entry, in the group mode) still reports it."""
    return isinstance(exc, PermissionError) and not os.access(root, os.W_OK)


def clone_infos(paths: RepoPaths, reader: records.Reader) -> list[CloneInfo]:
    clones = []
    for name in paths.clone_record_names():
        record = reader.read(paths.clone_record(name), records.CLONE) or {}
        try:
            alive = locks.clone_running(paths, name)
        except OSError as exc:
            if not writers_only(exc, paths.root):
                reader.note(paths.clone_lock(name), records.errno_name(exc), exc.strerror or "")
            alive = True  # cannot tell: its record stays
        clones.append(CloneInfo(name=name, pid=record.get("pid"), alive=alive, started_at=record.get("started_at"),
                                progress=record.get("progress") or {},
                                borrows=tuple((p[0], p[1]) for p in record.get("borrows") or []),
                                pidns=record.get("pidns")))
    return clones


def failures(paths: RepoPaths, reader: records.Reader) -> dict[str, Failure]:
    found = {}
    for name in paths.failure_record_names():
        failure = Failure.from_record(reader.read(paths.failure_record(name), records.FAILURE))
        if failure is not None:
            found[name] = failure
    return found


def repo_info(paths: RepoPaths, sizes: str = RECORDED_SIZES) -> RepoInfo:
    reader = records.Reader(paths.root)
    refused = tree.refusal(paths.base)
    if refused is not None:  # listed as a problem, never read or changed through the symlink
        reader.note(refused.filename, "ELOOP", refused.strerror or "")
        meta = reader.read(paths.repo_json, records.REPO) or {} if refused.filename != paths.base else {}
        return RepoInfo(key=paths.key, url=meta.get("url"), scope=meta.get("scope"), paths=paths, checkouts=[],
                        clones=[], failures={}, scratch=[], meta=meta, problems=reader.problems,
                        refused=refused.strerror)
    meta = reader.read(paths.repo_json, records.REPO) or {}
    checkouts = []
    for name in paths.checkout_names():
        try:
            checkouts.append(checkout_info(paths, name, sizes, reader))
        except OSError as exc:  # a peer's entry we cannot even look at: listed, left alone
            reader.note(paths.checkout(name), records.errno_name(exc), exc.strerror or "")
    try:
        scratch = scratch_facts(paths)
    except OSError as exc:
        if not writers_only(exc, paths.root):
            reader.note(paths.scratch_dir, records.errno_name(exc), exc.strerror or "")
        scratch = []
    return RepoInfo(key=paths.key, url=meta.get("url"), scope=meta.get("scope"), paths=paths,
                    checkouts=checkouts, clones=clone_infos(paths, reader), failures=failures(paths, reader),
                    scratch=scratch, meta=meta, problems=reader.problems)


def inventory(root_paths: RootPaths, sizes: str = RECORDED_SIZES, keys: list[str] | None = None) -> list[RepoInfo]:
    """Every repository store of the root (or those of keys)."""
    return [repo_info(root_paths.repo(key), sizes) for key in (root_paths.repo_keys() if keys is None else keys)]
