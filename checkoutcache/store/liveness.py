"""Is the process that owned something still alive? PIDs are reused, fast in
containers, so a pid alone proves nothing: an owner is identified by its pid
AND its process start time, recorded when it took ownership, and both mean
something only inside the owner's own PID namespace (containers sharing one
volume each have their own: equal pids, unrelated processes). So an owner
records its namespace too, and pid evidence is used only when the asker is in
the same one; elsewhere the owner's lock is the only authority.

Also which processes (of our PID namespace) work in a tree (InUse): by the
paths /proc shows, then by the identity of the directories they are in, so a
tree reached by another path is still seen (gc never keeps such a tree as a
spare). A process keeps its tree by holding it, never by being seen here."""

from __future__ import annotations

import errno
import functools
import os
import stat

# create_time() is derived from the boot time and the start tick; the same
# process always reports the same value, a reused pid a later one.
_SAME_START = 0.05


def process_start_time(pid: int) -> float | None:
    """The start time of a live (non-zombie) process, or None: psutil's create_time(),
    computed as psutil computes it, from /proc/<pid>/stat (an asker waiting on a clone looks
    at its owner this way ten times a second; importing psutil costs it 35 ms). psutil
    answers only where that file cannot be parsed."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rpartition(b")")[2].split()
        if fields[0] == b"Z":
            return None
        return int(fields[19]) / _clock_ticks() + _boot_time()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except (OSError, ValueError, IndexError):
        return _psutil_start_time(pid)


def _psutil_start_time(pid: int) -> float | None:
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def is_alive(pid: int | None, start_time: float | None) -> bool:
    """True only if pid runs and is the same process that recorded start_time."""
    if not pid or start_time is None:
        return False
    current = process_start_time(pid)
    return current is not None and abs(current - float(start_time)) < _SAME_START


def own_identity() -> tuple[int, float]:
    """Our pid and start time, as whoever checks on us computes it."""
    return os.getpid(), process_start_time(os.getpid())


@functools.cache
def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


@functools.cache
def _boot_time() -> float:
    with open("/proc/stat", "rb") as handle:
        for line in handle:
            if line.startswith(b"btime"):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def pid_namespace() -> str | None:
    """This process's PID namespace (the inode of /proc/self/ns/pid), or None if unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def same_pid_namespace(recorded: object) -> bool:
    """Whether a recorded namespace is ours: only then do pid and start time say anything."""
    return recorded is not None and recorded == pid_namespace()


# ------------------------------------------------------------ processes in a tree
# How far up `..` a walk goes from a directory a process is in: a deeper one is not placed,
# and a tree is then taken to be in use (spares only save time; this keeps the look bounded).
MAX_WALK = 256
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


