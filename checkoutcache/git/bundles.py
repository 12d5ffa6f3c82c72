"""git bundles of a mirror: make one, check one, take one in, and what a mirror holds.

The git CLI only, whatever the transport setting: libgit2 reads no bundles.
Every git runs in git_env() without a URL (no operator config, no credential):
a bundle is a local file. What a bundle brings in lands under refs/bundles/
(git's own bundle-uri does the same): a fetch from upstream offers those
commits as "haves", so only the difference is sent, and gc's repack keeps them.
"""

from __future__ import annotations

import shutil
import subprocess

from checkoutcache.git.cli import last_meaningful_line
from checkoutcache.git.env import git_env

BUNDLE_REFS = "refs/bundles/"
PUBLISHED_REFS = ("refs/heads/", "refs/tags/")


class BundleError(Exception):
    """A bundle could not be made, checked or taken in: the reason, one line."""


def bundles_unsupported() -> str | None:
    return None if shutil.which("git") else "bundles need the git CLI (git is not on PATH)"


def _git(args: list[str], keep_fds: tuple[int, ...] = (), timeout: float | None = None,
         stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], input=stdin, capture_output=True, text=True, errors="replace",
                              env=git_env(), cwd="/", pass_fds=keep_fds, timeout=timeout,
                              stdin=None if stdin is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BundleError(f"git {args[2] if len(args) > 2 else args[0]} did not finish within {timeout:g}s") from None
    except OSError as exc:
        raise BundleError(f"git could not start: {exc.strerror}") from None


def published_refs(mirror: str) -> dict[str, str]:
    """ref -> id of the mirror's branches and tags (what a bundle of it carries)."""
    done = _git(["-C", mirror, "for-each-ref", "--format=%(objectname) %(refname)", *PUBLISHED_REFS])
    if done.returncode != 0:
        raise BundleError(last_meaningful_line(done.stderr))
    refs = {}
    for line in done.stdout.splitlines():
        sha, _, ref = line.partition(" ")
        refs[ref] = sha
    return refs


def present(mirror: str, shas: set[str]) -> set[str]:
    """Those of the ids the mirror has (an increment may only exclude what exists)."""
    if not shas:
        return set()
    done = _git(["-C", mirror, "cat-file", "--batch-check=%(objectname) %(objecttype)"],
                stdin="".join(f"{sha}\n" for sha in sorted(shas)))
    return {line.split()[0] for line in done.stdout.splitlines() if not line.endswith(" missing")} & shas


def create_bundle(mirror: str, dest: str, exclude: set[str], keep_fds: tuple[int, ...], timeout: float) -> bool:
    """A bundle of the mirror's branches and tags, less what `exclude` reaches; False
    when that leaves nothing to bundle (no new objects since)."""
    revs = "".join(f"^{sha}\n" for sha in sorted(exclude))
    done = _git(["-C", mirror, "bundle", "create", "--quiet", dest, "--branches", "--tags", "--stdin"],
                keep_fds, timeout, stdin=revs)
    if done.returncode != 0:
        if "empty bundle" in done.stderr:
            return False
        raise BundleError(last_meaningful_line(done.stderr))
    return True


def verify_bundle(mirror: str, path: str, timeout: float) -> None:
    """git's own check: a bundle file, whole, whose prerequisites the mirror has."""
    done = _git(["-C", mirror, "bundle", "verify", "--quiet", path], timeout=timeout)
    if done.returncode != 0:
        raise BundleError(last_meaningful_line(done.stderr))


def take_in_bundle(mirror: str, path: str, keep_fds: tuple[int, ...], timeout: float) -> None:
    """Fetch every ref of the bundle into refs/bundles/ (objects checked as any fetch's)."""
    done = _git(["-C", mirror, "fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--", path,
                 f"+refs/*:{BUNDLE_REFS}*"], keep_fds, timeout)
    if done.returncode != 0:
        raise BundleError(last_meaningful_line(done.stderr))


def object_count(mirror: str) -> tuple[int, int]:
    """(objects, bytes) the mirror holds, loose and packed (git count-objects)."""
    done = _git(["-C", mirror, "count-objects", "-v"])
    if done.returncode != 0:
        raise BundleError(last_meaningful_line(done.stderr))
    fields = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    objects = int(fields.get("count", 0)) + int(fields.get("in-pack", 0))
    size = (int(fields.get("size", 0)) + int(fields.get("size-pack", 0))) * 1024
    return objects, size
