"""The git interface: every git operation the store needs, behind one small
interface with two implementations (git/cli.py, git/libgit2.py).

Which implementation runs is decided in one place: transport.py.

Operations: probe an upstream, create and check a mirror, fetch into it, test
for a commit (that very object: a tag that points to one is not a commit), say
what another object is, keep a commit with a keep-ref (add, drop, list), tell whether a
commit's objects are all readable, check a commit out of the mirror, repack
the mirror, and the deep check `verify` makes of a checkout.

Neither implementation ever sees a credential in a URL or argv; both report
failures as CheckoutCacheError with a code from the error table and one
redacted line of detail. Which code a failure gets (UNREACHABLE, DISK_FULL,
CLONE_FAILED) is read from git's output under LC_ALL=C; what the store does
next never is: it decides from exit codes, errno and what is on disk.

A checkout made by either is a small repository of its own: its objects are
borrowed from the mirror (objects/info/alternates), HEAD is detached at the
commit, and the full tree and index are written, so `git status` is clean and
`git log` works. Making it takes no lock on the mirror: the commit's keep-ref,
made first, keeps every object it reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Callable, NamedTuple, Protocol

from checkoutcache.credentials import Credential, redact
from checkoutcache.errors import CheckoutCacheError
from checkoutcache.git.env import SAFE_CONFIG, git_env
from checkoutcache.store.modes import git_shared_repository

Progress = Callable[[dict], None]
Log = Callable[[str], None]

MIRROR_CONFIG = {
    "gc.auto": "0",
    "maintenance.auto": "false",
    "core.logAllRefUpdates": "false",
    "fetch.writeCommitGraph": "false",
    "core.fsmonitor": "false",
    "receive.autogc": "false",
}


def mirror_config() -> dict[str, str]:
    """MIRROR_CONFIG and who may write the mirror's objects: the writer alone, or every
    member of the root's group in the trusted-peers mode (store/modes.py)."""
    return {**MIRROR_CONFIG, "core.sharedRepository": git_shared_repository()}


def partial_mirror_config(filter: str) -> dict[str, str]:
    """A partial mirror (CHECKOUTCACHE_FILTER): a promisor remote `origin` with the filter and
    no URL (benchmarks/MONOREPO.md A1: nothing can fetch lazily from a remote without one,
    whatever git's version), and no bitmaps (a repack with a bitmap needs every object)."""
    return {"remote.origin.promisor": "true", "remote.origin.partialclonefilter": filter,
            "repack.writeBitmaps": "false"}


def one_time_promisor_remote(url: str, filter: str) -> tuple[str, list[str]]:
    """A promisor remote for one fetch into a partial mirror, named and defined on the command
    line alone: its name is new each time, so no `remote.<name>.*` a group member wrote into
    the mirror's config (a URL to fetch from instead, an `uploadpack` or `vcs` that runs a
    command) can apply. The mirror's own `origin` stays URL-less, so nothing fetches lazily."""
    name = f"checkoutcache-{os.urandom(8).hex()}"
    return name, ["-c", f"remote.{name}.url={url}", "-c", f"remote.{name}.promisor=true",
                  "-c", f"remote.{name}.partialclonefilter={filter}"]


# What a checkout of a partial mirror adds: its objects come from a promisor pack, so git
# treats an out-of-cone blob it lacks as promised, not as damage (MONOREPO.md A3).
PROMISOR_CHECKOUT_CONFIG = {"remote.origin.promisor": "true"}
CHECKOUT_CONFIG = {k: v for k, v in SAFE_CONFIG.items() if k not in ("protocol.ext.allow", "safe.directory")}
CHECKOUT_CONFIG.update({"core.symlinks": "true", "core.filemode": "true"})
# The one filter a checkout runs (docs/repositories.md "Git LFS"): git-lfs's, and only when the
# commit has LFS files and git-lfs is installed; the store (lfs.storage) and the
# endpoint (lfs.url) are added per repository by lfs_checkout_config.
LFS_FILTER = {"filter.lfs.process": "git-lfs filter-process", "filter.lfs.required": "true"}
# Raised whenever the way a checkout writes its files changes in a way the inputs of
# checkout_conversion do not show (a new -c on the checkout's command line, say).
CONVERSION_VERSION = 1
# What of git_env() decides which attributes apply beside the commit's .gitattributes.
_ATTRIBUTE_ENV = ("GIT_ATTR_NOSYSTEM", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_GLOBAL")


def checkout_conversion(git: str, umask: int) -> str:
    """A digest of what decides how a checkout writes a blob, besides the commit's own
    .gitattributes and LFS (clone/tree.py decides those for a spare, and the marker records
    LFS): our checkout config (core.autocrlf, core.attributesFile, core.symlinks, ...), the
    attribute and config sources git_env leaves git (none of the machine's or a user's), the
    umask the files get their modes from (the sharing mode's), and the git program itself
    (its path, size and mtime: a git upgraded between a spare and its update). Two trees
    written with the same digest write an unchanged blob with the same attributes alike."""
    env = git_env()
    program = shutil.which(git, path=env.get("PATH")) or git
    try:
        info = os.stat(program)
        identity = [os.path.realpath(program), info.st_size, info.st_mtime_ns]
    except OSError:
        identity = [program]
    facts = [CONVERSION_VERSION, sorted(CHECKOUT_CONFIG.items()), [[k, env.get(k)] for k in _ATTRIBUTE_ENV],
             umask, identity]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:32]


