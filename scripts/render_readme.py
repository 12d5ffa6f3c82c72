"""Refresh the README's generated tables (settings, error codes) from the code.

    python scripts/render_readme.py          # rewrite README.md in place
    python scripts/render_readme.py --check  # exit 1 if README.md is stale

Each table sits between `<!-- NAME:start -->` and `<!-- NAME:end -->` markers.
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from checkoutcache.config import Config, PublishSettings, ServeSettings, options_table  # noqa: E402
from checkoutcache.errors import CODES  # noqa: E402
from checkoutcache.store import layout  # noqa: E402

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def errors_table() -> str:
    rows = ["| code | kind | exit | HTTP (serve) | next step |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{e.code}` | {e.kind} | {2 if e.kind == 'input' else 1} | {e.http_status} | {e.next} |"
             for e in CODES.values()]
    return "\n".join(rows)


def layout_contract() -> str:
    """The layout docstring from its tree on: the tree, what a reader may assume, the locks."""
    return "```\n" + "\n\n".join(layout.__doc__.split("\n\n")[2:]).rstrip() + "\n```"


TABLES = {"settings": lambda: options_table(Config), "serve-settings": lambda: options_table(ServeSettings),
          "publish-settings": lambda: options_table(PublishSettings), "errors": errors_table,
          "layout": layout_contract}


def render(text: str) -> str:
    for name, make in TABLES.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(\n<!-- {name}:end -->)", re.S)
        text = pattern.sub(lambda m: m.group(1) + make() + m.group(2), text)
    return text


if __name__ == "__main__":
    current = open(README).read()
    fresh = render(current)
    if "--check" in sys.argv:
        sys.exit(0 if fresh == current else 1)
    open(README, "w").write(fresh)
