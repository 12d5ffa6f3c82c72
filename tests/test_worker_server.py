"""serve starts clone workers from a pre-forked worker server, not by starting
Python for each; if the server is killed, serve falls back to spawning."""

from __future__ import annotations

import pytest

import os
import signal
import threading

import psutil

from .helpers import Serve, assert_checkout_matches, wait_until


def command_lines_during(action) -> list[str]:
    """Every process command line seen while action() runs (sampled every few ms)."""
    seen: set[str] = set()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        seen.add(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode())
                    except OSError:
                        pass

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        action()
    finally:
        stop.set()
        sampler.join()
    return sorted(seen)


@pytest.mark.slow
def test_serve_forks_workers_from_its_worker_server_and_falls_back_to_spawn(root, tmp_path, upstream):
    running = Serve(root, tmp_path, "--allow-local")
    try:
        children = psutil.Process(running.proc.pid).children()
        servers = [c for c in children if "checkoutcache-worker-server" in " ".join(c.cmdline())]
        assert len(servers) == 1, [c.cmdline() for c in children]
        client = running.client()
        first = upstream.shas[0]
        seen = command_lines_during(lambda: client.ensure(upstream.path, first, wait=60))
        assert any(f"checkoutcache-worker {first}" in line for line in seen), "a worker ran"
        # (Only this commit's: the scan sees every process on the machine, other suites' too.)
        assert not any("checkoutcache.clone.worker" in line and first in line for line in seen), \
            "no Python was started for it"
        assert_checkout_matches(client.ensure(upstream.path, first).path, upstream.path, first)
        # The worker server killed (the OOM killer): clones go on, spawned.
        servers[0].send_signal(signal.SIGKILL)
        wait_until(lambda: not servers[0].is_running() or servers[0].status() == psutil.STATUS_ZOMBIE, 10,
                   "the worker server to die")
        second = upstream.shas[1]
        seen = command_lines_during(lambda: client.ensure(upstream.path, second, wait=60))
        assert any("checkoutcache.clone.worker" in line and second in line for line in seen)
        assert client.ensure(upstream.path, second).state == "ready"
        assert not psutil.pid_exists(servers[0].pid), "serve collected its dead worker server"
    finally:
        assert running.stop() == 0
