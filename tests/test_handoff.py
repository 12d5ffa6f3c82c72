"""The CLI hands a new commit to the serve running on its root's socket
(<root>/checkoutcache.sock, or CHECKOUTCACHE_UNIX_SOCKET): serve's warm worker
server clones it. Only a ready answer for the path the CLI computed itself,
checked on disk, is taken; anything else (a refusal, a socket that lies, no
serve) and the CLI does the work itself."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from checkoutcache.handoff import HANDOFF_SLACK

from .helpers import TOKEN, Serve, assert_checkout_matches, run_cli, wait_until
from .helpers.daemons import answer_each
from .helpers.gate import GatedProxy
from .helpers.store import only_repo


def test_a_new_commit_is_handed_to_the_serve_of_the_root(root, tmp_path, served_upstream):
    repo, url = served_upstream
    os.makedirs(root, exist_ok=True)
    running = Serve(root, tmp_path, "--log-format", "json", "--gc-interval", "0",
                    unix=os.path.join(root, "checkoutcache.sock"))
    try:
        code, answer, out = run_cli("ensure", url, repo.shas[1], "--wait", "60", root=root,
                                    env={"CHECKOUTCACHE_API_TOKEN": TOKEN})
        assert code == 0, out
        assert answer["path"] == only_repo(root).checkout(repo.shas[1])
        assert_checkout_matches(answer["path"], repo.path, repo.shas[1])
        # serve answered it on its socket, and its own worker made the clone (its log is written in batches).
        wait_until(lambda: any(e.get("endpoint") == "/v1/ensure" and e.get("listener") == "unix"
                               and e.get("status") == 200 for e in running.json_lines()), 10, "serve's answer")
        wait_until(lambda: any(e.get("event") == "clone_published" and e.get("commit") == repo.shas[1]
                               for e in running.json_lines()), 10, "serve's clone")
    finally:
        running.stop()


def test_a_serve_that_refuses_leaves_the_cli_to_do_it(root, tmp_path, served_upstream):
    repo, url = served_upstream
    os.makedirs(root, exist_ok=True)
    running = Serve(root, tmp_path, "--log-format", "json", "--gc-interval", "0", "--allow-repo", "https://nowhere/*",
                    unix=os.path.join(root, "checkoutcache.sock"))
    try:
        code, answer, out = run_cli("ensure", url, repo.shas[0], "--wait", "60", root=root,
                                    env={"CHECKOUTCACHE_API_TOKEN": TOKEN})
        assert code == 0 and answer["state"] == "ready", out
        assert_checkout_matches(answer["path"], repo.path, repo.shas[0])
        wait_until(lambda: any(e.get("endpoint") == "/v1/ensure" and e.get("status") == 403
                               for e in running.json_lines()), 10, "serve's refusal")
        # The CLI's own worker cloned it: serve heard of no clone (its workers report to it).
        assert not any(e.get("event") == "clone_started" for e in running.json_lines())
    finally:
        running.stop()


def test_a_socket_that_lies_is_never_believed(root, served_upstream):
    """Any group member could put a socket in the root: one answering "ready" with a path
    of its choosing (outside the root) changes nothing; the CLI makes the checkout itself."""
    repo, url = served_upstream
    os.makedirs(root, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(root, "checkoutcache.sock"))
    listener.listen(8)
    asked = []

    def lie(conn: socket.socket) -> None:
        asked.append(conn.recv(65536))
        body = json.dumps({"state": "ready", "commit": repo.shas[2], "repo": url, "path": "/etc"}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)

    answer_each(listener, lie)
    try:
        code, answer, out = run_cli("ensure", url, repo.shas[2], "--wait", "60", root=root)
        assert asked, "the CLI never asked the socket"
        assert code == 0 and answer["path"] == only_repo(root).checkout(repo.shas[2]), answer
        assert_checkout_matches(answer["path"], repo.path, repo.shas[2])
    finally:
        listener.close()


FAKE_SERVE = r"""
import os, socket, sys, time
where, record, mode = sys.argv[1:4]
listener = socket.socket(socket.AF_UNIX)
listener.bind(where)
os.chmod(where, 0o777)
listener.listen(8)
open(record + ".listening", "w").close()
while True:
    conn, _ = listener.accept()
    conn.settimeout(2)
    try:
        data = conn.recv(65536)
    except OSError:
        data = b""
    with open(record, "ab") as handle:
        handle.write(data)
    if mode == "trickle":  # a status line, then a byte now and then, never the end
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        while True:
            time.sleep(0.5)
            try:
                conn.sendall(b"X")
            except OSError:
                break
    conn.close()
