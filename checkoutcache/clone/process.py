"""What the detached processes of a repository (a clone worker, the background history)
share: how a forked child becomes one (become_detached), their log, appended attempt after
attempt, how SIGTERM reaches them, and the count of what upstream sent since a mirror's
seeding (state/mirror-seed.json)."""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING, Callable, NoReturn

from checkoutcache.store import records, tree
from checkoutcache.store.layout import CLONE_LOG_CAP, RepoPaths

if TYPE_CHECKING:
    from checkoutcache.credentials import Credential


def fork_detached(child: Callable[[], None], what: str) -> int:
    """child() in a grandchild of ours, in a session of its own, whose parent has exited: init
    reaps it, never us (a long-lived caller gathers no zombie), and no terminal signal of
    the caller's reaches it. Its pid comes back through a pipe; OSError if it never started."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle child: a new session, then the process, then gone
        try:
            os.close(read_end)
            os.setsid()
            pid = os.fork()
            if pid == 0:
                os.close(write_end)
                child()
            os.write(write_end, str(pid).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        answer = os.read(read_end, 32)
    finally:
        os.close(read_end)
        os.waitpid(middle, 0)
    if not answer:
        raise OSError(f"the forked {what} did not start")
    return int(answer)


def become_detached(paths: RepoPaths, log_name: str, lock_fd: int, credential: "Credential | None", title: str,
                    body: Callable[[], int]) -> NoReturn:
    """The child side of a fork that becomes a repository's detached process: titled for
    `ps`, stdin and stdout on /dev/null and stderr on the log, every other descriptor closed
    but the lock it owns (the caller's pipes and sockets must not stay open in it), in /, the
    caller's credentials replaced by its own; then body(), whose code is the exit status.
    Never returns: whatever body raises goes to the log."""
    code = 1
    try:
        import setproctitle

        from checkoutcache.credentials import CREDENTIAL_VARS, credential_env

        setproctitle.setproctitle(title)
        devnull = os.open(os.devnull, os.O_RDWR)
        log = tree.open_file(paths.clone_log(log_name), os.O_WRONLY | os.O_APPEND, create=True)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.dup2(log, 2)
        for entry in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
            fd = int(entry)
            if fd > 2 and fd != lock_fd:
                try:
                    os.close(fd)
                except OSError:
                    pass
        os.chdir("/")
        for var in CREDENTIAL_VARS:
            os.environ.pop(var, None)
        os.environ.update(credential_env(credential))
        code = body()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def open_attempt_log(paths: RepoPaths, name: str):
    """The checkout's log, opened for one more attempt; a log over the cap is
    first rotated to <name>.log.1 (one previous generation is kept)."""
    log = paths.clone_log(name)
    try:
        if tree.lstat(log).st_size > CLONE_LOG_CAP:
            tree.rename(log, paths.previous_clone_log(name))
    except tree.NotBeneath:
        raise
    except OSError:
        pass
    fd = tree.open_file(log, os.O_WRONLY | os.O_APPEND, create=True)
    return os.fdopen(fd, "a", buffering=1, errors="replace")


def stop_on_sigterm(on_stop: Callable[[], None]) -> None:
    """Call on_stop on a thread of its own when SIGTERM comes, even while the main thread
    is inside a C call (libgit2's fetch): the C-level handler writes the signal to a wakeup
    pipe at once, and that thread is blocked reading it. Only for a worker process of its
    own (never a submodule's inline run, which shares its superproject's process)."""
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    os.set_blocking(read_end, True)
    signal.signal(signal.SIGTERM, lambda *_: None)  # the Python-level handler: the thread does the work
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def wait() -> None:
        while os.read(read_end, 1) != bytes([signal.SIGTERM]):
            pass
        on_stop()

    threading.Thread(target=wait, name="cc-sigterm", daemon=True).start()


def tracking(received: dict[str, int], on_progress: Callable[[dict], None]) -> Callable[[dict], None]:
    """A progress callback that also keeps what the upstream's pack held: its object count
    (`remote: Total N`, the receiving line, libgit2's stats) and its size where git reports
    one (git unpacks a small pack without a word of its size)."""
    def track(update: dict) -> None:
        received.update({k: update[k] for k in ("total_objects", "bytes") if isinstance(update.get(k), int)})
        on_progress(update)

    return track


def count_upstream(paths: RepoPaths, received: dict[str, int]) -> None:
    """What upstream sent since the mirror's seeding (one fetch), for status and metrics."""
    seed = records.read_json(paths.seed_record, records.SEED)
    if not seed or not seed.get("seeded"):
        return
    upstream = seed.setdefault("upstream", {})
    upstream["fetches"] = int(upstream.get("fetches", 0)) + 1
    upstream["objects"] = int(upstream.get("objects", 0)) + received.get("total_objects", 0)
    upstream["bytes"] = int(upstream.get("bytes", 0)) + received.get("bytes", 0)
    try:
        records.write_json(paths.seed_record, seed)
    except OSError:
        pass  # observability only: never the reason a clone fails
