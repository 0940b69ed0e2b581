"""ARCHITECTURE.md stays short enough to read as a whole, and true to the tree: every path it
names (`proxy/core/calls.py`, `docs/replicas.md`, `stepguard/`) exists in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
MAX_BYTES = 15 * 1024

# a path as the document writes it, in backticks or as a link target: folders end with a slash,
# files with an extension of the repository's files (`tools/call` or `Contract.step_for` are not)
_PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)*(?:/|\.(?:py|md|toml|yaml|yml|json|txt|cfg))$")


def _named_paths(text: str) -> set[str]:
    quoted = re.findall(r"`([^`\n]+)`", text)
    linked = re.findall(r"\]\(([^)#\s]+)", text)
    return {name for name in [*quoted, *linked] if _PATH.match(name) and "://" not in name}


def _missing(text: str) -> list[str]:
    return sorted(name for name in _named_paths(text) if not (ROOT / name).exists())


def test_architecture_is_at_most_15_kib() -> None:
    size = len(ARCHITECTURE.read_bytes())
    assert size <= MAX_BYTES, f"ARCHITECTURE.md is {size} bytes, more than {MAX_BYTES}"


def test_every_path_architecture_names_exists() -> None:
    text = ARCHITECTURE.read_text()
    assert len(_named_paths(text)) > 20      # the reader found the document's paths
    assert not _missing(text)


def test_a_named_path_that_does_not_exist_is_found() -> None:
    text = "`proxy/core/calls.py`, `proxy/core/gone.py`, [x](docs/nowhere.md), `tools/call`"
    assert _missing(text) == ["docs/nowhere.md", "proxy/core/gone.py"]