LFS_PROGRAM = "git-lfs"
# Where the commits a mirror must keep are named: spelled here only.
KEEP_PREFIX = "refs/keep/"
# The commits of spares (store/spares.py), kept by gc alone: their history stays in the mirror so a
# nearby commit needs little fetched, while LFS objects (already in a spare's tree) go by refs/keep/.
SPARE_PREFIX = "refs/spares/"
# Fetched when an upstream refuses to hand out a commit by id.
ALL_BRANCHES_AND_TAGS = ["+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"]
# Where review refs land for as long as it takes to keep the commit they hold.
REVIEW_PREFIX = "refs/review/"
# What seeding took in from bundles, one namespace per bundle (bundles/gitbundle.py).
BUNDLE_REFS = "refs/bundles/"
# The bases a review asked a merge base with (`ensure --base`, clone/history.py): kept, with the
# history fetched of them, for as long as a checkout's merge-base record names them (gc).
BASE_PREFIX = "refs/bases/"


def keep_ref(sha: str) -> str:
    return KEEP_PREFIX + sha


def base_ref(sha: str) -> str:
    return BASE_PREFIX + sha


def lfs_endpoint(url: str, is_local: bool) -> str | None:
    """The LFS endpoint of a repository, as git-lfs derives it from the URL, always
    pinned on our command line so that no .lfsconfig of the repository can send
    the download elsewhere: file://<path> for a local repository, <url>.git/info/lfs
    for https and for git:// (which has no LFS of its own: its https twin), the
    ssh URL itself for ssh (git-lfs authenticates over ssh)."""
    if is_local:
        return "file://" + url
    if url.startswith(("https://", "git://")):
        base = "https://" + url.split("://", 1)[1].rstrip("/")
        return base + ("" if base.endswith(".git") else ".git") + "/info/lfs"
    if url.startswith("ssh://"):
        return url
    scp = re.match(r"^([^/:]+):(.*)$", url)
    if scp:  # user@host:path, as ssh://user@host/path
        return f"ssh://{scp.group(1)}/{scp.group(2).lstrip('/')}"
    return None


class LfsPointer(NamedTuple):
    path: bytes  # in the commit's tree
    oid: str  # sha256 of the content, as the LFS store names it
    size: int


# A pointer file, as git-lfs writes it (its spec v1): version first, keys sorted, at most 1 KiB.
LFS_POINTER_MAX = 1024
_POINTER = re.compile(rb"version https://git-lfs\.github\.com/spec/v1\n(?:[a-z0-9.-]+ [^\n]*\n)*?"
                      rb"oid sha256:(?P<oid>[0-9a-f]{64})\n(?:[a-z0-9.-]+ [^\n]*\n)*?size (?P<size>[0-9]{1,19})\n")


def parse_lfs_pointer(data: bytes) -> tuple[str, int] | None:
    """(oid, size) of a pointer file's content, or None when it is not one (it is then
    checked out as it is, as git-lfs's smudge passes it through)."""
    if len(data) > LFS_POINTER_MAX:
        return None
    match = _POINTER.match(data)
    return (match["oid"].decode(), int(match["size"])) if match else None


def lfs_pointer_text(pointer: LfsPointer) -> bytes:
    """The canonical pointer file of an object (what git-lfs reads it back as)."""
    return b"version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n" % (pointer.oid.encode(),
                                                                                      pointer.size)


# What one LFS download may write whatever a server sends: git-lfs runs under a file size
# limit (RLIMIT_FSIZE), so its objects are fetched in batches of like size, each under the
# power of two at or above its largest object (and at least this much: small objects share
# one batch). A body longer than its pointer says is cut there: under twice its size.
LFS_BATCH_FLOOR = 1 << 20
# The most a file size limit may be (setrlimit takes a signed 64-bit value): a pointer may
# declare up to 19 digits (git-lfs reads an int64), and 2**62 bytes is past any disk anyway.
LFS_LIMIT_MAX = 1 << 62


