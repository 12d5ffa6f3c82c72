"""The private view of a mirror that every git reaching the network (and every
take-in of a bundle) runs in: what such a git runs, where it fetches from and
whom it gives a credential to never comes from a file a group member can write.

A mirror is the group's to write (docs/security.md), its `config` included, and
git reads a repository's config on every command: `remote.<url>.uploadpack`
runs a command on a fetch by URL, `lfs.customtransfer.*` runs one in
`git lfs fetch`, `http.<url>.curloptResolve` with `sslVerify=false` hands the
credential to a listener of the member's choosing. Overriding keys one by one
cannot win: the more specific URL key beats a general one. So the fetch runs in
a git directory of our own instead:

- a fresh 0700 directory (TMPDIR) holding HEAD and a config written here alone
  (the mirror's settings that matter to a fetch: bare, shared group modes, a
  partial mirror's promisor remote and filter, `lfs.storage`);
- `objects`, `refs` and `packed-refs` are symlinks to the mirror's: what the
  fetch brings lands in the mirror, its ref updates under git's own lock files
  there, and every ref of the mirror is a "have" in the negotiation;
- `shallow` is a symlink to the mirror's shallow file (dangling while the mirror's
  history is complete): git reads the mirror's shallow boundary through it (a fetch
  into a shallow mirror that did not send its boundary would be sent too little), and
  writes it there (lockfile.c resolves the link). git removes a shallow file by
  unlinking the name, here the link: `shallow_removed` tells the caller, who removes
  the mirror's after a fetch that succeeded (git/shallow.py). A view with refs of its
  own (a private fetch) has a shallow file of its own too, a copy of what it is given;
- git finds the view as the repository of its working directory (`git -C
  VIEW`), not through GIT_DIR or GIT_OBJECT_DIRECTORY: those would be inherited
  by what git starts, and git-lfs's file:// transfer agent, which opens a local
  upstream, would then read the view instead.

git takes its lock files next to a symlink's target (lockfile.c resolves
symlinks), so a rewrite of packed-refs (a packed ref deleted by `fetch
--prune`) happens in the mirror, under the mirror's `packed-refs.lock`, as if
git ran there (tests/test_git_view.py).

Callers hold the mirror lock (locks/mirror.lock), as for any write of a mirror.
The view is removed when the command is done, whatever happened. Its owner
holds `owner.lock` inside it (flock, exclusive) for the view's whole life, as a
clone holds its scratch's (DESIGN invariant 3): the lock appears already held
(taken on a temporary name, then renamed into place), and a view whose
owner.lock can be taken is a killed process's, removed by the next view this
uid makes, however young. A view without one (a process killed in the instant
before it took it, or a version without owner locks) is judged by its pid, and
only once it is older than any fetch runs: a pid names its process only in its
own PID namespace.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import tempfile
import time
from typing import Iterator

from checkoutcache.errors import CheckoutCacheError
from checkoutcache.git.backend import mirror_config, partial_mirror_config

PACKED_REFS = "packed-refs"
SHALLOW = "shallow"  # git's name for a repository's shallow boundary (git/shallow.py)
VIEW_PREFIX = "checkoutcache-view-"
OWNER_LOCK = "owner.lock"
# A pid names its process only in its own PID namespace: a view younger than this may be a
# live fetch's in another namespace sharing this TMPDIR (no fetch of ours runs this long).
DEAD_VIEW_AGE = 6 * 3600


@contextlib.contextmanager
def private_view(mirror: str, filter: str | None = None, settings: dict[str, str] | None = None,
                 objects: str | None = None, refs: dict[str, str] | None = None,
                 own_objects: bool = False, shallow: frozenset[str] | None = None) -> Iterator[str]:
    """Yields the private git directory that shows the mirror: run git with `-C` it.

    objects: another object store to show instead of the mirror's (a quarantine). refs: the
    view's own refs instead of the mirror's, these (ref -> id) as its packed-refs: what git
    writes to a ref then stays in the view (git/quarantine.py); its shallow file is then its
    own too: `shallow` (none when not given), read back with read_view_shallow. own_objects:
    objects written in the view stay in it (an objects directory of its own that borrows the
    mirror's as an alternate), for what only one command needs (git-lfs's list)."""
    remove_dead_views()
    view = None
    owner = None
    try:
        try:
            view = tempfile.mkdtemp(prefix=f"{VIEW_PREFIX}{os.getpid()}-")
            owner = _take_owner_lock(view)
            if own_objects:
                os.makedirs(os.path.join(view, "objects", "info"))
                with open(os.path.join(view, "objects", "info", "alternates"), "w") as handle:
                    handle.write(os.path.abspath(os.path.join(mirror, "objects")) + "\n")
            else:
                os.symlink(objects or os.path.join(mirror, "objects"), os.path.join(view, "objects"))
            if refs is None:
                for name in ("refs", PACKED_REFS, SHALLOW):
                    os.symlink(os.path.join(mirror, name), os.path.join(view, name))
            else:
                if shallow:
                    with open(os.path.join(view, SHALLOW), "w") as handle:
                        handle.write("".join(f"{sha}\n" for sha in sorted(shallow)))
                for name in ("refs/heads", "refs/tags"):
                    os.makedirs(os.path.join(view, name))
                with open(os.path.join(view, PACKED_REFS), "w") as handle:
                    # No header: git sorts the lines itself and trusts no peeled value.
                    handle.write("".join(f"{sha} {ref}\n" for ref, sha in sorted(refs.items())))
            with open(os.path.join(view, "HEAD"), "w") as handle:
                handle.write("ref: refs/heads/main\n")  # a fetch never reads it; git wants one
            config = {"core.bare": "true", **mirror_config(), **(partial_mirror_config(filter) if filter else {}),
                      **(settings or {})}
            with open(os.path.join(view, "config"), "w") as handle:
                handle.write(_config_text(config, partial=filter is not None))
        except OSError as exc:  # TMPDIR's disk, not the store's (DISK_FULL names the root's): say which
            full = " is full" if exc.errno == errno.ENOSPC else ""
            where = tempfile.tempdir or os.environ.get("TMPDIR") or "/tmp"  # gettempdir() may be what failed
            raise CheckoutCacheError("CLONE_FAILED", detail=f"TMPDIR ({where}){full}: no private git "
                                                            f"directory for the fetch could be made there "
                                                            f"({exc.strerror or exc})") from None
        yield view
    finally:
        if view is not None:
            shutil.rmtree(view, ignore_errors=True)
        if owner is not None:
            os.close(owner)  # after the removal: no reaper takes a view still being removed


def shallow_removed(view: str) -> bool:
    """Whether git removed the view's shallow link (it unshallowed a view of the mirror)."""
    return not os.path.islink(os.path.join(view, SHALLOW))


