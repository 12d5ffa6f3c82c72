"""A fetch into a partial mirror, checked by git's fsck with our choices before any of it
reaches the mirror (git before 2.44).

Every fetch runs git's fsck with the harmless quirks of old histories let through
(env.py FSCK_CHOICES, DESIGN invariant 17). git 2.44 hands those choices to a partial
fetch's index-pack too; before, a fetch from a promisor remote runs `index-pack
--fsck-objects`, strict whatever the config says, and one zero-padded mode in a
history (pallets/flask) fails every fetch of a partial mirror. There the fetch runs
without git's check, into a quarantine, and `git fsck` checks what came:

- objects: `mirror.git/objects/tmp_objdir-checkoutcache-<nonce>/` (store/layout.py),
  whose alternate is the mirror's object store (the fetch's haves and its own
  connectivity check see the mirror); the view's `objects` (git/view.py) is it;
- refs: the view's own, a snapshot of the mirror's as its packed-refs: a ref the fetch
  updates is updated in the view only;
- the check: `git fsck --strict` of the quarantine alone (its alternate removed), in a
  partial view (what its promisor packs refer to may be missing: a blob, or history the
  mirror holds; is_connected walks that), with `fsck.<msg-id>` our choices. Refused:
  the quarantine is removed, nothing reached the mirror, CLONE_FAILED names the check;
- admitted: its packs are renamed into the mirror's (the `.idx` last: git sees a pack by
  its index), then the refs the fetch changed are updated in the mirror in one
  transaction (`update-ref --stdin`, each from the value it had).

Callers hold the mirror lock. A process killed on the way leaves a quarantine the mirror
never reads: the next writer under the mirror lock removes it (git/mirror.py), and its
view goes as every dead view does.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
from typing import Iterator

from checkoutcache.errors import CheckoutCacheError
from checkoutcache.git.env import FSCK_CHOICES, FSCK_VAR, git_env
from checkoutcache.git.view import private_view
from checkoutcache.store import modes
from checkoutcache.store.layout import RepoPaths

# The first git whose partial fetches take fetch.fsck.<msg-id> (index-pack --fsck-objects=<msg-ids>).
NATIVE_SINCE = (2, 44)
FSCK_SETTINGS = {f"fsck.{msg}": level for msg, (level, _why) in FSCK_CHOICES.items()}
_PACK_FILE = re.compile(r"^pack-[0-9a-f]{40,64}\.(pack|rev|promisor|idx|bitmap)$")
# What makes a pack visible to git comes last.
_ADMIT_ORDER = {"pack": 0, "rev": 1, "bitmap": 1, "promisor": 2, "idx": 3}


@functools.cache
def git_version(git: str = "git") -> tuple[int, ...]:
    done = subprocess.run([git, "version"], capture_output=True, text=True, env=git_env(), cwd="/")
    found = re.search(r"(\d+)\.(\d+)", done.stdout)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def needed(filter: str | None, git: str = "git") -> bool:
    """Whether a fetch into this mirror is checked after it (a partial one, checks on, old git)."""
    return filter is not None and os.environ.get(FSCK_VAR, "on") != "off" and git_version(git) < NATIVE_SINCE


def refs_of(git_dir: str, git: str = "git") -> dict[str, str]:
    done = subprocess.run([git, "-C", git_dir, "for-each-ref", "--format=%(objectname) %(refname)"],
                          capture_output=True, text=True, env=git_env(), cwd="/", errors="surrogateescape")
    if done.returncode != 0:
        raise CheckoutCacheError("CLONE_FAILED", detail=f"the mirror's refs cannot be listed: "
                                                        f"{done.stderr.strip()[-200:]}")
    refs = {}
    for line in done.stdout.splitlines():
        sha, _, ref = line.partition(" ")
        refs[ref] = sha
    return refs


@contextlib.contextmanager
def incoming_objects(mirror: str) -> Iterator[str]:
    """A quarantine object store in the mirror, its alternate the mirror's; removed on leaving."""
    incoming = RepoPaths.quarantine_objects(mirror, os.urandom(8).hex())
    try:
        for directory in (incoming, os.path.join(incoming, "pack"), os.path.join(incoming, "info")):
            modes.make_dir(directory)
        with open(os.path.join(incoming, "info", "alternates"), "w") as handle:
            handle.write(os.path.join(os.path.abspath(mirror), "objects") + "\n")
        yield incoming
    finally:
        shutil.rmtree(incoming, ignore_errors=True)


