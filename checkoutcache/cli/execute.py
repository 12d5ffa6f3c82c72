"""exec: run a command inside a held checkout and pass its exit status through.

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
        try:
            # The command inherits the hold (the marker's shared lock): killed, this
            # wrapper never leaves a running command in a checkout gc may evict.
            proc = subprocess.Popen(command, cwd=hold.answer.path, pass_fds=hold.descriptors())
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
