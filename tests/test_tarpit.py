"""A server that accepts and never answers (a TCP tarpit): the first contact
gives up after the probe timeout with a recorded UNREACHABLE failure, and
every ask within its back-off answers at once from that record."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from checkoutcache import Cache

from .helpers import run_cli
from .helpers.daemons import answer_each


@pytest.fixture
def tarpit():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    answer_each(server, held.append, close=False)  # accepted, never answered, never closed
    yield f"git://127.0.0.1:{server.getsockname()[1]}/x", held
    server.close()
    for conn in held:
        conn.close()


@pytest.mark.parametrize("transport", ["cli", "pygit2"])
@pytest.mark.slow
def test_a_server_that_never_answers_is_a_recorded_unreachable(root, tarpit, transport):
    url, held = tarpit
    env = {"CHECKOUTCACHE_PROBE_TIMEOUT": "2s", "CHECKOUTCACHE_BACKOFF": "60", "CHECKOUTCACHE_TRANSPORT": transport}
    started = time.monotonic()
    code, answer, err = run_cli("ensure", url, "a" * 40, "--wait", "30", root=root, env=env)
    took = time.monotonic() - started
    assert code == 1, (answer, err)
    assert answer["state"] == "failed" and answer["error"] == "UNREACHABLE", answer
    assert answer["message"] and answer["next"] and answer["retry_after"] >= 50, answer
    assert 2 <= took < 15
    connections = len(held)
    assert connections >= 1

    # Within the back-off: answered at once from the record, any commit, no new contact.
    # (never timed: the same record and message, and no new connection, say it was not asked)
    code, again, _ = run_cli("ensure", url, "b" * 40, "--wait", "30", root=root, env=env)
    assert code == 1 and again["error"] == "UNREACHABLE" and 0 < again["retry_after"] <= answer["retry_after"]
    assert again["message"] == answer["message"]
    assert len(held) == connections
    # Nothing but the record was written for the repository: no store, no mirror.
    assert os.listdir(root) == ["unreachable"]
    assert len(os.listdir(os.path.join(root, "unreachable"))) == 1
    code, status, _ = run_cli("status", root=root)
    assert code == 0 and [(u["repo"], u["error"]) for u in status["unreachable"]] == [(url, "UNREACHABLE")]


def test_gc_forgets_an_unreachable_record_long_past_its_retry(root):
    answer = Cache(root).ensure("git://127.0.0.1:1/nothing-here", "a" * 40)
    assert answer.error == "UNREACHABLE"
    (name,) = os.listdir(os.path.join(root, "unreachable"))
    assert run_cli("gc", root=root)[0] == 0
    assert os.listdir(os.path.join(root, "unreachable")) == [name]  # still within its back-off
    record = os.path.join(root, "unreachable", name)
    with open(record) as handle:
        old = json.load(handle)
    old["retry_at"] = time.time() - 2 * 86400
    with open(record, "w") as handle:
        json.dump(old, handle)
    assert run_cli("gc", root=root)[0] == 0
    assert os.listdir(os.path.join(root, "unreachable")) == []
