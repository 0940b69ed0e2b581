"""No function of the product code is longer than 80 lines, bar the few named below: a longer
one is split along its concerns (#25)."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())
# the real folders the packages are mapped from (proxy, contracts, metrics, bench, examples),
# not the stepguard/ symlinks to them
FOLDERS = sorted({folder.split("/")[0]
                  for folder in CONFIG["tool"]["setuptools"]["package-dir"].values()})
MAX_LINES = 80

# functions allowed past MAX_LINES, each with why: (file from the root, qualified name)
EXEMPT = {
    # a declaration block: one statement a metric, nothing to split
    ("metrics/prom.py", "Metrics.__init__"),
}


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, lines from its `def` to its last line) of every function in `tree`,
    nested ones too (`outer.inner`, `Class.method`)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")
        else:
            yield from _functions(node, prefix)


def _lengths() -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.relative_to(ROOT).as_posix()
            for name, lines in _functions(ast.parse(path.read_text(), source)):
                found[source, name] = max(lines, found.get((source, name), 0))
    return found


def test_the_walk_reads_every_product_folder() -> None:
    assert FOLDERS == ["bench", "contracts", "examples", "metrics", "proxy"]
    assert {source.split("/")[0] for source, _ in _lengths()} == set(FOLDERS)


def test_the_walk_measures_methods_and_nested_functions_from_def_to_last_line() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    source = f"class A:\n    def long(self) -> None:\n{body}\n        def inner() -> None:\n" \
             "            pass\n"
    assert dict(_functions(ast.parse(source))) == {"A.long": MAX_LINES + 3, "A.long.inner": 2}


def test_no_product_function_is_longer_than_80_lines() -> None:
    long = [f"{source} {name}: {lines} lines" for (source, name), lines in _lengths().items()
            if lines > MAX_LINES and (source, name) not in EXEMPT]
    assert not long, f"split along its concerns (at most {MAX_LINES} lines): {long}"


def test_every_exemption_names_a_function_still_longer_than_80_lines() -> None:
    lengths = _lengths()
    stale = sorted(f"{source} {name}" for source, name in EXEMPT
                   if lengths.get((source, name), 0) <= MAX_LINES)
    assert not stale, f"no longer needed: remove from EXEMPT: {stale}"
