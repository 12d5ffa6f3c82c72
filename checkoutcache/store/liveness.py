"""Is the process that owned something still alive? PIDs are reused, fast in
containers, so a pid alone proves nothing: an owner is identified by its pid
AND its process start time, recorded when it took ownership, and both mean
something only inside the owner's own PID namespace (containers sharing one
volume each have their own: equal pids, unrelated processes). So an owner
records its namespace too, and pid evidence is used only when the asker is in
the same one; elsewhere the owner's lock is the only authority."""

from __future__ import annotations

import functools
import os

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


def paths_in_use(proc: str = "/proc") -> list[str]:
    """Every path a process of this PID namespace has open, as /proc shows it: working and
    root directories, descriptors, mapped files. What a caller can see only: another uid's
    descriptors are hidden unless we are root, and another PID namespace's processes always
    are (the caller says what that leaves unseen)."""
    found: list[str] = []
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return found
    for pid in pids:
        base = f"{proc}/{pid}"
        for link in ("cwd", "root"):
            try:
                found.append(os.readlink(f"{base}/{link}"))
            except OSError:
                pass
        try:
            descriptors = os.listdir(f"{base}/fd")
        except OSError:
            descriptors = []
        for fd in descriptors:
            try:
                found.append(os.readlink(f"{base}/fd/{fd}"))
            except OSError:
                pass
        try:
            with open(f"{base}/maps", "rb") as handle:
                for line in handle:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(b"/"):
                        found.append(os.fsdecode(fields[5].rstrip(b"\n")))
        except OSError:
            pass
    return found


def in_use_beneath(path: str, in_use: list[str]) -> bool:
    """Whether any of the paths in use (paths_in_use) is path or lies beneath it."""
    path = path.rstrip("/") or "/"
    prefix = path.rstrip("/") + "/"
    return any(used == path or used.startswith(prefix) for used in in_use)
