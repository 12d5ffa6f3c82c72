"""Shallow mirrors: the boundary of a mirror's history, and the fetches that move it
(issue 34: a cold node answers at the cost of one commit; its history follows).

The boundary is git's own: `mirror.git/shallow` lists the commits whose parents the
mirror does not have (git treats them as roots). No file: the history is complete.
DESIGN invariant 13, "connected down to the recorded shallow boundary and no further",
is git's reading of that file: every walk (`rev-list`, fetch's connectivity check,
`is_connected`) stops at a listed commit and never counts what lies below it, so a
commit whose history reaches the boundary is present; objects below it, whatever
brought them (a bundle, an interrupted fetch), are never vouched for until a complete
fetch has proven them and the entry is dropped (install_history).

Who writes the file, always under locks/mirror.lock:
- git itself, fetching through a view of the mirror (git/view.py: the view's `shallow`
  is a symlink to the mirror's). git removes the file by unlinking the view's link:
  after a successful fetch the caller removes the mirror's (`after_view_fetch`). A
  failed fetch never removes it (git unlinks before its connectivity check).
- install_fetched: a private fetch's delta (the entries it added and removed), checked
  against the objects there (settled_boundary): an entry whose parents are missing is
  never dropped, and none is added above history the mirror has connected (git lists
  every commit at a fetch's depth, even one whose parents are here).
- install_history: the entries a complete history fetch proved.
Both write `shallow.lock` and rename it over `shallow` (git's own lock file: a killed
writer's is removed as every stale git lock file is, git/mirror.py), in this order
after the objects and before the refs: killed at any point, the file claims at most
less history than there is, never more.

A private fetch (`fetch_privately`) runs without the mirror lock, so fetches of
different commits on a cold node run side by side: its objects go to an object store
of the caller's (in its scratch, reaped with it: store/layout.py) whose alternate is the
mirror's, in a view with refs and a shallow file of its own (snapshots of the mirror's,
refs first: a ref an installer wrote is read only after the shallow entries written
before it). `install_fetched` then moves its packs into the mirror (`.idx` last), applies
its shallow delta and writes its refs, under the mirror lock, in milliseconds.

A checkout's `.git/shallow` is a symlink to the mirror's (`link_shallow`): its git reads
the boundary the mirror has now, so the history of every checkout, the first ones
included, completes when the mirror's does, and nothing in the checkout changes.

Only the git CLI backend mixes this in (GitCliBackend): libgit2 cannot run a fetch
through the view's shallow link and its own shallow file alike, so the pygit2 transport
makes full mirrors (supports_shallow False).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import NamedTuple

from checkoutcache.credentials import Credential, redact, secrets_of
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.git import quarantine
from checkoutcache.git.backend import Log, Progress, git_failure, keep_ref, one_time_promisor_remote
from checkoutcache.git.boundary import (is_shallow, link_shallow, read_shallow, shallow_file,  # noqa: F401
                                        write_shallow)
from checkoutcache.git.env import git_env
from checkoutcache.git.messages import FILTER_REFUSED, last_meaningful_line
from checkoutcache.git.view import private_view, read_view_shallow
from checkoutcache.store import modes


def mirror_is_empty(mirror: str) -> bool:
    """A mirror nothing was fetched into yet (no object, no ref): a cold node's, whose first
    fetches of different commits may all be shallow ones side by side."""
    objects = os.path.join(mirror, "objects")
    try:
        if any(name.endswith(".pack") for name in os.listdir(os.path.join(objects, "pack"))):
            return False
        if any(len(name) == 2 for name in os.listdir(objects)):
            return False
        if os.path.exists(os.path.join(mirror, "packed-refs")):
            return False
        for _directory, _dirs, files in os.walk(os.path.join(mirror, "refs")):
            if files:
                return False
    except FileNotFoundError:
        return False
    return True


def make_incoming(path: str, mirror: str) -> str:
    """A private object store at path (in the caller's scratch), borrowing the mirror's."""
    shutil.rmtree(path, ignore_errors=True)  # an earlier attempt's, in this same scratch
    for directory in (path, os.path.join(path, "pack"), os.path.join(path, "info")):
        modes.make_dir(directory)
    with open(os.path.join(path, "info", "alternates"), "w") as handle:
        handle.write(os.path.join(os.path.abspath(mirror), "objects") + "\n")
    return path


class Fetched(NamedTuple):
    """What a private fetch brought: objects in `incoming`, refs and shallow before and after."""

    incoming: str
    refs_before: dict[str, str]
    refs_after: dict[str, str]
    shallow_before: frozenset[str]
    shallow_after: frozenset[str]
    filter_refused: bool
    # git said `error:` and still succeeded (it reads a damaged pack of the mirror so): the
    # caller checks the mirror on disk (is_sound), never decides from the words.
    complained: bool = False

    @property
    def added(self) -> frozenset[str]:
        return self.shallow_after - self.shallow_before

    @property
    def removed(self) -> frozenset[str]:
        return self.shallow_before - self.shallow_after


class ShallowOps:
    """The shallow half of the git CLI backend (mixed into GitCliBackend: it uses its git,
    _stream and partial_filter)."""

    supports_shallow = True

    def fetch_privately(self, mirror: str, incoming: str, url: str, refspecs: list[str],
                        credential: Credential | None, on_progress: Progress, log: Log,
                        keep_fds: tuple[int, ...] = (), depth: int | None = None, deepen: int | None = None,
                        refs: dict[str, str] | None = None, shallow: frozenset[str] | None = None,
                        refs_after: bool = True) -> Fetched:
        """Fetch into `incoming` (make_incoming), not into the mirror, without its lock: a
        view with refs (default: a snapshot of the mirror's) and a shallow boundary (default:
        the mirror's, read after its refs) of its own. depth: `--depth`; deepen: `--deepen`
        (from the view's boundary). Into a partial mirror with its filter, checked by fsck
        where git cannot check it itself (git/quarantine.py). refs_after: read the view's refs
        after the fetch (the caller writes none of them: not needed)."""
        secrets = secrets_of(credential)
        filter = self.partial_filter(mirror)
        before = dict(quarantine.refs_of(mirror, self.git) if refs is None else refs)
        boundary = read_shallow(mirror) if shallow is None else frozenset(shallow)
        limit = [f"--depth={depth}"] if depth is not None else [f"--deepen={deepen}"] if deepen is not None else []
        if filter is None:
            cmd = ["fetch", "--no-tags", "--no-write-fetch-head", "--progress", *limit, "--", url, *refspecs]
        else:
            remote, remote_config = one_time_promisor_remote(url, filter)
            cmd = [*remote_config, "fetch", "--no-tags", "--no-write-fetch-head", "--progress", *limit,
                   f"--filter={filter}", remote, *refspecs]
        log("$ git " + redact(" ".join(cmd), secrets) + " (privately)")
        checked_after = quarantine.needed(filter, self.git)
        with private_view(mirror, filter, objects=incoming, refs=before, shallow=boundary) as view:
            code, output = self._stream(["-C", view, *cmd],
                                        git_env(credential=credential, url=url, fsck=not checked_after),
                                        on_progress, log, secrets, keep_fds)
            if code != 0:
                raise git_failure(output, last_meaningful_line(output), secrets)
            after = quarantine.refs_of(view, self.git) if refs_after else {}
            boundary_after = read_view_shallow(view)
        if checked_after:
            quarantine.check(mirror, incoming, filter, keep_fds, self.git)
        complained = any(line.lower().startswith("error:") for line in output.splitlines())
        return Fetched(incoming, before, after, boundary, boundary_after,
                       filter is not None and FILTER_REFUSED in output, complained)

    def install_fetched(self, mirror: str, fetched: Fetched, keep_fds: tuple[int, ...] = (),
                        refs: list[str] | None = None, boundary: frozenset[str] | None = None) -> None:
        """A private fetch's result into the mirror, under the mirror lock: objects, then the
        shallow delta, then the refs it wrote (refs: only these; keep-refs are written by
        the caller). boundary: the entries the fetch added that count (default: all)."""
        quarantine.move_objects(mirror, fetched.incoming)
        added = fetched.added if boundary is None else boundary
        now = read_shallow(mirror)
        wanted = self.settled_boundary(mirror, now, (now | added) - fetched.removed)
        if wanted != now:
            write_shallow(mirror, wanted)
        self.update_refs(mirror, {ref: sha for ref, sha in fetched.refs_after.items()
                                  if fetched.refs_before.get(ref) != sha and (refs is None or ref in refs)}, keep_fds)

    def update_refs(self, git_dir: str, refs: dict[str, str], keep_fds: tuple[int, ...] = ()) -> None:
        """Set these refs, in one transaction (the caller holds the repository's lock)."""
        if not refs:
            return
        lines = "".join(f"update {ref} {sha}\n" for ref, sha in sorted(refs.items()))
        done = subprocess.run([self.git, "-C", git_dir, "update-ref", "--stdin"], input=lines, text=True,
                              capture_output=True, env=git_env(), cwd="/", pass_fds=keep_fds)
        if done.returncode != 0:
            raise CheckoutCacheError("CLONE_FAILED", detail=f"refs could not be written: {done.stderr.strip()[-200:]}")

    def drop_refs(self, git_dir: str, refs: list[str], keep_fds: tuple[int, ...] = ()) -> None:
        """Delete these refs, in one transaction (the caller holds the repository's lock)."""
        if not refs:
            return
        done = subprocess.run([self.git, "-C", git_dir, "update-ref", "--stdin"],
                              input="".join(f"delete {ref}\n" for ref in sorted(refs)), text=True,
                              capture_output=True, env=git_env(), cwd="/", pass_fds=keep_fds)
        if done.returncode != 0:
            raise CheckoutCacheError("CLONE_FAILED", detail=f"refs could not be deleted: {done.stderr.strip()[-200:]}")

    def refs_named(self, git_dir: str, prefix: str = "") -> dict[str, tuple[str, str]]:
        """ref -> (id, the object's type) of the repository's refs (under prefix)."""
        done = self._run(["-C", git_dir, "for-each-ref", "--format=%(objectname) %(objecttype) %(refname)",
                          *([prefix] if prefix else [])])
        found = {}
        for line in done.stdout.splitlines():
            sha, kind, ref = (line.split(" ", 2) + ["", ""])[:3]
            if ref:
                found[ref] = (sha, kind)
        return found

    def settled_boundary(self, mirror: str, now: frozenset[str], proposed: frozenset[str]) -> frozenset[str]:
        """The boundary a fetch's install writes, under the mirror lock, from what the fetch and
        its caller propose checked against the objects now in the mirror. An entry leaves only
        when its parents are here (a caller's filter, or a second search's narrower view, proves
        no history it did not fetch: dropped, the entry would claim history that is not there).
        An entry comes only where a parent is not in the history the refs reach (git registers
        every commit at a fetch's depth, even one whose history the mirror already has: listed,
        it would cut that history from every checkout that reaches it); a parent that is here
        but no ref reaches (what an interrupted install or prune left) is never vouched for.
        A root commit git lists stays listed: it hides nothing, and a mirror whose only entry
        it is stays shallow, so its history (every branch) still follows."""
        removals, additions = now - proposed, proposed - now
        if not removals and not additions:
            return proposed
        parents = self.parents_of(mirror, removals | additions)
        missing = self.lacking_parents(mirror, parents)
        needless = {sha for sha in additions - missing if parents[sha] and self.reached_by_refs(mirror, sha, parents[sha])}
        return frozenset((proposed | (removals & missing)) - needless)

    def reached_by_refs(self, git_dir: str, sha: str, parents: list[str]) -> bool:
        """Whether every parent of commit SHA lies in the history the repository's refs reach
        (their history is connected: DESIGN invariant 13), SHA's own keep-ref aside. Commits
        only, and the walk stops at what the refs reach: cheap where it holds."""
        if not parents:
            return True
        done = self._run(["-C", git_dir, "rev-list", "-n", "1", *parents, "--not", f"--exclude={keep_ref(sha)}",
                          "--all"])
        return done.returncode == 0 and not done.stdout.strip()

    def parents_of(self, git_dir: str, shas: frozenset[str] | set[str]) -> dict[str, list[str] | None]:
        """Each commit's parents as its object names them (a shallow file hides none), None for one
        that is not a commit here: one git execution, whatever their number."""
        wanted = sorted(shas)
        found: dict[str, list[str] | None] = dict.fromkeys(wanted)
        if not wanted:
            return found
        listed = subprocess.run([self.git, "-C", git_dir, "cat-file", "--batch"], capture_output=True, env=git_env(),
                                cwd="/", input="".join(sha + "\n" for sha in wanted).encode())
        if listed.returncode != 0:
            return found
        rest = listed.stdout
        for sha in wanted:
            header, _, rest = rest.partition(b"\n")
            fields = header.split()
            if len(fields) != 3 or not fields[2].isdigit():
                continue  # "<sha> missing"
            size = int(fields[2])
            body, rest = rest[:size], rest[size + 1:]
            if fields[1] == b"commit":
                found[sha] = [line.split()[1].decode() for line in body.split(b"\n\n", 1)[0].splitlines()
                              if line.startswith(b"parent ")]
        return found

    def lacking_parents(self, git_dir: str, parents: dict[str, list[str] | None]) -> set[str]:
        """Which of these commits (parents_of) lack a parent here, or are not commits here: one git
        execution."""
        named = sorted({p for found in parents.values() for p in found or ()})
        present: set[str] = set()
        if named:
            checked = subprocess.run([self.git, "-C", git_dir, "cat-file", "--batch-check=%(objectname) %(objecttype)"],
                                     input="".join(p + "\n" for p in named), capture_output=True, text=True,
                                     env=git_env(), cwd="/")
            present = {line.split()[0] for line in checked.stdout.splitlines() if line.endswith(" commit")}
        return {sha for sha, found in parents.items() if found is None or not set(found) <= present}

    def parents_reached(self, mirror: str, sha: str) -> bool:
        """Whether every parent of the commit is in the history the mirror's refs reach (a root
        commit: True); a parent object that is merely here is not."""
        parents = self.parents_of(mirror, {sha})[sha]
        return parents is not None and self.reached_by_refs(mirror, sha, parents)

    def reachable_commits(self, git_dir: str, tips: list[str] | None = None) -> set[str]:
        """The commits reachable from tips (default: every ref), down to the repository's
        shallow boundary (its boundary commits included)."""
        args = ["--stdin"] if tips is not None else ["--all"]
        done = subprocess.run([self.git, "-C", git_dir, "rev-list", *args], capture_output=True, text=True,
                              env=git_env(), cwd="/", input="".join(t + "\n" for t in tips or []))
        if done.returncode != 0:
            raise git_failure(done.stderr, last_meaningful_line(done.stderr), [])
        return set(done.stdout.split())

    def pack_loose_objects(self, git_dir: str) -> None:
        """The repository's loose objects into one new pack, the loose files then removed
        (`repack -d` without -a: existing packs stay as they are)."""
        done = self._run(["-C", git_dir, "repack", "-d", "-q", "--no-write-bitmap-index"])
        if done.returncode != 0:
            raise git_failure(done.stderr, last_meaningful_line(done.stderr), [])

    def boundary_reached(self, git_dir: str, tips: list[str]) -> frozenset[str]:
        """The repository's boundary commits the tips' history reaches (none: it is complete
        here). One walk, listing only the commits without parents (git takes a boundary commit
        for one); a tip the repository lacks is a CheckoutCacheError."""
        boundary = read_shallow(git_dir)
        if not boundary:
            return frozenset()
        done = subprocess.run([self.git, "-C", git_dir, "rev-list", "--max-parents=0", "--stdin"],
                              capture_output=True, text=True, env=git_env(), cwd="/",
                              input="".join(t + "\n" for t in tips))
        if done.returncode != 0:
            raise git_failure(done.stderr, last_meaningful_line(done.stderr), [])
        return boundary & frozenset(done.stdout.split())

    def merge_bases(self, git_dir: str, a: str, b: str) -> list[str]:
        """Every best common ancestor of two commits as far as the repository's history goes
        (`merge-base --all`; none: none found above its boundary, or a commit is missing)."""
        done = self._run(["-C", git_dir, "merge-base", "--all", a, b])
        return done.stdout.split() if done.returncode == 0 else []

    def merge_base(self, git_dir: str, a: str, b: str) -> str | None:
        """The merge base of two commits as far as the repository's history goes (None: none
        found above its boundary, or a commit is missing)."""
        done = self._run(["-C", git_dir, "merge-base", a, b])
        found = done.stdout.strip()
        return found if done.returncode == 0 and len(found) in (40, 64) else None

    def commit_time(self, git_dir: str, sha: str) -> int | None:
        done = self._run(["-C", git_dir, "show", "-s", "--format=%ct", sha])
        text = done.stdout.strip()
        return int(text) if done.returncode == 0 and text.isdigit() else None