"""


@contextlib.contextmanager
def fake_serve(mode: str, uid: int | None = None):
    """A stranger's server on a socket the CLI is pointed at, as another uid or as ours;
    yields (socket path, file of what it received). Its folder is one any uid can reach."""
    # /tmp: a socket path is at most 107 bytes. Not named checkoutcache-*: the session-end check
    # for product writes in /tmp would see it while another worker runs this test.
    folder = tempfile.mkdtemp(prefix="test-sock-", dir="/tmp")
    os.chmod(folder, 0o777)
    where, record = os.path.join(folder, "serve.sock"), os.path.join(folder, "received")
    command = [sys.executable, "-c", FAKE_SERVE, where, record, mode]
    if uid is not None:
        command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *command]
    proc = subprocess.Popen(command)
    try:
        wait_until(lambda: proc.poll() is None and os.path.exists(record + ".listening"), 20,
                   "the fake serve to listen")
        yield where, record
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a server as another uid")
def test_a_socket_of_another_uid_is_sent_nothing(root, tmp_path, served_upstream):
    """Regression (review): a group member moved the root's socket away and listened there
    itself; the CLI sent it the API token (and believed its "cloning")."""
    repo, url = served_upstream
    os.makedirs(root, exist_ok=True)
    with fake_serve("record", uid=54321) as (where, record):
        code, answer, out = run_cli("ensure", url, repo.shas[0], "--wait", "60", root=root,
                                    env={"CHECKOUTCACHE_API_TOKEN": TOKEN, "CHECKOUTCACHE_UNIX_SOCKET": where})
        assert code == 0 and answer["state"] == "ready", out  # the CLI made it itself
        assert_checkout_matches(answer["path"], repo.path, repo.shas[0])
        received = open(record, "rb").read() if os.path.exists(record) else b""
        assert received == b"", received  # not a byte: neither the request nor the token


@pytest.mark.slow
def test_a_socket_that_trickles_its_answer_never_holds_the_cli_past_its_bound(root, tmp_path, served_upstream):
    """Regression (review): the time limit applied to each read, not to the answer: a peer
    sending a byte now and then held `ensure --wait 1s` for as long as it liked."""
    repo, url = served_upstream
    os.makedirs(root, exist_ok=True)
    with fake_serve("trickle") as (where, record):
        started = time.monotonic()
        code, answer, out = run_cli("ensure", url, repo.shas[0], "--wait", "1", root=root, timeout=60,
                                    env={"CHECKOUTCACHE_UNIX_SOCKET": where})
        took = time.monotonic() - started
        assert os.path.getsize(record) > 0, "the CLI never asked the socket"
        assert answer["state"] in ("ready", "cloning"), out
        assert took < 1 + HANDOFF_SLACK + 10, took


@pytest.mark.slow
def test_serves_cap_on_waiting_does_not_cut_the_clis_wait_short(root, tmp_path, daemon, served_upstream):
    """Regression (review): serve waits at most CHECKOUTCACHE_MAX_WAIT and then answers
    `cloning`; the CLI printed that, though its own --wait had most of its time left."""
    repo, url = served_upstream
    proxy = GatedProxy(daemon.port)
    url = proxy.url(url.rsplit("/", 1)[1])
    os.makedirs(root, exist_ok=True)
    running = Serve(root, tmp_path, "--log-format", "json", "--gc-interval", "0",
                    env={"CHECKOUTCACHE_MAX_WAIT": "1s"}, unix=os.path.join(root, "checkoutcache.sock"))
    try:
        # A warm mirror (no first contact), then a new commit whose fetch is held at the gate.
        code, _, out = run_cli("ensure", url, repo.shas[0], "--wait", "120", root=root,
                               env={"CHECKOUTCACHE_UNIX_SOCKET": str(tmp_path / "none.sock")})
        assert code == 0, out
        new = repo.commit({"NEW.txt": "new\n"}, message="new")
        proxy.shut()
        result = {}
        asking = threading.Thread(target=lambda: result.update(answer=run_cli(
            "ensure", url, new, "--wait", "120", root=root, env={"CHECKOUTCACHE_API_TOKEN": TOKEN})))
        asking.start()
        # serve answered (cloning, at its cap) while the clone is held at the gate; then it goes on.
        wait_until(lambda: any(e.get("endpoint") == "/v1/ensure" for e in running.json_lines()), 30,
                   "serve's capped answer")
        time.sleep(1)  # had the CLI taken that answer, it would have printed it by now
        assert asking.is_alive(), result
        proxy.open()
        asking.join(120)
        code, answer, out = result["answer"]
        assert code == 0 and answer["state"] == "ready", out
        assert_checkout_matches(answer["path"], repo.path, new)
    finally:
        proxy.open()
        running.stop()


def test_a_bad_wait_is_bad_argument_not_a_traceback(root, served_upstream):
    """Regression (review): the hand-off's time left was computed from --wait outside any
    error handling: `--wait abc` ended in a traceback and no answer."""
    repo, url = served_upstream
    os.makedirs(root, exist_ok=True)
    code, answer, out = run_cli("ensure", url, repo.shas[0], "--wait", "abc", root=root)
    assert code == 2 and answer["error"] == "BAD_ARGUMENT" and "--wait" in answer["message"], out
    assert "Traceback" not in out
    assert os.listdir(root) == []
