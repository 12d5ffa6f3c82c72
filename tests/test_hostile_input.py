"""Hostile input across every command: each gets its documented code and exit
status and writes nothing, checked against a snapshot of a store that already
holds a checkout (so "nothing written" covers existing stores, not only new
roots)."""

from __future__ import annotations

import os

import pytest

from .helpers import Upstream, run_cli, settled, store_snapshot, wait_ready

pytestmark = pytest.mark.faults

SHA = "0123456789abcdef0123456789abcdef01234567"
LONG = "a" * 5000
NASTY_REPOS = ["ext::sh -c touch% /tmp/cc-pwned", "fd::7", "transport::x", "http://example.com/r.git",
               "ftp://example.com/r.git", "https://example.com/a/../b.git", "https:///nohost.git",
               "https://example.com/r.git?q=1", "https://example.com/r.git#frag", "ssh://host/../etc",
               "git@host:../../etc/passwd", "file:///tmp/../etc", "file://remote-host/repo", "/tmp/x\nrm -rf /",
               "/tmp/$(touch /tmp/cc-pwned)", "https://example.com/" + LONG, "/tmp/x\x7f"]


def cases():
    table = []
    for repo in NASTY_REPOS:  # 17 repository forms, on ensure
        code = "UNSAFE_TRANSPORT" if "::" in repo or repo.startswith(("http:", "ftp:")) else "BAD_REPO"
        if repo.startswith("/tmp/$("):
            code = "NOT_A_REPOSITORY"  # a plain (odd) path: never given to a shell
        table.append((["ensure", "--", repo, SHA], code, 2))
    for commit in ["HEAD", "main", "abc123", "g" * 40, "A" * 41, LONG, "$(id)", "-", "' OR 1=1"]:
        table.append((["ensure", "{repo}", commit], "BAD_COMMIT", 2))
    table += [
        (["ensure", "{repo}", SHA, "--scope", "../../etc"], "BAD_SCOPE", 2),
        (["ensure", "{repo}", SHA, "--scope", "a b"], "BAD_SCOPE", 2),
        (["ensure", "{repo}", SHA, "--scope", LONG], "BAD_SCOPE", 2),
        (["ensure", "{repo}", SHA, "--wait", "forever"], "BAD_ARGUMENT", 2),
        (["ensure", "{repo}", SHA, "--wait", "100d"], "BAD_ARGUMENT", 2),
        (["ensure", "--upload-pack=touch /tmp/cc-pwned", SHA], "BAD_ARGUMENT", 2),
        (["exec", "{repo}", "nothex", "--", "true"], "BAD_COMMIT", 125),
        (["exec", "ext::sh", SHA, "--", "true"], "UNSAFE_TRANSPORT", 125),
        (["exec", "{repo}", SHA, "--wait", "-1", "--", "true"], "BAD_ARGUMENT", 125),
        (["exec", "{repo}", SHA], "BAD_ARGUMENT", 2),
        (["gc", "--max-checkouts", "-3"], "BAD_ARGUMENT", 2),
        (["gc", "--max-checkouts", "many"], "BAD_ARGUMENT", 2),
        (["gc", "--max-bytes", "20X"], "BAD_ARGUMENT", 2),
        (["gc", "--max-bytes", LONG], "BAD_ARGUMENT", 2),
        (["gc", "--min-free", "101%"], "BAD_ARGUMENT", 2),
        (["gc", "--min-free", "-5%"], "BAD_ARGUMENT", 2),
        (["gc", "--grace", "15 minutes"], "BAD_ARGUMENT", 2),
        (["gc", "--max-age", "1y"], "BAD_ARGUMENT", 2),
        (["gc", "--free-headroom", "lots"], "BAD_ARGUMENT", 2),
        (["status", "ext::sh"], "UNSAFE_TRANSPORT", 2),
        (["status", "{repo}", "--scope", ".hidden"], "BAD_SCOPE", 2),
        (["verify", "{repo}", "HEAD"], "BAD_COMMIT", 2),
        (["verify", "--", "-x"], "BAD_REPO", 2),
        (["no-such-command"], "BAD_ARGUMENT", 2),
    ]
    return table


CASES = cases()


@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    upstream = Upstream(str(base / "upstream"))
    upstream.standard_history(1)
    root = str(base / "cache")
    wait_ready(root, upstream.path, upstream.shas[0])
    settled(root)  # the store the cases snapshot is the one the clone finished with
    return root, upstream


def test_the_table_has_at_least_forty_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("index", range(len(CASES)))
def test_hostile_input(populated, index):
    root, upstream = populated
    args, code, exit_status = CASES[index]
    args = [a.replace("{repo}", upstream.path) for a in args]
    before = store_snapshot(root)
    assert before, "the store holds a checkout, so a write would show"
    status, answer, out = run_cli(*args, root=root)
    if status == 125:  # exec: the answer goes to stderr, its command did not run
        import json

        answer = json.loads(out.strip().splitlines()[0])
    assert (status, answer["error"]) == (exit_status, code), (args, out)
    assert answer["message"] and answer["next"]
    assert store_snapshot(root) == before
    assert not os.path.exists("/tmp/cc-pwned")