def check(mirror: str, incoming: str, filter: str, keep_fds: tuple[int, ...] = (), git: str = "git") -> None:
    """git fsck of what the fetch brought, alone, with our choices; CLONE_FAILED if refused."""
    os.unlink(os.path.join(incoming, "info", "alternates"))
    with private_view(mirror, filter, FSCK_SETTINGS, objects=incoming, refs={}) as view:
        done = subprocess.run([git, "-C", view, "fsck", "--strict", "--no-dangling", "--no-reflogs", "--no-progress"],
                              capture_output=True, text=True, env=git_env(), cwd="/", pass_fds=keep_fds,
                              errors="replace")
    if done.returncode != 0:
        errors = [line for line in done.stdout.splitlines() + done.stderr.splitlines()
                  if line.startswith(("error", "fatal", "missing", "broken"))]
        raise CheckoutCacheError("CLONE_FAILED", detail=(errors or ["git fsck refused what the server sent"])[0][:300])


def admit(mirror: str, incoming: str, before: dict[str, str], after: dict[str, str], git: str = "git",
          view_shallow: frozenset[str] | None = None) -> None:
    """Move the checked objects into the mirror, then (a shallow mirror) the boundary the fetch
    left in its view, then update the refs the fetch changed there."""
    move_objects(mirror, incoming)
    if view_shallow is not None:
        from checkoutcache.git.boundary import read_shallow, write_shallow

        if read_shallow(mirror) != view_shallow:
            write_shallow(mirror, view_shallow)
    changed = [(ref, sha) for ref, sha in sorted(after.items()) if before.get(ref) != sha]
    if not changed:
        return
    zero = "0" * len(next(iter(after.values())))
    commands = "".join(f"update {ref} {sha} {before.get(ref, zero)}\n" for ref, sha in changed)
    done = subprocess.run([git, "-C", mirror, "update-ref", "--stdin"], input="start\n" + commands + "commit\n",
                          capture_output=True, text=True, env=git_env(), cwd="/", errors="replace")
    if done.returncode != 0:
        raise CheckoutCacheError("CLONE_FAILED", detail=f"the fetched refs could not be written: "
                                                        f"{done.stderr.strip()[-200:]}")


def move_objects(mirror: str, incoming: str) -> None:
    """An object store's packs (the `.idx` last: git sees a pack by its index) and loose
    objects, moved into the mirror's (the same file system: one rename each)."""
    pack_dir = os.path.join(mirror, "objects", "pack")
    packs = sorted((name for name in os.listdir(os.path.join(incoming, "pack")) if _PACK_FILE.match(name)),
                   key=lambda name: _ADMIT_ORDER[name.rsplit(".", 1)[1]])
    for name in packs:
        os.rename(os.path.join(incoming, "pack", name), os.path.join(pack_dir, name))
    for directory in os.listdir(incoming):
        if len(directory) == 2 and all(c in "0123456789abcdef" for c in directory):  # loose objects
            target = os.path.join(mirror, "objects", directory)
            if not os.path.isdir(target):
                modes.make_dir(target)
            for name in os.listdir(os.path.join(incoming, directory)):
                os.replace(os.path.join(incoming, directory, name), os.path.join(target, name))


def gitmodules_refused(mirror: str, sha: str, filter: str, git: str = "git") -> str | None:
    """fsck's `.gitmodules` checks (a URL or path git refuses, a name that escapes) for a
    commit of a partial mirror; the reason, or None. Its `.gitmodules` blob comes in a blob
    fetch of its own, where no tree says what it is, so no git checks it at the fetch (git
    2.44 neither). The root's (the one git reads) is checked in a quarantine of its own,
    beside a one-entry tree naming it `.gitmodules`, by git fsck with our choices."""
    listed = subprocess.run([git, "-C", mirror, "ls-tree", "-z", sha, "--", ".gitmodules"], capture_output=True,
                            env=git_env(), cwd="/")
    entry = listed.stdout.split(b"\0")[0] if listed.returncode == 0 else b""
    meta, _, _name = entry.partition(b"\t")
    if not meta.startswith((b"100644 blob ", b"100755 blob ")):  # git reads an executable one the same
        return None  # none, or a symlink: the tree's own check refused that at the fetch
    blob = meta.split()[2].decode()
    data = subprocess.run([git, "-C", mirror, "cat-file", "blob", blob], capture_output=True, env=git_env(),
                          cwd="/")
    if data.returncode != 0:
        return None  # not fetched: the checkout does not read it either
    with incoming_objects(mirror) as incoming:
        os.unlink(os.path.join(incoming, "info", "alternates"))
        with private_view(mirror, filter, FSCK_SETTINGS, objects=incoming, refs={}) as view:
            def run(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
                return subprocess.run([git, "-C", view, *args], input=stdin, capture_output=True, env=git_env(),
                                      cwd="/")

            run("hash-object", "-w", "--stdin", stdin=data.stdout)
            run("mktree", stdin=f"100644 blob {blob}\t.gitmodules\n".encode())
            done = run("fsck", "--strict", "--no-dangling", "--no-reflogs", "--no-progress")
    if done.returncode == 0:
        return None
    lines = (done.stdout + done.stderr).decode("utf-8", "replace").splitlines()
    return next((line for line in lines if line.startswith("error")), "git fsck refused its .gitmodules")[:300]
