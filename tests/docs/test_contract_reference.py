"""docs/contract.md cannot drift from contracts/contract.schema.json: its key index lists exactly
the keys the schema allows, its complete example uses every one of them, and every contract or
contract fragment on any docs page loads."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from docblocks import DOCS, ROOT, Block, blocks, doc_files, table_between

from stepguard.contracts.loader import parse_contract

SCHEMA = json.loads((ROOT / "contracts" / "contract.schema.json").read_text())
REFERENCE = DOCS / "contract.md"
# a list of conditions is documented once, as `condition.*`, not under each key that holds one
CONDITIONS_REF = "#/$defs/conditions"
NAME = "<name>"


def _resolve(node: Any) -> Any:
    while isinstance(node, dict) and "$ref" in node and node["$ref"] != CONDITIONS_REF:
        node = SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _branches(node: Any) -> list[dict[str, Any]]:
    node = _resolve(node)
    if not isinstance(node, dict):
        return []
    if "oneOf" in node:
        return [b for branch in node["oneOf"] for b in _branches(branch)]
    return [node]


def _children(node: Any) -> tuple[dict[str, Any], Any, Any]:
    """(properties, additionalProperties schema, items schema) over every branch of `node`."""
    properties: dict[str, Any] = {}
    extra = items = None
    for branch in _branches(node):
        properties.update(branch.get("properties", {}))
        if isinstance(branch.get("additionalProperties"), dict):
            extra = branch["additionalProperties"]
        if "items" in branch:
            items = branch["items"]
    return properties, extra, items


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def schema_paths(node: Any, path: str = "") -> Iterator[str]:
    if isinstance(node, dict) and node.get("$ref") == CONDITIONS_REF:
        return
    properties, extra, items = _children(node)
    for key, child in properties.items():
        yield _join(path, key)
        yield from schema_paths(child, _join(path, key))
    if extra is not None:
        yield _join(path, NAME)
        yield from schema_paths(extra, _join(path, NAME))
    if items is not None:
        yield from schema_paths(items, path)


def every_schema_path() -> set[str]:
    return set(schema_paths(SCHEMA)) | set(schema_paths(SCHEMA["$defs"]["condition"], "condition"))


def instance_paths(value: Any, node: Any, path: str = "") -> Iterator[str]:
    """The schema paths a contract document uses (x- keys left out)."""
    if isinstance(node, dict) and node.get("$ref") == CONDITIONS_REF:
        for condition in value:
            yield from instance_paths(condition, SCHEMA["$defs"]["condition"], "condition")
        return
    properties, extra, items = _children(node)
    if isinstance(value, dict):
        for key, child in value.items():
            if key.startswith("x-"):
                continue
            if key in properties:
                yield _join(path, key)
                yield from instance_paths(child, properties[key], _join(path, key))
            elif extra is not None:
                yield _join(path, NAME)
                yield from instance_paths(child, extra, _join(path, NAME))
    elif isinstance(value, list) and items is not None:
        for item in value:
            yield from instance_paths(item, items, path)


def indexed_keys() -> list[str]:
    rows = table_between(REFERENCE, "key-index", "/key-index")
    keys = []
    for row in rows:
        found = re.fullmatch(r"`([^`]+)`", row[0])
        assert found, f"the key index's first column holds one `key`, not {row[0]!r}"
        keys.append(found.group(1))
    return keys


def complete_example() -> dict[str, Any]:
    (block,) = [b for b in blocks(REFERENCE) if b.marker == "complete-example"]
    document: dict[str, Any] = yaml.safe_load(block.text)
    return document


def test_the_key_index_lists_every_key_the_schema_allows() -> None:
    assert every_schema_path() - set(indexed_keys()) == set()


def test_every_key_in_the_index_exists_in_the_schema() -> None:
    assert set(indexed_keys()) - every_schema_path() == set()


def test_the_key_index_lists_each_key_once() -> None:
    keys = indexed_keys()
    assert len(keys) == len(set(keys))


def test_every_index_row_says_what_the_key_is() -> None:
    assert [row[0] for row in table_between(REFERENCE, "key-index", "/key-index")
            if not row[1]] == []


def test_the_complete_example_uses_every_key_the_schema_allows() -> None:
    assert every_schema_path() - set(instance_paths(complete_example(), SCHEMA)) == set()


def test_the_complete_example_loads() -> None:
    contract = parse_contract(yaml.safe_dump(complete_example()).encode(), "contract.md")
    assert contract.workflow == "order-confirmation"


BASE: dict[str, Any] = {"workflow": "docs-example", "contract_version": 1,
                        "upstreams": {"tools": {"url": "http://127.0.0.1:9002", "kind": "http"},
                                      "model": {"url": "http://127.0.0.1:9001", "kind": "openai"}}}


def contract_blocks() -> list[Block]:
    """Every YAML block on a docs page that is a contract or a piece of one (not a manifest)."""
    found = []
    for path in doc_files():
        for block in blocks(path):
            if block.lang != "yaml" or block.marker.startswith("not a contract"):
                continue
            found.append(block)
    return found


def as_contract(block: Block) -> dict[str, Any]:
    """A fragment completed with what every contract needs: a workflow, a version, an upstream."""
    document: dict[str, Any] = yaml.safe_load(block.text)
    if "workflow" in document:
        return document
    merged = {**BASE, **document}
    merged["upstreams"] = {**BASE["upstreams"], **document.get("upstreams", {})}
    return merged


@pytest.mark.parametrize("block", contract_blocks(), ids=Block.where)
def test_every_contract_example_in_the_docs_loads(block: Block) -> None:
    parse_contract(yaml.safe_dump(as_contract(block)).encode(), block.where())
