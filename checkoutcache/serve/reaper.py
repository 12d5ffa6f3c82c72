"""serve as PID 1, or under a PID 1 that reaps nothing: a child subreaper.

Clone workers are double-forked so that they outlive the request that started
them; an orphan goes to the nearest subreaper, else to PID 1. serve marks
itself a subreaper (PR_SET_CHILD_SUBREAPER), so its workers come back to it
and not to a PID 1 that may not reap (serve itself, when the image runs
without tini), and it reaps them: every half second it waits for zombie
children that are not its own (processes its code started and waits for
itself, e.g. through subprocess) and have been zombies for a while, so no
exit status our own code waits for is ever taken from it. No SIGCHLD handler:
the event loop (uvloop) owns that signal for its own subprocesses.

At a stop, `workers()` names the clone workers still running among them (their
process titles say so), so serve can give them the rest of its stop bound and
then SIGTERM them (worker.on_stop: a clean end with no verdict).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

PR_SET_CHILD_SUBREAPER = 36
# A clone worker's command line: forked ones retitle themselves (spawn.worker_title), spawned
# ones run the module.
WORKER_MARKS = (b"checkoutcache-worker ", b"checkoutcache.clone.worker")


def become_subreaper() -> bool:
    """Mark this process a child subreaper; False where the kernel refuses."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class Reaper:
    """Reaps zombie children that are not ours (`own`) once they stayed zombies `grace` seconds."""

    def __init__(self, grace: float = 0.5):
        self.grace = grace
        self.own: set[int] = set()  # pids our code waits for itself
        self.seen: dict[int, float] = {}
        self.reaped = 0

    @staticmethod
    def children() -> list[int]:
        pids = []
        try:
            tasks = os.listdir("/proc/self/task")
        except OSError:
            return pids
        for tid in tasks:
            try:
                with open(f"/proc/self/task/{tid}/children") as handle:
                    pids += [int(p) for p in handle.read().split()]
            except (OSError, ValueError):
                continue
        return pids

    @staticmethod
    def is_zombie(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            return False

    def sweep(self) -> None:
        now = time.monotonic()
        current = set()
        for pid in self.children():
            if pid in self.own or not self.is_zombie(pid):
                continue
            current.add(pid)
            if now - self.seen.setdefault(pid, now) < self.grace:
                continue
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    self.reaped += 1
            except ChildProcessError:
                pass
            self.seen.pop(pid, None)
        for gone in set(self.seen) - current:
            self.seen.pop(gone, None)

    @staticmethod
    def is_worker(pid: int) -> bool:
        """Whether a process of this PID namespace is a clone worker (its title says so)."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except OSError:
            return False
        return any(mark in cmdline for mark in WORKER_MARKS)

    def workers(self) -> list[int]:
        """Our children that are clone workers and still running (exited ones are reaped here)."""
        running = []
        for pid in self.children():
            if pid in self.own or not self.is_worker(pid):
                continue
            if self.is_zombie(pid):
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
                continue
            running.append(pid)
        return running

    def stop_workers(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
