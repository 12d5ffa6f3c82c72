"""A git daemon on loopback: a realistic remote (a plain path hard-links and
libgit2's file:// is slow). The class lives in benchmarks/gitdaemon.py so the
benchmarks and the tests share it; this module makes it importable here.
Also answer_each(): a stand-in server's accept loop (a liar, a recorder)."""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Callable

_BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)

from gitdaemon import GitDaemon, free_port  # noqa: E402

__all__ = ["GitDaemon", "answer_each", "free_port"]


def answer_each(listener: socket.socket, handle: Callable[[socket.socket], None], close: bool = True) -> None:
    """Call handle(connection) for every connection the listening socket accepts, in a
    daemon thread, closing each after (unless close=False: handle keeps it); the loop ends
    when the test closes the listener."""

    def loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            handle(conn)
            if close:
                conn.close()

    threading.Thread(target=loop, daemon=True).start()
