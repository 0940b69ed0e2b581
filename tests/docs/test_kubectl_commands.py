"""The kubectl commands the docs give name what deploy/kubernetes creates: a `deploy/NAME` is a
Deployment there, and `-c NAME` one of its containers."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from docblocks import DOCS, ROOT

PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
_COMMAND = re.compile(r"kubectl (?:logs|exec)[^\n`|]*?deploy/([\w-]+)[^\n`|]*?-c ([\w-]+)")


def deployments() -> dict[str, set[str]]:
    """Each Deployment's name and its containers' (init containers included)."""
    found: dict[str, set[str]] = {}
    for manifest in (ROOT / "deploy" / "kubernetes").glob("*.yaml"):
        for doc in yaml.safe_load_all(manifest.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "Deployment":
                spec: dict[str, Any] = doc["spec"]["template"]["spec"]
                found[doc["metadata"]["name"]] = {
                    c["name"] for c in spec.get("initContainers", []) + spec["containers"]}
    return found


def commands() -> list[tuple[str, str, str]]:
    return [(f"{page.relative_to(ROOT)}", m.group(1), m.group(2))
            for page in PAGES for m in _COMMAND.finditer(page.read_text())]


def test_the_docs_give_the_incident_commands() -> None:
    assert {page for page, _, _ in commands()} >= {"docs/operations.md"}


@pytest.mark.parametrize(("page", "deployment", "container"), commands())
def test_a_kubectl_command_names_a_deployment_and_container_of_the_manifests(
        page: str, deployment: str, container: str) -> None:
    manifests = deployments()
    assert deployment in manifests, f"{page}: no Deployment {deployment!r} in deploy/kubernetes"
    assert container in manifests[deployment], f"{page}: {deployment} has no container {container!r}"

