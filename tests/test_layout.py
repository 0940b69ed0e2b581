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
    packages = config["tool"]["setuptools"]["packages"]
    # every mapped package is listed; every other listed one is a subpackage of a mapped one
    assert set(dirs) <= set(packages)
    assert all(any(p.startswith(f"{d}.") for d in dirs) for p in set(packages) - set(dirs))
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


def test_every_subpackage_folder_is_listed_for_the_installed_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = set(config["tool"]["setuptools"]["packages"])
    missing = []
    for package, folder in _package_dirs().items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            name = ".".join([package, *parts])
            if name not in packages:
                missing.append(name)
    assert not missing, f"add to [tool.setuptools] packages: {missing}"