class InUse:
    """What the processes of this PID namespace have open, as /proc shows it: working and
    root directories, descriptors, mapped files. What a caller can see only: another uid's
    descriptors are hidden unless we are root, and another PID namespace's processes always
    are (the caller says what that leaves unseen).

    A tree is in use (beneath) when one of them lies in it by its path, the fast look, or by
    identity: walking up `..` from the directory a process is in, holds open, or holds a file
    in meets the tree's own directory (st_dev, st_ino). A path string alone misses a process
    that reaches the tree another way: a bind mount of the root, another mount namespace
    where the volume is mounted elsewhere (/proc shows paths as the process sees them), a
    parent renamed. The walk starts from /proc's own links (the cwd and root links, a
    directory descriptor's link), or, for a file, from its directory resolved beneath the
    process's root one component at a time (never following a symlink) and checked to hold
    that very inode. Each walk is done once per gc run, when the first tree is asked about
    (remembered by mount namespace, path and identity), and is at most MAX_WALK levels.
    Not seen by identity: a bind mount whose root is a directory inside the tree (its `..`
    leads out of the mount, never through the tree)."""

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self.paths: list[str] = []
        # ((mount namespace, path as the process sees it), the /proc link that opens it)
        self._directories: list[tuple[tuple, str]] = []
        # (view, directory) -> (a /proc root link to resolve it beneath, {file name: inode})
        self._files: dict[tuple, tuple[str, dict[str, int]]] = {}
        self._reached: set[tuple[int, int]] | None = None
        self._unplaced = False
        self._collect()

    def _collect(self) -> None:
        try:
            pids = [name for name in os.listdir(self.proc) if name.isdigit()]
        except OSError:
            return
        for pid in pids:
            base = f"{self.proc}/{pid}"
            try:
                namespace = os.readlink(f"{base}/ns/mnt")
            except OSError:
                namespace = None
            seen_as = {}
            for link in ("cwd", "root"):
                try:
                    target = seen_as[link] = os.readlink(f"{base}/{link}")
                except OSError as exc:
                    if exc.errno == errno.ENAMETOOLONG:  # deeper than a path can say: walked all the same
                        self._directories.append(((namespace, base, link), f"{base}/{link}"))
                    continue
                self.paths.append(target)
                if not target.endswith(" (deleted)"):
                    self._directories.append(((namespace, target), f"{base}/{link}"))
            # A file's directory is resolved beneath this process's root: the same path names
            # the same directory for every process of one mount namespace and one root.
            view = (namespace, seen_as.get("root"))
            try:
                descriptors = os.listdir(f"{base}/fd")
            except OSError:
                descriptors = []
            for fd in descriptors:
                try:
                    target = os.readlink(f"{base}/fd/{fd}")
                except OSError:
                    continue
                self.paths.append(target)
                if not target.startswith("/") or target.endswith(" (deleted)"):
                    continue  # a socket, a pipe, an anonymous inode; a deleted file goes nowhere
                try:
                    info = os.stat(f"{base}/fd/{fd}")  # through the magic link: what the descriptor is
                except OSError:
                    continue
                if stat.S_ISDIR(info.st_mode):
                    self._directories.append(((namespace, target), f"{base}/fd/{fd}"))
                elif stat.S_ISREG(info.st_mode):
                    self._add_file(view, f"{base}/root", target, info.st_ino)
            try:
                with open(f"{base}/maps", "rb") as handle:
                    for line in handle:
                        fields = line.split(maxsplit=5)
                        if len(fields) == 6 and fields[5].startswith(b"/"):
                            path = os.fsdecode(fields[5].rstrip(b"\n"))
                            self.paths.append(path)
                            if not path.endswith(" (deleted)") and fields[4].isdigit():
                                self._add_file(view, f"{base}/root", path, int(fields[4]))
            except OSError:
                pass

    def _add_file(self, view: tuple, root: str, path: str, inode: int) -> None:
        directory, name = os.path.split(path)
        _root, names = self._files.setdefault((view, directory), (root, {}))
        names[name] = inode

    def beneath(self, path: str) -> bool:
        """Whether a process is in the tree at path (by its path, then by identity)."""
        top = path.rstrip("/") or "/"
        prefix = top.rstrip("/") + "/"
        if any(used == top or used.startswith(prefix) for used in self.paths):
            return True
        try:
            info = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        if self._reached is None:
            self._reached = self._walk_all()
        return self._unplaced or (info.st_dev, info.st_ino) in self._reached

    def _walk_all(self) -> set[tuple[int, int]]:
        """The identity of every directory some process is in or below (its ancestors, up to
        the top of its mount tree): each directory /proc links to, and each directory holding
        a file a process has open or mapped, walked once."""
        reached: set[tuple[int, int]] = set()
        walked: set[tuple] = set()
        for key, link in self._directories:
            if key in walked:
                continue
            walked.add(key)
            try:
                fd = os.open(link, _DIR_FLAGS)
            except OSError:
                continue
            self._walk_up(fd, reached)
        for (_view, directory), (root, names) in self._files.items():
            fd = _open_beneath(root, directory)
            if fd is None:
                continue
            if not any(_holds(fd, name, inode) for name, inode in names.items()):
                os.close(fd)  # renamed or replaced since: the path no longer places the files
                continue
            self._walk_up(fd, reached)
        return reached

    def _walk_up(self, fd: int, reached: set[tuple[int, int]]) -> None:
        """Add the directory fd opens and each one above it; closes fd. Never stops early at a
        directory reached before: through another mount its parents may be others."""
        try:
            for _ in range(MAX_WALK):
                info = os.fstat(fd)
                identity = (info.st_dev, info.st_ino)
                reached.add(identity)
                parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = parent
                above = os.fstat(fd)
                if (above.st_dev, above.st_ino) == identity:  # the top of its mount tree
                    return
            self._unplaced = True  # deeper than MAX_WALK: cannot tell, so a tree counts as in use
        except OSError:
            return
        finally:
            os.close(fd)


def _holds(fd: int, name: str, inode: int) -> bool:
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False).st_ino == inode
    except OSError:
        return False


def _open_beneath(root: str, directory: str) -> int | None:
    """The directory at this path beneath a process's root link, one component at a time
    without following a symlink (a path /proc showed names real directories; a symlink there
    now is a change made since, not ours to follow). None when it is not there."""
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return None
    for part in directory.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            os.close(fd)
            return None
        try:
            inner = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = inner
    return fd


def paths_in_use(proc: str = "/proc") -> InUse:
    """What the processes of this PID namespace have open (InUse), looked up once."""
    return InUse(proc)


def in_use_beneath(path: str, in_use: InUse | list[str]) -> bool:
    """Whether any of what is in use (paths_in_use) is path or lies beneath it; a plain list
    of paths is compared as strings only."""
    if isinstance(in_use, InUse):
        return in_use.beneath(path)
    path = path.rstrip("/") or "/"
    prefix = path.rstrip("/") + "/"
    return any(used == path or used.startswith(prefix) for used in in_use)