def lfs_fetch_batches(pointers: list[LfsPointer]) -> list[tuple[int, list[LfsPointer]]]:
    """(file size limit, pointers) of each git-lfs run, smallest first: every object's
    limit is at least its size and less than twice max(its size, LFS_BATCH_FLOOR), but never
    above LFS_LIMIT_MAX (setrlimit's range)."""
    batches: dict[int, list[LfsPointer]] = {}
    for pointer in pointers:
        limit = min(1 << (max(pointer.size, LFS_BATCH_FLOOR) - 1).bit_length(), LFS_LIMIT_MAX)
        batches.setdefault(limit, []).append(pointer)
    return sorted(batches.items())


def lfs_checkout_config(store: str, endpoint: str | None) -> dict[str, str]:
    """What a checkout with LFS content adds to CHECKOUT_CONFIG (in its .git/config, so the
    review's own `git status` runs the same filter and finds the tree clean)."""
    config = dict(LFS_FILTER)
    config["lfs.storage"] = store
    if endpoint is not None:
        config["lfs.url"] = endpoint
    return config


def lfs_failure(text: str, detail: str, secrets: list[str]) -> CheckoutCacheError:
    """A git-lfs download that failed: LFS_FAILED, unless the disk is full."""
    code = "DISK_FULL" if _DISK_FULL.search(text) else "LFS_FAILED"
    return CheckoutCacheError(code, detail=redact(detail, secrets), output=redact(text, secrets))


class GitKilled(Exception):
    """A git child killed by a signal. SIGKILL is what the OOM killer sends: the
    attempt counts as the worker's death (WORKER_DIED after three in a row), not as
    a failure of the clone; another signal (a crash) is the clone's failure."""

    def __init__(self, signum: int, command: str, output: str = ""):
        import signal

        try:
            self.name = signal.Signals(signum).name
        except ValueError:
            self.name = f"signal {signum}"
        self.signum = signum
        self.output = output
        super().__init__(f"git {command} was killed by {self.name}")

    @property
    def is_death(self) -> bool:
        import signal

        return self.signum == signal.SIGKILL


class GitBackend(Protocol):
    name: str
    fetches_into_refs: bool  # fetch(refspecs=["<sha>:refs/keep/<sha>"]) works
    supports_partial: bool  # partial mirrors (CHECKOUTCACHE_FILTER): the methods below marked so
    supports_sparse: bool  # sparse checkouts of a cone (cones.py)
    # Shallow mirrors (git/shallow.py: fetch_privately, install_fetched, reachable_commits,
    # merge_base): a cold node's first answer from the commit alone. Backends without
    # them make full mirrors.
    supports_shallow: bool

    def probe(self, url: str, is_local: bool, credential: Credential | None, timeout: float) -> None: ...
    def init_mirror(self, path: str, filter: str | None = None) -> None: ...
    # The filter a mirror was made with (partial), or None (full).
    def partial_filter(self, mirror: str) -> str | None: ...
    def is_usable(self, mirror: str) -> bool: ...
    def has_commit(self, mirror: str, sha: str) -> bool: ...
    def object_kind(self, mirror: str, sha: str) -> tuple[str, str | None] | None: ...
    def objects_readable(self, mirror: str, sha: str, cone: tuple[str, ...] = ()) -> bool: ...
    # The commit's history is all there: walked down to what the mirror's refs reach
    # (the commit's own keep-ref excepted), which git's fetches checked when they made them.
    def is_connected(self, mirror: str, sha: str) -> bool: ...
    # Every object every ref of the mirror reaches is there (a whole walk: only after a failure).
    def is_sound(self, mirror: str) -> bool: ...
    # True when a partial mirror's server ignored its filter (it sent every object).
    # refetch: ask for the wanted commits' objects as a new clone would, whatever the mirror
    # holds (a commit there without its history would otherwise count as fetched).
    # whole_packs: what arrives stays a pack, however few its objects (never unpacked loose).
    def fetch(self, mirror: str, url: str, refspecs: list[str], credential: Credential | None,
              on_progress: Progress, log: Log, keep_fds: tuple[int, ...] = (), refetch: bool = False,
              whole_packs: bool = False) -> bool: ...
    # Partial mirrors only (supports_partial): the blobs a checkout needs that the mirror
    # lacks, their fetch in one request, and a new mirror's fallback to a full one.
    def missing_blobs(self, mirror: str, sha: str, cone: tuple[str, ...] = ()) -> list[str]: ...
    def fetch_blobs(self, mirror: str, url: str, oids: list[str], filter: str, credential: Credential | None,
                    on_progress: Progress, log: Log, keep_fds: tuple[int, ...] = ()) -> None: ...
    def make_full(self, mirror: str) -> None: ...
    def keep(self, mirror: str, sha: str, keep_fds: tuple[int, ...] = ()) -> None: ...
    def drop_keep(self, mirror: str, sha: str) -> None: ...
    def kept(self, mirror: str) -> list[str]: ...
    def remote_refs(self, url: str, patterns: tuple[str, ...], credential: Credential | None,
                    timeout: float) -> dict[str, str]: ...
    def drop_refs_under(self, mirror: str, prefix: str) -> None: ...
    # Submodules (clone/submodules.py): paths as bytes, as git's index holds them.
    def gitmodules(self, mirror: str, sha: str) -> dict[bytes, str]: ...
    def index_gitlinks(self, tree_dir: str, keep_fds: tuple[int, ...] = ()) -> dict[bytes, str]: ...
    def repack(self, mirror: str, keep_fds: tuple[int, ...], timeout: float) -> bool | None: ...
    # keep_fds: descriptors git must inherit (tree_dir may be /proc/self/fd/N: store/beneath.py)
    def checkout(self, tree_dir: str, mirror_objects: str, sha: str, on_progress: Progress, log: Log,
                 lfs: dict[str, str] | None = None, keep_fds: tuple[int, ...] = (),
                 cone: tuple[str, ...] = ()) -> None: ...
    # Git LFS (docs/repositories.md "Git LFS"): why LFS content cannot be had (None: it can), the
    # oids a commit's LFS files name, their download into the store, and whether a
    # checked-out tree has LFS files (for the answer when their content is absent).
    def lfs_unsupported(self) -> str | None: ...
    def lfs_objects(self, mirror: str, sha: str) -> list[str]: ...
    # The files of the commit git's attributes route through filter=lfs whose content is a
    # pointer: what a checkout's smudge needs from the store (every .gitattributes counts).
    def lfs_pointers(self, mirror: str, sha: str, cone: tuple[str, ...] = ()) -> list[LfsPointer]: ...
    # Downloads exactly these objects (never a scan of the commit's tree: a partial mirror
    # lacks the pointers outside a cone), each cut near its declared size (lfs_fetch_batches).
    def lfs_fetch(self, mirror: str, url: str, is_local: bool, pointers: list[LfsPointer], store: str,
                  credential: Credential | None, on_progress: Progress, log: Log,
                  keep_fds: tuple[int, ...] = ()) -> None: ...
    def lfs_in_tree(self, tree_dir: str) -> bool: ...
    def deep_problems(self, checkout_dir: str, sha: str) -> list[str]: ...


