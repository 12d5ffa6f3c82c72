"""Writable workspaces (DESIGN invariant 16): a review that must write (build, run
tests, apply a patch) gets its own tree of a commit, never the shared checkout.

How one is made: the ready checkout is held (its marker's shared lock, as exec
holds it) and copied with `cp -a --reflink=auto` into a directory the caller
owns (store/workspaces.py: made under a .making- name with its owner lock
held, then renamed into place). The copy is the checkout exactly (LFS content,
submodule work trees, a sparse cone) with its own .git, whose objects are
borrowed from the mirror by the absolute alternates the checkout already has:
read only, no network fetch, and git never writes an object into an
alternate. (It may "freshen" one: set the mtime of the mirror's pack that
holds an object it was about to write; through the reader's read-only mount,
or as another uid, that fails and git writes its own copy; only the writer's
own uid, a single user, can bump a pack's mtime, never its content.) Then in
the copy: the ready marker goes, git's stat check is told to compare only
mtime and size (core.checkStat=minimal, core.trustctime=false: the copy keeps
the checkout's mtimes, so the index the checkout wrote is right without
re-reading every file), and Git LFS stores what it cleans in the copy's own
.git/lfs (the store's lfs/ is never written). Measured against `git worktree
add` and a plain copy in benchmarks/workspace.py (benchmarks/RESULTS.md): a
fresh `git checkout` through alternates writes the same files and cost more.

Who owns it, and for how long (the owner-lock rule scratch follows):
- `Workspace` (the library, `exec --writable`): the calling process. It holds
  owner.lock and the source checkout's hold; `remove()` (or leaving the `with`
  block) deletes the workspace; a process that dies, SIGKILL included, frees
  both locks and the workspace is reaped by its uid's next workspace call or
  by gc where gc may delete it.
- `keep_for` (the `workspace create` command, which prints a path and exits):
  a forked keeper inherits both locks, leaves the caller's session and
  descriptors, and watches the owner process (the command's caller, or
  --owner-pid) through a pidfd; when the owner ends (or on SIGTERM from
  `workspace remove`) it deletes the workspace and exits. A keeper killed
  frees the lock like any owner.

While a workspace lives its source checkout stays held, so gc cannot evict the
checkout whose mirror objects the workspace borrows (a keep-ref stays while a
checkout exists), and gc counts the workspace's bytes against max-bytes.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import time
from typing import Callable, Sequence

from checkoutcache.answers import Answer
from checkoutcache.cache import Cache, Hold
from checkoutcache.errors import CheckoutCacheError, is_disk_full
from checkoutcache.repospec import DEFAULT_SCOPE
from checkoutcache.store import records, workspaces
from checkoutcache.store.checkouts import Removal
from checkoutcache.store.layout import READY_MARKER, RepoPaths, WorkspacePaths, default_workspaces
from checkoutcache.store.liveness import is_alive, process_start_time, same_pid_namespace
from checkoutcache.store.ready import marker_record, submodules_of

# What the copy's own git says, appended to each .git/config of the copy.
WORKSPACE_GIT_CONFIG = {"core.checkStat": "minimal", "core.trustctime": "false"}
KEEPER_POLL = 1.0  # only where pidfd_open is missing (Linux < 5.3)
REMOVE_WAIT = 30.0  # how long `workspace remove` waits for a keeper to finish deleting


def root_writable(root: str) -> bool:
    """Whether this user may write the root (a single user, or the writer): then workspaces
    default to <root>/workspaces. A root not made yet will be made by this user."""
    if os.path.isdir(root):
        return os.access(root, os.W_OK | os.X_OK)
    return True


def workspaces_dir(cache: Cache) -> WorkspacePaths:
    """CHECKOUTCACHE_WORKSPACES, else the default for this user (layout.default_workspaces)."""
    return workspaces_dir_of(cache.root, cache.config)


def workspaces_dir_of(root: str, config) -> WorkspacePaths:
    configured = config.workspaces
    base = os.path.abspath(os.path.expanduser(configured if configured else default_workspaces(root, root_writable(root))))
    if base == root or base.startswith(root.rstrip("/") + "/"):
        # Under the root (the default <root>/workspaces): a store directory, reached beneath the
        # root like every other (store/tree.py). realpath would follow a peer's symlink there and
        # gc would reap `.trash-*` and lockless `ws-*` wherever it pointed.
        return WorkspacePaths(base)
    return WorkspacePaths(os.path.realpath(base))  # the user's own directory, outside every store


class Workspace:
    """A writable tree of a commit owned by this process; `made` False when it could not
    be made (then `answer` says why, as a failed ensure answer does)."""

    def __init__(self, answer: Answer, made: workspaces.Made | None = None, hold: Hold | None = None,
                 source: str | None = None):
        self.answer = answer
        self._made = made
        self._hold = hold
        self.source = source

    @property
    def made(self) -> bool:
        return self._made is not None

    @property
    def path(self) -> str | None:
        """The work tree: write, build and commit here."""
        return self._made.tree if self._made is not None else None

    def descriptors(self) -> tuple[int, ...]:
        """What a child process must inherit to keep the workspace (and its source) alive as long as it runs."""
        fds = (self._made.owner_lock.fileno(),) if self._made is not None else ()
        return fds + (self._hold.descriptors() if self._hold is not None else ())

    def remove(self) -> Removal:
        """Delete the workspace now and release its source checkout."""
        removal = Removal()
        if self._made is not None:
            made, self._made = self._made, None
            removal = workspaces.discard(made.paths, made.path, made.owner_lock)
        if self._hold is not None:
            hold, self._hold = self._hold, None
            hold.release()
        return removal

    def to_json(self) -> dict:
        if not self.made:
            return self.answer.to_json()
        return {**self.answer.to_json(), "state": "workspace", "path": self.path, "source": self.source,
                "workspace": os.path.basename(self._made.path)}

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def make_workspace(cache: Cache, repo: str, commit: str, wait: float = 0.0, scope: str = DEFAULT_SCOPE,
                   on_progress: Callable[[Answer], None] | None = None, sparse: Sequence[str] | None = None) -> Workspace:
    """A workspace of COMMIT (made ready first, within wait); owned by this process."""
    try:
        paths = workspaces_dir(cache)
    except CheckoutCacheError as exc:
        return Workspace(Answer.from_error(exc))
    reap_own(paths)  # the owner-lock rule: this uid's dead workspaces go at its next call
    hold = cache.hold(repo, commit, wait=wait, scope=scope, on_progress=on_progress, sparse=sparse)
    if not hold.held:
        return Workspace(hold.answer)
    answer = hold.answer
    try:
        made = copy_checkout(paths, answer.path, hold.descriptors()[0], {"repo": answer.repo or repo})
    except CheckoutCacheError as exc:
        hold.release()
        return Workspace(Answer.from_error(exc, commit=answer.commit, repo=answer.repo))
    except BaseException:
        hold.release()
        raise
    # Copied: its source is held from now on like any reader's (bounded), and its objects stay
    # while it lives (gc keeps its commit's keep-ref: upkeep/workspace_upkeep.py).
    hold.unregister()
    return Workspace(answer, made, hold, answer.path)


def copy_checkout(paths: WorkspacePaths, source: str, marker_fd: int, extra: dict) -> workspaces.Made:
    """Copy a ready checkout (held by the caller: marker_fd, its marker's shared lock) into a
    new workspace and publish it. CheckoutCacheError WORKSPACES_UNUSABLE or WORKSPACE_FAILED;
    nothing is left behind."""
    record = marker_record(marker_fd)
    repo_paths = RepoPaths(os.path.dirname(os.path.dirname(source)))
    name = os.path.basename(source)
    fields = {"root": repo_paths.root, "key": repo_paths.key, "commit": name.partition("-")[0], "name": name,
              "source": source, **extra}
    try:
        made = workspaces.begin(paths, fields)
    except OSError as exc:
        raise CheckoutCacheError("WORKSPACES_UNUSABLE", where=paths.base,
                                 why=exc.strerror or type(exc).__name__) from None
    try:
        done = subprocess.run(["cp", "-a", "--reflink=auto", "--no-target-directory", source, made.tree],
                              capture_output=True, env={**os.environ, "LC_ALL": "C"}, cwd="/")
        if done.returncode != 0:
            line = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["cp failed"]
            raise CheckoutCacheError("WORKSPACE_FAILED", detail=line[0][:300])
        make_own(made.tree, paths.tree(made.final), submodules_of(record) == "included")
        workspaces.publish(made)
    except OSError as exc:
        workspaces.discard(paths, made.path, made.owner_lock)
        what = "no space left" if is_disk_full(exc) else (exc.strerror or type(exc).__name__)
        raise CheckoutCacheError("WORKSPACE_FAILED", detail=f"{what} in {paths.base}") from None
    except BaseException:
        workspaces.discard(paths, made.path, made.owner_lock)
        raise
    return made


def make_own(tree: str, final_tree: str, with_submodules: bool) -> None:
    """Turn a copy of a checkout into a repository of its own (see the module's docstring);
    final_tree: where tree will be once published (the paths its config names)."""
    os.unlink(os.path.join(tree, ".git", READY_MARKER))
    git_dirs = [os.path.join(tree, ".git")]
    if with_submodules:
        for here, dirs, _files in os.walk(tree):
            if ".git" in dirs:
                dirs.remove(".git")
                if here != tree:
                    git_dirs.append(os.path.join(here, ".git"))
    for git_dir in git_dirs:
        if not os.path.isdir(git_dir) or os.path.islink(git_dir):
            continue
        own_shallow(git_dir)
        # O_NOFOLLOW: in the trusted-peers mode a peer may have swapped the checkout's config for a
        # symlink (the copy keeps it): appending by name would write a file of the caller's elsewhere.
        try:
            fd = os.open(os.path.join(git_dir, "config"), os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            rel = os.path.relpath(os.path.join(git_dir, "config"), tree)
            raise CheckoutCacheError("WORKSPACE_FAILED", detail=f"{rel} of the checkout is a symlink (somebody changed "
                                     f"the published checkout: `checkoutcache evict REPO COMMIT` drops it)") from None
        with open(fd, "a") as handle:
            handle.write("[core]\n" + "".join(f"\t{k.split('.', 1)[1]} = {v}\n"
                                               for k, v in WORKSPACE_GIT_CONFIG.items()))
            # git-lfs's clean filter stores what a review adds here, never in the store's lfs/.
            final_git_dir = os.path.join(final_tree, os.path.relpath(git_dir, tree))
            handle.write(f"[lfs]\n\tstorage = {os.path.join(final_git_dir, 'lfs')}\n")


def own_shallow(git_dir: str) -> None:
    """A checkout's .git/shallow is a link to its mirror's (git/shallow.py): the workspace gets
    a copy of the boundary as it is now, never the link, so a review's own `git fetch --deepen`
    or `git gc` there writes the workspace's file, never the mirror's."""
    link = os.path.join(git_dir, "shallow")
    if not os.path.islink(link):
        return
    try:
        with open(link, "rb") as handle:  # the mirror's file, through the link (read only)
            content = handle.read(1 << 24)
    except OSError:
        content = b""  # no boundary: the mirror's history is complete
    os.unlink(link)
    if content:
        fd = os.open(link, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with open(fd, "wb") as handle:
            handle.write(content)


def reap_own(paths: WorkspacePaths) -> list[workspaces.Reaped]:
    """This uid's dead workspaces (free owner lock) are deleted."""
    if not os.path.isdir(paths.base):
        return []
    return workspaces.reap_dead(paths)[0]


# ------------------------------------------------------------------ the keeper


def owner_process(owner_pid: int | None) -> tuple[int, float]:
    """(pid, start time) of the process a `workspace create` serves: --owner-pid, else the
    command's caller (its parent). BAD_ARGUMENT if it does not run."""
    pid = os.getppid() if owner_pid is None else owner_pid
    start = process_start_time(pid) if pid > 0 else None
    if start is None:
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"--owner-pid {pid}: no such process")
    return pid, start


def keep_for(workspace: Workspace, owner_pid: int, owner_start: float) -> int:
    """Fork a keeper that owns the workspace until owner_pid ends; the keeper's pid.
    This process gives up its own references (the keeper's descriptors keep the locks)."""
    try:
        pidfd = os.pidfd_open(owner_pid)
    except (AttributeError, OSError):
        pidfd = None
    if not is_alive(owner_pid, owner_start):  # the pid named another process by the time we looked
        raise CheckoutCacheError("BAD_ARGUMENT", what=f"--owner-pid {owner_pid}: the process ended")
    keep = set(workspace.descriptors()) | ({pidfd} if pidfd is not None else set())
    child = os.fork()
    if child == 0:  # pragma: no cover - the keeper: measured by the tests through its effects
        code = 0
        try:
            _become_keeper(keep)
            _watch(owner_pid, owner_start, pidfd)
        except BaseException:
            code = 1
        finally:
            try:
                workspace.remove()
            finally:
                os._exit(code)
    # The keeper owns it now: owner.json names it (for `workspace remove` and status).
    made = workspace._made
    record = records.read_json(made.paths.owner_json(made.path), workspaces.WORKSPACE_RECORD) or {}
    records.write_json(made.paths.owner_json(made.path),
                       {**record, "pid": child, "start_time": process_start_time(child) or 0.0, "keeper": True,
                        "owner_pid": owner_pid, "owner_start_time": owner_start})
    # The keeper's copies of the descriptors hold the locks now: ours are only closed.
    if workspace._made is not None:
        workspace._made.owner_lock.release()
        workspace._made = None
    if workspace._hold is not None:
        for fd in workspace._hold.descriptors():
            os.close(fd)
        workspace._hold._fd = None
        workspace._hold = None
    if pidfd is not None:
        os.close(pidfd)
    return child


_stop = False


def _become_keeper(keep: set[int]) -> None:
    """Out of the caller's session, its terminal and its pipes (a `$(checkoutcache workspace
    create ...)` must see EOF), with only the descriptors it needs."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the directory's own descriptor, gone already

    def stop(_signum, _frame) -> None:
        global _stop
        _stop = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)


def _watch(owner_pid: int, owner_start: float, pidfd: int | None) -> None:
    """Return when the owner has ended, or when asked to stop (SIGTERM)."""
    poller = select.poll()
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    while not _stop:
        if pidfd is not None:
            try:
                if poller.poll(KEEPER_POLL * 1000):
                    return
            except InterruptedError:
                continue
        else:
            time.sleep(KEEPER_POLL)
            if not is_alive(owner_pid, owner_start):
                return


def remove_kept(paths: WorkspacePaths, given: str) -> dict:
    """`workspace remove PATH`: ask the keeper of a workspace to delete it (SIGTERM) and wait
    for it; a dead owner's workspace is reaped at once. UNKNOWN_WORKSPACE / WORKSPACE_OWNED."""
    where = workspaces.find(paths, given)
    if where is None:
        raise CheckoutCacheError("UNKNOWN_WORKSPACE", what=given[:200], where=paths.base)
    facts = {f.path: f for f in workspaces.workspace_facts(paths)}.get(where)
    if facts is None:
        raise CheckoutCacheError("UNKNOWN_WORKSPACE", what=given[:200], where=paths.base)
    if facts.alive:
        record = facts.record
        keeper = record.get("pid")
        if not record.get("keeper") or not same_pid_namespace(record.get("pidns")) \
                or not is_alive(keeper, record.get("start_time")) or facts.uid != os.geteuid():
            raise CheckoutCacheError("WORKSPACE_OWNED", pid=keeper)
        if not _signal_holder(keeper, paths.owner_lock(where), signal.SIGTERM):
            raise CheckoutCacheError("WORKSPACE_OWNED", pid=keeper)
        deadline = time.monotonic() + REMOVE_WAIT
        while os.path.lexists(where) and time.monotonic() < deadline:
            time.sleep(0.02)
        return {"removed": os.path.basename(where), "by": "keeper", "pid": keeper,
                "done": not os.path.lexists(where)}
    reaped, left = workspaces.reap_dead(paths)
    if left and any(n.name == facts.name for n in left):
        raise CheckoutCacheError("WORKSPACE_OWNED", pid=facts.record.get("pid"))
    return {"removed": facts.name, "by": "reaper", "done": not os.path.lexists(where)}


def _signal_holder(pid: int, lock_path: str, signum: int) -> bool:
    """Signal pid only if it holds the workspace's owner.lock open (the keeper does, from
    before the workspace was published); owner.json alone is no proof: in the trusted-peers
    mode a peer may rewrite it to name any process. Through a pidfd, so the pid checked is
    the pid signalled. False when pid is not the holder (nothing is sent)."""
    try:
        lock = os.lstat(lock_path)
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        fd_dir = f"/proc/{pid}/fd"
        for name in os.listdir(fd_dir):
            try:
                held = os.stat(os.path.join(fd_dir, name))
            except OSError:
                continue
            if (held.st_dev, held.st_ino) == (lock.st_dev, lock.st_ino):
                signal.pidfd_send_signal(pidfd, signum)
                return True
        return False
    except OSError:
        return False
    finally:
        os.close(pidfd)


def list_workspaces(paths: WorkspacePaths) -> list[dict]:
    """What a workspaces directory holds (no sizes: listing never walks a tree)."""
    out = []
    for f in workspaces.workspace_facts(paths):
        r = f.record
        out.append({"workspace": f.name, "path": f.tree, "alive": f.alive, "uid": f.uid, "pid": r.get("pid"),
                    "keeper": bool(r.get("keeper")), "owner_pid": r.get("owner_pid"), "repo": r.get("repo"),
                    "key": r.get("key"), "commit": r.get("commit"), "name": r.get("name"),
                    "source": r.get("source"), "created_at": r.get("created_at")})
    return out
