"""The layering of the packages, read from their source (every import, nested ones included):
contracts/ (the contract model, the pure engine, the stores) imports nothing of the others;
metrics/ observes and may read contracts/; proxy/ (transport) uses both; the examples may run
the proxy; bench/ (tooling) may use all of these. cli.py is the one module that knows every
command, so it alone may import bench/ and the examples, and nothing imports it. No module
takes part in an import circle.

Inside proxy/, every module but the entry points (the package's __init__ and cli.py) sits in a
subpackage: core/ (the shared call core), one per traffic kind (http/, model/, mcp/, a2a/), and ops/
(the operator surface). The traffic kinds never import each other, the core imports no traffic
kind and not the operator surface, and only the operator surface (and cli.py above it) knows the
traffic kinds besides themselves."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = "stepguard.proxy.cli"

# what each part may import (besides itself); CLI may import anything
ALLOWED = {
    "contracts": set(),
    "metrics": {"contracts"},
    "proxy": {"contracts", "metrics"},
    "examples": {"contracts", "metrics", "proxy"},
    "bench": {"contracts", "metrics", "proxy", "examples"},
}
# the engine side of contracts/ is pure: it never reaches the run book or the stores
PURE = ("engine", "conditions", "model", "loader", "events", "envelope", "errors", "redact")
STORE_SIDE = ("runs", "store", "sqlite_store")


@dataclass(frozen=True)
class Import:
    source: str          # the importing module
    target: str          # the stepguard module it imports
    where: str           # file:line, for the message


def _packages() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: ROOT / folder
            for name, folder in config["tool"]["setuptools"]["package-dir"].items()}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in _packages().items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _targets(node: ast.Import | ast.ImportFrom, source: str) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:      # relative: resolved against the importing module's package
        package = source if MODULES[source].stem == "__init__" else source.rpartition(".")[0]
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    for alias in node.names:
        # `from package import module` imports the module; `from module import name`, the module
        yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base


def _imports() -> list[Import]:
    found = []
    for source, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(node, source):
                    if target.startswith("stepguard.") and target != source:
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        found.append(Import(source, target, where))
    return found


IMPORTS = _imports()


def _part(module: str) -> str:
    return module.split(".")[1]


def test_every_import_names_a_module_of_the_packages() -> None:
    unknown = [f"{i.where} imports {i.target}" for i in IMPORTS if i.target not in MODULES]
    assert not unknown


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_each_part_imports_only_the_parts_below_it(part: str) -> None:
    wrong = [f"{i.where}: {i.source} imports {i.target}" for i in IMPORTS
             if i.source != CLI and _part(i.source) == part
             and _part(i.target) not in ALLOWED[part] | {part}]
    assert not wrong, f"{part}/ may import only {sorted(ALLOWED[part])}"


def test_only_the_command_line_knows_the_tooling_and_the_examples() -> None:
    wrong = [f"{i.where}: {i.source} imports {i.target}" for i in IMPORTS
             if _part(i.source) in ("proxy", "contracts", "metrics") and i.source != CLI
             and _part(i.target) in ("bench", "examples")]
    assert not wrong


def test_nothing_imports_the_command_line() -> None:
    assert not [f"{i.where}: {i.source}" for i in IMPORTS if i.target == CLI]


def test_the_engine_side_of_contracts_never_reaches_the_stores() -> None:
    pure = {f"stepguard.contracts.{m}" for m in PURE}
    store = {f"stepguard.contracts.{m}" for m in STORE_SIDE}
    assert pure | store <= set(MODULES), "PURE/STORE_SIDE name modules that no longer exist"
    wrong = [f"{i.where}: {i.source} imports {i.target}" for i in IMPORTS
             if i.source in pure and i.target in store]
    assert not wrong


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return circles


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_takes_part_in_an_import_circle() -> None:
    edges: dict[str, set[str]] = {}
    for i in IMPORTS:
        edges.setdefault(i.source, set()).add(i.target)
    assert _circles(edges) == []


def test_no_part_takes_part_in_an_import_circle() -> None:
    edges: dict[str, set[str]] = {}
    for i in IMPORTS:
        source = "cli" if i.source == CLI else _part(i.source)
        target = "cli" if i.target == CLI else _part(i.target)
        if source != target:
            edges.setdefault(source, set()).add(target)
    assert _circles(edges) == []


# the subpackages of proxy/, and what each may import of the others (besides itself)
PROXY = "stepguard.proxy"
ENTRY_POINTS = {PROXY, CLI}
KINDS = ("http", "model", "mcp", "a2a")
SUBPACKAGE_ALLOWED = {
    "core": set(),
    **{kind: {"core"} for kind in KINDS},
    "ops": {"core", *KINDS},
}


def _subpackage(module: str) -> str | None:
    """The subpackage of proxy/ a module sits in (None outside proxy/ and for its entry points)."""
    if not module.startswith(f"{PROXY}.") or module in ENTRY_POINTS:
        return None
    return module.split(".")[2]


def _subpackage_breaches(imports: list[Import]) -> list[str]:
    breaches = []
    for i in imports:
        source, target = _subpackage(i.source), _subpackage(i.target)
        if source is None or target is None or source == target:
            continue
        if target not in SUBPACKAGE_ALLOWED.get(source, set()):
            breaches.append(f"{i.where}: {source}/ may not import {target}/ ({i.target})")
    return breaches


def test_every_module_of_the_proxy_but_its_entry_points_sits_in_a_subpackage() -> None:
    loose = [module for module in MODULES if module.startswith(f"{PROXY}.")
             and module not in ENTRY_POINTS and _subpackage(module) not in SUBPACKAGE_ALLOWED]
    assert not loose, f"proxy/ modules outside {sorted(SUBPACKAGE_ALLOWED)}: {loose}"


def test_every_subpackage_of_the_proxy_exists() -> None:
    assert {f"{PROXY}.{name}" for name in SUBPACKAGE_ALLOWED} <= set(MODULES)


def test_the_subpackages_of_the_proxy_import_only_what_their_rules_allow() -> None:
    assert not _subpackage_breaches(IMPORTS)


@pytest.mark.parametrize(("source", "target"), [
    ("stepguard.proxy.model.adapter", "stepguard.proxy.http.adapter"),     # kind on kind
    ("stepguard.proxy.http.adapter", "stepguard.proxy.mcp.rpc"),           # kind on kind
    ("stepguard.proxy.core.calls", "stepguard.proxy.model.dialects"),      # core on a kind
    ("stepguard.proxy.core.calls", "stepguard.proxy.ops.app"),             # core on ops
    ("stepguard.proxy.mcp.adapter", "stepguard.proxy.ops.dispatch"),       # kind on ops
])
def test_a_forbidden_import_between_subpackages_is_found(source: str, target: str) -> None:
    assert _subpackage_breaches([Import(source, target, "x.py:1")])


@pytest.mark.parametrize(("source", "target"), [
    ("stepguard.proxy.model.adapter", "stepguard.proxy.core.calls"),
    ("stepguard.proxy.ops.app", "stepguard.proxy.mcp.adapter"),
    ("stepguard.proxy.cli", "stepguard.proxy.http.listener"),
    ("stepguard.bench.proxy", "stepguard.proxy.http.listener"),
])
def test_an_allowed_import_between_subpackages_passes(source: str, target: str) -> None:
    assert not _subpackage_breaches([Import(source, target, "x.py:1")])
