"""Refresh the generated parts of README.md and docs/*.md (settings, error codes,
the on-disk layout, the bundle store's layout, serve's metrics) from the code.

    python scripts/render_readme.py          # rewrite every stale file in place
    python scripts/render_readme.py --check  # exit 1, naming them, if any file is stale

Each generated part sits between `<!-- NAME:start -->` and `<!-- NAME:end -->`
markers; NAME is one of TABLES. A marker of any other name is an error, so a
typo cannot leave a table silently unrefreshed.
"""

from __future__ import annotations

import glob
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from checkoutcache.bundles import location  # noqa: E402
from checkoutcache.config import Config, PublishSettings, ServeSettings, options_table  # noqa: E402
from checkoutcache.errors import CODES  # noqa: E402
from checkoutcache.serve.metrics import reference_table  # noqa: E402
from checkoutcache.store import layout  # noqa: E402

TOP = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# A marker is a line of its own (a page may mention the syntax inline, as this docstring does).
MARKER = re.compile(r"^<!-- ([A-Za-z0-9_-]+):(start|end) -->$", re.M)


def documents(top: str = TOP) -> list[str]:
    """Every file that may hold generated parts: the README and the pages under docs/."""
    return [os.path.join(top, "README.md"), *sorted(glob.glob(os.path.join(top, "docs", "*.md")))]


def errors_table() -> str:
    rows = ["| code | kind | exit | HTTP (serve) | next step |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{e.code}` | {e.kind} | {2 if e.kind == 'input' else 1} | {e.http_status} | {e.next} |"
             for e in CODES.values()]
    return "\n".join(rows)


def layout_contract() -> str:
    """The layout docstring from its tree on: the tree, what a reader may assume, the locks."""
    return "```\n" + "\n\n".join(layout.__doc__.split("\n\n")[2:]).rstrip() + "\n```"


def bundle_store_layout() -> str:
    """The bundle store's tree and what its names mean, from bundles/location.py's docstring."""
    return "```\n" + "\n\n".join(location.__doc__.split("\n\n")[2:4]).rstrip() + "\n```"


TABLES = {"settings": lambda: options_table(Config), "serve-settings": lambda: options_table(ServeSettings),
          "publish-settings": lambda: options_table(PublishSettings), "errors": errors_table,
          "layout": layout_contract, "bundle-layout": bundle_store_layout, "metrics": reference_table}


def markers(text: str) -> list[str]:
    """The names of the generated parts in text; ValueError for an unknown or unpaired marker."""
    found = MARKER.findall(text)
    for name, _end in found:
        if name not in TABLES:
            raise ValueError(f"unknown generated part {name!r} (known: {', '.join(TABLES)})")
    names = [name for name, end in found if end == "start"]
    if sorted(names) != sorted(name for name, end in found if end == "end"):
        raise ValueError(f"unpaired markers: {sorted(found)}")
    return names


def render(text: str) -> str:
    markers(text)
    for name, make in TABLES.items():
        pattern = re.compile(rf"(^<!-- {name}:start -->\n).*?(\n<!-- {name}:end -->$)", re.S | re.M)
        text = pattern.sub(lambda m: m.group(1) + make() + m.group(2), text)
    return text


def stale(top: str = TOP) -> list[str]:
    """The files whose generated parts differ from the code's."""
    result = []
    for path in documents(top):
        with open(path) as handle:
            current = handle.read()
        if render(current) != current:
            result.append(path)
    return result


def main(argv: list[str]) -> int:
    if "--check" in argv:
        behind = stale()
        for path in behind:
            print(f"stale: {os.path.relpath(path, TOP)} (refresh with: python scripts/render_readme.py)",
                  file=sys.stderr)
        return 1 if behind else 0
    for path in documents():
        with open(path) as handle:
            current = handle.read()
        fresh = render(current)
        if fresh != current:
            with open(path, "w") as handle:
                handle.write(fresh)
            print(f"refreshed {os.path.relpath(path, TOP)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
