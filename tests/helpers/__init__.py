"""Helpers shared by every test file: repositories, daemons, the CLI, one tree
walker, store paths and snapshots, and waiting for events. conftest.py holds
only fixtures; test files import what they need from here.

- repos.py    git(), Upstream: real repositories made by the tests.
- daemons.py  GitDaemon and free_port (one helper for tests and benchmarks).
- cli.py      run_cli() and wait_ready(): the CLI run as a user runs it.
- tree.py     walk(): the one tree walker; files_under, grep_tree, content_snapshot, exchange.
- store.py    store paths through checkoutcache.store.layout, store snapshots,
              assert_checkout_matches, making a checkout look idle.
- waiting.py  wait_until(): a bounded wait for an event instead of a fixed sleep.
- serve.py    Serve: a real `serve` process with tokens; raw requests and the typed client.
- s3.py       MotoS3: a real S3 API (moto in server mode) in a process of its own.
- containers.py  the image built and run by podman: Containers, Container (conftest's
              container_image and containers fixtures; import it from there).
"""

from .cli import run_cli, wait_ready
from .daemons import GitDaemon, free_port
from .repos import GIT_ENV, Upstream, git
from .s3 import AWS_TEST_SECRET, MotoS3
from .serve import SCOPED, SHORT_BACKOFF, TOKEN, Serve
from .store import (
    assert_checkout_matches,
    blob_id,
    make_idle,
    marker,
    only_repo,
    settled,
    store_snapshot,
    writers_only,
)
from .tree import content_snapshot, exchange, files_under, grep_tree, walk
from .waiting import pid_alive, wait_until

__all__ = [
    "AWS_TEST_SECRET", "MotoS3", "GIT_ENV", "GitDaemon", "SCOPED", "SHORT_BACKOFF", "Serve", "TOKEN", "Upstream", "assert_checkout_matches", "blob_id", "content_snapshot", "exchange", "files_under",
    "free_port", "git", "grep_tree", "make_idle", "marker", "only_repo", "pid_alive", "run_cli", "settled", "store_snapshot",
    "wait_ready", "wait_until", "walk", "writers_only",
]
