"""The on-disk layout of a checkoutcache root: the one module that knows paths.

Every other module asks this one for a path; none joins path parts itself. The
layout is a contract with operators and with other versions of this tool
running on the same root, so a change here is a change of LAYOUT_VERSION.

    <root>/
    ├── README                     says which tool maintains this directory
    ├── locks/
    │   ├── gc.lock                exclusive for one gc run (two crons never overlap)
    │   └── health.lock            taken and dropped by serve's /healthz probe
    └── repos/
        └── <key>/                 one repository in one owner scope. <key> is the first 32
            │                      hex digits of sha256("checkoutcache-repo-v1" NUL scope NUL
            │                      normalized URL): never a raw path, never credentials.
            ├── repo.json          normalized URL (credentials removed) and scope. Written once,
            │                      whole (temp file + rename), before anything else in <key>/.
            ├── mirror.git/        bare mirror: the object store every checkout borrows.
            │                      Written only under locks/mirror.lock (fetch, refs, repack).
            │                      refs/keep/<sha> exists for every checkout that exists or is
            │                      being made, so maintenance never drops objects one borrows.
            ├── checkouts/
            │   └── <sha>/         a published checkout: work tree plus a .git whose
            │       │              objects/info/alternates points at mirror.git/objects.
            │       │              Appears by one rename from scratch; leaves by one rename to
            │       │              trash/. Only its marker's mtime changes in between.
            │       └── .git/checkoutcache-ready
            │                      the ready marker. Written (whole) last, checked first; a
            │                      checkout without it is not ready. Its mtime is the last use.
            │                      Readers flock it shared (briefly, or for an exec's whole
            │                      run); the evictor flocks it exclusive to rename the checkout.
            ├── scratch/
            │   └── .clone-<pid>/  a clone in the making, owned by process <pid>:
            │       ├── owner.lock held exclusive by the owner for its whole life
            │       ├── owner.json pid, process start time, commit (written under the lock)
            │       ├── mirror.git/  a first mirror being made; renamed to mirror.git
            │       └── tree/      the checkout being built; published by rename to checkouts/
            │                      Created and reaped only under locks/scratch.lock; reaped only
            │                      when owner.lock is free and <pid> is gone or another process.
            ├── trash/             checkouts and scratch renamed out of the way, being deleted.
            │                      Anything here may be deleted by anyone at any time.
            ├── state/
            │   ├── <sha>.clone.json   clone record: owner pid, start time, progress. Written
            │   │                      whole by the owner; meaningful only while the clone lock
            │   │                      is held (a record without a held lock is a dead clone's).
            │   └── <sha>.failed.json  the last failure: code, message, attempts, retry time.
            ├── logs/<sha>.log     the commit's clone attempts, appended: git's output, redacted.
            └── locks/
                ├── mirror.lock    exclusive for every write to mirror.git
                ├── scratch.lock   exclusive, briefly, to create or reap scratch directories
                └── clone-<sha>.lock  exclusive for a clone's whole life: one clone per commit

A reader may assume: a checkout with its marker is complete and stays where it
is for as long as the reader holds the marker's shared lock; records are
always whole JSON (never half-written); nothing under scratch/ or trash/ is
ever served.
"""

from __future__ import annotations

import os

LAYOUT_VERSION = 1
REPO_KEY_DOMAIN = b"checkoutcache-repo-v1"
READY_MARKER = "checkoutcache-ready"
SCRATCH_PREFIX = ".clone-"

ROOT_README = """\
This directory is a checkoutcache store (layout version {version}).
It is maintained by the `checkoutcache` tool: do not edit it by hand.
Run `checkoutcache status` to see what it holds and `checkoutcache gc` to trim it.
"""


def entries(directory: str) -> list[str]:
    """The sorted names in a directory of the store; none if it does not exist (yet, or any more)."""
    try:
        return sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []


def default_root() -> str:
    """$CHECKOUTCACHE_ROOT, else $XDG_CACHE_HOME/checkoutcache, else ~/.cache/checkoutcache."""
    explicit = os.environ.get("CHECKOUTCACHE_ROOT")
    if explicit:
        return os.path.realpath(explicit)
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.realpath(os.path.join(cache_home, "checkoutcache"))


