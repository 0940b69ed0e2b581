"""The committed stepguard/ folder mirrors the setuptools package-dir mapping with relative
symlinks, so static tools (mypy, pyright, editors) resolve `stepguard.*` from the repository root
by plain path lookup, in any clone, with the same folders the installed package maps."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "stepguard"


def _package_dirs() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    assert sorted(dirs) == sorted(config["tool"]["setuptools"]["packages"])
    return dirs


def _link(package: str) -> Path:
    return TREE.joinpath(*package.split(".")[1:])


def test_every_mapped_package_has_a_relative_symlink_to_its_folder() -> None:
    for package, folder in _package_dirs().items():
        link = _link(package)
        assert link.is_symlink(), f"{link.relative_to(ROOT)} -> ../{folder} is missing"
        assert not os.path.isabs(os.readlink(link)), f"{link.relative_to(ROOT)} must be relative"
        assert link.resolve() == (ROOT / folder).resolve(), package


def test_the_tree_holds_nothing_but_the_symlinks_and_their_folders() -> None:
    expected = {_link(p) for p in _package_dirs()}
    parents = {parent for link in expected for parent in link.parents if TREE in parent.parents}
    found = set()
    for dirpath, dirnames, filenames in os.walk(TREE):
        for name in dirnames + filenames:
            found.add(Path(dirpath) / name)
    assert found == expected | parents
