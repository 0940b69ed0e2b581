"""The package folders are imported only as `stepguard.*`: from the repository root a bare
`import proxy.app` would also resolve, and load a second copy of the module with state of its
own. ruff bans each folder as an import root (TID251, pyproject.toml), and `make lint` runs it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())
# the top-level folders the packages are mapped from: proxy, contracts, metrics, bench, examples
ROOTS = sorted({folder.split("/")[0]
                for folder in CONFIG["tool"]["setuptools"]["package-dir"].values()})


def test_ruff_bans_every_package_folder_as_an_import_root() -> None:
    lint = CONFIG["tool"]["ruff"]["lint"]
    assert "TID251" in lint["select"]
    assert sorted(lint["flake8-tidy-imports"]["banned-api"]) == ROOTS


@pytest.mark.parametrize("root", ROOTS)
def test_ruff_refuses_a_bare_import_of_a_module_below_each_root(root: str) -> None:
    source = f"import {root}.anything\nfrom {root} import anything\n"
    found = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
         "--stdin-filename", "proxy/bare.py", "-"],
        input=source, capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert found.returncode == 1, found.stdout + found.stderr
    assert found.stdout.count(f"TID251 `{root}` is banned") == 2, found.stdout


def test_ruff_allows_the_stepguard_spelling_and_the_test_helpers() -> None:
    source = "import sgtest\nimport stepguard.proxy.ops.app\nfrom stepguard.contracts import engine\n"
    found = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "TID251",
         "--stdin-filename", "tests/allowed.py", "-"],
        input=source, capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert found.returncode == 0, found.stdout + found.stderr
