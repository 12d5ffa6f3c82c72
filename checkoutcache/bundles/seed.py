"""Seeding a new mirror from the bundle store, before its first fetch from upstream.

Steps: read the repository's bundle list; download its bundles in token order
(the full one first), each checked by `git bundle verify` and fetched into
refs/bundles/; stop at the first that fails (the later ones build on it).
Whatever was taken in stays: the upstream fetch that follows sends only
what is missing (git offers refs/bundles/ as "haves").

Nothing here fails a clone: a store that is down, a list that is missing or
malformed, a bundle removed, truncated or older than the commit all end in a
SeedResult saying what was taken in and why not more. Only a bundle that has
passed `git bundle verify` is fetched from. Downloads go to the worker's
scratch directory and are removed as soon as they are taken in.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Callable, NamedTuple, TypeVar

from checkoutcache.bundles.bundlelist import MAX_LIST_BYTES, MalformedList, parse_list
from checkoutcache.bundles.location import LIST_NAME, BundleLocation
from checkoutcache.bundles.objectstore import StoreError, open_folder
from checkoutcache.errors import is_disk_full
from checkoutcache.bundles.gitbundle import (
    BundleError,
    bundles_unsupported,
    drop_unreachable,
    take_in_bundle,
    verify_bundle,
)

T = TypeVar("T")
# Why a mirror was not (wholly) seeded, as a metrics label: a fixed set.
NO_GIT, NO_LIST, STORE_DOWN, BAD_LIST, OUT_OF_TIME, NO_SPACE, BUNDLE_UNUSABLE, REBUILD, UNEXPECTED = (
    "no-git", "no-list", "store-down", "bad-list", "out-of-time", "no-space", "bundle-unusable", "rebuild",
    "unexpected")
REASONS = (NO_GIT, NO_LIST, STORE_DOWN, BAD_LIST, OUT_OF_TIME, NO_SPACE, BUNDLE_UNUSABLE, REBUILD, UNEXPECTED)
# What seeding may download, all bundles together: half the space free beyond this
# share of the disk when it starts (each bundle's pack takes about as much again in
# the mirror while its download is still there; other clones need room).
DISK_RESERVE = 0.10


def space_for_downloads(directory: str) -> int:
    usage = shutil.disk_usage(directory)
    return max(0, int(usage.free - DISK_RESERVE * usage.total) // 2)


class SeedResult(NamedTuple):
    seeded: bool  # at least one bundle taken in
    bundles: tuple[str, ...]  # the names taken in, in order
    why: str | None  # why nothing, or not every listed bundle, was taken in
    reason: str | None  # the same, one of REASONS
    store: str  # where from (no credentials: locations never hold any)
    bytes: int  # downloaded
    seconds: float

    def to_record(self, at: float) -> dict:
        return {"seeded": self.seeded, "bundles": list(self.bundles), "why": self.why, "reason": self.reason,
                "store": self.store,
                "bundle_bytes": self.bytes, "seconds": round(self.seconds, 3), "at": at}

    @property
    def outcome(self) -> str:
        """What a journal line says of it: none, partial or seeded."""
        return "none" if not self.seeded else ("partial" if self.why else "seeded")

    def write_record(self, path: str) -> None:
        """The repository's seed record (state/mirror-seed.json), counting upstream's bytes from
        zero when bundles seeded it. Observability only: a full disk fails what follows, with
        its own code."""
        from checkoutcache.store import records

        record = self.to_record(time.time())
        if self.seeded:
            record["upstream"] = {"fetches": 0, "objects": 0, "bytes": 0}
        try:
            records.write_json(path, record)
        except OSError:
            pass


def within(deadline: float, what: str, operation: Callable[[], T]) -> T:
    """operation's result, or StoreError once the deadline passes. A store can send a
    byte at a time, each within every socket timeout: the read runs in a thread we stop
    waiting for (it ends with the worker; what it writes lands in our scratch)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = operation()
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="bundle-download", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        raise StoreError(f"{what}: the download did not finish in the time seeding may take", late=True)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def seed_mirror(mirror: str, location: BundleLocation, key: str, workdir: str, keep_fds: tuple[int, ...],
                budget: float, log: Callable[[str], None], reachable_only: bool = False) -> SeedResult:
    """Never raises (bar the worker's own death): whatever the store does ends in a result.

    budget: the seconds seeding may take (its own, not the clone's). reachable_only: drop
    whatever the bundles' refs do not reach once they are taken in (libgit2 fetches take an
    object's presence for its history's, so a stray commit a pack carried must not stay)."""
    started = time.monotonic()
    try:
        result = _seed(mirror, location, key, workdir, keep_fds, budget, log, started)
        if result.seeded and reachable_only:
            drop_unreachable(mirror, keep_fds, timeout=max(30.0, budget))
        return result
    except Exception as exc:  # a store's answer no branch foresaw: a speed-up lost, not a clone
        why = f"unexpected {type(exc).__name__}: {str(exc)[:300]}"
        log(f"bundles: {why}")
        return SeedResult(False, (), why, UNEXPECTED, str(location), 0, time.monotonic() - started)