class RootPaths:
    """Paths at the top of a root."""

    __slots__ = ("root",)

    def __init__(self, root: str):
        self.root = root

    @property
    def readme(self) -> str:
        return os.path.join(self.root, "README")

    @property
    def repos_dir(self) -> str:
        return os.path.join(self.root, "repos")

    @property
    def locks_dir(self) -> str:
        return os.path.join(self.root, "locks")

    @property
    def gc_lock(self) -> str:
        return os.path.join(self.root, "locks", "gc.lock")

    def repo(self, key: str) -> "RepoPaths":
        return RepoPaths(os.path.join(self.root, "repos", key))

    def repo_keys(self) -> list[str]:
        return [name for name in entries(self.repos_dir) if not name.startswith(".")]


class RepoPaths:
    """Paths inside one repository's store (repos/<key>/)."""

    __slots__ = ("base",)

    def __init__(self, base: str):
        self.base = base

    @property
    def key(self) -> str:
        return os.path.basename(self.base)

    @property
    def repo_json(self) -> str:
        return os.path.join(self.base, "repo.json")

    @property
    def mirror(self) -> str:
        return os.path.join(self.base, "mirror.git")

    @property
    def mirror_objects(self) -> str:
        return os.path.join(self.base, "mirror.git", "objects")

    @property
    def checkouts_dir(self) -> str:
        return os.path.join(self.base, "checkouts")

    def checkout(self, sha: str) -> str:
        return os.path.join(self.base, "checkouts", sha)

    def ready_marker(self, sha: str) -> str:
        return os.path.join(self.base, "checkouts", sha, ".git", READY_MARKER)

    @staticmethod
    def ready_marker_in(checkout_dir: str) -> str:
        return os.path.join(checkout_dir, ".git", READY_MARKER)

    @property
    def scratch_dir(self) -> str:
        return os.path.join(self.base, "scratch")

    def scratch_dir_for(self, pid: int) -> str:
        return os.path.join(self.base, "scratch", f"{SCRATCH_PREFIX}{pid}")

    @staticmethod
    def scratch_owner_lock(scratch: str) -> str:
        return os.path.join(scratch, "owner.lock")

    @staticmethod
    def scratch_owner_json(scratch: str) -> str:
        return os.path.join(scratch, "owner.json")

    @staticmethod
    def scratch_tree(scratch: str) -> str:
        return os.path.join(scratch, "tree")

    @staticmethod
    def scratch_pid(name: str) -> int | None:
        """The owner pid of a scratch directory name, or None if it is not one."""
        if not name.startswith(SCRATCH_PREFIX):
            return None
        digits = name[len(SCRATCH_PREFIX):]
        return int(digits) if digits.isdigit() else None

    @property
    def trash_dir(self) -> str:
        return os.path.join(self.base, "trash")

    def trash_slot(self, what: str) -> str:
        """A fresh, unique name in trash/ for something about to be renamed there."""
        return os.path.join(self.base, "trash", f"{what}.{os.getpid()}.{os.urandom(4).hex()}")

    @property
    def state_dir(self) -> str:
        return os.path.join(self.base, "state")

    def clone_record(self, sha: str) -> str:
        return os.path.join(self.base, "state", f"{sha}.clone.json")

    def failure_record(self, sha: str) -> str:
        return os.path.join(self.base, "state", f"{sha}.failed.json")

    @property
    def logs_dir(self) -> str:
        return os.path.join(self.base, "logs")

    def clone_log(self, sha: str) -> str:
        return os.path.join(self.base, "logs", f"{sha}.log")

    @property
    def locks_dir(self) -> str:
        return os.path.join(self.base, "locks")

    @property
    def mirror_lock(self) -> str:
        return os.path.join(self.base, "locks", "mirror.lock")

    @property
    def scratch_lock(self) -> str:
        return os.path.join(self.base, "locks", "scratch.lock")

    def clone_lock(self, sha: str) -> str:
        return os.path.join(self.base, "locks", f"clone-{sha}.lock")

    def all_dirs(self) -> list[str]:
        """Directories a repository store needs, created together on first use."""
        return [self.base, self.checkouts_dir, self.scratch_dir, self.trash_dir,
                self.state_dir, self.logs_dir, self.locks_dir]

    def checkout_shas(self) -> list[str]:
        return [name for name in entries(self.checkouts_dir) if len(name) in (40, 64)]
