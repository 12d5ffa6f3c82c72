"""The on-disk layout of a checkoutcache root: the one module that knows paths.

Every other module asks this one for a path; none joins path parts itself. The
layout is a contract with operators and with other versions of this tool
running on the same root, so a change here is a change of LAYOUT_VERSION. A
repository store whose repo.json names a newer layout_version than this one's is
never written by this version: its answers are NEWER_LAYOUT and gc leaves it
alone (a rollback cannot corrupt what a newer version made).

    <root>/
    ├── README                     says which tool maintains this directory
    ├── checkoutcache.sock         the image's API socket (CHECKOUTCACHE_UNIX_SOCKET; any
    │                              name works): serve's, 0660 in the root's group. The CLI
    │                              hands a new commit to the serve listening here (its warm
    │                              worker server clones it) and checks the answer on disk.
    │                              Names at this level other than those listed here are
    │                              never touched by checkoutcache.
    ├── limits.json                the limits in force of the writer that enforces them
    │                              (max checkouts and bytes, min free, grace, clone timeout),
    │                              who wrote it (serve at start, gc at each run) and when:
    │                              written whole (temp file + rename); `status` reads it, never
    │                              writes it, so a read-only reader shows the writer's limits.
    ├── holds/
    │   └── <pid>-<nonce>.hold     a registered hold (store/holds.py): {key, name, pid, at}, the
    │                              checkout an exec, a workspace copy or serve's /v1/hold of the
    │                              writer holds, locked exclusive by its holder for the hold's life
    │                              (made as .new-<pid>-<nonce>, then renamed). gc keeps what these
    │                              hold whatever its bounds on readers' locks; one whose lock is
    │                              free is a dead holder's, removed by gc. Written by the writer only.
    ├── locks/
    │   ├── gc.lock                exclusive for one gc run (two crons never overlap)
    │   └── .health-<nonce>        a probe file /readyz locks, writes and removes at once
    │                              (a fresh random name per probe: serves of equal pids in
    │                              other PID namespaces probe the same root)
    ├── serve/
    │   └── <pid>-<nonce>.journal  a running serve's clone journal: its workers append one
    │                              JSON line per event; opened without following symlinks.
    │                              Named by a nonce (every container's serve has the same
    │                              pid) and held exclusive (flock) by its serve for its whole
    │                              life: THE proof that its serve lives. The serve removes its
    │                              own when it stops; gc removes one whose lock is free (a
    │                              serve killed; a worker that outlived it may write it anew).
    │                              `<pid>.journal` (older versions, no lock): gc removes it
    │                              once untouched for a day.
    ├── unreachable/
    │   └── <key>.failed.json      a repository never reached: its first contact failed (code
    │                              UNREACHABLE, message, attempts, retry time). Until the retry
    │                              time every ask answers it at once; removed when the repository
    │                              is reached, or by gc a day after its retry time. Nothing else
    │                              is written for a repository before its first contact succeeds.
    └── repos/
        ├── .dropped-<key>-<pid>-<hex>/  a whole repository being removed (gc past
        │                          CHECKOUTCACHE_REPO_MAX_IDLE or min-free, `evict REPO`): renamed
        │                          here in one step under its mirror lock and every clone lock
        │                          (so an asker finds the whole store or none and starts anew),
        │                          then deleted; one a killed gc left is deleted by the next gc.
        └── <key>/                 one repository in one owner scope. <key> is the first 32
            │                      hex digits of sha256("checkoutcache-repo-v1" NUL scope NUL
            │                      identity), identity being the URL with equivalent spellings
            │                      made one (repospec.identity): never a raw path, never
            │                      credentials. A store made under a key of layout v1 (which
            │                      kept `.git` and `user@host:path` spellings apart) is used on.
            │                      CHECKOUTCACHE_LFS=off adds NUL "lfs=off" after the identity:
            │                      pointer-file checkouts never share a path with content ones
            │                      (the default, on, keeps the keys stores had before).
            ├── repo.json          normalized URL (credentials removed), scope, LFS setting.
            │                      Written once, whole (temp file + rename), before anything
            │                      else in <key>/.
            ├── mirror.git/        bare mirror: the object store every checkout borrows. A
            │                      partial one (CHECKOUTCACHE_FILTER) has a promisor remote
            │                      `origin` without a URL and only promisor packs: the blobs a
            │                      checkout needs are fetched into it before that checkout.
            │                      Written only under locks/mirror.lock (fetch, refs, repack).
            │                      refs/keep/<sha> exists for every checkout that exists or is
            │                      being made, so maintenance never drops objects one borrows.
            │                      refs/spares/<sha> (gc's alone) for every spare's commit: its
            │                      history stays, so a nearby commit needs little fetched.
            │                      refs/bases/<sha> for every base an existing checkout's
            │                      merge-base record names (`ensure --base`): BASE and its
            │                      history down to the boundary; gc drops the others.
            │                      refs/bundles/ holds what seeding took in from bundles;
            │                      refs/heads/ and refs/tags/ what `bundle publish` fetched.
            │                      Its config names lfs/ as git-lfs's lfs.storage.
            │                      objects/tmp_objdir-checkoutcache-<nonce>/: a partial fetch's
            │                      quarantine (git/quarantine.py), under locks/mirror.lock;
            │                      never read by the mirror, its packs moved in once git's
            │                      fsck passed them; one a killed fetch left is removed by
            │                      the next writer under the lock (git/mirror.py).
            │                      shallow: git's shallow file, the history's boundary (the
            │                      commits whose parents the mirror lacks; none: complete).
            │                      A cold node's first answers are depth-1 fetches: the file
            │                      lists their commits until the history arrives (git/shallow.py).
            │                      Written only under locks/mirror.lock (git through a view's
            │                      link, or shallow.lock renamed over it), after the objects
            │                      and before the refs: it never claims more history than is there.
            ├── history.git/       the background history's own repository (clone/history.py):
            │                      bare, no alternates, no boundary; fetched into as a clone
            │                      would, seeded from bundles first. Written only by the holder
            │                      of locks/history.lock; its packs are hard-linked into
            │                      mirror.git/objects/pack under locks/mirror.lock (.idx last).
            │                      Kept by a killed history to resume from; removed when the
            │                      mirror's history is complete (else by gc once it is).
            ├── lfs/               the repository's one Git LFS object store (git-lfs's
            │   │                  lfs.storage for the mirror and for every checkout), so an
            │   │                  object is downloaded once per store, not once per checkout.
            │   ├── objects/<o1>/<o2>/<oid>  an LFS object, <oid> its sha256 (o1, o2: its first
            │   │                  two pairs of hex digits). Downloaded by `git lfs fetch` into
            │   │                  the mirror under locks/mirror.lock, before the checkout whose
            │   │                  smudge filter copies it; removed by gc, under mirror.lock,
            │   │                  when no commit kept in mirror.git (refs/keep/) references it.
            │   ├── incomplete/<oid>*  git-lfs's partial downloads, under locks/mirror.lock: each cut
            │   │                  near its pointer's size (RLIMIT_FSIZE), removed by the worker after
            │   │                  its fetch, else by gc under mirror.lock once an hour old.
            │   └── tmp/           git-lfs's own temporary files (its business).
            ├── checkouts/
            │   └── <name>/        a published checkout: work tree plus a .git whose
            │       │              objects/info/alternates points at mirror.git/objects.
            │       │              <name> is the commit's <sha> for the whole tree, or
            │       │              <sha>-<16 hex> for a sparse checkout of a cone (the hex:
            │       │              cones.cone_digest of its canonical directories; its
            │       │              .git/info/sparse-checkout and the marker name them).
            │       │              Every record below of one checkout is named by <name>.
            │       │              Appears by one rename from scratch; leaves by one rename to
            │       │              trash/. Only its marker's mtime changes in between; its
            │       │              .git/shallow is a symlink to mirror.git/shallow, made before
            │       │              the publish and never changed: what the checkout's git reads
            │       │              through it (the mirror's boundary) moves as the history
            │       │              arrives, so the checkout's history completes with the
            │       │              mirror's and nothing of the checkout is written (a dangling
            │       │              link: complete). The ready answer's `history` is one stat of it.
            │       └── .git/checkoutcache-ready
            │                      the ready marker (with what the answer says of LFS files and
            │                      submodules, and the [key, commit] pairs of other repositories'
            │                      mirrors its submodules borrow objects from: gc keeps their
            │                      keep-refs). Written (whole) last, checked first; a
            │                      checkout without it is not ready. Its mtime is the last use.
            │                      It records the top-level names and, for a commit with LFS
            │                      files, what the answer says of them (lfs, lfs_why); for a
            │                      sparse checkout its cone (sparse: the directories).
            │                      Readers flock it shared (briefly, or for an exec's whole
            │                      run); the evictor flocks it exclusive to rename the checkout.
            ├── scratch/
            │   └── .clone-<pid>-<nonce>/  a clone in the making, owned by process <pid>
            │       │              (pid in its own PID namespace; the nonce keeps equal pids
            │       │              of different namespaces on one volume apart):
            │       ├── owner.lock held exclusive by the owner for its whole life: THE proof
            │       │              that the owner lives, whatever namespace asks
            │       ├── owner.json pid, process start time, PID namespace, commit
            │       ├── mirror.git/  a first mirror being made; renamed to mirror.git
            │       ├── spare/     a spare taken from spares/ (its spare.json; its tree/ goes on to be
            │       │              tree/ below, updated in place, then published like any tree;
            │       │              a tree that could not be emptied comes back here, never into a checkout)
            │       ├── index      the spare's verified index, kept here while tree/.git is made anew
            │       ├── incoming/  a private fetch's object store (git/shallow.py: a depth-1
            │       │              first answer, a merge-base search), its alternate the mirror's,
            │       │              written without the mirror lock; its packs are moved into the
            │       │              mirror under locks/mirror.lock, then its shallow delta, then refs
            │       └── tree/      the checkout being built; published by rename to checkouts/
            │                      Created and reaped only under locks/scratch.lock; reaped only
            │                      when owner.lock is free (and, when the reaper shares the
            │                      owner's PID namespace, <pid> is gone or another process).
            ├── spares/            recycled trees (clone/tree.py; made by the first gc that keeps one):
            │   │                  a checkout gc evicted, kept to be
            │   │                  updated in place into a later commit's checkout instead of deleted.
            │   │                  Written by gc alone (under gc.lock); never served.
            │   ├── <name>.<nonce>/  one spare: what was checkouts/<name>, with
            │   │   ├── spare.json the commit, cone, LFS and submodule settings it was made with, its
            │   │   │              bytes and its index's identity when it was published (st_ino,
            │   │   │              st_ctime_ns, st_size of .git/index: a changed index is never trusted)
            │   │   └── tree/      the tree itself, renamed here from checkouts/<name> under its
            │   │                  marker's exclusive lock (as an eviction to trash/)
            │   └── .new-<nonce>/  a spare gc is making (spare.json, then tree/, then renamed to
            │                      <name>.<nonce>); one left by a killed gc goes to trash/ next run.
            │                      A worker takes a spare by renaming <name>.<nonce> to spare/ in its
            │                      own scratch (one rename: two workers never share one); from then
            │                      on it is that scratch's, reaped with it when its owner dies.
            ├── trash/             checkouts and scratch renamed out of the way, being deleted.
            │                      Anything here may be deleted by anyone at any time.
            ├── state/
            │   ├── <name>.clone.json  clone record: owner pid, its PID namespace, start time,
            │   │                      progress, deaths so far. Written
            │   │                      whole by the owner; meaningful only while the clone lock
            │   │                      is held (a record without a held lock is a dead clone's).
            │   ├── <name>.failed.json the last failure: code, message, attempts, retry time.
            │   │                      Removed when a clone publishes, or by gc (with the commit's
            │   │                      log and clone lock, under that lock) a day after its retry
            │   │                      time: never during its back-off. No use of the repository.
            │   ├── <name>.deaths.json how many clone workers died in a row on this checkout, kept
            │   │                      when gc removes a dead clone's record (so an OOM-killed
            │   │                      worker still ends in WORKER_DIED); removed when a clone
            │   │                      publishes or fails, or a day after the last death.
            │   ├── last-use.json      the latest last use of the checkouts gc or `evict` removed
            │   │                      (a repository's own last use once none is left). Written whole
            │   │                      by the evictor; gc drops a repository unused past a limit.
            │   ├── <name>.size.json   the checkout's size and the last use it was measured at:
            │   │                      written at publish, measured again by gc only after a use;
            │   │                      index: the identity of its .git/index at publish (spares/).
            │   ├── mirror-seed.json   how mirror.git began (CHECKOUTCACHE_BUNDLE_URI set): the
            │   │                      bundles taken in and from where, why not more, and the
            │   │                      objects and bytes fetched from upstream since. Written by
            │   │                      the worker that made the mirror, under locks/mirror.lock.
            │   ├── mirror-filter.json how mirror.git was made when CHECKOUTCACHE_FILTER asked for a
            │   │                      partial clone: the filter, whether it is one, and why not
            │   │                      (the transport, or a server that ignored the filter).
            │   │                      Written by the worker that made the mirror.
            │   ├── history.json       the background history (clone/history.py): its owner (pid,
            │   │                      PID namespace, start time) and progress while
            │   │                      locks/history.lock is held (written first by its starter);
            │   │                      once complete, when and in how many rounds. Written whole.
            │   ├── history.failed.json the history's last failure: code, message, attempts, retry
            │   │                      time (a back-off as a clone's); removed when it completes.
            │   │                      `boundary`: when only commits the server no longer has were
            │   │                      left, the boundary they leave (the failure holds for it alone).
            │   ├── <name>.bases.json  the merge bases asked of the checkout's commit (`--base`):
            │   │                      version 2, base -> merge base ("" for none), the search
            │   │                      running, failures with their back-off, and the bases handed
            │   │                      over to the background history (`handed_over`). Written whole
            │   │                      by the holder of locks/base-<name>.lock; removed by gc with
            │   │                      the checkout; one of an older version is not read.
            │   ├── mirror-gc.json     when gc last repacked the mirror, and whether keep-refs
            │   │                      were dropped since (a repack is then due at the interval);
            │   │                      lfs_pending: an LFS prune of lfs/ could not run yet.
            │   ├── held.json          gc's own: since when each checkout held by a reader's lock has
            │   │                      been held, as its runs saw it (a checkout seen free leaves it):
            │   │                      past CHECKOUTCACHE_MAX_HOLD_AGE the hold no longer protects it.
            │   └── unremovable.json   what gc's last run could not delete in trash/ (path from the
            │                          root, errno name, stuck since); gone when trash/ empties.
            ├── logs/history.log   the background history's attempts, as a clone's log (a merge-
            │                      base search appends to its checkout's <name>.log).
            ├── logs/<name>.log    the checkout's clone attempts, appended: git's output, redacted,
            │                      at most CLONE_LOG_CAP bytes per attempt; an attempt that
            │                      finds it over the cap first renames it to <name>.log.1.
            └── locks/
                ├── mirror.lock    exclusive for every write to mirror.git
                ├── scratch.lock   exclusive, briefly, to create or reap scratch directories
                ├── clone-<name>.lock exclusive for a clone's whole life: one clone per checkout
                ├── history.lock   exclusive for the background history's whole life: one per repository
                └── base-<name>.lock exclusive for a merge-base search of the checkout's commit

Workspaces (store/workspaces.py): a review's own writable trees, in a directory the
review owns (CHECKOUTCACHE_WORKSPACES; default: <root>/workspaces when this user may
write the root, a single user's case; else $XDG_CACHE_HOME/checkoutcache-workspaces,
the read-only reader's own). Not part of the store: nothing in it is ever served, and
the writer's gc only reads it (counts its bytes, reaps what it may delete):

    <workspaces>/
    ├── ws-<pid>-<nonce>/          one workspace, owned by process <pid> (the caller of
    │   │                          the library, `exec --writable`, or a `workspace` keeper)
    │   ├── owner.lock             held exclusive for the owner's whole life: THE proof
    │   │                          that it lives (free: reaped by its uid's next workspace
    │   │                          call, or by gc where gc may delete it)
    │   ├── owner.json             pid, start time, PID namespace, uid, root, repository
    │   │                          key and URL, commit, checkout name, source checkout, the
    │   │                          watched owner (keeper), bytes at creation
    │   └── tree/                  the writable work tree: a copy of the ready checkout with
    │                              its own .git (objects borrowed from the mirror by
    │                              alternates, read only; LFS storage in tree/.git/lfs)
    ├── .making-<pid>-<nonce>/     being made: locked and recorded first, then renamed to
    │                              ws-*; one older than an hour with a free lock is reaped
    └── .trash-<pid>-<nonce>/      a workspace being deleted; anyone's to finish

While a workspace lives, its owner also holds its source checkout's marker shared (as
exec does): the checkout and the mirror objects the workspace borrows stay.

Permissions (store/modes.py), set by the store whatever the creator's umask,
never world-writable, decided by CHECKOUTCACHE_SHARING:
- writer (the default): directories 0755, files 0644, git under umask 022 and
  mirrors core.sharedRepository=umask. Only the writer's uid (the sidecar, and
  cron's gc as the same uid) writes anything here; a published checkout's
  content cannot be changed by any other uid. Readers (review containers,
  other uids, a read-only mount) read checkouts, take shared locks on markers
  (flock needs no write access) and ask the writer, over the root's socket or
  CHECKOUTCACHE_API_URL, to record their uses and to make new commits.
- group (trusted peers): directories 2775 (setgid, so what is made inside
  belongs to the root's group), files 0664, git under umask 002, mirrors
  core.sharedRepository=group: every member writes the store.
Writers-only directories: <root>/locks, <root>/holds, <root>/serve, and each
repository's locks/ and scratch/ are 0700 (writer) or 2770 (group): any uid
that can open a lock file can flock it (no write access needed) and keep it, so
none that only reads may open one (DESIGN invariant 18). A reader's status says
nothing of what only they hold (running clones come from their records); gc and
serve give an older store's directories this mode as they meet them.
An entry a peer made unreadable costs that entry in status and gc (listed with
its errno), never the whole run.

Every path below the root is reached beneath it (store/tree.py): the root is
the only path opened by name; each entry's directory is opened relative to the
root's descriptor one component at a time, each openat(O_NOFOLLOW) relative
to the one before (open_store_dir), and the entry by *at calls relative to it
(a ready answer: one readlink of its marker's descriptor); removals walk descriptors and never start from
realpath. A symlink (or a file) where a directory of this tree should be
refuses that repository (gc and status list it as a problem, ELOOP; ensure
answers ROOT_UNUSABLE naming it); where repos/ or the root's locks/ should be,
the whole root. Nothing is ever followed or moved through it.

A reader may assume: a checkout with its marker is complete and stays where it
is for as long as the reader holds the marker's shared lock; records are
always whole JSON (never half-written); nothing under scratch/ or trash/ is
ever served.

Locks (flock; all die with their holder; helpers named for their purpose in locks.py):

    lock                      mode       taken by                          held for
    locks/gc.lock             exclusive  gc (never waits: a second gc skips)  the whole run
    <key>/locks/clone-<name>  exclusive  the starter, then its clone worker   the clone's life
                              (probe)    askers, gc (never wait)              a look
    <key>/locks/scratch.lock  exclusive  a worker creating its scratch;       milliseconds
                                         gc reaping dead scratch
    scratch/.clone-*/owner.lock exclusive the scratch's owner                 the owner's life
    (spares/ takes no lock: gc alone makes spares, under gc.lock; a worker takes one by one
    rename into its scratch, and a rename that finds it gone tries the next)
    <workspaces>/ws-*/owner.lock exclusive the workspace's owner (or keeper)  the owner's life
                              (try)      a reaper (its uid's next call, gc)   one rename + delete
    <key>/locks/mirror.lock   exclusive  a worker's fetch, keep-ref and LFS   the write (bounded
                                         download; gc's keep-ref drop,        wait, then skip)
                                         repack and LFS prune (lfs/); a
                                         private fetch's install, the
                                         history's install (never its fetch)  milliseconds
    <key>/locks/history.lock  exclusive  its starter (worker after a publish, the history's life
                                         gc, --history full), then the
                                         history process; gc's history.git
                                         removal and a repository's drop (try)
    <key>/locks/base-<name>   exclusive  its starter, then the merge-base     the search
                                         search process
    .git/checkoutcache-ready  shared     a ready answer (briefly); an exec    the answer / the
                                         or /v1/hold (the command's run)      command (bounded:
                                                                              max-held, max-hold-age)
                              exclusive  eviction, moving a checkout aside   one rename (never
                                         (flock's and the open file          waits)
                                         description's write lock, which
                                         only a writer's descriptor takes;
                                         a ready answer that meets a
                                         reader's exclusive flock takes the
                                         description's read lock instead:
                                         store/ready.py)
    holds/<pid>-<nonce>.hold  exclusive  its holder (an exec's command too)   the hold
                              (try)      gc (a free one is removed)           a look
    locks/.health-<nonce>     exclusive  /readyz (a fresh file per probe)    a probe
    serve/<pid>-<nonce>.journal exclusive its serve; gc (never waits)        the serve's life

Order in which locks may nest (outer first); an inner lock taken against this
order is only ever tried without waiting, so no cycle can deadlock:

    gc.lock -> mirror.lock -> clone-<name> (try) -> marker exclusive (try)
    mirror.lock -> history.lock (try: a repository's drop)
    clone-<name> -> scratch.lock -> owner.lock (fresh) ; clone-<name> -> mirror.lock
    clone-<name> -> history.lock (try: the worker starts the history after its publish)
    history.lock -> mirror.lock ; base-<name> -> scratch.lock ; base-<name> -> mirror.lock
    clone-<name> -> marker exclusive (try: a damaged checkout moved aside)
"""

