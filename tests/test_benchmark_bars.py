"""benchmarks/run.py --check judges the bars of benchmarks/README.md: tested
on canned reports (CI does not run the benchmarks themselves)."""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest

RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "run.py")


@pytest.fixture(scope="module")
def run():
    spec = importlib.util.spec_from_file_location("benchmarks_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GOOD = {
    "ready": {"ratio_cli_to_python": 2.1},
    "new_commit": {"ratio": 1.05, "ratio_library": 0.98},
    "first_clone": {"ratio": 1.2},
    "reviews": {"ours, grace > pause": {"errors": 0, "lost": 0},
                "ours, grace < pause, exec": {"errors": 0, "lost": 0},
                "old keep-newest-3": {"errors": 40, "lost": 12}},
}


def test_all_bars_met_exits_zero(run):
    results = run.bars(GOOD)
    assert len(results) == 8 and all(bar["met"] for bar in results)
    assert run.exit_status(results, check=True) == 0


@pytest.mark.parametrize("path,value", [
    (("ready", "ratio_cli_to_python"), 3.01),
    (("new_commit", "ratio"), 1.16),
    (("new_commit", "ratio_library"), 1.2),
    (("first_clone", "ratio"), 1.31),
    (("reviews", "ours, grace > pause", "lost"), 1),
    (("reviews", "ours, grace < pause, exec", "errors"), 2),
])
def test_any_missed_bar_exits_one_under_check(run, path, value):
    report = copy.deepcopy(GOOD)
    target = report
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    results = run.bars(report)
    assert [bar["met"] for bar in results].count(False) == 1
    assert run.exit_status(results, check=True) == 1
    assert run.exit_status(results, check=False) == 0  # without --check a run only reports


def test_a_bar_exactly_at_its_limit_is_met(run):
    report = copy.deepcopy(GOOD)
    report["new_commit"]["ratio"] = run.BAR_NEW_COMMIT
    assert run.exit_status(run.bars(report), check=True) == 0
