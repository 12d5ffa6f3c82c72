"""Sizes are recorded at publish and measured again only after a use, so gc
and status cost grows with the number of checkouts, not of their files."""

from __future__ import annotations

import json
import os

import pytest

from .helpers import make_idle, only_repo, run_cli, wait_ready


def checkout_sizes(report: dict) -> dict[str, int]:
    return {c["commit"]: c["size"] for r in report["repos"] for c in r["checkouts"]}


@pytest.mark.slow
def test_a_size_is_recorded_at_publish_and_measured_again_only_after_a_use(root, upstream):
    sha = upstream.shas[0]
    path = wait_ready(root, upstream.path, sha)["path"]
    store = only_repo(root)
    record = json.load(open(store.size_record(sha)))
    assert record["bytes"] > 0 and record["use_at_measure"] is not None
    make_idle(path, 3600)  # last used an hour ago
    # Files added without a use (no ready answer since): gc and status trust the record.
    with open(os.path.join(path, "build-output.bin"), "wb") as handle:
        handle.write(os.urandom(4 << 20))
    code, report, _ = run_cli("gc", root=root)
    assert code == 0 and report["totals_after"]["bytes"] == record["bytes"]
    assert checkout_sizes(run_cli("status", root=root)[1])[sha] == record["bytes"]
    # A use (the review that wrote them asks again): the next gc measures it anew.
    wait_ready(root, upstream.path, sha)
    code, report, _ = run_cli("gc", root=root)
    assert code == 0 and report["totals_after"]["bytes"] >= record["bytes"] + (4 << 20)
    assert checkout_sizes(run_cli("status", root=root)[1])[sha] == report["totals_after"]["bytes"]


@pytest.mark.slow
def test_a_missing_or_damaged_size_record_is_measured_again(root, upstream):
    sha = upstream.shas[1]
    wait_ready(root, upstream.path, sha)
    store = only_repo(root)
    expected = json.load(open(store.size_record(sha)))["bytes"]
    with open(store.size_record(sha), "w") as handle:
        handle.write("{half a rec")
    assert checkout_sizes(run_cli("status", root=root)[1])[sha] == expected
    os.unlink(store.size_record(sha))
    code, report, _ = run_cli("gc", root=root)
    assert code == 0 and report["totals_after"]["bytes"] == expected
    assert json.load(open(store.size_record(sha)))["bytes"] == expected
    # An evicted checkout's record goes with it.
    code, report, _ = run_cli("gc", "--max-checkouts", "0", "--grace", "0", root=root)
    assert code == 0 and not os.path.exists(store.size_record(sha))


def hard_linked(directory: str, links: int = 300, size: int = 1 << 20) -> None:
    """One file of `size` bytes and `links` more names for it (a build's hard-linked outputs)."""
    os.makedirs(directory, exist_ok=True)
    first = os.path.join(directory, "blob.0")
    with open(first, "wb") as handle:
        handle.write(os.urandom(size))
    for number in range(1, links + 1):
        os.link(first, os.path.join(directory, f"blob.{number}"))


def test_a_file_hard_linked_300_times_is_measured_once(tmp_path):
    """Regression (issue 33): disk_usage counted a file once per link: 1 MiB with 300 links
    was 315 MB. A directory met again through a bind mount is the same inode too."""
    from checkoutcache.store.sizes import disk_usage

    hard_linked(str(tmp_path / "tree" / "out"))
    measured = disk_usage(str(tmp_path / "tree"))
    assert (1 << 20) <= measured < (1 << 20) + (64 << 10), measured
    # Two trees measured as one (a shared `seen`): the inode they share counts once.
    os.makedirs(tmp_path / "other")
    os.link(tmp_path / "tree" / "out" / "blob.0", tmp_path / "other" / "blob")
    seen: set = set()
    both = disk_usage(str(tmp_path / "tree"), seen) + disk_usage(str(tmp_path / "other"), seen)
    assert both < (1 << 20) + (64 << 10), both


@pytest.mark.slow
def test_hard_links_in_a_checkout_and_a_workspace_do_not_evict_idle_checkouts(root, upstream, monkeypatch):
    """Regression (issue 33): a workspace holding one 1 MiB file under 300 names counted
    315 MB against max-bytes, so every idle checkout was evicted, run after run. The same
    links in a checkout a review wrote into count 1 MiB too."""
    from checkoutcache.cache import Cache
    from checkoutcache.workspaces import make_workspace

    first, second = upstream.shas[0], upstream.shas[1]
    paths = {sha: wait_ready(root, upstream.path, sha)["path"] for sha in (first, second)}
    recorded = {sha: json.load(open(only_repo(root).size_record(sha)))["bytes"] for sha in (first, second)}
    # A review's build in the first checkout, then a use: gc measures it anew.
    hard_linked(os.path.join(paths[first], "build"))
    wait_ready(root, upstream.path, first)
    code, report, _ = run_cli("gc", root=root)
    assert code == 0, report
    grown = checkout_sizes(run_cli("status", root=root)[1])[first] - recorded[first]
    assert (1 << 20) <= grown < 2 << 20, grown
    monkeypatch.setenv("CHECKOUTCACHE_ROOT", root)
    with make_workspace(Cache(root), upstream.path, second) as made:
        assert made.made, made.answer
        hard_linked(os.path.join(made.path, "build"))
        for path in paths.values():
            make_idle(path, 3600)
        # Room for both checkouts and a workspace of a few MiB, far less than 300 MiB.
        limit = f"{recorded[first] + recorded[second] + (2 << 20) + (16 << 20)}B"
        code, report, _ = run_cli("gc", "--max-bytes", limit, "--grace", "0", root=root)
        assert code == 0, report
        assert report["workspaces"]["live"] == 1, report["workspaces"]
        assert (1 << 20) <= report["workspaces"]["bytes"] < 16 << 20, report["workspaces"]
        assert report["removed"] == [] and report["unmet"] == [], report
        assert all(os.path.isdir(path) for path in paths.values())
