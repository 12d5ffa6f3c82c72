"""A store written by a newer version (issue 27): refused with both versions named,
and nothing written in it, through the CLI and through serve, so that a rollback
of the sidecar cannot corrupt what the newer version made."""

from __future__ import annotations

import json
import os

import pytest

from checkoutcache.client import HoldFailed

from checkoutcache.store.layout import LAYOUT_VERSION, RootPaths

from .helpers import Serve, run_cli
from .helpers.cli import wait_ready
from .helpers.store import settled

NEWER = LAYOUT_VERSION + 6


def snapshot(directory: str) -> dict[str, tuple[int, int, int]]:
    """Every entry under directory: (mode, size, mtime in ns). A ready answer's recorded use
    (the marker's mtime) counts as a write."""
    found = {}
    for parent, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(parent, name)
            info = os.lstat(path)
            found[path] = (info.st_mode, info.st_size if not os.path.isdir(path) else 0, info.st_mtime_ns)
    return found


def written_by_a_newer_version(root: str) -> str:
    """The one repository's store, its repo.json now saying a newer layout; its directory
    (once this version's clone and the mirror's history are done with it)."""
    settled(root)
    [key] = RootPaths(root).repo_keys()
    paths = RootPaths(root).repo(key)
    with open(paths.repo_json) as handle:
        record = json.load(handle)
    record["layout_version"] = NEWER
    with open(paths.repo_json, "w") as handle:
        json.dump(record, handle)
    return paths.base


def assert_refused(answer: dict | None, output: str) -> None:
    assert answer is not None and answer["state"] == "failed" and answer["error"] == "NEWER_LAYOUT", output
    assert f"layout version {NEWER}" in answer["message"] and f"up to {LAYOUT_VERSION}" in answer["message"]


@pytest.mark.slow
def test_a_store_of_a_newer_layout_is_refused_by_the_cli_and_left_as_it_is(root, upstream):
    """Regression: `"layout_version": 7` in repo.json was served silently (a ready answer,
    its use recorded) and a new commit was cloned into it."""
    wait_ready(root, upstream.path, upstream.shas[0])
    store = written_by_a_newer_version(root)
    before = snapshot(store)
    for sha in (upstream.shas[0], upstream.shas[1]):  # ready there, and a new commit
        code, answer, output = run_cli("ensure", upstream.path, sha, "--wait", "30", root=root)
        assert code == 1, output
        assert_refused(answer, output)
    code, answer, output = run_cli("exec", upstream.path, upstream.shas[0], "--", "true", root=root)
    assert code != 0 and "NEWER_LAYOUT" in output, output
    assert snapshot(store) == before


def test_a_store_of_a_newer_layout_is_refused_by_serve_and_left_as_it_is(root, tmp_path, upstream):
    wait_ready(root, upstream.path, upstream.shas[0])
    store = written_by_a_newer_version(root)
    before = snapshot(store)
    running = Serve(root, tmp_path, "--allow-local")
    try:
        client = running.client()
        for sha in (upstream.shas[0], upstream.shas[1]):
            answer = client.ensure(upstream.path, sha, wait=30)
            assert answer.state == "failed" and answer.error == "NEWER_LAYOUT", answer
            assert f"layout version {NEWER}" in answer.message and f"up to {LAYOUT_VERSION}" in answer.message
        with pytest.raises(HoldFailed) as refused:
            client.hold(upstream.path, upstream.shas[0])
        assert refused.value.answer.error == "NEWER_LAYOUT"
    finally:
        assert running.stop() == 0
    assert snapshot(store) == before


def test_gc_leaves_a_store_of_a_newer_layout_as_it_is_and_says_so(root, upstream):
    """A rollback's cron gc, even at a limit of no checkouts, evicts, repacks and tidies
    nothing in a newer version's store."""
    wait_ready(root, upstream.path, upstream.shas[0])
    store = written_by_a_newer_version(root)
    before = snapshot(store)
    code, report, output = run_cli("gc", "--max-checkouts", "0", "--grace", "0s", root=root)
    assert code == 0, output
    assert report["removed"] == [], report
    assert [p["error"] for p in report["problems"]] == ["NEWER_LAYOUT"], report
    assert f"layout version {NEWER}" in report["problems"][0]["why"]
    assert snapshot(store) == before
