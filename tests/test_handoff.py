"""The CLI hands a new commit to the serve running on its root's socket
(<root>/checkoutcache.sock, or CHECKOUTCACHE_UNIX_SOCKET): serve's warm worker
server clones it. Only a ready answer for the path the CLI computed itself,
checked on disk, is taken; anything else (a refusal, a socket that lies, no
serve) and the CLI does the work itself."""

from __future__ import annotations

import json
import os
import socket
import threading

from .helpers import TOKEN, Serve, assert_checkout_matches, run_cli, wait_until
from .helpers.store import only_repo


def journal_events(running: Serve) -> list[dict]:
    found = []
    for line in running.log().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            pass
    return found


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
                               and e.get("status") == 200 for e in journal_events(running)), 10, "serve's answer")
        wait_until(lambda: any(e.get("event") == "clone_published" and e.get("commit") == repo.shas[1]
                               for e in journal_events(running)), 10, "serve's clone")
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
                               for e in journal_events(running)), 10, "serve's refusal")
        # The CLI's own worker cloned it: serve heard of no clone (its workers report to it).
        assert not any(e.get("event") == "clone_started" for e in journal_events(running))
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

    def liar() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                asked.append(conn.recv(65536))
                body = json.dumps({"state": "ready", "commit": repo.shas[2], "repo": url, "path": "/etc"}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)

    threading.Thread(target=liar, daemon=True).start()
    try:
        code, answer, out = run_cli("ensure", url, repo.shas[2], "--wait", "60", root=root)
        assert asked, "the CLI never asked the socket"
        assert code == 0 and answer["path"] == only_repo(root).checkout(repo.shas[2]), answer
        assert_checkout_matches(answer["path"], repo.path, repo.shas[2])
    finally:
        listener.close()
