"""Submodules: a checkout holds its submodules' work trees (DESIGN invariant 11),
and nothing a repository says about them can write outside the root (12).

Which submodules: the gitlinks (mode 160000) of the index git wrote when it
checked the commit out, as bytes: exactly what git itself would populate. A
tree can name one path twice (a gitlink `a` beside a tree `a/`): `ls-tree`
sees both, git's index keeps one, and only the index says what is on disk.
Each path must also be named by the commit's .gitmodules (its URL).

Where: each path is opened beneath the checkout's directory descriptor,
component by component, never through a symlink (store/beneath.py), and the
submodule is checked out through that descriptor (/proc/self/fd/N): a
submodule whose own tree holds a symlink can never steer a later one outside.
A path that leaves the checkout, passes a symlink or a file, or is not empty
fails the commit with SUBMODULE_FAILED saying so.

How: each submodule repository is a repository of the store in its own right
(its own key, mirror, keep-refs and single-flight clone), and its commit is
made ready in this very process (the coordinator, with the clone run inline
when no one else is making it): no Python start per submodule. The
superproject's worker then checks the commit out at its path with objects
borrowed from that repository's mirror; its ready marker lists what it
borrows ([key, commit] pairs) and gc keeps those keep-refs.

Bounds, per superproject commit: MAX_DEPTH levels, config.max_submodules
nested checkouts and config.max_submodule_bytes of their files; past one,
SUBMODULE_FAILED names the setting to raise.

Relative URLs resolve against the superproject's URL; every URL passes the
same parsing as any request (no `ext::`, `http://`, ...), a local path only
from a local superproject, and the sidecar's repository policy applies.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import posixpath
import re
import time
from typing import Callable, Iterator, NamedTuple

import attrs

from checkoutcache.cones import Cone, matcher
from checkoutcache.credentials import strip_userinfo
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.repospec import parse_repo
from checkoutcache.store.beneath import Escape, fd_path, open_dir_beneath, shown
from checkoutcache.store.sizes import measure_at
from checkoutcache.units import format_bytes

# Deeper than this is a cycle (a repository that is its own submodule) or abuse.
MAX_DEPTH = 8
# The sidecar's policy on repositories, handed to its workers through their
# environment: a .gitmodules names no repository the API could not name itself.
POLICY_REPOS_VAR = "CHECKOUTCACHE_SUBMODULE_REPOS"  # comma-separated patterns; unset: any
POLICY_LOCAL_VAR = "CHECKOUTCACHE_SUBMODULE_LOCAL"  # "0": no local paths


# (key, commit) of every clone of this process populating its submodules, outermost
# first: a worker runs its submodules' clones inline, so a chain of them is bounded
# here across levels, and a repository that is its own submodule is told apart at once.
_MAKING: list[tuple[str, str]] = []


@contextlib.contextmanager
def making(key: str, sha: str) -> Iterator[None]:
    _MAKING.append((key, sha))
    try:
        yield
    finally:
        _MAKING.pop()


class Submodule(NamedTuple):
    path: bytes  # as git's index holds it: any bytes but NUL
    url: str  # resolved against the superproject's URL
    sha: str


def resolve_url(super_url: str, url: str) -> str:
    """A .gitmodules URL; `./x` and `../x` are relative to the superproject's URL."""
    if not url.startswith(("./", "../")):
        return url
    if "://" in super_url:
        scheme, _, rest = super_url.partition("://")
        host, _, path = rest.partition("/")
        return f"{scheme}://{host}{_join('/' + path, url)}"
    scp = re.match(r"^([^/:]+):(.*)$", super_url)
    if scp:
        return f"{scp.group(1)}:{_join(scp.group(2), url).lstrip('/')}"
    return _join(super_url, url)


def _join(base: str, relative: str) -> str:
    return posixpath.normpath(posixpath.join(base.rstrip("/"), relative))


def failed(path: bytes, url: str, detail: str) -> CheckoutCacheError:
    return CheckoutCacheError("SUBMODULE_FAILED", path=shown(path), url=strip_userinfo(url)[:300],
                              detail=detail[:400])


def submodules_in(backend, tree_dir: str, mirror: str, sha: str, super_url: str,
                  keep_fds: tuple[int, ...] = (), cone: Cone = (), urls: dict[bytes, str] | None = None
                  ) -> list[Submodule]:
    """The submodules git checked out as empty directories in tree_dir (the gitlinks
    of its index), each with its URL from the commit's .gitmodules. A commit without
    a .gitmodules has none (one git execution). In a sparse checkout, only those of
    its cone (git leaves the others out too)."""
    urls = urls if urls is not None else backend.gitmodules(mirror, sha)
    if not urls:
        return []
    found = []
    in_cone = matcher(cone)
    for path, link in sorted(backend.index_gitlinks(tree_dir, keep_fds).items()):
        if not in_cone(path):
            continue
        if path not in urls:
            raise failed(path, "(none)", "the commit has a submodule .gitmodules does not name")
        found.append(Submodule(path, resolve_url(super_url, urls[path]), link))
    return found


