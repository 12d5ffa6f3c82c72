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
