"""The package's architecture, checked from its source: the import graph of
every module under checkoutcache/ (imports inside functions included: a lazy
import is still a dependency) has no cycles, and no module imports a layer
above its own.

Layers, bottom to top (a module may import its own layer and those below):

    ground  errors, units, testhooks, credentials, sharing, signing
    base    config, repospec, cones, answers, bundles.location (what a bundle store
            location is: pure parsing the settings need; the rest of bundles/ is its layer)
    store < git < bundles < clone < cache (and handoff: asking the writer; workspaces) < upkeep < serve < cli, client (the API's typed client)

checkoutcache/__init__.py (the public API) and __main__.py are exempt from
layering: they sit on top of everything.
"""

from __future__ import annotations

import ast
import os

from .helpers import walk

PACKAGE = "checkoutcache"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", PACKAGE)

LAYERS = [
    {"errors", "units", "testhooks", "credentials", "sharing", "signing"},
    {"config", "repospec", "cones", "answers", "bundles.location"},
    {"store"}, {"git"}, {"bundles"}, {"clone"}, {"cache", "handoff", "workspaces"}, {"upkeep"}, {"serve"}, {"cli", "client"},
]
EXEMPT = {PACKAGE, f"{PACKAGE}.__main__"}


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the package (a package is its __init__)."""
    found = {}
    for entry in walk(SOURCE):
        if entry.is_file and entry.rel.endswith(".py") and "__pycache__" not in entry.rel:
            parts = [PACKAGE] + entry.rel[:-3].split(os.sep)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = entry.path
    return found


MODULES = modules()


def is_package(module: str) -> bool:
    return MODULES[module].endswith("__init__.py")


def imports_of(module: str) -> set[str]:
    """The package's modules this one imports, anywhere in its body (functions included)."""
    tree = ast.parse(open(MODULES[module]).read(), MODULES[module])
    here = module if is_package(module) else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from pkg import name` imports the submodule pkg.name when there is one, else pkg itself.
            names = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in MODULES else origin
                     for alias in node.names]
        else:
            continue
        for name in names:
            # `import a.b.c` depends on a.b.c (the closest module of the package that it names).
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


GRAPH = {module: imports_of(module) for module in MODULES}


def layer_of(module: str) -> int | None:
    if module in EXEMPT:
        return None
    name = module.split(".", 1)[1]
    for index, members in enumerate(LAYERS):  # a module named in a layer first, then its package's
        if name in members:
            return index
    first = name.split(".")[0]
    for index, members in enumerate(LAYERS):
        if first in members:
            return index
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {__file__}")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def upward_edges() -> list[tuple[str, str]]:
    edges = []
    for source, targets in GRAPH.items():
        for target in targets:
            low, high = layer_of(source), layer_of(target)
            if low is not None and high is not None and high > low:
                edges.append((source, target))
    return sorted(edges)


def test_the_graph_sees_the_whole_package():
    assert len(MODULES) > 30 and all(layer_of(m) is not None for m in MODULES if m not in EXEMPT)
    assert f"{PACKAGE}.store.layout" in GRAPH[f"{PACKAGE}.store.locks"] | GRAPH[f"{PACKAGE}.store.checkouts"]
    # Imports inside functions count: the coordinator imports liveness only inside start_clone.
    assert f"{PACKAGE}.store.liveness" in GRAPH[f"{PACKAGE}.clone.coordinator"]


def test_the_checker_finds_cycles_and_upward_edges():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert layer_of(f"{PACKAGE}.store.layout") < layer_of(f"{PACKAGE}.cli.commands")


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_no_module_imports_a_layer_above_its_own():
    assert upward_edges() == []
