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
- git finds the view as the repository of its working directory (`git -C
  VIEW`), not through GIT_DIR or GIT_OBJECT_DIRECTORY: those would be inherited
  by what git starts, and git-lfs's file:// transfer agent, which opens a local
  upstream, would then read the view instead.

git takes its lock files next to a symlink's target (lockfile.c resolves
symlinks), so a rewrite of packed-refs (a packed ref deleted by `fetch
--prune`) happens in the mirror, under the mirror's `packed-refs.lock`, as if
git ran there (tests/test_git_view.py).

Callers hold the mirror lock (locks/mirror.lock), as for any write of a mirror.
The view is removed when the command is done, whatever happened; one a killed
process left (its name carries its pid) is removed by a later view made by
the same uid, once it is older than any fetch runs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import time
from typing import Iterator

from checkoutcache.errors import CheckoutCacheError
from checkoutcache.git.backend import mirror_config, partial_mirror_config

PACKED_REFS = "packed-refs"
VIEW_PREFIX = "checkoutcache-view-"
# A pid names its process only in its own PID namespace: a view younger than this may be a
# live fetch's in another namespace sharing this TMPDIR (no fetch of ours runs this long).
DEAD_VIEW_AGE = 6 * 3600


@contextlib.contextmanager
def private_view(mirror: str, filter: str | None = None, settings: dict[str, str] | None = None,
                 own_objects: bool = False) -> Iterator[str]:
    """Yields the private git directory that shows the mirror: run git with `-C` it.
    own_objects: objects written in the view stay in it (an objects directory of its own that
    borrows the mirror's as an alternate), for what only one command needs (git-lfs's list)."""
    remove_dead_views()
    view = None
    try:
        try:
            view = tempfile.mkdtemp(prefix=f"{VIEW_PREFIX}{os.getpid()}-")
            for name in ("refs", PACKED_REFS) if own_objects else ("objects", "refs", PACKED_REFS):
                os.symlink(os.path.join(mirror, name), os.path.join(view, name))
            if own_objects:
                os.makedirs(os.path.join(view, "objects", "info"))
                with open(os.path.join(view, "objects", "info", "alternates"), "w") as handle:
                    handle.write(os.path.abspath(os.path.join(mirror, "objects")) + "\n")
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
        pid = name[len(VIEW_PREFIX):].split("-", 1)[0]
        path = os.path.join(where, name)
        try:
            info = os.lstat(path)
            if not pid.isdigit() or info.st_uid != os.getuid() or os.path.exists(f"/proc/{pid}") \
                    or time.time() - info.st_mtime < DEAD_VIEW_AGE:
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
