"""The loader: a contract file is validated against the format, then compiled; every problem
found is reported as a ContractIssue naming the file, the step and the field."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

from stepguard.contracts.errors import ContractError, ContractIssue
from stepguard.contracts.loader import load_contract, load_contracts, parse_contract
from stepguard.contracts.model import OnFailure

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "order-confirmation" / "contract.yaml"


def where(issues: list[ContractIssue]) -> set[tuple[str | None, str]]:
    return {(i.step, i.field) for i in issues}


# --- the example and the two spellings ---------------------------------------------------------


def test_example_contract_loads_with_its_steps_in_declaration_order(example):
    assert example.workflow == "order-confirmation"
    assert list(example.steps) == ["lookup_order", "check_policy", "reserve_slot", "confirm"]
    assert [s.index for s in example.steps.values()] == [1, 2, 3, 4]


def test_example_contract_compiles_upstream_match_and_ordering(example):
    tools = example.upstreams["tools"]
    assert (tools.url, tools.kind, tools.mount, tools.timeout_s) == (
        "http://127.0.0.1:9002", "http", "/tools", 5.0)
    step = example.steps["check_policy"]
    assert (step.match.upstream, step.match.method, step.match.path) == (
        "tools", "POST", "/check_policy")
    assert step.after == ("lookup_order",)
    assert step.input_schema is not None and step.input_schema.name == "order_ref.v1"
    assert step.output_schema is not None and step.output_schema.name == "policy.v1"


def test_example_contract_keeps_condition_expressions_drift_tags_and_messages(example):
    (pre,) = example.steps["check_policy"].preconditions
    assert (pre.expr, pre.drift) == ("input.order_id == state.order_id", "freshness")
    assert pre.message == "policy check asked for another order than the one looked up"
    untagged, tagged = example.steps["reserve_slot"].preconditions
    assert (untagged.drift, untagged.message) == ("precondition", None)
    assert tagged.drift == "freshness"
    assert [c.drift for c in example.steps["reserve_slot"].postconditions] == ["postcondition"] * 2
    assert [c.drift for c in example.steps["reserve_slot"].error_when] == ["tool_error"]


def test_example_contract_compiles_record_completion_and_retry_policy(example):
    assert set(example.steps["lookup_order"].record) == {"order_id", "customer"}
    assert example.steps["reserve_slot"].on_failure == OnFailure("escalate", 1, 0.02)
    assert example.steps["reserve_slot"].idempotent is True
    completion = example.completion
    assert completion is not None and completion.requires == ("confirm",)
    assert completion.claim is not None and completion.claim.drift == "false_completion"
    assert completion.proof is not None
    assert completion.proof.message == "completion claimed without a confirmation id"


def test_example_contract_carries_its_source_and_content_hash(example):
    assert example.source == str(EXAMPLE)
    assert example.content_hash == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()


def test_contract_version_is_kept_as_a_string(make_contract):
    assert make_contract(contract_version=3).version == "3"
    assert make_contract(contract_version="2024-06").version == "2024-06"


def test_optional_top_level_settings_take_their_documented_defaults(make_contract):
    contract = make_contract()
    assert contract.mode == "enforce"
    assert contract.unmatched == "pass"
    assert contract.run_keys == ("header:x-stepguard-run", "traceparent", "mcp-session")
    assert contract.implicit_run is False
    assert contract.completion is None
    assert (contract.webhook, contract.webhook_timeout_s) == (None, 5.0)
    assert contract.upstreams["tools"].mount == "/tools"
    assert contract.upstreams["tools"].timeout_s == 30.0
    assert contract.redact == ()


def test_redact_lists_the_fields_to_hide_in_order(make_contract):
    assert make_contract(redact=["card_number", "email"]).redact == ("card_number", "email")


@pytest.mark.parametrize(("spec", "expected"), [
    ("halt", OnFailure("halt", 0, 0.1)),
    ("escalate", OnFailure("escalate", 0, 0.1)),
    ({"retry": 3}, OnFailure("halt", 3, 0.1)),
    ({"retry": 2, "then": "escalate", "backoff_ms": 250}, OnFailure("escalate", 2, 0.25)),
])
def test_on_failure_accepts_an_action_or_a_retry_policy(make_contract, spec, expected):
    contract = make_contract(steps={"first": {"on_failure": spec}})
    assert contract.steps["first"].on_failure == expected


@pytest.mark.parametrize("source", ["flow.yaml", "flow.yml", "flow.json"])
def test_yaml_and_json_spellings_compile_to_the_same_contract(source):
    document = yaml.safe_load(EXAMPLE.read_bytes())
    raw = json.dumps(document).encode() if source.endswith(".json") else yaml.safe_dump(
        document).encode()
    contract = parse_contract(raw, source)
    reference = load_contract(EXAMPLE)
    assert contract.source == source
    assert (contract.workflow, contract.version, contract.mode) == (
        reference.workflow, reference.version, reference.mode)
    assert contract.upstreams == reference.upstreams
    for name, step in reference.steps.items():
        mine = contract.steps[name]
        assert (mine.match, mine.after, mine.on_failure) == (step.match, step.after,
                                                             step.on_failure)
        assert mine.preconditions == step.preconditions
        assert mine.postconditions == step.postconditions
        assert dict(mine.record) == dict(step.record)
    assert contract.completion == reference.completion


def test_mcp_tool_lists_follow_unmatched_unless_mcp_list_says_otherwise(make_contract):
    assert make_contract().mcp_list == "all"
    assert make_contract(unmatched="refuse").mcp_list == "steps"
    assert make_contract(unmatched="refuse", mcp={"list": "all"}).mcp_list == "all"
    assert make_contract(mcp={"list": "ready"}).mcp_list == "ready"


def test_an_unknown_mcp_list_is_named_in_the_error(make_contract):
    with pytest.raises(ContractError) as caught:
        make_contract(mcp={"list": "some"})
    assert {(i.step, i.field) for i in caught.value.issues} == {(None, "mcp.list")}


def test_a_json_file_is_read_as_json_not_as_yaml():
    with pytest.raises(ContractError) as caught:
        parse_contract(b"workflow: test-flow\n", "flow.json")
    (issue,) = caught.value.issues
    assert (issue.file, issue.step, issue.field) == ("flow.json", None, "")
    assert issue.message.startswith("not valid YAML/JSON")


def test_a_yaml_file_with_a_json_body_loads(contract_doc):
    contract = parse_contract(json.dumps(contract_doc()).encode(), "flow.yaml")
    assert list(contract.steps) == ["first", "second"]


def test_step_for_finds_the_step_by_upstream_method_and_path(make_contract):
    contract = make_contract(steps={
        "first": {"match": {"upstream": "tools", "method": "POST", "path": "/a"}},
        "second": {"match": {"upstream": "tools", "path": "/b"}},
    })
    assert contract.step_for("tools", "POST", "/a") is contract.steps["first"]
    assert contract.step_for("tools", "GET", "/a") is None
    assert contract.step_for("tools", "DELETE", "/b") is contract.steps["second"]
    assert contract.step_for("other", "POST", "/a") is None


# --- format errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "step", "field", "fragment"), [
    pytest.param({"workflow": None}, None, "", "'workflow' is a required property",
                 id="missing-workflow"),
    pytest.param({"upstreams": None}, None, "", "'upstreams' is a required property",
                 id="missing-upstreams"),
    pytest.param({"colour": "blue"}, None, "", "'colour' was unexpected",
                 id="unknown-top-level-key"),
    pytest.param({"mode": "strict"}, None, "mode", "'strict' is not one of",
                 id="unknown-mode"),
    pytest.param({"upstreams": {"tools": {"url": "ftp://tools"}}}, None, "upstreams.tools.url",
                 "'ftp://tools' does not match", id="non-http-upstream-url"),
    pytest.param({"upstreams": {"tools": {"url": "http://t", "case_insensitive": "yes"}}},
                 None, "upstreams.tools.case_insensitive", "'yes' is not of type 'boolean'",
                 id="case-insensitive-not-a-boolean"),
    pytest.param({"upstreams": {"tools": {"url": "http://t", "allow_method_override": 1}}},
                 None, "upstreams.tools.allow_method_override", "1 is not of type 'boolean'",
                 id="allow-method-override-not-a-boolean"),
    pytest.param({"steps": {"first": {"colour": "blue"}}}, "first", "",
                 "'colour' was unexpected", id="unknown-step-key"),
    pytest.param({"steps": {"first": {"match": {"upstream": "tools", "method": "FETCH",
                                                "path": "/a"}}}},
                 "first", "match.method", "'FETCH' is not one of", id="unknown-method"),
    pytest.param({"steps": {"first": {"precondition": [{"expr": "input.x == 1",
                                                        "drift": "staleness"}]}}},
                 "first", "precondition[0].drift", "staleness", id="bad-drift-tag"),
    pytest.param({"steps": {"first": {"match": [
        {"upstream": "tools", "path": "/a"},
        {"upstream": "tools", "method": "FETCH", "path": "/b"}]}}},
                 "first", "match[1].method", "'FETCH' is not one of", id="index-in-brackets"),
    pytest.param({"steps": {"first": {"on_failure": "retry"}}}, "first", "on_failure",
                 "'retry'", id="bad-on-failure-action"),
    pytest.param({"steps": {"first": {"on_failure": {"then": "explode"}}}}, "first",
                 "on_failure.then", "'explode' is not one of ['halt', 'escalate', 'hold']",
                 id="bad-on-failure-then"),
    pytest.param({"steps": {"first": {"on_failure": {"retry": 11}}}}, "first", "on_failure.retry",
                 "11 is greater than the maximum of 10", id="too-many-retries"),
])
def test_format_violations_are_contract_issues_naming_file_step_and_field(
        contract_issues, overrides, step, field, fragment):
    (issue,) = contract_issues(**overrides)
    assert (issue.file, issue.step, issue.field) == ("test.yaml", step, field)
    assert fragment in issue.message


@pytest.mark.parametrize(("spec", "allowed"), [
    pytest.param({"precondition": [{"expr": "input.x == 1", "drift": "staleness"}]},
                 "'freshness'", id="drift-tag"),
    pytest.param({"on_failure": "retry"}, "'halt', 'escalate'", id="on-failure"),
])
def test_a_bad_enum_value_inside_a_one_of_is_reported_with_the_allowed_values(
        contract_issues, spec, allowed):
    # Regression: loader._schema_issue once chose the shortest oneOf sub-error, the type
    # mismatch of the branch the author did not mean ("... is not of type 'string'").
    (issue,) = contract_issues(steps={"first": spec})
    assert allowed in issue.message


def test_every_format_violation_in_a_file_is_reported(contract_issues):
    issues = contract_issues(workflow=None, colour="blue",
                             steps={"first": {"on_failure": "retry"}})
    assert len(issues) == 3
    assert where(issues) == {(None, ""), ("first", "on_failure")}
    assert {i.file for i in issues} == {"test.yaml"}


def test_contract_error_is_a_value_error_whose_message_lists_every_issue():
    with pytest.raises(ValueError, match=re.escape("test.yaml: steps.first.on_failure: ")) as caught:
        parse_contract(yaml.safe_dump({"workflow": "w", "contract_version": 1, "colour": 1,
                                       "upstreams": {"t": {"url": "http://t"}},
                                       "steps": {"first": {"match": {"upstream": "t",
                                                                     "path": "/a"},
                                                           "on_failure": "x"}}}).encode(),
                       "test.yaml")
    assert isinstance(caught.value, ContractError)
    lines = str(caught.value).splitlines()
    assert len(lines) == len(caught.value.issues) == 2
    assert "test.yaml: <root>: Additional properties are not allowed" in lines[0]


@pytest.mark.parametrize(("issue", "text"), [
    (ContractIssue("a.yaml", "s", "after[0]", "m"), "a.yaml: steps.s.after[0]: m"),
    (ContractIssue("a.yaml", "s", "", "m"), "a.yaml: steps.s: m"),
    (ContractIssue("a.yaml", None, "completion.requires[0]", "m"),
     "a.yaml: completion.requires[0]: m"),
    (ContractIssue("a.yaml", None, "", "m"), "a.yaml: <root>: m"),
])
def test_a_contract_issue_prints_as_file_path_and_message(issue, text):
    assert str(issue) == text


# --- compile errors ----------------------------------------------------------------------------

STEPS_AB = {"first": {}, "second": {"after": ["first"]}}


@pytest.mark.parametrize(("overrides", "step", "field", "fragments"), [
    pytest.param({"steps": {"first": {}, "second": {"after": ["first", "ship"]}}},
                 "second", "after[1]", ["unknown step 'ship'"], id="unknown-step-in-after"),
    pytest.param({"steps": {"first": {"input": {"schema": "order.v9"}}}},
                 "first", "input.schema", ["unknown schema 'order.v9'"],
                 id="unknown-schema-name"),
    pytest.param({"steps": {"first": {"output": {"schema": {"type": "strng"}}}}},
                 "first", "output.schema", ["invalid JSON Schema at /type"],
                 id="invalid-inline-json-schema"),
    pytest.param({"schemas": {"order.v1": {"required": "order_id"}}},
                 None, "schemas.order.v1", ["invalid JSON Schema at /required"],
                 id="invalid-named-json-schema"),
    pytest.param({"steps": {"first": {"output": {"schema": {"pattern": "(["}}}}},
                 "first", "output.schema", ["invalid JSON Schema at /pattern"],
                 id="invalid-regex-in-json-schema"),
    pytest.param({"steps": {"first": {"postcondition": ["output.ok", "output.x =="]}}},
                 "first", "postcondition[1]", ["'output.x =='", "does not compile", "Syntax"],
                 id="cel-syntax-error"),
    pytest.param({"steps": {"first": {"precondition": ["output.x == 1"]}}},
                 "first", "precondition[0]",
                 ["undeclared reference to 'output.x'", "variables here: input, state"],
                 id="cel-output-in-precondition"),
    pytest.param({"steps": {"first": {"precondition": ["status == 200"]}}},
                 "first", "precondition[0]", ["undeclared reference to 'status'"],
                 id="cel-status-in-precondition"),
    pytest.param({"steps": {"first": {"error_when": [{"expr": "result.failed"}]}}},
                 "first", "error_when[0]",
                 ["undeclared reference", "variables here: input, output, state, status"],
                 id="cel-unknown-variable-in-error-when"),
    pytest.param({"steps": {"first": {"record": {"order_id": "response.order_id"}}}},
                 "first", "record.order_id", ["undeclared reference"],
                 id="cel-unknown-variable-in-record"),
    pytest.param({"steps": {"first": {"match": {"upstream": "billing", "path": "/a"}}}},
                 "first", "match.upstream", ["unknown upstream 'billing'", "declared: tools"],
                 id="unknown-upstream-in-match"),
    pytest.param({"steps": {"first": {},
                            "second": {"match": {"upstream": "tools", "method": "POST",
                                                 "path": "/first"}}}},
                 "second", "match", ["same match as step 'first'", "POST tools /first"],
                 id="duplicate-match"),
    pytest.param({"steps": {"first": {},
                            "second": {"match": {"upstream": "tools", "path": "/first"}}}},
                 "second", "match", ["same match as step 'first'", "* tools /first"],
                 id="duplicate-match-any-method"),
    pytest.param({"steps": STEPS_AB, "completion": {"requires": ["second", "ship"]}},
                 None, "completion.requires[1]", ["unknown step 'ship'"],
                 id="unknown-step-in-completion-requires"),
    pytest.param({"steps": STEPS_AB, "completion": {"claim": "output.done ==", "requires": []}},
                 None, "completion.claim", ["does not compile"], id="cel-error-in-claim"),
    pytest.param({"steps": STEPS_AB, "completion": {"claim": "output.done",
                                                    "proof": "receipt.id != ''"}},
                 None, "completion.proof", ["undeclared reference"], id="cel-error-in-proof"),
])
def test_compile_errors_name_file_step_and_field(contract_issues, overrides, step, field,
                                                 fragments):
    (issue,) = contract_issues(**overrides)
    assert (issue.file, issue.step, issue.field) == ("test.yaml", step, field)
    for fragment in fragments:
        assert fragment in issue.message


@pytest.mark.parametrize(("steps", "step", "cycle"), [
    pytest.param({"first": {"after": ["first"]}}, "first", "first -> first", id="self"),
    pytest.param({"first": {"after": ["second"]}, "second": {"after": ["first"]}},
                 "first", "first -> second -> first", id="two-steps"),
    pytest.param({"a": {}, "b": {"after": ["a", "d"]}, "c": {"after": ["b"]},
                  "d": {"after": ["c"]}},
                 "b", "b -> d -> c -> b", id="three-steps-behind-a-root"),
])
def test_a_cycle_in_after_is_one_issue_whose_message_shows_the_cycle(contract_issues, steps,
                                                                       step, cycle):
    (issue,) = contract_issues(steps=steps)
    assert (issue.file, issue.step, issue.field) == ("test.yaml", step, "after")
    assert issue.message == f"cycle: {cycle}"


def test_the_same_path_under_different_methods_is_not_a_duplicate_match(make_contract):
    contract = make_contract(steps={
        "read": {"match": {"upstream": "tools", "method": "GET", "path": "/order"}},
        "write": {"match": {"upstream": "tools", "method": "PUT", "path": "/order"}},
    })
    assert list(contract.steps) == ["read", "write"]


def test_a_named_schema_that_fails_to_compile_is_reported_once_not_also_as_unknown(
        contract_issues):
    issues = contract_issues(schemas={"order.v1": {"type": "thing"}},
                             steps={"first": {"output": {"schema": "order.v1"}}})
    assert where(issues) == {(None, "schemas.order.v1")}


def test_a_schema_whose_ref_cannot_be_resolved_is_a_contract_issue(contract_doc):
    # Regression: jsonschema's check_schema accepts the dangling $ref, and the ValidationError
    # that building the validator then raised once escaped parse_contract (loader._Compiler.schema).
    doc = contract_doc(steps={"first": {"output": {"schema": {"$ref": "#/$defs/missing"}}}})
    with pytest.raises(ContractError) as caught:
        parse_contract(yaml.safe_dump(doc).encode(), "test.yaml")
    (issue,) = caught.value.issues
    assert (issue.step, issue.field) == ("first", "output.schema")


def test_every_compile_error_in_a_file_is_reported(contract_issues):
    issues = contract_issues(
        schemas={"bad.v1": {"type": 7}},
        steps={
            "first": {"input": {"schema": "nope.v1"}, "precondition": ["output.x == 1"],
                      "record": {"k": "output.k +"}},
            "second": {"after": ["ghost"], "postcondition": ["output.ok &&"],
                       "match": {"upstream": "billing", "path": "/x"}},
            "third": {"match": {"upstream": "tools", "method": "POST", "path": "/first"},
                      "after": ["third"]},
        },
        completion={"requires": ["phantom"], "proof": "proof.ok"},
    )
    assert {i.file for i in issues} == {"test.yaml"}
    assert where(issues) == {
        (None, "schemas.bad.v1"),
        ("first", "input.schema"),
        ("first", "precondition[0]"),
        ("first", "record.k"),
        ("second", "match.upstream"),
        ("second", "postcondition[0]"),
        ("second", "after[0]"),
        ("third", "after"),
        ("third", "match"),
        (None, "completion.requires[0]"),
        (None, "completion.proof"),
    }


# --- files: reading, parsing, several at once --------------------------------------------------


def test_a_missing_file_cannot_be_read(tmp_path):
    path = tmp_path / "absent.yaml"
    with pytest.raises(ContractError) as caught:
        load_contract(path)
    (issue,) = caught.value.issues
    assert (issue.file, issue.step, issue.field) == (str(path), None, "")
    assert issue.message == "cannot read: No such file or directory"


def test_a_directory_is_not_a_readable_contract(tmp_path):
    with pytest.raises(ContractError) as caught:
        load_contract(tmp_path)
    (issue,) = caught.value.issues
    assert issue.file == str(tmp_path)
    assert issue.message.startswith("cannot read: ")


@pytest.mark.parametrize(("filename", "raw", "detail"), [
    ("broken.yaml", b"workflow: [unclosed\n", "line 2"),
    ("broken.yaml", b"workflow: a\n  steps: b\n", "mapping values are not allowed"),
    ("broken.yaml", b"workflow: \x80\x81\n", "invalid"),
    ("broken.json", b'{"workflow": "a",}', "line 1 column"),
])
def test_a_file_that_is_not_yaml_or_json_is_one_clear_issue(tmp_path, filename, raw, detail):
    path = tmp_path / filename
    path.write_bytes(raw)
    with pytest.raises(ContractError) as caught:
        load_contract(path)
    (issue,) = caught.value.issues
    assert (issue.file, issue.step, issue.field) == (str(path), None, "")
    assert issue.message.startswith("not valid YAML/JSON: ")
    assert detail in issue.message


@pytest.mark.parametrize(("raw", "shown"), [(b"", "None"), (b"- a\n- b\n", "['a', 'b']"),
                                            (b"just text\n", "'just text'")])
def test_a_document_that_is_not_a_mapping_is_reported_at_the_root(tmp_path, raw, shown):
    path = tmp_path / "flow.yaml"
    path.write_bytes(raw)
    with pytest.raises(ContractError) as caught:
        load_contract(path)
    (issue,) = caught.value.issues
    assert (issue.step, issue.field) == (None, "")
    assert issue.message == f"{shown} is not of type 'object'"


def test_load_contracts_returns_every_contract_in_order(write_contract):
    paths = [write_contract("a.yaml", workflow="alpha",
                            upstreams={"tools": {"url": "http://a", "mount": "/a"}}),
             write_contract("b.json", workflow="beta",
                            upstreams={"tools": {"url": "http://b", "mount": "/b"}})]
    contracts = load_contracts(paths)
    assert [c.workflow for c in contracts] == ["alpha", "beta"]
    assert [c.source for c in contracts] == [str(p) for p in paths]


def test_load_contracts_reports_a_workflow_defined_in_two_files(write_contract):
    first = write_contract("a.yaml", upstreams={"tools": {"url": "http://a", "mount": "/a"}})
    second = write_contract("b.yaml", upstreams={"tools": {"url": "http://b", "mount": "/b"}})
    with pytest.raises(ContractError) as caught:
        load_contracts([first, second])
    (issue,) = caught.value.issues
    assert (issue.file, issue.step, issue.field) == (str(second), None, "workflow")
    assert issue.message == f"workflow 'test-flow' also defined in {first}"


def test_load_contracts_reports_a_mount_used_in_two_files(write_contract):
    first = write_contract("a.yaml", workflow="alpha")
    second = write_contract("b.yaml", workflow="beta",
                            upstreams={"billing": {"url": "http://b", "mount": "/tools/"}},
                            steps={"charge": {"match": {"upstream": "billing", "path": "/c"}}})
    with pytest.raises(ContractError) as caught:
        load_contracts([first, second])
    (issue,) = caught.value.issues
    assert (issue.file, issue.step, issue.field) == (str(second), None, "upstreams.billing.mount")
    assert issue.message == f"mount '/tools' also used by {first} upstream 'tools'"


def test_load_contracts_reports_issues_of_every_file_and_across_files(write_contract, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_bytes(b"workflow: [\n")
    invalid = write_contract("invalid.yaml", workflow="gamma", colour="blue")
    first = write_contract("a.yaml", workflow="alpha")
    second = write_contract("b.yaml", workflow="alpha")
    with pytest.raises(ContractError) as caught:
        load_contracts([broken, invalid, first, second])
    assert [(i.file, i.field) for i in caught.value.issues] == [
        (str(broken), ""),
        (str(invalid), ""),
        (str(second), "workflow"),
        (str(second), "upstreams.tools.mount"),
    ]


def test_load_contracts_of_nothing_is_an_empty_list():
    assert load_contracts([]) == []


def test_load_contract_accepts_a_string_path(tmp_path, contract_doc):
    path = tmp_path / "flow.yaml"
    path.write_text(yaml.safe_dump(contract_doc()))
    assert load_contract(str(path)).source == str(path)
    assert isinstance(load_contract(Path(path)).content_hash, str)


DRAFT7_PAIR = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
               "items": [{"type": "string"}, {"type": "integer"}], "additionalItems": False}


def test_a_schema_naming_draft_07_is_checked_and_enforced_as_draft_07(make_contract):
    contract = make_contract(schemas={"pair.v1": DRAFT7_PAIR},
                             steps={"first": {"output": {"schema": "pair.v1"}}})
    schema = contract.steps["first"].output_schema
    assert schema is not None
    assert schema.first_fault(["sku-1", 2], "output") is None
    assert schema.first_fault(["sku-1", "two"], "output") is not None


def test_a_schema_naming_an_unknown_draft_is_refused_naming_it(contract_issues):
    issues = contract_issues(schemas={"x.v1": {"$schema": "https://example.com/my-draft",
                                               "type": "object"}})
    assert [(i.field, i.message.split(":")[0]) for i in issues] == [
        ("schemas.x.v1", "unknown $schema 'https")]


def test_a_case_insensitive_upstream_matches_its_steps_in_lower_case(make_contract):
    contract = make_contract(upstreams={"tools": {"url": "http://t", "case_insensitive": True,
                                                  "allow_method_override": True}},
                             steps={"first": {"match": {"upstream": "tools", "method": "POST",
                                                        "path": "/Orders/Confirm/"}}})

    assert contract.upstreams["tools"].case_insensitive
    assert contract.upstreams["tools"].allow_method_override
    assert contract.steps["first"].match.path == "/orders/confirm"
    assert contract.step_for("tools", "POST", "/orders/confirm") is contract.steps["first"]