def _seed(mirror: str, location: BundleLocation, key: str, workdir: str, keep_fds: tuple[int, ...],
          budget: float, log: Callable[[str], None], started: float) -> SeedResult:
    deadline = started + budget
    taken: list[str] = []
    downloaded = 0

    def result(why: str | None, reason: str | None = None) -> SeedResult:
        if why is not None:
            log(f"bundles: {why}")
        return SeedResult(bool(taken), tuple(taken), why, reason, str(location), downloaded,
                          time.monotonic() - started)

    unsupported = bundles_unsupported()
    if unsupported is not None:
        return result(unsupported, NO_GIT)
    try:
        folder = open_folder(location, key, timeout=max(1.0, min(30.0, budget)))
        raw = within(deadline, LIST_NAME, lambda: folder.read(LIST_NAME, MAX_LIST_BYTES))
        listed = parse_list(raw.decode("utf-8", "replace"))
    except StoreError as exc:
        if exc.large:
            return result(f"the bundle list at {location} is not usable: {exc}", BAD_LIST)
        return result(("no bundle list for this repository: " if exc.missing else "the store did not answer: ")
                      + str(exc), NO_LIST if exc.missing else STORE_DOWN)
    except MalformedList as exc:
        return result(f"the bundle list at {location} is not usable: {exc}", BAD_LIST)
    if not listed.entries:
        return result(f"the bundle list at {location} names no bundle", BAD_LIST)
    log(f"bundles: {len(listed.entries)} listed at {folder.where}")
    room = space_for_downloads(workdir)  # for all of them: a long chain cannot fill the disk
    for entry in listed.entries:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return result(f"stopped before {entry.uri}: seeding may take {budget:.0f}s of the clone at most",
                          OUT_OF_TIME)
        path = os.path.join(workdir, entry.uri)
        try:
            size = within(deadline, entry.uri,
                          lambda: folder.download(entry.uri, path, deadline, max(0, room - downloaded)))
            downloaded += size
            verify_bundle(mirror, path, timeout=max(1.0, deadline - time.monotonic()))
            take_in_bundle(mirror, path, entry.uri[: -len(".bundle")], keep_fds,
                           timeout=max(1.0, deadline - time.monotonic()))
        except (StoreError, BundleError, OSError) as exc:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            reason = BUNDLE_UNUSABLE
            if isinstance(exc, StoreError):
                reason = OUT_OF_TIME if exc.late else NO_SPACE if exc.large else BUNDLE_UNUSABLE
            elif is_disk_full(exc):
                reason = NO_SPACE
            return result(f"{entry.uri} not taken in ({detail}); fetching the rest from upstream", reason)
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
        taken.append(entry.uri)
        log(f"bundles: took in {entry.uri} ({size} bytes)")
    return result(None)
