"""benchmarks/run.py --check judges the bars of benchmarks/README.md: tested
on canned reports (CI does not run the benchmarks themselves)."""

from __future__ import annotations

import copy

import pytest

from .helpers import daemons  # noqa: F401 - puts benchmarks/ on the path

import run  # noqa: E402  (benchmarks/run.py)


# A good report sits just under each bar, so lowering a bar in run.py keeps
# these tests about the judging, not about last year's numbers.
def shape(serve: float = run.BAR_NEW_COMMIT_SERVE - 0.05, cli: float = run.BAR_NEW_COMMIT_CLI - 0.1,
          first: float = run.BAR_FIRST_READY - 0.05) -> dict:
    return {"new_commit": {"ratio_serve": serve, "ratio_cli_to_worktree_plus_python": cli},
            "first_clone": {"ratio_to_mirror_plus_worktree": first}}


GOOD = {
    "main_shape": "large",
    "ready": {"ratio_cli_to_python": run.BAR_READY_CLI - 0.1},
    "shapes": {"small": shape(), "history": shape(), "large": shape()},
    "reviews": {"ours, grace > pause": {"errors": 0, "lost": 0, "clones": 24, "distinct_commits": 23, "evictions": 6},
                "ours, grace < pause, exec": {"errors": 0, "lost": 0, "clones": 30, "distinct_commits": 23,
                                              "evictions": 7},
                "old keep-newest-3": {"errors": 40, "lost": 12, "clones": 24}},
    "scaling": {"bar": {"gc_seconds": 0.4, "status_seconds": 0.3}},
}


def test_all_bars_met_exits_zero():
    results = run.bars(GOOD)
    # ready; 3 shapes x (serve, CLI, first ready); 2 review columns x 3; gc and status
    assert len(results) == 1 + 9 + 6 + 2 and all(bar["met"] for bar in results)
    assert run.exit_status(results, check=True) == 0


@pytest.mark.parametrize("path,value", [
    (("ready", "ratio_cli_to_python"), run.BAR_READY_CLI + 0.01),
    (("shapes", "small", "new_commit", "ratio_serve"), run.BAR_NEW_COMMIT_SERVE + 0.01),
    (("shapes", "history", "new_commit", "ratio_cli_to_worktree_plus_python"), run.BAR_NEW_COMMIT_CLI + 0.01),
    (("shapes", "large", "first_clone", "ratio_to_mirror_plus_worktree"), run.BAR_FIRST_READY + 0.01),
    (("reviews", "ours, grace > pause", "lost"), 1),
    (("reviews", "ours, grace < pause, exec", "errors"), 2),
    (("reviews", "ours, grace < pause, exec", "clones"), 31),
    (("scaling", "bar", "gc_seconds"), run.BAR_GC_SECONDS + 0.01),
    (("scaling", "bar", "status_seconds"), run.BAR_STATUS_SECONDS + 0.01),
])
def test_any_missed_bar_exits_one_under_check(path, value):
    report = copy.deepcopy(GOOD)
    target = report
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    results = run.bars(report)
    assert [bar["met"] for bar in results].count(False) == 1
    assert run.exit_status(results, check=True) == 1
    assert run.exit_status(results, check=False) == 0  # without --check a run only reports


def test_a_bar_exactly_at_its_limit_is_met():
    report = copy.deepcopy(GOOD)
    report["shapes"]["large"]["new_commit"]["ratio_serve"] = run.BAR_NEW_COMMIT_SERVE
    report["ready"]["ratio_cli_to_python"] = run.BAR_READY_CLI
    report["reviews"]["ours, grace > pause"]["clones"] = 29
    assert run.exit_status(run.bars(report), check=True) == 0


def test_bars_not_run_are_listed_never_met_and_do_not_fail_check():
    report = copy.deepcopy(GOOD)
    del report["shapes"]["history"]
    del report["scaling"]
    results = run.bars(report)
    not_run = [bar["name"] for bar in results if bar["met"] is None]
    assert len(not_run) == 4 and any("history" in name for name in not_run)
    assert run.exit_status(results, check=True) == 0
