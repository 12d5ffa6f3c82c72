"""Is the process that owned something still alive? PIDs are reused, fast in
containers, so a pid alone proves nothing: an owner is identified by its pid
AND its process start time, recorded when it took ownership."""

from __future__ import annotations

import psutil

# create_time() is derived from the boot time and the start tick; the same
# process always reports the same value, a reused pid a later one.
_SAME_START = 0.05


def process_start_time(pid: int) -> float | None:
    """The start time of a live (non-zombie) process, or None."""
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
    proc = psutil.Process()
    return proc.pid, proc.create_time()