_UNREACHABLE = re.compile(
    r"could not resolve|connection refused|timed out|unable to access|could not read from remote"
    r"|repository not found|does not appear to be a git repository|authentication failed"
    r"|could not read username|permission denied|early eof|unable to connect|failed to connect"
    r"|ssl|http[^\n]*\b(401|403|404)\b|not found|unexpected http status|no such device or address"
    r"|connection reset|network is unreachable|host key verification", re.I)
_DISK_FULL = re.compile(r"no space left on device|disk quota exceeded", re.I)


def disk_full_text(text: str) -> bool:
    return _DISK_FULL.search(text) is not None


def classify(text: str) -> str:
    """Which error code a failed git operation reports (its answer, not our next step)."""
    if _DISK_FULL.search(text):
        return "DISK_FULL"
    if _UNREACHABLE.search(text):
        return "UNREACHABLE"
    return "CLONE_FAILED"


def git_failure(text: str, detail: str, secrets: list[str]) -> CheckoutCacheError:
    """The error for a git operation that failed, printing text (its whole output)."""
    return CheckoutCacheError(classify(text), detail=redact(detail, secrets), output=redact(text, secrets))


def probe_failure(url: str, is_local: bool, detail: str, secrets: list[str]) -> CheckoutCacheError:
    if is_local:
        return CheckoutCacheError("NOT_A_REPOSITORY", path=repr(url[:200]))
    return CheckoutCacheError("UNREACHABLE", detail=redact(detail, secrets))


def not_a_commit(sha: str, kind: str, target: str | None) -> CheckoutCacheError:
    """The input error for an id naming an object that is not a commit: kind is git's
    type name; target, for an annotated tag, the commit it points to (if any)."""
    if kind == "tag":
        what = f"an annotated tag pointing to commit {target}" if target else "an annotated tag of no commit"
    else:
        what = {"tree": "a tree (a directory listing)", "blob": "a blob (a file's content)"}.get(kind, f"a {kind}")
    return CheckoutCacheError("NOT_A_COMMIT", commit=sha, what=what)


def write_alternates(tree_dir: str, mirror_objects: str) -> None:
    with open(os.path.join(tree_dir, ".git", "objects", "info", "alternates"), "w") as handle:
        handle.write(mirror_objects + "\n")
