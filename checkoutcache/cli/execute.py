"""exec: run a command inside a held checkout (or, with --writable, in a workspace of its
own: workspaces.py) and pass its exit status through.

The checkout is held (its marker's shared lock) from before the command starts
until after it ends, so gc cannot evict it meanwhile, whatever its age; the
end of the command counts as the last use. Termination signals sent to us are
passed to the command, so a pipeline that stops us stops it too.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from checkoutcache.answers import EXIT_EXEC_FAILED
from checkoutcache.cache import Cache
from checkoutcache.cli.output import ProgressBar, emit_answer

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def run_held(cache: Cache, repo: str, commit: str, command: list[str], wait: float, scope: str,
             sparse: tuple[str, ...] = ()) -> int:
    bar = ProgressBar() if wait > 0 and sys.stderr.isatty() else None
    try:
        hold = cache.hold(repo, commit, wait=wait, scope=scope, on_progress=bar, sparse=sparse)
    finally:
        if bar is not None:
            bar.close()
    if not hold.held:
        emit_answer(hold.answer, True, sys.stderr)
        return EXIT_EXEC_FAILED
    with hold:
        # The command inherits the hold (the marker's shared lock): killed, this
        # wrapper never leaves a running command in a checkout gc may evict.
        return run_command(command, hold.answer.path, hold.descriptors())


def run_in_workspace(cache: Cache, repo: str, commit: str, command: list[str], wait: float, scope: str,
                     sparse: tuple[str, ...] = ()) -> int:
    """exec --writable: the command runs in a workspace owned by this process, removed after it."""
    from checkoutcache.workspaces import make_workspace

    bar = ProgressBar() if wait > 0 and sys.stderr.isatty() else None
    try:
        made = make_workspace(cache, repo, commit, wait=wait, scope=scope, on_progress=bar, sparse=sparse)
    finally:
        if bar is not None:
            bar.close()
    if not made.made:
        emit_answer(made.answer, True, sys.stderr)
        return EXIT_EXEC_FAILED
    with made:
        # The command inherits the workspace's owner lock and its source's hold: this
        # wrapper killed, the workspace lives exactly as long as the command.
        return run_command(command, made.path, made.descriptors())


def run_command(command: list[str], cwd: str, fds: tuple[int, ...]) -> int:
    try:
        proc = subprocess.Popen(command, cwd=cwd, pass_fds=fds)
    except FileNotFoundError:
        sys.stderr.write(f"checkoutcache exec: command not found: {command[0]}\n")
        return 127
    except PermissionError:
        sys.stderr.write(f"checkoutcache exec: command not executable: {command[0]}\n")
        return 126
    previous = {sig: signal.signal(sig, lambda signum, _frame: proc.send_signal(signum)) for sig in FORWARDED}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code if code >= 0 else 128 - code
