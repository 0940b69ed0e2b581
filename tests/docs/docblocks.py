"""Reading the docs the way the doc tests need: fenced blocks with the marker comment before
them, and the rows of a marked table."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language, text, the marker comment right before it (or ""), and
    the file and line it starts on."""

    lang: str
    text: str
    marker: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i, marker = 0, ""
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if opened:
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            found.append(Block(opened.group(1), "\n".join(body) + "\n", marker, path, start))
            marker = ""
        else:
            comment = _MARKER.match(lines[i])
            if comment:
                marker = comment.group(1)
            elif lines[i].strip():
                marker = ""
        i += 1
    return found


def table_between(path: Path, start: str, end: str) -> list[list[str]]:
    """The body rows (cells stripped) of the table between `<!-- start -->` and `<!-- end -->`."""
    text = path.read_text()
    section = text.split(f"<!-- {start} -->", 1)[1].split(f"<!-- {end} -->", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[2:]]


def doc_files() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))
