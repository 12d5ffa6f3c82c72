"""`checkoutcache bundle publish`: a repository's branches and tags, as git bundles
in the fleet's shared store (location.py draws the store's layout).

Per repository:
 1. Under locks/mirror.lock (the lock every clone's fetch takes): fetch the
    upstream's branches and tags into the mirror, pruning those deleted upstream (a missing mirror is made in
    our scratch and renamed into place, as a clone makes one), then
    `git bundle create` of them into our scratch: a full bundle, or an
    increment of everything the current chain's heads do not reach.
 2. The lock released: upload the bundle, then its heads file, then the new
    list; each appears whole (S3 PUT, or temp file + rename), and the list
    last, so no reader ever sees a list naming a bundle not yet there.
 3. Mark retired what no list names any more; delete what was marked
    --prune-after ago.

Two publishers at once leave one of their lists (the last written), each
naming only whole bundles as long as a publish takes less than
--prune-after: a bundle is deleted only that long after a publisher first
found it in no list. A publisher that finds a listed bundle or its heads
missing starts a new chain. Failures are reported per repository with a
code; the others go on.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import attrs

from checkoutcache.bundles.bundlelist import (
    MAX_LIST_BYTES,
    BundleEntry,
    BundleList,
    MalformedList,
    next_token,
    parse_heads,
    parse_list,
    plan_publish,
    render_heads,
    plan_prune,
    render_list,
)
from checkoutcache.bundles.objectstore import RepositoryFolder, StoreError, open_folder
from checkoutcache.bundles.location import LIST_NAME, BundleLocation, bundle_key, heads_name, object_name, retired_name
from checkoutcache.config import Config
from checkoutcache.credentials import credential_for
from checkoutcache.errors import CheckoutCacheError, disk_full, is_disk_full
from checkoutcache.bundles.gitbundle import (
    BundleError,
    bundles_unsupported,
    create_bundle,
    fetch_published,
    present,
    published_refs,
)
from checkoutcache.git.boundary import is_shallow
from checkoutcache.git.mirror import install_new_mirror
from checkoutcache.git.transport import pick_backend
from checkoutcache.repospec import RepoSpec
from checkoutcache.store import locks, records
from checkoutcache.store.create import init_repo_store, store_exists, store_key
from checkoutcache.store.layout import RepoPaths, RootPaths
from checkoutcache.store.scratch import create_scratch

Log = Callable[[str], None]


@attrs.frozen
class PublishOptions:
    full: bool = False  # start a new chain whatever the list holds
    max_increments: int = 6  # increments on one full bundle before the next full one
    full_every: float = 7 * 86400.0  # a full bundle at least this often
    prune_after: float = 3600.0  # unlisted objects older than this are deleted


def stored_repositories(root_paths: RootPaths) -> list[RepoSpec]:
    """Every remote repository of the root that has a mirror: one per bundle key
    (settings variants of one repository share their bundles)."""
    found: dict[str, RepoSpec] = {}
    for key in root_paths.repo_keys():
        paths = root_paths.repo(key)
        info = records.read_json(paths.repo_json, records.REPO) or {}
        url, scope, is_local = info.get("url"), info.get("scope"), bool(info.get("is_local"))
        if not isinstance(url, str) or not isinstance(scope, str) or is_local or not os.path.isdir(paths.mirror):
            continue
        found.setdefault(bundle_key(scope, url, is_local), RepoSpec(url=url, scope=scope, key=key, is_local=False))
    return list(found.values())


def read_list(folder: RepositoryFolder) -> BundleList | None:
    """The current list; None when there is none or it is not one we can build on."""
    try:
        return parse_list(folder.read(LIST_NAME, MAX_LIST_BYTES).decode("utf-8", "replace"))
    except StoreError as exc:
        if exc.missing:
            return None
        raise
    except MalformedList:
        return None


def chain_heads(folder: RepositoryFolder, current: BundleList) -> list[dict[str, str]] | None:
    """The heads file of every listed bundle, oldest first; None if one is missing or unusable."""
    chain = []
    for entry in current.entries:
        try:
            text = folder.read(heads_name(entry.uri), MAX_LIST_BYTES * 16).decode("utf-8", "replace")
        except StoreError as exc:
            if exc.missing or exc.large:
                return None  # a new chain needs no heads
            raise
        chain.append(parse_heads(text))
    return chain


class Publisher:
    def __init__(self, root_paths: RootPaths, location: BundleLocation, config: Config, options: PublishOptions,
                 log: Log, environ: dict[str, str] | None = None):
        self.root_paths, self.location, self.config, self.options, self.log = (
            root_paths, location, config, options, log)
        self.environ = dict(os.environ if environ is None else environ)
        self.backend = pick_backend(config.transport)

    def publish(self, spec: RepoSpec) -> dict:
        key = bundle_key(spec.scope, spec.url, spec.is_local)
        report = {"repo": spec.url, "scope": spec.scope, "bundle_key": key, "store": str(self.location)}
        try:
            report.update(self._publish(spec, key))
        except Exception as exc:  # one repository's failure, reported with a code; the others go on
            error = self._explain(spec, exc)
            report.update(action="failed", error=error.code, message=error.message, next=error.next)
        return report

    def _explain(self, spec: RepoSpec, exc: Exception) -> CheckoutCacheError:
        if isinstance(exc, CheckoutCacheError):
            return exc
        if isinstance(exc, StoreError):
            return CheckoutCacheError("BUNDLE_STORE_FAILED", where=str(self.location), detail=str(exc))
        if isinstance(exc, locks.LockTimeout):
            return CheckoutCacheError("BUNDLE_FAILED", repo=spec.url, detail=(
                f"its mirror stayed locked for {self.config.clone_timeout:g}s (a clone or gc holds it)"))
        if is_disk_full(exc):
            return disk_full(exc)
        return CheckoutCacheError("INTERNAL_ERROR", detail=f"{type(exc).__name__}: {exc}"[:300])

    def _publish(self, spec: RepoSpec, key: str) -> dict:
        if spec.is_local:
            raise CheckoutCacheError("BAD_ARGUMENT", what="a local repository is not published: its nodes read it "
                                                          "directly")
        unsupported = bundles_unsupported()
        if unsupported is not None:
            raise CheckoutCacheError("BUNDLE_FAILED", repo=spec.url, detail=unsupported)
        folder = open_folder(self.location, key, timeout=self.config.probe_timeout)
        current = read_list(folder)
        stored = {name for name, _ in folder.list()}
        now = time.time()
        plan = plan_publish(current, now, self.options.max_increments, self.options.full_every, self.options.full)
        chain = chain_heads(folder, current) if current is not None and not plan.full else None
        if not plan.full and chain is None:
            plan = plan._replace(full=True, why="a listed bundle's heads file is missing")
        if not plan.full and any(e.uri not in stored for e in current.entries):
            plan = plan._replace(full=True, why="a listed bundle is missing from the store")
        spec = store_key(self.root_paths, spec)
        paths = self.root_paths.repo(spec.key)
        if os.path.isdir(paths.mirror) and self.backend.partial_filter(paths.mirror) is not None:
            # git bundle create needs every object of what it bundles (MONOREPO.md A6).
            raise CheckoutCacheError("BUNDLE_FAILED", repo=spec.url, detail=(
                "its mirror is a partial clone (CHECKOUTCACHE_FILTER): bundles are made from a full mirror; "
                "publish from a node without CHECKOUTCACHE_FILTER"))
        if os.path.isdir(paths.mirror) and is_shallow(paths.mirror):
            # A bundle of a shallow history would name commits whose parents no reader has.
            raise CheckoutCacheError("BUNDLE_FAILED", repo=spec.url, detail=(
                "its mirror's history is still shallow (a cold node's first answers; the history follows in the "
                "background): publish once it is complete (`checkoutcache ensure REPO COMMIT --history full "
                "--wait 1h` waits for it)"))
        if not store_exists(paths):  # a repository never seen here: nothing is written before it answers
            self.backend.probe(spec.url, False, self._credential(spec), self.config.probe_timeout)
            init_repo_store(self.root_paths, paths, spec)
        scratch = create_scratch(paths, "bundle-publish")
        try:
            made = self._make_bundle(spec, paths, scratch.path, plan.full, chain or [], now, current)
            if made is None:
                return {"action": "up to date", "why": "no branch or tag moved since the newest bundle",
                        "list": [e.uri for e in current.entries] if current else [],
                        "pruned": self._prune(folder, current.entries if current else ())}
            entry, path, heads = made
            entries = (entry,) if plan.full else (*current.entries, entry)
            folder.write(entry.uri, path)
            folder.write(heads_name(entry.uri), render_heads(heads).encode())
            folder.write(LIST_NAME, render_list(entries).encode())  # last: every bundle it names is whole
            pruned = self._prune(folder, entries)
            self.log(f"{spec.url}: published {entry.uri} ({'full' if plan.full else 'increment'}: {plan.why})")
            return {"action": "full" if plan.full else "increment", "why": plan.why, "bundle": entry.uri,
                    "bytes": os.path.getsize(path), "refs": len(heads), "list": [e.uri for e in entries],
                    "pruned": pruned}
        finally:
            scratch.discard()

    def _credential(self, spec: RepoSpec):
        return credential_for(spec.url, spec.credential, self.environ)

    def _make_bundle(self, spec: RepoSpec, paths: RepoPaths, workdir: str, full: bool,
                     chain: list[dict[str, str]], now: float, current: BundleList | None):
        """(entry, file, heads) of a new bundle, or None when nothing moved."""
        with locks.mirror_write(paths, timeout=self.config.clone_timeout) as mirror_lock:
            keep_fds = (mirror_lock.fileno(),)
            if not os.path.isdir(paths.mirror):
                install_new_mirror(paths, self.backend, workdir)  # a full one: bundles need every object
            fetch_published(paths.mirror, spec.url, self._credential(spec), lambda line: self.log(f"{spec.url}: {line}"),
                            keep_fds, self.config.clone_timeout)
            try:
                heads = published_refs(paths.mirror)
                if not heads:
                    raise CheckoutCacheError("BUNDLE_FAILED", repo=spec.url, detail="it has no branch or tag")
                if not full and chain and chain[-1] == heads:
                    return None
                exclude = set() if full else present(paths.mirror, {sha for h in chain for sha in h.values()})
                token = next_token(None if full else current, now)
                name = object_name(token, os.urandom(4).hex())
                path = os.path.join(workdir, name)
                if not create_bundle(paths.mirror, path, exclude, keep_fds, self.config.clone_timeout):
                    return None
            except BundleError as exc:
                raise CheckoutCacheError("BUNDLE_FAILED", repo=spec.url, detail=str(exc)) from None
        return BundleEntry(name[: -len(".bundle")], name, token), path, heads

    def _prune(self, folder: RepositoryFolder, entries) -> list[str]:
        """Retire what neither our list nor the store's current one names; delete what was
        retired --prune-after ago (bundlelist.plan_prune). Returns what was deleted."""
        listed = {e.uri for e in entries}
        try:
            latest = read_list(folder)  # another publisher's list, written since ours, keeps its bundles
            listed |= {e.uri for e in latest.entries} if latest else set()
            stored = folder.list()
            # The store's clock, not ours: marks and objects carry its times (S3 LastModified,
            # file mtimes); its freshest object is no later than its now (a run that wrote
            # nothing prunes late, never early).
            now = max([modified for _name, modified in stored], default=time.time())
            plan = plan_prune(stored, listed, now, self.options.prune_after)
            for aborted in folder.abort_stale_uploads(now, self.options.prune_after):
                self.log(f"aborted an upload of {aborted} a publisher left unfinished")
            for bundle in plan.retire:
                folder.write(retired_name(bundle), b"")
            for name in plan.delete + plan.relisted:
                folder.delete(name)
        except StoreError as exc:
            self.log(f"pruning skipped: {exc}")
            return []
        return plan.delete
