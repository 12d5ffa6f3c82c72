"""The README and docs/ state the same contract as the code: settings, error
codes, layout, exit statuses; the generated parts are fresh in every file."""

from __future__ import annotations

import importlib.util
import os
import re

from checkoutcache.config import Config, PublishSettings, ServeSettings, options_table
from checkoutcache.errors import CODES
from checkoutcache.store import layout

TOP = os.path.join(os.path.dirname(__file__), "..")


def read(name: str) -> str:
    with open(os.path.join(TOP, name)) as handle:
        return handle.read()


README = read("README.md")


def render_script():
    spec = importlib.util.spec_from_file_location("render_readme", os.path.join(TOP, "scripts", "render_readme.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_starts_with_the_two_commands():
    commands = [line for line in README.splitlines()[:6] if line.startswith("pip install")]
    assert len(commands) == 2 and "checkoutcache demo" in commands[0] and "pytest" in commands[1]
    ci = read(".ci/run")
    assert "python -m pytest" in ci and ".[test]" in ci


def test_every_generated_part_is_fresh_in_every_file():
    # Refresh with: python scripts/render_readme.py
    script = render_script()
    for path in script.documents(os.path.normpath(TOP)):
        with open(path) as handle:
            text = handle.read()
        assert script.render(text) == text, f"{path} is stale: run python scripts/render_readme.py"


def test_every_generated_part_is_in_some_file():
    script = render_script()
    placed = set()
    for path in script.documents(os.path.normpath(TOP)):
        with open(path) as handle:
            placed.update(script.markers(handle.read()))
    assert placed == set(script.TABLES)


def test_the_operations_page_has_the_settings_tables():
    operations = read("docs/operations.md")
    for cls in (Config, ServeSettings, PublishSettings):
        assert options_table(cls) in operations


def test_the_errors_page_lists_every_error_code_and_exit_status():
    errors = read("docs/errors.md")
    for code in CODES:
        assert f"`{code}`" in errors
    for status in ("| 0 |", "| 75 |", "| 1 |", "| 2 |", "| 125 |", "| 126, 127 |"):
        assert status in errors


def test_the_layout_page_draws_the_layout_and_locks_from_layout_py():
    tree, *rest = layout.__doc__.split("\n\n")[2:]
    page = read("docs/layout.md")
    assert tree in page
    assert any("Locks (flock" in part for part in rest) and all(part.strip() in page for part in rest)


def test_the_fleets_page_draws_the_bundle_store_from_location_py():
    from checkoutcache.bundles import location

    tree, names = location.__doc__.split("\n\n")[2:4]
    page = read("docs/fleets.md")
    assert tree in page and names in page


def pages() -> list[str]:
    """README.md and every docs/*.md, as paths relative to the top of the tree."""
    return ["README.md", *sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(TOP, "docs"))
                                 if n.endswith(".md"))]


def prose(text: str) -> str:
    """text without fenced code blocks and inline code, where a link is only an example."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def links(text: str) -> list[str]:
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose(text))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a page: lower case, punctuation dropped,
    spaces as hyphens, a repeated one numbered."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        candidate, number = slug, 0
        while candidate in found:
            number += 1
            candidate = f"{slug}-{number}"
        found.add(candidate)
    return found


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(target.split("#")[0]) for target in links(README)}
    missing = [page for page in pages() if page != "README.md" and page not in linked]
    assert not missing, f"pages the README does not link to: {missing}"


def test_every_relative_link_points_at_an_existing_file_and_heading():
    broken = []
    for page in pages():
        for target in links(read(page)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(TOP, resolved)):
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(read(resolved)):
                broken.append(f"{page}: {target} (no such heading in {resolved})")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_page_with_the_exit_statuses_in_brief():
    for status in ("| 0 |", "| 75 |", "| 1 |", "| 2 |"):
        assert status in README
    assert "## A five-minute tour" in README and "## Where to read on" in README