from __future__ import annotations

import errno
import os
import re
import stat

LAYOUT_VERSION = 1
# What one clone attempt may write to its log: a server's endless `remote:`
# output must not fill the disk.
CLONE_LOG_CAP = 1 << 20
READY_MARKER = "checkoutcache-ready"
SCRATCH_PREFIX = ".clone-"
QUARANTINE_PREFIX = "tmp_objdir-checkoutcache-"
CLONE_RECORD_SUFFIX = ".clone.json"
FAILURE_RECORD_SUFFIX = ".failed.json"
DEATHS_RECORD_SUFFIX = ".deaths.json"
BASES_RECORD_SUFFIX = ".bases.json"
BASE_LOCK_PREFIX = "base-"
CLONE_LOCK_PREFIX = "clone-"
SPARE_MAKING_PREFIX = ".new-"
DROPPED_PREFIX = ".dropped-"
JOURNAL_SUFFIX = ".journal"

ROOT_README = """\
This directory is a checkoutcache store (layout version {version}).
It is maintained by the `checkoutcache` tool: do not edit it by hand.
Run `checkoutcache status` to see what it holds and `checkoutcache gc` to trim it.
"""


class NotBeneath(OSError):
    """A store path that passes through a symlink (or a file) where a directory should be:
    never followed (ELOOP, naming the path)."""

    def __init__(self, path: str, why: str):
        super().__init__(errno.ELOOP, f"{why}: the store never follows a symlink (move it away)", path)