def check_allowed(spec, super_is_local: bool, token_patterns: tuple[str, ...] = ()) -> None:
    """What a .gitmodules may name: a local path (or file://) only from a local
    superproject (as git's protocol.file.allow=user) and where the sidecar's
    policy allows local paths; a URL only where the policy's patterns allow it, and
    the asking token's own (its repos=: config.submodule_repos) too."""
    if spec.is_local and not (super_is_local and os.environ.get(POLICY_LOCAL_VAR, "1") == "1"):
        raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why="a submodule of a remote repository (or through the "
                                                             "API) may not name a local path")
    patterns = [p for p in os.environ.get(POLICY_REPOS_VAR, "").split(",") if p]
    if patterns and not any(fnmatch.fnmatchcase(spec.url, p) for p in patterns):
        raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why=f"{spec.url[:200]} matches no allowed pattern")
    if token_patterns and not any(fnmatch.fnmatchcase(spec.url, p) for p in token_patterns):
        raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why=f"{spec.url[:200]} is not among the asking token's "
                                                             f"repositories")


def ensure_in_store(root: str, config, scope: str, url: str, sha: str, wait: float, start,
                    super_is_local: bool = False) -> str:
    """Make the submodule's commit ready in its own repository's store, in this
    process (single flight as for any caller; `start` runs the clone inline when
    nobody else is making it: worker.py's run_inline); returns that repository's key."""
    if url.startswith("~"):
        raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why="a submodule may not name a path in a home directory")
    spec = parse_repo(url, scope, cwd="/", lfs=config.lfs, submodules=config.submodules)
    check_allowed(spec, super_is_local, tuple(getattr(config, "submodule_repos", ()) or ()))
    from checkoutcache.clone.coordinator import Coordinator  # only a commit with submodules pays for it
    from checkoutcache.store.layout import RootPaths, existing_key

    root_paths = RootPaths(root)
    spec = spec._replace(key=existing_key(root_paths, spec.key, spec.legacy_key), legacy_key=None)
    if (spec.key, sha) in _MAKING:
        raise CheckoutCacheError("CLONE_FAILED", detail="the commit is its own submodule (a cycle)")
    if len(_MAKING) > MAX_DEPTH:
        raise CheckoutCacheError("CLONE_FAILED", detail=f"submodules nested deeper than {MAX_DEPTH} levels")
    answer = Coordinator(root_paths, config, spec, sha, start).run(max(0.0, wait))
    if answer.state == "cloning":
        raise CheckoutCacheError("TIMEOUT", limit=f"{max(1.0, wait):.0f}s")
    if answer.error == "SUBMODULE_FAILED":
        # A submodule of the submodule: its message names the deepest path and URL; passed up whole.
        nested = CheckoutCacheError("SUBMODULE_FAILED", path="", url="", detail="")
        nested.message = str(answer.message)
        raise nested
    if answer.state != "ready":
        raise CheckoutCacheError("CLONE_FAILED", detail=f"{answer.error}: {answer.message}")
    return spec.key


@attrs.define
class Budget:
    """What one superproject commit's submodules may cost, all levels together."""

    max_checkouts: int
    max_bytes: int
    checkouts: int = 0
    bytes: int = 0

    def count(self, sub: Submodule) -> None:
        self.checkouts += 1
        if self.checkouts > self.max_checkouts:
            raise failed(sub.path, sub.url, f"the commit needs more than {self.max_checkouts} submodule checkouts "
                                            f"(raise CHECKOUTCACHE_MAX_SUBMODULES if that is right)")

    def add_bytes(self, sub: Submodule, size: int) -> None:
        self.bytes += size
        if self.bytes > self.max_bytes:
            raise failed(sub.path, sub.url, f"the commit's submodules hold more than {format_bytes(self.max_bytes)} "
                                            f"(raise CHECKOUTCACHE_MAX_SUBMODULE_BYTES if that is right)")


# ensure(url, sha, wait) -> key; checkout(dir, dir_fd, key, sha); submodules_at(dir, dir_fd, key, url, sha)
Ensure = Callable[[str, str, float], str]
Checkout = Callable[[str, int, str, str], None]
SubmodulesAt = Callable[[str, int, str, str, str], list[Submodule]]


def populate(tree_fd: int, submodules: list[Submodule], deadline: float, depth: int, budget: Budget,
             ensure: Ensure, checkout: Checkout, submodules_at: SubmodulesAt,
             log: Callable[[str], None]) -> list[list[str]]:
    """Check every submodule out at its path below the directory tree_fd holds, nested
    ones too; returns the [key, commit] pairs whose objects the checkout borrows."""
    borrowed: list[list[str]] = []
    for sub in submodules:
        if depth > MAX_DEPTH:
            raise failed(sub.path, sub.url, f"submodules nested deeper than {MAX_DEPTH} levels (a cycle?)")
        budget.count(sub)
        try:
            where_fd = open_dir_beneath(tree_fd, sub.path, create=True)
        except Escape as exc:
            raise failed(sub.path, sub.url, f"its path leaves the checkout: {exc}") from None
        try:
            where = fd_path(where_fd)
            if os.listdir(where_fd):
                raise failed(sub.path, sub.url, "its directory is not empty (another entry of the tree is there)")
            try:
                key = ensure(sub.url, sub.sha, deadline - time.monotonic())
                log(f"submodule {shown(sub.path)}: {strip_userinfo(sub.url)} at {sub.sha}")
                checkout(where, where_fd, key, sub.sha)
                budget.add_bytes(sub, measure_at(where_fd).bytes)
                nested = submodules_at(where, where_fd, key, sub.url, sub.sha)
            except CheckoutCacheError as exc:
                if exc.code == "SUBMODULE_FAILED":
                    raise
                raise failed(sub.path, sub.url, f"{exc.code}: {exc.message}") from None
            borrowed.append([key, sub.sha])
            borrowed += populate(where_fd, nested, deadline, depth + 1, budget, ensure, checkout, submodules_at,
                                 log)
        finally:
            os.close(where_fd)
    return borrowed
