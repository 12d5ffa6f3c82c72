"""Every failure of contact is a recorded failure (a code from the table, a
message, the next step and a retry_after), never INTERNAL_ERROR: a TLS
certificate git does not trust, a server that closes every connection at once,
and one that cuts the fetch after the first contact succeeded. A first contact
that fails is recorded in unreachable/<key>.failed.json and every ask within
its back-off is answered from there, without contacting the server again."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from .helpers import (
    Upstream,
    assert_checkout_matches,
    only_repo,
    run_cli,
    wait_ready,
    wait_until,
)
from .helpers.daemons import answer_each
from .https_git import GitHttpsServer

pytestmark = pytest.mark.faults

TRANSPORTS = ["cli", "pygit2"]
FAILURE_CODES = {"UNREACHABLE", "CLONE_FAILED"}


def assert_recorded_unreachable(root: str, url: str, answer: dict) -> None:
    assert answer["state"] == "failed" and answer["error"] == "UNREACHABLE", answer
    assert answer["message"] and answer["next"] and answer["retry_after"] >= 50, answer
    # The record is the only thing written for a repository never reached.
    assert sorted(os.listdir(root)) == ["unreachable"]
    (name,) = os.listdir(os.path.join(root, "unreachable"))
    with open(os.path.join(root, "unreachable", name)) as handle:
        record = json.load(handle)
    assert record["code"] == "UNREACHABLE" and record["repo"] == url and record["retry_at"] > time.time() + 50, record
    code, status, _ = run_cli("status", root=root)
    assert code == 0 and [(u["repo"], u["error"]) for u in status["unreachable"]] == [(url, "UNREACHABLE")]


# ------------------------------------------------------------------ TLS


HANDSHAKE_DELAY = 2.0


@pytest.fixture
def untrusted_https(tmp_path):
    """A real git server over HTTPS whose certificate comes from a CA git is never given.
    Each connection waits HANDSHAKE_DELAY before the handshake (so the probe takes a
    measurable time) and is counted."""
    served = tmp_path / "https-served"
    served.mkdir()
    Upstream(str(served / "x")).standard_history(1)
    server = GitHttpsServer(str(served), str(tmp_path), accept=lambda user, password: True)
    connections: list[float] = []
    accept = server.httpd.get_request

    def slow_accept():
        connections.append(time.monotonic())
        time.sleep(HANDSHAKE_DELAY)
        return accept()

    server.httpd.get_request = slow_accept
    yield server, connections
    server.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.slow
def test_a_certificate_git_does_not_trust_is_a_recorded_unreachable(root, untrusted_https, transport):
    server, connections = untrusted_https
    url = server.url("127.0.0.1", "x")
    env = {"CHECKOUTCACHE_TRANSPORT": transport, "CHECKOUTCACHE_PROBE_TIMEOUT": "20s",
           "CHECKOUTCACHE_BACKOFF": "60"}
    sha = "a" * 40
    started = time.monotonic()
    code, answer, out = run_cli("ensure", url, sha, "--wait", "30", root=root, env=env)
    probe_time = time.monotonic() - started
    assert code == 1, out
    print("ANS", answer); assert_recorded_unreachable(root, url, answer)
    assert answer["error"] != "INTERNAL_ERROR"
    assert len(connections) >= 1 and probe_time >= HANDSHAKE_DELAY
    assert server.requests == [], "no HTTP request got past the handshake"
    if transport == "cli":
        assert "certificate" in answer["message"].lower(), answer

    # Within the back-off: answered at once from the record, without a new connection.
    seen = len(connections)
    started = time.monotonic()
    code, again, out = run_cli("ensure", url, "b" * 40, "--wait", "30", root=root, env=env)
    took = time.monotonic() - started
    assert code == 1 and again["error"] == "UNREACHABLE", out
    assert again["message"] == answer["message"] and 0 < again["retry_after"] <= answer["retry_after"]
    assert took < HANDSHAKE_DELAY * 0.75 and took < probe_time / 2, (took, probe_time)
    assert len(connections) == seen


# ------------------------------------------------------------------ accept and close


@pytest.fixture
def slammer():
    """A server on 127.0.0.1 that accepts every connection and closes it at once."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted: list[float] = []

    answer_each(server, lambda conn: accepted.append(time.monotonic()))
    yield f"git://127.0.0.1:{server.getsockname()[1]}/x", accepted
    server.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_server_that_closes_every_connection_is_a_recorded_unreachable(root, slammer, transport):
    url, accepted = slammer
    env = {"CHECKOUTCACHE_TRANSPORT": transport, "CHECKOUTCACHE_PROBE_TIMEOUT": "20s",
           "CHECKOUTCACHE_BACKOFF": "60"}
    code, answer, out = run_cli("ensure", url, "a" * 40, "--wait", "30", root=root, env=env)
    assert code == 1, out
    print("ANS", answer); assert_recorded_unreachable(root, url, answer)
    seen = len(accepted)
    assert seen >= 1, "the server was contacted"
    code, again, out = run_cli("ensure", url, "b" * 40, "--wait", "30", root=root, env=env)
    assert code == 1 and again["error"] == "UNREACHABLE" and again["message"] == answer["message"], out
    assert 0 < again["retry_after"] <= answer["retry_after"]
    assert len(accepted) == seen, "answered from the record, without contacting the server"


