"""The README states the same contract as the code: settings, error codes,
layout, exit statuses."""

from __future__ import annotations

import os

from checkoutcache.config import options_table
from checkoutcache.errors import CODES
from checkoutcache.store import layout

README = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()


def test_readme_starts_with_the_two_commands():
    commands = [line for line in README.splitlines()[:6] if line.startswith("pip install")]
    assert len(commands) == 2 and "checkoutcache demo" in commands[0] and "pytest" in commands[1]
    ci = open(os.path.join(os.path.dirname(__file__), "..", ".ci", "run")).read()
    assert "python -m pytest" in ci and ".[test]" in ci


def test_readme_has_the_settings_table():
    # Refresh with: python scripts/render_readme.py
    assert options_table() in README


def test_readme_lists_every_error_code_and_exit_status():
    for code in CODES:
        assert f"`{code}`" in README
    for status in ("| 0 |", "| 75 |", "| 1 |", "| 2 |"):
        assert status in README


def test_readme_draws_the_layout_and_locks_from_layout_py():
    tree, *rest = layout.__doc__.split("\n\n")[2:]
    assert tree in README
    assert any("Locks (flock" in part for part in rest) and all(part.strip() in README for part in rest)
