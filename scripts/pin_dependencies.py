"""Write constraints.txt: every distribution that `pip install '.[s3,test]'` brings, at the
version installed here (the set the suite last passed with), so CI and the image install the
same versions. Run it on purpose, after installing newer versions and running the suite:

    pip install -U -e '.[s3,test]' && python -m pytest && python scripts/pin_dependencies.py

It reads the installed distributions' metadata (no network); a requirement whose
environment marker does not hold here (another Python, another platform) is left out.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PROJECT = "checkoutcache"
EXTRAS = ("s3", "test")
# The installer's own tools (moto[server] asks for setuptools): left to pip and to the build's
# isolated environment (pyproject's build-system), as `pip freeze` leaves them.
UNPINNED = {"pip", "setuptools", "wheel"}
HEADER = """\
# The versions CI and the image install (pip install -c constraints.txt ...): the whole set
# that checkoutcache[s3,test] brings, as the suite last passed with it. Made by
# scripts/pin_dependencies.py; update it on purpose (its docstring says how), never by hand.
"""


def closure() -> dict[str, str]:
    """canonical name -> installed version, for the project's requirements with EXTRAS."""
    pinned: dict[str, str] = {}
    queue = [(PROJECT, set(EXTRAS))]
    seen: set[tuple[str, str]] = set()
    while queue:
        name, extras = queue.pop()
        dist = metadata.distribution(name)
        for text in dist.requires or []:
            requirement = Requirement(text)
            environments = [{"extra": extra} for extra in extras] or [{"extra": ""}]
            if requirement.marker and not any(requirement.marker.evaluate(env) for env in environments):
                continue
            child = canonicalize_name(requirement.name)
            for extra in {"", *requirement.extras}:
                if (child, extra) not in seen:
                    seen.add((child, extra))
                    queue.append((child, {extra} - {""}))
    for name, _extra in seen:
        if name != PROJECT and name not in UNPINNED:
            pinned[name] = metadata.version(name)
    return pinned


def main() -> None:
    lines = [f"{name}=={version}\n" for name, version in sorted(closure().items())]
    with open(os.path.join(ROOT, "constraints.txt"), "w") as handle:
        handle.write(HEADER + "".join(lines))
    print(f"constraints.txt: {len(lines)} distributions", file=sys.stderr)


if __name__ == "__main__":
    main()
