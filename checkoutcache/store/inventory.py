"""What a root holds, gathered without changing anything: checkouts (last
use, size, held), clones in flight, failures, scratch. gc plans from it and
status prints it; both see the same facts the same way.

"Held" is probed by trying the checkout marker's exclusive lock without
waiting (and dropping it at once): an exec holds the shared lock for its whole
run, so a held checkout refuses us.

Sizes cost a walk of every file, so they are recorded (state/<sha>.size.json,
written whole) when a checkout is published and measured again only for a
checkout used since its last measure (a review's build outputs grow it): the
cost of gc and status grows with the number of checkouts, not of their files.
"""

from __future__ import annotations

import os

import attrs

from checkoutcache.store import locks, records
from checkoutcache.store.layout import RepoPaths, RootPaths
from checkoutcache.store.ready import looks_intact
from checkoutcache.store.records import Failure, read_failure
from checkoutcache.store.scratch import ScratchFacts, scratch_facts


@attrs.frozen
class CheckoutInfo:
    sha: str
    path: str
    ready: bool
    intact: bool
    last_used: float | None
    size: int
    held: bool
    # (key, commit) of other repositories' mirrors whose objects it borrows (submodules)
    borrows: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class CloneInfo:
    sha: str
    pid: int | None
    alive: bool
    started_at: float | None
    progress: dict


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


def disk_usage(path: str) -> int:
    """Bytes a directory tree occupies on disk, never following a symlink out."""
    total = 0
    stack = [path]
    while stack:
        current = stack.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:  # gone, unreadable, or a path too long (a deep tree): never a reason to fail
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            total += info.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return total


NO_SIZES, RECORDED_SIZES, FRESH_SIZES = "none", "recorded", "fresh"


def record_size(paths: RepoPaths, sha: str) -> int:
    """Measure a checkout and record its size with the last use it was measured at."""
    try:
        use = os.stat(paths.ready_marker(sha)).st_mtime
    except OSError:
        use = None
    size = disk_usage(paths.checkout(sha))
    try:
        records.write_json(paths.size_record(sha), {"bytes": size, "use_at_measure": use})
    except OSError:
        pass  # a size not recorded is measured again next time
    return size


def checkout_size(paths: RepoPaths, sha: str, last_used: float | None, sizes: str) -> int:
    """The recorded size; measured (and recorded) again when there is none, or,
    for FRESH_SIZES, when the checkout was used after its last measure."""
    if sizes == NO_SIZES:
        return 0
    record = records.read_json(paths.size_record(sha)) or {}
    size, use = record.get("bytes"), record.get("use_at_measure")
    if isinstance(size, int) and size >= 0:
        stale = sizes == FRESH_SIZES and last_used is not None and (not isinstance(use, (int, float))
                                                                     or last_used > use)
        if not stale:
            return size
    return record_size(paths, sha)


def checkout_info(paths: RepoPaths, sha: str, sizes: str = RECORDED_SIZES) -> CheckoutInfo:
    path = paths.checkout(sha)
    marker = paths.ready_marker(sha)
    try:
        last_used = os.stat(marker).st_mtime
        ready = True
    except (FileNotFoundError, NotADirectoryError):
        last_used, ready = None, False
    record = (records.read_json(marker) or {}) if ready else {}
    intact = ready and looks_intact(path, record)
    borrows = tuple((str(pair[0]), str(pair[1])) for pair in record.get("borrows") or []
                    if isinstance(pair, list) and len(pair) == 2)
    return CheckoutInfo(sha=sha, path=path, ready=ready, intact=intact, last_used=last_used,
                        size=checkout_size(paths, sha, last_used, sizes) if ready else 0,
                        held=ready and locks.checkout_held(marker), borrows=borrows)


def clone_infos(paths: RepoPaths) -> list[CloneInfo]:
    clones = []
    for sha in paths.clone_record_shas():
        record = records.read_json(paths.clone_record(sha)) or {}
        clones.append(CloneInfo(sha=sha, pid=record.get("pid"), alive=locks.clone_running(paths, sha),
                                started_at=record.get("started_at"), progress=record.get("progress") or {}))
    return clones


def failures(paths: RepoPaths) -> dict[str, Failure]:
    found = {}
    for sha in paths.failure_record_shas():
        failure = read_failure(paths.failure_record(sha))
        if failure is not None:
            found[sha] = failure
    return found


def repo_info(paths: RepoPaths, sizes: str = RECORDED_SIZES) -> RepoInfo:
    meta = records.read_json(paths.repo_json) or {}
    return RepoInfo(key=paths.key, url=meta.get("url"), scope=meta.get("scope"), paths=paths,
                    checkouts=[checkout_info(paths, sha, sizes) for sha in paths.checkout_shas()],
                    clones=clone_infos(paths), failures=failures(paths), scratch=scratch_facts(paths))


def inventory(root_paths: RootPaths, sizes: str = RECORDED_SIZES) -> list[RepoInfo]:
    return [repo_info(root_paths.repo(key), sizes) for key in root_paths.repo_keys()]
