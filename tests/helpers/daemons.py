"""A git daemon on loopback: a realistic remote (a plain path hard-links and
libgit2's file:// is slow). The class lives in benchmarks/gitdaemon.py so the
benchmarks and the tests share it; this module makes it importable here."""

from __future__ import annotations

import os
import sys

_BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)

from gitdaemon import GitDaemon, free_port  # noqa: E402

__all__ = ["GitDaemon", "free_port"]
