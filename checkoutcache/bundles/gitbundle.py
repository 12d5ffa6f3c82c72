"""git bundles of a mirror: make one, check one, take one in, and what a mirror holds.

The git CLI only, whatever the transport setting: libgit2 reads no bundles.
Every git runs in git_env() without a URL (no operator config, no credential):
a bundle is a local file. What a bundle brings in lands under refs/bundles/
(git's own bundle-uri does the same, there one folder per bundle): a fetch from upstream offers those
commits as "haves", so only the difference is sent, and gc's repack keeps them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import Callable

from checkoutcache.credentials import Credential, redact, secrets_of
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.git.backend import ALL_BRANCHES_AND_TAGS, BUNDLE_REFS, git_failure
from checkoutcache.git.cli import die_with_parent, partial_filter_of
from checkoutcache.git.messages import last_meaningful_line
from checkoutcache.git import quarantine
from checkoutcache.git.env import FSCK_VAR, git_env
from checkoutcache.git.view import private_view

PUBLISHED_REFS = ("refs/heads/", "refs/tags/")


class BundleError(Exception):
    """A bundle could not be made, checked or taken in: the reason, one line."""

    def __init__(self, why: str, timed_out: bool = False):
        super().__init__(why)
        self.timed_out = timed_out


def bundles_unsupported() -> str | None:
    return None if shutil.which("git") else "bundles need the git CLI (git is not on PATH)"


def _git(args: list[str], keep_fds: tuple[int, ...] = (), timeout: float | None = None,
         stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run git in a process group of its own: at the timeout the whole group is killed
    (git fetch's index-pack would otherwise read on, holding the inherited mirror lock
    and writing into the mirror after we cleaned it), and it dies with its parent."""
    try:
        proc = subprocess.Popen(["git", *args], stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                                env=env if env is not None else git_env(), cwd="/", pass_fds=keep_fds,
                                start_new_session=True, preexec_fn=die_with_parent)
    except OSError as exc:
        raise BundleError(f"git could not start: {exc.strerror}") from None
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.communicate()
        raise BundleError(f"git {args[2] if len(args) > 2 else args[0]} did not finish within {timeout:g}s",
                          timed_out=True) from None
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


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


def take_in_bundle(mirror: str, path: str, namespace: str, keep_fds: tuple[int, ...], timeout: float) -> None:
    """Fetch every ref of the bundle into refs/bundles/<namespace>/, all or nothing.

    git stores the bundle's pack before its connectivity check: a bundle whose pack
    lacks objects its refs need fails the fetch but leaves the pack behind, and a
    commit in it would then be taken as present (its history missing). So whatever
    pack a failed take-in added is removed again."""
    packs = os.path.join(mirror, "objects", "pack")
    before = set(os.listdir(packs)) if os.path.isdir(packs) else set()
    fetched = False
    try:
        # --atomic: every ref or none (a failed one would leave the others pointing into
        # the pack removed below). A namespace per bundle: a branch `foo` in one bundle
        # and `foo/bar` in a later one never clash.
        with private_view(mirror, partial_filter_of(mirror)) as view:
            done = _git(["-C", view, "fetch", "--atomic", "--quiet", "--no-tags", "--no-write-fetch-head", "--",
                         path, f"+refs/*:{BUNDLE_REFS}{namespace}/*"], keep_fds, timeout,
                        env=git_env(takes_objects=True))
        if done.returncode != 0:
            raise BundleError(last_meaningful_line(done.stderr))
        fetched = True
        check_bundle_packs(mirror, sorted(set(os.listdir(packs)) - before), keep_fds)
    except BaseException:
        if fetched:  # refused after the fetch wrote its refs: they would name removed objects
            _drop_refs(mirror, f"{BUNDLE_REFS}{namespace}/")
        for name in set(os.listdir(packs)) - before if os.path.isdir(packs) else ():
            try:
                os.unlink(os.path.join(packs, name))
            except OSError:
                pass
        raise


def check_bundle_packs(mirror: str, names: list[str], keep_fds: tuple[int, ...] = ()) -> None:
    """git's fsck, with our choices (env.py FSCK_CHOICES), of the packs a bundle's take-in
    stored. git before 2.46 checks nothing a fetch from a bundle brings, whatever
    fetch.fsckObjects says: a tree with `.git` (any spelling) or a symlinked .gitmodules
    landed in the mirror unchecked. The packs are shown alone in a quarantine
    (git/quarantine.py), marked promisor there so that what they refer to and lack (the
    history the mirror holds, or a blob a partial mirror never fetched) is no error of
    theirs: the fetch's own connectivity check judged that. CHECKOUTCACHE_FSCK=off skips
    it, as it skips git's."""
    packs = [name for name in names if name.endswith(".pack")]
    if os.environ.get(FSCK_VAR, "on") == "off" or not packs:
        return
    pack_dir = os.path.join(os.path.abspath(mirror), "objects", "pack")
    with quarantine.incoming_objects(mirror) as incoming:
        for name in packs:
            stem = name[:-len(".pack")]
            for suffix in (".pack", ".idx"):
                os.symlink(os.path.join(pack_dir, stem + suffix), os.path.join(incoming, "pack", stem + suffix))
            open(os.path.join(incoming, "pack", stem + ".promisor"), "w").close()
        try:
            quarantine.check(mirror, incoming, partial_filter_of(mirror) or "blob:none", keep_fds)
        except CheckoutCacheError as exc:
            raise BundleError(f"git fsck refused the bundle: {exc.detail or exc.message}"[:300]) \
                from None


def _drop_refs(mirror: str, prefix: str) -> None:
    listed = _git(["-C", mirror, "for-each-ref", "--format=%(refname)", prefix])
    refs = listed.stdout.split() if listed.returncode == 0 else []
    if refs:
        _git(["-C", mirror, "update-ref", "--stdin"], stdin="".join(f"delete {ref}\n" for ref in refs))


def drop_unreachable(mirror: str, keep_fds: tuple[int, ...], timeout: float) -> None:
    """Repack a freshly seeded mirror to what its refs reach, and prune the rest."""
    for args in (["repack", "-a", "-d", "-q"], ["prune", "--expire=now"]):
        done = _git(["-C", mirror, *args], keep_fds, timeout)
        if done.returncode != 0:
            raise BundleError(last_meaningful_line(done.stderr))


def fetch_published(mirror: str, url: str, credential: Credential | None, log: Callable[[str], None],
                    keep_fds: tuple[int, ...], timeout: float) -> None:
    """The upstream's branches and tags, as they are now: a branch or tag deleted
    upstream is deleted here too (--prune), so no bundle carries it on."""
    secrets = secrets_of(credential)
    args = ["fetch", "--prune", "--no-tags", "--no-write-fetch-head", "--quiet", "--", url, *ALL_BRANCHES_AND_TAGS]
    log("$ git " + redact(" ".join(args), secrets))
    try:
        with private_view(mirror) as view:  # bundles come from full mirrors only
            done = _git(["-C", view, *args], keep_fds, timeout, env=git_env(credential=credential, url=url))
    except BundleError as exc:
        raise CheckoutCacheError("TIMEOUT" if exc.timed_out else "CLONE_FAILED",
                                 limit=f"{timeout:g}s", detail=str(exc)) from None
    if done.returncode != 0:
        raise git_failure(done.stderr, last_meaningful_line(done.stderr), secrets)