class NotAFile(OSError):
    """A lock or record path that names something other than a regular file (a FIFO, a
    socket, a device, a directory), as anyone who may write that directory can make it: it
    is never read, written, locked or waited on (DESIGN invariant 18), and its caller skips
    it and counts it (records.errno_name: NOT_A_FILE)."""

    code = "NOT_A_FILE"

    def __init__(self, path: str, kind: str):
        super().__init__(errno.EINVAL, f"{kind} where a regular file should be: skipped, never waited on", path)
        self.kind = kind


def file_kind(mode: int) -> str:
    """What an entry is, in words, for NotAFile's message."""
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return kind
    return "not a regular file"


def refuse_unless_regular(fd: int, path: str) -> os.stat_result:
    """fstat of a descriptor just opened (O_NONBLOCK, so a FIFO's open did not wait); closes
    it and raises NotAFile unless it is a regular file."""
    try:
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotAFile(path, file_kind(info.st_mode))
    return info


# Every root this process works in: a path below one is reached beneath it
# (store/tree.py). Registered by RootPaths (and RepoPaths).
_ROOTS: set[str] = set()


def root_of(path: str) -> str | None:
    """The known root a store path is under (None: under none, e.g. a test's own file)."""
    found = None
    for root in _ROOTS:
        if (path == root or path.startswith(root + "/")) and (found is None or len(root) > len(found)):
            found = root
    return found


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_store_dir(path: str) -> int:
    """A descriptor of a directory below a known root, opened one component at a time
    from the root's descriptor with O_NOFOLLOW (what openat2's RESOLVE_NO_SYMLINKS does,
    without ctypes on the new commit's path): a symlink (or a file) on the way raises
    NotBeneath, a missing component FileNotFoundError. Only the root is opened by name
    (the operator chose it). A path under no known root is opened by name, its last
    component not followed. The caller closes the descriptor."""
    root = root_of(path)
    if root is None:
        return os.open(path, _DIR_FLAGS | os.O_NOFOLLOW)
    current = os.open(root, _DIR_FLAGS)
    rel = path[len(root):].strip("/")
    done = root
    try:
        for part in rel.split("/") if rel else []:
            done = f"{done}/{part}"
            if part in ("", ".", ".."):
                raise NotBeneath(path, f"{_shown(root, path)} has a {part or 'empty'!r} component")
            following = open_step(current, part, root, done)
            os.close(current)
            current = following
        return current
    except BaseException:
        os.close(current)
        raise


