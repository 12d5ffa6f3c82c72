"""Submodules: a checkout holds its submodules' work trees (DESIGN invariant 11).

Each submodule repository is a repository of the store in its own right: its
commit is made ready by an ordinary `checkoutcache ensure` of that repository
(its own key, mirror, keep-refs and single-flight clone, and recursively its
own submodules), so a submodule commit used by many superproject commits is
fetched once. The superproject's worker then checks the submodule commit out
at its path, inside its own scratch tree, with objects borrowed from the
submodule repository's mirror, as every checkout borrows from its own mirror.

The superproject's ready marker lists what it borrows ([key, commit] pairs);
gc never drops a keep-ref a published checkout borrows, whichever repository's
store it is in, so the borrowed objects live as long as the checkout does (the
submodule repository's own checkout may be evicted meanwhile).

Relative URLs resolve against the superproject's URL; every URL passes the
same parsing as any request (no `ext::`, `http://`, ...), and a credential goes
only to its host (credentials.py). A submodule that cannot be made fails the
whole checkout with SUBMODULE_FAILED, naming its path and URL: nothing partly
populated is ever published.
"""

from __future__ import annotations

import fnmatch
import json
import os
import posixpath
import re
import subprocess
import sys
import time
from typing import Callable, NamedTuple

from checkoutcache.credentials import credential_env, strip_userinfo
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.repospec import parse_repo

# Deeper than this is a cycle (a repository that is its own submodule) or abuse.
MAX_DEPTH = 8
# The sidecar's policy on repositories, handed to its workers (and their nested
# ensures) through their environment: a .gitmodules names no repository the API
# could not name itself.
POLICY_REPOS_VAR = "CHECKOUTCACHE_SUBMODULE_REPOS"  # comma-separated patterns; unset: any
POLICY_LOCAL_VAR = "CHECKOUTCACHE_SUBMODULE_LOCAL"  # "0": no local paths


class Submodule(NamedTuple):
    path: str
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


def failed(path: str, url: str, detail: str) -> CheckoutCacheError:
    return CheckoutCacheError("SUBMODULE_FAILED", path=repr(path[:200]), url=strip_userinfo(url)[:300],
                              detail=detail[:400])


def submodules_of(backend, mirror: str, sha: str, super_url: str) -> list[Submodule]:
    """The commit's submodules: .gitmodules first (a commit without it has none, and
    costs one git execution), then its gitlinks."""
    urls = backend.gitmodules(mirror, sha)
    if not urls:
        return []
    found = []
    for path, link in sorted(backend.gitlinks(mirror, sha).items()):
        if path not in urls:
            raise failed(path, "(none)", "the commit has a submodule .gitmodules does not name")
        found.append(Submodule(path, resolve_url(super_url, urls[path]), link))
    return found


def check_allowed(spec, super_is_local: bool) -> None:
    """What a .gitmodules may name: a local path (or file://) only from a local
    superproject (as git's protocol.file.allow=user) and where the sidecar's
    policy allows local paths; a URL only where the policy's patterns allow it."""
    if spec.is_local and not (super_is_local and os.environ.get(POLICY_LOCAL_VAR, "1") == "1"):
        raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why="a submodule of a remote repository (or through the "
                                                             "API) may not name a local path")
    patterns = [p for p in os.environ.get(POLICY_REPOS_VAR, "").split(",") if p]
    if patterns and not any(fnmatch.fnmatchcase(spec.url, p) for p in patterns):
        raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why=f"{spec.url[:200]} matches no allowed pattern")


def ensure_in_store(root: str, scope: str, url: str, sha: str, wait: float, super_is_local: bool = False) -> str:
    """Make the submodule's commit ready in its own repository's store, as any
    caller would (`checkoutcache ensure`); returns that repository's key."""
    if url.startswith("~"):
        raise CheckoutCacheError("FORBIDDEN_REPOSITORY", why="a submodule may not name a path in a home directory")
    spec = parse_repo(url, scope, cwd="/")  # transport rules, credentials split off: before anything runs
    check_allowed(spec, super_is_local)
    env = {k: v for k, v in os.environ.items()}
    env.update(credential_env(spec.credential))  # a token of the URL goes by environment, never argv
    try:
        done = subprocess.run([sys.executable, "-m", "checkoutcache", "--root", root, "--json", "ensure", spec.url,
                               sha, "--scope", scope, "--wait", f"{max(1.0, wait):.0f}"], capture_output=True,
                              text=True, env=env, stdin=subprocess.DEVNULL, cwd="/", timeout=max(1.0, wait) + 60)
    except subprocess.TimeoutExpired:
        raise CheckoutCacheError("TIMEOUT", limit=f"{max(1.0, wait):.0f}s") from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        raise CheckoutCacheError("CLONE_FAILED", detail="the submodule's ensure answered no JSON") from None
    if answer.get("state") == "cloning":
        raise CheckoutCacheError("TIMEOUT", limit=f"{max(1.0, wait):.0f}s")
    if answer.get("state") != "ready":
        raise CheckoutCacheError("CLONE_FAILED", detail=f"{answer.get('error')}: {answer.get('message')}")
    return os.path.basename(os.path.dirname(os.path.dirname(answer["path"])))


def populate(tree_dir: str, submodules: list[Submodule], deadline: float, depth: int,
             ensure: Callable[[str, str, float], str], checkout: Callable[[str, str, str], None],
             submodules_at: Callable[[str, str, str], list[Submodule]],
             log: Callable[[str], None]) -> list[list[str]]:
    """Check every submodule out at its path in tree_dir, nested ones too; returns the
    [key, commit] pairs whose objects the checkout borrows. ensure(url, sha, wait) ->
    key; checkout(dir, key, sha); submodules_at(key, url, sha)."""
    borrowed: list[list[str]] = []
    for sub in submodules:
        if depth > MAX_DEPTH:
            raise failed(sub.path, sub.url, f"submodules nested deeper than {MAX_DEPTH} levels (a cycle?)")
        where = os.path.normpath(os.path.join(tree_dir, sub.path))
        if not where.startswith(os.path.normpath(tree_dir) + os.sep) or os.path.islink(where):
            raise failed(sub.path, sub.url, "its path leaves the checkout")
        try:
            key = ensure(sub.url, sub.sha, deadline - time.monotonic())
            log(f"submodule {sub.path}: {strip_userinfo(sub.url)} at {sub.sha}")
            os.makedirs(where, exist_ok=True)
            checkout(where, key, sub.sha)
            nested = submodules_at(key, sub.url, sub.sha)
        except CheckoutCacheError as exc:
            if exc.code == "SUBMODULE_FAILED":
                raise
            raise failed(sub.path, sub.url, f"{exc.code}: {exc.message}") from None
        borrowed.append([key, sub.sha])
        borrowed += populate(where, nested, deadline, depth + 1, ensure, checkout, submodules_at, log)
    return borrowed
