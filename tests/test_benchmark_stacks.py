"""benchmarks/serve_stacks.py: its response parser, the minimal app's answers and
the reaper, without the servers (CI does not run the benchmark itself)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time

import pytest

from .helpers import daemons  # noqa: F401 - puts benchmarks/ on the path

import serve_stacks as ss  # noqa: E402  (benchmarks/serve_stacks.py)


def test_parse_responses_frames_length_chunked_and_unframed():
    data = (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
            b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\nInvalid HTTP request received.")
    got = ss.parse_responses(data)
    assert [r["status"] for r in got] == [200, 404, 400]
    assert got[0]["content_type"] == "application/json" and got[1]["body"] == "abc"
    assert got[2]["body"] == "Invalid HTTP request received."


@pytest.fixture
def app_state(tmp_path, monkeypatch):
    info = ss.setup(str(tmp_path))
    monkeypatch.setenv("SERVE_STACKS_ROOT", info["root"])
    monkeypatch.setenv("SERVE_STACKS_TOKEN", "secret")
    monkeypatch.setattr(ss, "_STATE", None)
    yield ss.state(), info
    ss._STATE = None


def asgi(method: str, path: str, body: bytes = b"", headers: list | None = None, query: bytes = b"") -> tuple:
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "query_string": query,
             "headers": headers or []}
    asyncio.run(ss.asgi_app(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"]) if sent[1]["body"].startswith(b"{") else sent[1]["body"]


def test_minimal_app_ready_answer_token_and_hostile_bodies(app_state):
    st, info = app_state
    auth = [(b"authorization", b"Bearer secret")]
    status, body = asgi("POST", "/v1/ensure", b"{}", auth + [(b"content-length", b"2")])
    assert status == 200 and body["commit"] == info["commit"]
    assert asgi("POST", "/v1/ensure", b"{}", [(b"authorization", b"Bearer nope")])[0] == 401
    deep = b"[" * 60000
    assert asgi("POST", "/v1/ensure", deep, auth + [(b"content-length", str(len(deep)).encode())])[0] == 400
    assert asgi("POST", "/v1/ensure", b"", auth + [(b"content-length", "²".encode())])[0] == 413
    assert asgi("GET", "/healthz")[0] == 200 and asgi("GET", "/elsewhere")[1]["path"] == "/elsewhere"


def test_long_poll_answers_503_with_retry_after_on_shutdown(app_state):
    st, _ = app_state
    lock = ss.CloneLock(st.root)
    lock.hold()
    try:
        st.shutdown.set()
        status, data, extra = ss.longpoll_wait(st, 30)
    finally:
        lock.release()
    assert status == 503 and (b"retry-after", b"5") in extra
    st.shutdown.clear()
    assert ss.longpoll_wait(st, 30)[0] == 200  # the lock is free: a ready answer


def test_reaper_reaps_orphans_not_our_children():
    reaper = ss.Reaper(grace=0.0)
    own = subprocess.Popen(["sh", "-c", "exit 3"])
    reaper.own.add(own.pid)
    time.sleep(0.2)
    reaper.sweep()  # a zombie of ours: left for Popen.wait
    assert own.wait() == 3
    child = subprocess.Popen(["sh", "-c", "exit 0"])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{child.pid}") and reaper.reaped == 0:
        reaper.sweep()
        time.sleep(0.05)
    assert reaper.reaped == 1  # not registered as ours: reaped