def open_step(dir_fd: int, part: str, root: str, done: str) -> int:
    try:
        return os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), done) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
    kind = "a symlink" if names_a_symlink(dir_fd, part) else "not a directory"
    raise NotBeneath(done, f"{_shown(root, done)} is {kind}")


def names_a_symlink(dir_fd: int, part: str | bytes) -> bool:
    """Whether a directory entry is a symlink: O_NOFOLLOW | O_DIRECTORY answers ENOTDIR for a
    symlink and for a file alike, and an error should say which it was."""
    try:
        return stat.S_ISLNK(os.stat(part, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _shown(root: str, path: str) -> str:
    return repr(path[len(root):].strip("/") or ".")


def entries(directory: str) -> list[str]:
    """The sorted names in a directory of the store; none if it does not exist (yet, or any more).
    Listed through a descriptor opened beneath the root (open_store_dir): a symlink where
    the directory should be raises NotBeneath (an OSError), never lists its target."""
    try:
        fd = open_store_dir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)


def _names_like(names: list[str], prefix: str, suffix: str) -> list[str]:
    """The middles of names of the form <prefix><middle><suffix> (keys: 32 hex digits)."""
    return [name[len(prefix):len(name) - len(suffix)] for name in names
            if name.startswith(prefix) and name.endswith(suffix) and len(name) > len(prefix) + len(suffix)]


# A checkout's name: its commit, and for a sparse checkout a digest of its cone
# (cones.cone_digest): `<sha>` or `<sha>-<16 hex>`. Every per-checkout path and
# record is named by it; the mirror's keep-refs by the commit alone.
CHECKOUT_NAME = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?(?:-[0-9a-f]{16})?")


def checkout_name(sha: str, cone_digest: str | None = None) -> str:
    return f"{sha}-{cone_digest}" if cone_digest else sha


def root_of_checkout(path: str, name: str) -> str | None:
    """The root of a path shaped as checkout NAME's (<root>/repos/<key>/checkouts/<name>, absolute,
    normalized), else None: what a process that did not compute the path itself (a client given
    one by a server) checks before it works there."""
    if not os.path.isabs(path) or os.path.normpath(path) != path:
        return None
    checkouts, base = os.path.split(path)
    repo, checkouts_name = os.path.split(checkouts)
    repos, key = os.path.split(repo)
    root, repos_name = os.path.split(repos)
    if (base, checkouts_name, repos_name) != (name, "checkouts", "repos") or not key or key.startswith("."):
        return None
    return root


def commit_of(name: str) -> str:
    """The commit of a checkout name."""
    return name.partition("-")[0]


def _checkouts_named(names: list[str], prefix: str, suffix: str) -> list[str]:
    """The checkout names in names of the form <prefix><name><suffix>."""
    found = []
    for name in names:
        if name.startswith(prefix) and name.endswith(suffix):
            middle = name[len(prefix):len(name) - len(suffix)]
            if CHECKOUT_NAME.fullmatch(middle):
                found.append(middle)
    return found


# A published workspace's name (store/workspaces.py): ws-<pid>-<12 hex>.
WORKSPACE_NAME = re.compile(r"ws-[0-9]{1,10}-[0-9a-f]{12}")
WORKSPACES_DIR_NAME = "workspaces"


def default_workspaces(root: str, root_writable: bool, environ: dict | os._Environ | None = None) -> str:
    """Where workspaces go when CHECKOUTCACHE_WORKSPACES is not set: <root>/workspaces for
    a user who may write the root (one directory to think about, and gc sees it); else
    (a read-only reader) $XDG_CACHE_HOME/checkoutcache-workspaces, else ~/.cache/..."""
    if root_writable:
        return os.path.join(root, WORKSPACES_DIR_NAME)
    environ = os.environ if environ is None else environ
    cache_home = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.realpath(os.path.join(cache_home, "checkoutcache-workspaces"))


def existing_key(root_paths: "RootPaths", key: str, legacy_key: str | None) -> str:
    """The key of the store to use: a store made under an older key for this
    spelling (layout v1 keyed some spellings apart) goes on serving, unless the
    repository's own store exists already."""
    if legacy_key is None or os.path.isdir(root_paths.repo(key).base) \
            or not os.path.isdir(root_paths.repo(legacy_key).base):
        return key
    return legacy_key


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
        _ROOTS.add(root.rstrip("/") or "/")

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

    def health_probe(self, token: str) -> str:
        return os.path.join(self.root, "locks", f".health-{token}")

    @property
    def api_socket(self) -> str:
        """Where the image's serve listens (CHECKOUTCACHE_UNIX_SOCKET's default there), and
        where the CLI looks for a serve of this root to hand a new commit to."""
        return os.path.join(self.root, "checkoutcache.sock")

    @property
    def holds_dir(self) -> str:
        return os.path.join(self.root, "holds")

    def hold_record(self, pid: int, nonce: str) -> str:
        return os.path.join(self.root, "holds", f"{pid}-{nonce}.hold")

    @property
    def limits_record(self) -> str:
        return os.path.join(self.root, "limits.json")

    @property
    def serve_dir(self) -> str:
        return os.path.join(self.root, "serve")

    @property
    def private_dirs(self) -> tuple[str, ...]:
        """Directories only writers enter (modes.private_dir_mode): what holds the locks a
        writer waits on or trusts (gc.lock, a hold's, a serve's journal)."""
        return (self.locks_dir, self.holds_dir, self.serve_dir)

    def serve_journal(self, pid: int, nonce: str) -> str:
        return os.path.join(self.root, "serve", f"{pid}-{nonce}{JOURNAL_SUFFIX}")

    def serve_journals(self) -> list[str]:
        """Every journal in serve/: this version's (<pid>-<nonce>) and older ones' (<pid>)."""
        return [os.path.join(self.root, "serve", name) for name in entries(self.serve_dir)
                if name.endswith(JOURNAL_SUFFIX) and not name.startswith(".")]

    @staticmethod
    def journal_has_owner_lock(path: str) -> bool:
        """Whether a journal is of the kind its serve holds locked (named with a nonce): an
        older version's <pid>.journal is never locked, so its lock says nothing."""
        return not os.path.basename(path)[:-len(JOURNAL_SUFFIX)].isdigit()

    @property
    def unreachable_dir(self) -> str:
        return os.path.join(self.root, "unreachable")

    def unreachable_records(self) -> list[tuple[str, str]]:
        """(key, record path) of every repository never reached."""
        return [(key, self.unreachable_record(key)) for key in
                _names_like(entries(self.unreachable_dir), "", FAILURE_RECORD_SUFFIX)]

    def unreachable_record(self, key: str) -> str:
        return os.path.join(self.root, "unreachable", f"{key}{FAILURE_RECORD_SUFFIX}")

    def repo(self, key: str) -> "RepoPaths":
        return RepoPaths(f"{self.root}/repos/{key}")

    def repo_keys(self) -> list[str]:
        return [name for name in entries(self.repos_dir) if not name.startswith(".")]

    def dropped_repo_slot(self, key: str) -> str:
        """A fresh name in repos/ for a whole repository about to be removed (hidden from repo_keys)."""
        return os.path.join(self.root, "repos", f"{DROPPED_PREFIX}{key}-{os.getpid()}-{os.urandom(4).hex()}")

    def dropped_repos(self) -> list[str]:
        """Repositories renamed aside for removal that are still there (a removal killed or under way)."""
        return [os.path.join(self.root, "repos", name) for name in entries(self.repos_dir)
                if name.startswith(DROPPED_PREFIX)]


class RepoPaths:
    """Paths inside one repository's store (repos/<key>/)."""

    __slots__ = ("base",)

    def __init__(self, base: str):
        self.base = base
        _ROOTS.add(os.path.dirname(os.path.dirname(base)) or "/")

    @property
    def key(self) -> str:
        return os.path.basename(self.base)

    @property
    def root(self) -> str:
        """The cache root this repository's store is in (<root>/repos/<key>)."""
        return os.path.dirname(os.path.dirname(self.base))

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
    def mirror_shallow(self) -> str:
        """git's shallow file of the mirror: its history's boundary (none: complete)."""
        return os.path.join(self.base, "mirror.git", "shallow")

    @property
    def history_repo(self) -> str:
        """The background history fetch's own repository (clone/history.py)."""
        return os.path.join(self.base, "history.git")

    @property
    def lfs_store(self) -> str:
        """git-lfs's lfs.storage: the repository's one LFS object store."""
        return os.path.join(self.base, "lfs")

    @property
    def lfs_objects(self) -> str:
        return os.path.join(self.base, "lfs", "objects")

    @property
    def lfs_incomplete(self) -> str:
        """Where git-lfs writes a download until its content checks out (names start with the oid)."""
        return os.path.join(self.base, "lfs", "incomplete")

    def lfs_object(self, oid: str) -> str:
        return os.path.join(self.base, "lfs", "objects", oid[0:2], oid[2:4], oid)

    def lfs_object_oids(self) -> list[str]:
        """The oids of the LFS objects the store holds (names of 64 hex digits where git-lfs puts them)."""
        found = []
        for first in entries(self.lfs_objects):
            for second in entries(os.path.join(self.lfs_objects, first)):
                for name in entries(os.path.join(self.lfs_objects, first, second)):
                    if len(name) == 64 and name[0:2] == first and name[2:4] == second \
                            and all(c in "0123456789abcdef" for c in name):
                        found.append(name)
        return found

    @property
    def checkouts_dir(self) -> str:
        return os.path.join(self.base, "checkouts")

    # The two paths of every ready answer: plain concatenation (a key and a name hold no '/').
    def checkout(self, name: str) -> str:
        return f"{self.base}/checkouts/{name}"

    def ready_marker(self, name: str) -> str:
        return f"{self.base}/checkouts/{name}/.git/{READY_MARKER}"

    def checkout_shallow(self, name: str) -> str:
        """The checkout's .git/shallow: a symlink to the mirror's (the ready answer's one stat)."""
        return f"{self.base}/checkouts/{name}/.git/shallow"

    @staticmethod
    def shallow_link_in(checkout_dir: str) -> str:
        return os.path.join(checkout_dir, ".git", "shallow")

    @staticmethod
    def ready_marker_in(checkout_dir: str) -> str:
        return os.path.join(checkout_dir, ".git", READY_MARKER)

    @property
    def scratch_dir(self) -> str:
        return os.path.join(self.base, "scratch")

    def scratch_dir_for(self, pid: int, nonce: str) -> str:
        return os.path.join(self.base, "scratch", f"{SCRATCH_PREFIX}{pid}-{nonce}")

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
    def scratch_mirror(scratch: str) -> str:
        return os.path.join(scratch, "mirror.git")

    @staticmethod
    def scratch_incoming(scratch: str) -> str:
        """A private fetch's object store (git/shallow.py), moved into the mirror under its lock."""
        return os.path.join(scratch, "incoming")

    @staticmethod
    def quarantine_objects(mirror: str, nonce: str) -> str:
        """A partial fetch's quarantine object store inside a mirror (git/quarantine.py)."""
        return os.path.join(mirror, "objects", f"{QUARANTINE_PREFIX}{nonce}")

    @staticmethod
    def scratch_pid(name: str) -> int | None:
        """The owner pid of a scratch directory name, or None if it is not one."""
        if not name.startswith(SCRATCH_PREFIX):
            return None
        digits = name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        return int(digits) if digits.isdigit() else None

    @property
    def spares_dir(self) -> str:
        return os.path.join(self.base, "spares")

    def spare_entry(self, entry: str) -> str:
        return os.path.join(self.base, "spares", entry)

    def spare_slot(self, name: str) -> str:
        """A fresh name in spares/ for a spare of checkout <name>."""
        return os.path.join(self.base, "spares", f"{name}.{os.urandom(6).hex()}")

    def spare_in_making(self) -> str:
        return os.path.join(self.base, "spares", f"{SPARE_MAKING_PREFIX}{os.urandom(6).hex()}")

    @staticmethod
    def spare_tree(spare: str) -> str:
        return os.path.join(spare, "tree")

    @staticmethod
    def spare_record(spare: str) -> str:
        return os.path.join(spare, "spare.json")

    @staticmethod
    def scratch_spare(scratch: str) -> str:
        return os.path.join(scratch, "spare")

    @staticmethod
    def scratch_index(scratch: str) -> str:
        return os.path.join(scratch, "index")

    def spare_entries(self) -> list[tuple[str, str]]:
        """(entry, checkout name) of every finished spare in spares/."""
        found = []
        for entry in entries(self.spares_dir):
            name, dot, nonce = entry.rpartition(".")
            if dot and CHECKOUT_NAME.fullmatch(name) and re.fullmatch(r"[0-9a-f]{12}", nonce):
                found.append((entry, name))
        return found

    def spares_in_making(self) -> list[str]:
        return [self.spare_entry(e) for e in entries(self.spares_dir) if e.startswith(SPARE_MAKING_PREFIX)]

    @property
    def trash_dir(self) -> str:
        return os.path.join(self.base, "trash")

    def trash_entry(self, name: str) -> str:
        return os.path.join(self.base, "trash", name)

    def scratch_entry(self, name: str) -> str:
        return os.path.join(self.base, "scratch", name)

    def trash_slot(self, what: str) -> str:
        """A fresh, unique name in trash/ for something about to be renamed there."""
        return os.path.join(self.base, "trash", f"{what}.{os.getpid()}.{os.urandom(4).hex()}")

    @property
    def state_dir(self) -> str:
        return os.path.join(self.base, "state")

    def clone_record(self, name: str) -> str:
        return os.path.join(self.base, "state", f"{name}{CLONE_RECORD_SUFFIX}")

    def failure_record(self, name: str) -> str:
        return os.path.join(self.base, "state", f"{name}{FAILURE_RECORD_SUFFIX}")

    def deaths_record(self, name: str) -> str:
        return os.path.join(self.base, "state", f"{name}{DEATHS_RECORD_SUFFIX}")

    def deaths_record_names(self) -> list[str]:
        return _checkouts_named(entries(self.state_dir), "", DEATHS_RECORD_SUFFIX)

    def clone_record_names(self) -> list[str]:
        return _checkouts_named(entries(self.state_dir), "", CLONE_RECORD_SUFFIX)

    def failure_record_names(self) -> list[str]:
        return _checkouts_named(entries(self.state_dir), "", FAILURE_RECORD_SUFFIX)

    def size_record(self, name: str) -> str:
        return os.path.join(self.base, "state", f"{name}.size.json")

    @property
    def last_use_record(self) -> str:
        return os.path.join(self.base, "state", "last-use.json")

    @property
    def history_record(self) -> str:
        return os.path.join(self.base, "state", "history.json")

    @property
    def history_failure(self) -> str:
        return os.path.join(self.base, "state", f"history{FAILURE_RECORD_SUFFIX}")

    def bases_record(self, name: str) -> str:
        return os.path.join(self.base, "state", f"{name}{BASES_RECORD_SUFFIX}")

    def bases_record_names(self) -> list[str]:
        return _checkouts_named(entries(self.state_dir), "", BASES_RECORD_SUFFIX)

    @property
    def mirror_gc_stamp(self) -> str:
        return os.path.join(self.base, "state", "mirror-gc.json")

    @property
    def filter_record(self) -> str:
        return os.path.join(self.state_dir, "mirror-filter.json")

    @property
    def seed_record(self) -> str:
        return os.path.join(self.state_dir, "mirror-seed.json")

    @property
    def held_record(self) -> str:
        return os.path.join(self.base, "state", "held.json")

    @property
    def unremovable_record(self) -> str:
        return os.path.join(self.base, "state", "unremovable.json")

    @property
    def logs_dir(self) -> str:
        return os.path.join(self.base, "logs")

    def clone_log(self, name: str) -> str:
        return os.path.join(self.base, "logs", f"{name}.log")

    def previous_clone_log(self, name: str) -> str:
        return os.path.join(self.base, "logs", f"{name}.log.1")

    @property
    def locks_dir(self) -> str:
        return os.path.join(self.base, "locks")

    @property
    def mirror_lock(self) -> str:
        return os.path.join(self.base, "locks", "mirror.lock")

    @property
    def scratch_lock(self) -> str:
        return os.path.join(self.base, "locks", "scratch.lock")

    def clone_lock(self, name: str) -> str:
        return os.path.join(self.base, "locks", f"{CLONE_LOCK_PREFIX}{name}.lock")

    @property
    def history_lock(self) -> str:
        return os.path.join(self.base, "locks", "history.lock")

    def base_lock(self, name: str) -> str:
        return os.path.join(self.base, "locks", f"{BASE_LOCK_PREFIX}{name}.lock")

    def clone_lock_names(self) -> list[str]:
        return _checkouts_named(entries(self.locks_dir), CLONE_LOCK_PREFIX, ".lock")

    def all_dirs(self) -> list[str]:
        """Directories a repository store needs, created together on first use."""
        return [self.base, self.checkouts_dir, self.scratch_dir, self.trash_dir,
                self.state_dir, self.logs_dir, self.locks_dir]

    @property
    def private_dirs(self) -> tuple[str, ...]:
        """Directories of all_dirs only writers enter (modes.private_dir_mode): the locks (a
        reader holding mirror.lock or a clone's lock would stop new commits or fake a clone)
        and the scratch (its owner locks: a reader holding one keeps dead scratch for ever)."""
        return (self.locks_dir, self.scratch_dir)

    def checkout_names(self) -> list[str]:
        return [name for name in entries(self.checkouts_dir) if CHECKOUT_NAME.fullmatch(name)]


class WorkspacePaths:
    """Paths in a workspaces directory (CHECKOUTCACHE_WORKSPACES; drawn in the docstring)."""

    __slots__ = ("base",)
    MAKING_PREFIX = ".making-"
    TRASH_PREFIX = ".trash-"
    TREE = "tree"

    def __init__(self, base: str):
        self.base = base

    def workspace(self, name: str) -> str:
        return os.path.join(self.base, name)

    def making(self, pid: int, nonce: str) -> str:
        return os.path.join(self.base, f"{self.MAKING_PREFIX}{pid}-{nonce}")

    def trash_slot(self) -> str:
        return os.path.join(self.base, f"{self.TRASH_PREFIX}{os.getpid()}-{os.urandom(6).hex()}")

    @staticmethod
    def owner_lock(workspace: str) -> str:
        return os.path.join(workspace, "owner.lock")

    @staticmethod
    def owner_json(workspace: str) -> str:
        return os.path.join(workspace, "owner.json")

    @classmethod
    def tree(cls, workspace: str) -> str:
        return os.path.join(workspace, cls.TREE)