def read_view_shallow(view: str) -> frozenset[str]:
    """The shallow boundary a view with its own refs has after a command (empty: none)."""
    try:
        with open(os.path.join(view, SHALLOW)) as handle:
            return frozenset(line.strip() for line in handle if line.strip())
    except FileNotFoundError:
        return frozenset()


def _take_owner_lock(view: str) -> int:
    """The view's owner.lock, held: taken on a temporary name and renamed into place, so no
    reaper ever finds it free while its owner lives."""
    fresh = os.path.join(view, f".{OWNER_LOCK}.new")
    handle = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(fresh, os.path.join(view, OWNER_LOCK))
    except BaseException:
        os.close(handle)
        raise
    return handle


def _config_text(entries: dict[str, str], partial: bool) -> str:
    sections: dict[str, list[str]] = {"core": [f"\trepositoryformatversion = {1 if partial else 0}\n"]}
    if partial:
        sections["extensions"] = ["\tpartialClone = origin\n"]
    for key, value in entries.items():
        section, name = key.rsplit(".", 1)
        sections.setdefault(section, []).append(f"\t{name} = {_quoted(value)}\n")
    text = ""
    for section, lines in sections.items():
        head, dot, sub = section.partition(".")
        text += f'[{head} "{sub}"]\n' if dot else f"[{head}]\n"
        text += "".join(lines)
    return text


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def remove_dead_views() -> None:
    """Views of processes of this uid that are gone (killed during a fetch)."""
    where = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(where) if n.startswith(VIEW_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(where, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if info.st_uid != os.getuid() or not os.path.isdir(path) or os.path.islink(path):
            continue
        owner = owner_gone(path)
        if owner is None:
            owner = _pid_gone_long_ago(name, info.st_mtime)
        if not owner:
            continue
        shutil.rmtree(path, ignore_errors=True)


def owner_gone(view: str) -> bool | None:
    """Whether the view's owner is gone, as its owner.lock says (None: the view has none)."""
    try:
        # O_NONBLOCK: only this uid writes its 0700 views, but no lock is ever waited on in open().
        handle = os.open(os.path.join(view, OWNER_LOCK), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        return False  # not ours to judge (a symlink, unreadable)
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return False
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # held: its owner lives
        return True
    finally:
        os.close(handle)


def _pid_gone_long_ago(name: str, mtime: float) -> bool:
    pid = name[len(VIEW_PREFIX):].split("-", 1)[0]
    return pid.isdigit() and not os.path.exists(f"/proc/{pid}") and time.time() - mtime >= DEAD_VIEW_AGE
