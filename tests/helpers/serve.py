"""A real `checkoutcache serve` process for the tests, on 127.0.0.1 (or a Unix
socket), with bearer tokens from a file: raw requests, the typed client, and
the process's own figures."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys

from checkoutcache.client import Client

from .daemons import free_port
from .waiting import wait_until

TOKEN = "tok-" + "a" * 28  # every scope
SCOPED = "tok-" + "b" * 28  # scope team-a only
# serve in a PID namespace of its own, pid 1 there (as in every container of the image).
PID_NAMESPACE = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
SHORT_BACKOFF = {"CHECKOUTCACHE_BACKOFF": "0.1", "CHECKOUTCACHE_BACKOFF_MAX": "0.2"}


class Serve:
    def __init__(self, root: str, tmp_path, *extra: str, env: dict | None = None, unix: str | None = None,
                 tokens: str | None = None, listen: str | None = "loopback", prefix: tuple[str, ...] = ()):
        """listen: "loopback" (127.0.0.1 on a free port), an address (HOST:PORT), or None (from
        the environment given: CHECKOUTCACHE_LISTEN). prefix: a command serve runs under
        (PID_NAMESPACE: its own PID namespace, where it is pid 1 as under tini's exec)."""
        self.root = root
        self.unix = unix
        if listen == "loopback":
            listen = f"127.0.0.1:{free_port()}"
        address = listen or (env or {}).get("CHECKOUTCACHE_LISTEN", "")
        self.port = int(address.rpartition(":")[2]) if address else free_port()
        token_file = tmp_path / f"tokens-{self.port}"
        token_file.write_text(tokens if tokens is not None else f"{TOKEN}\n{SCOPED} team-a\n")
        ready = self.ready_path = tmp_path / f"ready-{self.port}"
        where = ["--unix", unix] if unix else (["--listen", listen] if listen else [])
        # Its log goes to a file the test reads (a pipe nobody reads would fill).
        self.log_path = tmp_path / f"serve-{self.port}.log"
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "checkoutcache", "--root", root, "serve", *where,
                                      "--ready-file", str(ready), "--token-file", str(token_file), *extra],
                                     env=dict(os.environ, **(env or {})), stdout=subprocess.DEVNULL,
                                     stderr=open(self.log_path, "w"), text=True)

        def started() -> bool:
            assert self.proc.poll() is None, self.log()
            return ready.exists()

        wait_until(started, 30, "serve to write its ready file")

    def client(self, token: str | None = TOKEN) -> Client:
        """The typed client, on this machine: it reads the root serve writes (its ready paths
        are checked there)."""
        if self.unix:
            return Client(unix=self.unix, token=token, root=self.root)
        return Client(f"http://127.0.0.1:{self.port}", token=token, root=self.root)

    def connection(self) -> http.client.HTTPConnection:
        if self.unix:
            conn = http.client.HTTPConnection("localhost", timeout=60)
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(self.unix)
            conn.sock = sock
            return conn
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def request(self, method: str, path: str, body: dict | None = None, conn=None,
                token: str | None = TOKEN) -> tuple[int, dict | str]:
        """One request through http.client (JSON body); (status, parsed JSON or text)."""
        own = conn is None
        conn = conn or self.connection()
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            if data:
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            text = response.read().decode()
            kind = response.getheader("Content-Type", "")
            return response.status, json.loads(text) if kind.startswith("application/json") else text
        finally:
            if own:
                conn.close()

    def raw(self, data: bytes, timeout: float = 10) -> bytes:
        """Send bytes as they are; the whole answer (until the server closes or goes quiet)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            sock.sendall(data)
            chunks = []
            try:
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
                    if _complete(b"".join(chunks)):
                        break
            except socket.timeout:
                pass
            return b"".join(chunks)

    def log(self) -> str:
        return self.log_path.read_text()

    def json_lines(self) -> list[dict]:
        """The log's JSON lines (--log-format json), in order; other lines are skipped."""
        found = []
        for line in self.log().splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                pass
        return found

    def vm_hwm_kib(self) -> int:
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.serve_pid(), signal.SIGTERM)
        return self.proc.wait(30)

    def serve_pid(self) -> int:
        """serve's pid as this test sees it: the process started, or under a prefix (unshare
        --fork) its child, which unshare does not forward signals to."""
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as handle:
                children = handle.read().split()
        except FileNotFoundError:
            children = []
        if self.proc.args[0] == sys.executable or not children:
            return self.proc.pid
        return int(children[0])

    def announced(self) -> dict:
        """What serve wrote to its ready file (its pid there is the one of its own namespace)."""
        return json.loads(self.ready_path.read_text())


def _complete(data: bytes) -> bool:
    head, separator, body = data.partition(b"\r\n\r\n")
    if not separator:
        return False
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False