# ------------------------------------------------------------------ cut in the middle of a fetch


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 in front of a server: the first `whole` connections (and
    every one once `forward_all` is set) are forwarded fully; later ones are cut (both
    sides closed) after `cut_after` bytes from the server."""

    def __init__(self, target_port: int, whole: int, cut_after: int):
        self.target_port, self.whole, self.cut_after = target_port, whole, cut_after
        self.forward_all = False
        self.connections = 0
        self.cuts = 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, name: str) -> str:
        return f"git://127.0.0.1:{self.port}/{name}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            index, self.connections = self.connections, self.connections + 1
            limit = None if index < self.whole or self.forward_all else self.cut_after
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, limit), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                if limit is not None and sent + len(data) >= limit:
                    sink.sendall(data[:limit - sent])
                    self.cuts += 1
                    for end in (source, sink):
                        try:
                            end.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                        end.close()
                    return
                sink.sendall(data)
                sent += len(data)
        except OSError:
            for end in (source, sink):
                try:
                    end.close()
                except OSError:
                    pass

    def stop(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            try:
                sock.close()
            except OSError:
                pass


def failure_record(store, sha: str) -> dict:
    with open(store.failure_record(sha)) as handle:
        return json.load(handle)


@pytest.fixture
def big_served(daemon, request):
    """A repository on the tests' git daemon whose pack is far larger than the cut (2 MiB of noise)."""
    name = f"big-{request.node.name}".replace("[", "-").replace("]", "")
    repo = Upstream(os.path.join(daemon.base, name))
    repo.standard_history(1)
    sha = repo.commit({"noise.bin": os.urandom(2 << 20)}, message="noise")
    return repo, name, sha


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.slow
def test_a_fetch_cut_after_the_first_contact_is_a_recorded_failure(root, daemon, big_served, transport):
    upstream, name, sha = big_served
    proxy = CuttingProxy(daemon.port, whole=1, cut_after=8192)
    try:
        url = proxy.url(name)
        env = {"CHECKOUTCACHE_TRANSPORT": transport, "CHECKOUTCACHE_BACKOFF": "1",
               "CHECKOUTCACHE_BACKOFF_MAX": "2", "CHECKOUTCACHE_PROBE_TIMEOUT": "20s"}
        code, answer, out = run_cli("ensure", url, sha, "--wait", "60", root=root, env=env)
        assert code == 1 and answer["state"] == "failed", out
        print("CUT", transport, answer, proxy.connections, proxy.cuts); assert answer["error"] in FAILURE_CODES, answer
        assert answer["message"] and answer["next"] and answer["retry_after"] >= 1, answer
        assert proxy.connections >= 2 and proxy.cuts >= 1, "the probe went through and a fetch was cut"
        store = only_repo(root)
        assert failure_record(store, sha)["code"] == answer["error"]
        assert not os.path.lexists(store.checkout(sha))
        assert os.listdir(store.scratch_dir) == []

        proxy.forward_all = True
        wait_until(lambda: failure_record(store, sha)["retry_at"] < time.time(), 10,
                   "the back-off to pass")
        ready = wait_ready(root, url, sha, env=env)
        assert_checkout_matches(ready["path"], upstream.path, sha)
        assert run_cli("verify", root=root)[0] == 0
    finally:
        proxy.stop()
