"""Floods of unauthenticated connections against a real serve (issue 27): what a
connection that has not shown a token may hold. Real sockets, counted events, no
timing: the ready answer must come while the flood goes on."""

from __future__ import annotations

import pytest

import socket
import threading

from .helpers import TOKEN, Serve
from .helpers.waiting import wait_until

SLOTS = 16
FLOODERS = 20


def answer_and_close(sock: socket.socket) -> tuple[bytes, bool]:
    """One whole answer from sock, and whether the server then closed the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data, True
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return head + b"\r\n\r\n" + body, True
        body += chunk
    sock.settimeout(2)
    try:
        closed = sock.recv(1) == b""  # an idle keep-alive connection is closed only after 5 s
    except socket.timeout:
        closed = False
    return head + b"\r\n\r\n" + body, closed


class Flood:
    """Unauthenticated clients on keep-alive connections: each asks /healthz or, without a
    token, /v1/status (401), and asks again on the same connection while it stays open (a
    closed one is opened anew: a flood does not give up)."""

    def __init__(self, port: int, count: int):
        self.port, self.stop = port, threading.Event()
        self.answers: list[tuple[bytes, bool]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(n,), daemon=True) for n in range(count)]
        for thread in self.threads:
            thread.start()

    def run(self, number: int) -> None:
        path = "/healthz" if number % 2 else "/v1/status"
        request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n\r\n".encode()
        while not self.stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=60) as sock:
                    while not self.stop.is_set():
                        sock.settimeout(60)
                        sock.sendall(request)
                        answer, closed = answer_and_close(sock)
                        with self.lock:
                            self.answers.append((answer, closed))
                        if closed:
                            break  # and at once again, on a new connection
                        self.stop.wait(1.0)  # well within the 5 s idle deadline: the slot stays held
            except OSError:
                self.stop.wait(0.1)

    def end(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(70)


@pytest.mark.slow
def test_unauthenticated_keep_alive_floods_never_hold_the_slots_a_ready_answer_needs(root, tmp_path, upstream):
    """Regression: 20 unauthenticated keep-alive connections asking /healthz or a 401 /v1/status
    every few seconds held 16 connection slots forever: ready answers on new connections never
    came (they timed out after 12 s). An answer to a request that did not show a valid token now
    closes its connection, so such a client holds a slot for one request only."""
    running = Serve(root, tmp_path, "--allow-local", env={"CHECKOUTCACHE_MAX_CONNECTIONS": str(SLOTS)})
    flood = None
    try:
        sha = upstream.shas[0]
        assert running.client().ensure(upstream.path, sha, wait=60).state == "ready"
        flood = Flood(running.port, FLOODERS)
        wait_until(lambda: len(flood.answers) >= 2 * FLOODERS, 120, "the flood's answers")
        # While the flood goes on: a fresh connection's ready answer (a generous bound: before the
        # fix it never came while the flood lasted).
        with socket.create_connection(("127.0.0.1", running.port), timeout=60) as sock:
            body = f'{{"repo": "{upstream.path}", "commit": "{sha}"}}'.encode()
            sock.sendall(f"POST /v1/ensure HTTP/1.1\r\nHost: 127.0.0.1:{running.port}\r\n"
                         f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            answer, closed = answer_and_close(sock)
        assert answer.startswith(b"HTTP/1.1 200") and b'"state": "ready"' in answer, answer[:300]
        assert not closed, "an authenticated connection is kept alive"
        assert not flood.stop.is_set() and all(t.is_alive() for t in flood.threads), "the flood went on meanwhile"
        with flood.lock:
            answers = list(flood.answers)
        statuses = {a[:12] for a, _ in answers}
        assert statuses == {b"HTTP/1.1 200", b"HTTP/1.1 401"}, statuses
        assert all(closed for _, closed in answers), "every unauthenticated answer closed its connection"
        assert all(b"connection: close" in a.lower() for a, _ in answers)
    finally:
        if flood is not None:
            flood.end()
        running.stop()


def test_a_health_port_flood_never_holds_its_slots(root, tmp_path):
    """The health port (no token by design, often 0.0.0.0) closes every connection after its
    answer: a keep-alive flood there cannot keep a kubelet's probe waiting either."""
    from .helpers import free_port

    health = free_port()
    running = Serve(root, tmp_path, "--health-listen", f"127.0.0.1:{health}",
                    env={"CHECKOUTCACHE_MAX_CONNECTIONS": str(SLOTS)})
    flood = None
    try:
        flood = Flood(health, FLOODERS)
        wait_until(lambda: len(flood.answers) >= 2 * FLOODERS, 120, "the flood's answers")
        with socket.create_connection(("127.0.0.1", health), timeout=60) as sock:
            sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{health}\r\n\r\n".encode())
            answer, closed = answer_and_close(sock)
        assert answer.startswith(b"HTTP/1.1 200") and closed
        with flood.lock:
            assert flood.answers and all(closed for _, closed in flood.answers)
    finally:
        if flood is not None:
            flood.end()
        running.stop()
