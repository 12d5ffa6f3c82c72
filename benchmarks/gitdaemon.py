"""A git daemon on 127.0.0.1 (a free port), started and stopped by its user:
the realistic remote for the tests and the benchmarks (a plain path hard-links
and libgit2's file:// is slow, so neither shows real fetch behaviour)."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GitDaemon:
    def __init__(self, base: str, env: dict | None = None):
        """env: the daemon's environment (default: ours), e.g. a server-side git config."""
        self.base = base
        self.port = free_port()
        self.proc = subprocess.Popen(["git", "daemon", "--reuseaddr", f"--base-path={base}", "--export-all",
                                      "--listen=127.0.0.1", f"--port={self.port}", base],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("git daemon did not start")

    def url(self, name: str) -> str:
        return f"git://127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
