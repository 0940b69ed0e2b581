"""CEL conditions: compiled once, evaluated against only the fields they read."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from cel_expr_python import cel

from stepguard.contracts.conditions import (
    ENTRY_VARIABLES,
    EXIT_VARIABLES,
    ConditionSyntaxError,
    compile_condition,
)

CONTEXT: dict[str, Any] = {
    "input": {"order_id": "ord-1", "qty": 2, "tags": ["gift", "rush"]},
    "output": {
        "order_id": "ord-1",
        "customer": {"name": "Ada", "tier": "gold"},
        "items": [{"sku": "a", "qty": 0}, {"sku": "b", "qty": 3}],
        "done": True,
    },
    "state": {"order_id": "ord-1", "approved": True, "slot_id": "s-7"},
    "status": 200,
}


def exit_condition(expr: str):
    return compile_condition(expr, EXIT_VARIABLES, "postcondition")


def cel_directly(expr: str, context: dict[str, Any]) -> Any:
    """The CEL runtime's own answer on the whole context: the oracle for narrowing."""
    env = cel.NewEnv(variables={"input": cel.Type.DYN, "output": cel.Type.DYN,
                                "state": cel.Type.Map(cel.Type.STRING, cel.Type.DYN),
                                "status": cel.Type.INT})
    result = env.compile(expr).eval(data=context)
    return None if result.type() == cel.Type.ERROR else result.plain_value()


# --- compiling ---------------------------------------------------------------------------------


def test_a_compiled_condition_keeps_its_expression_drift_and_message():
    cond = compile_condition("input.qty > 0", ENTRY_VARIABLES, "freshness", "qty must be set")
    assert (cond.expr, cond.drift, cond.message) == ("input.qty > 0", "freshness",
                                                     "qty must be set")


@pytest.mark.parametrize("expr", ["input.qty >", "input.qty > > 1", "(input.qty", "'open"])
def test_a_syntax_error_does_not_compile_and_says_where(expr):
    with pytest.raises(ConditionSyntaxError) as caught:
        exit_condition(expr)
    message = str(caught.value)
    assert message.startswith("<input>:1:")
    assert "Syntax error" in message
    assert "INVALID_ARGUMENT" not in message and "ERROR:" not in message


@pytest.mark.parametrize(("expr", "variables", "unknown"), [
    ("output.order_id == 'ord-1'", ENTRY_VARIABLES, "output.order_id"),
    ("status == 200", ENTRY_VARIABLES, "status"),
    ("result.ok", EXIT_VARIABLES, "result.ok"),
    ("env.HOME != ''", EXIT_VARIABLES, "env.HOME"),
])
def test_a_variable_the_context_does_not_offer_does_not_compile(expr, variables, unknown):
    with pytest.raises(ConditionSyntaxError, match=f"undeclared reference to '{unknown}'"):
        compile_condition(expr, variables, "precondition")


def test_a_condition_syntax_error_is_a_value_error():
    assert issubclass(ConditionSyntaxError, ValueError)


# --- evaluating --------------------------------------------------------------------------------


@pytest.mark.parametrize(("expr", "expected"), [
    ("input.order_id == state.order_id", True),
    ("input.order_id == 'ord-2'", False),
    ("output.customer.tier == 'gold' && state.approved", True),
    ("status == 200", True),
    ("status >= 500", False),
    ("output.items.exists(i, i.qty > 0)", True),
    ("output.items.all(i, i.qty > 0)", False),
    ("has(output.done) && output.done == true", True),
    ("has(output.partial)", False),
    ("'rush' in input.tags", True),
    ("size(output.items) == 2", True),
])
def test_holds_reports_whether_the_condition_is_true(expr, expected):
    outcome = exit_condition(expr).holds(CONTEXT)
    assert outcome.ok is True
    assert outcome.value is expected
    assert (outcome.missing, outcome.error) == (None, None)


@pytest.mark.parametrize(("expr", "value"), [
    ("input.qty * 2", 4),
    ("output.customer.name", "Ada"),
    ("output.items[1].sku", "b"),
    ("status", 200),
    ("state.approved", True),
])
def test_evaluate_returns_the_value_of_any_type(expr, value):
    outcome = exit_condition(expr).evaluate(CONTEXT)
    assert outcome.ok is True
    assert outcome.value == value


@pytest.mark.parametrize(("expr", "type_name", "value"), [
    ("input.qty", "int", 2),
    ("output.customer.name", "str", "Ada"),
    ("double(input.qty) * 1.5", "float", 3.0),
])
def test_holds_is_not_ok_when_the_result_is_not_a_bool(expr, type_name, value):
    outcome = exit_condition(expr).holds(CONTEXT)
    assert outcome.ok is False
    assert outcome.value == value
    assert outcome.error == f"condition returned {type_name}, not bool"
    assert outcome.missing is None


@pytest.mark.parametrize(("expr", "context", "missing"), [
    ("input.order_id == 'ord-1'", {"input": {}}, "input.order_id"),
    ("input.order_id == 'ord-1'", {"input": None}, "input.order_id"),
    ("input.order_id == 'ord-1'", {}, "input.order_id"),
    ("state.slot_id != ''", {"state": {}}, "state.slot_id"),
    ("input.order_id == state.order_id", {"input": {"order_id": "o"}, "state": {}},
     "state.order_id"),
    ("output.customer.name == 'Ada'", {"output": {"customer": {}}}, "output.customer.name"),
    ("output.customer.name == 'Ada'", {"output": {"customer": "Ada"}}, "output.customer.name"),
    ("output.customer.name == 'Ada'", {"output": {}}, "output.customer"),
    ("has(output.done) && output.total > 0", {"output": {"done": True}}, "output.total"),
])
def test_a_missing_field_is_named_by_its_dotted_path(expr, context, missing):
    outcome = exit_condition(expr).holds(context)
    assert outcome.ok is False
    assert outcome.missing == missing
    assert outcome.error


def test_a_failure_unrelated_to_missing_fields_has_an_error_but_no_missing_path():
    outcome = exit_condition("output.items[5].qty > 0").holds(CONTEXT)
    assert outcome.ok is False
    assert outcome.missing is None
    assert "index" in outcome.error.lower()


def test_has_on_an_absent_field_is_a_false_value_not_a_missing_field():
    outcome = exit_condition("has(output.partial)").holds({"output": {}})
    assert (outcome.ok, outcome.value, outcome.missing) == (True, False, None)


def test_evaluating_does_not_change_the_context():
    before = json.loads(json.dumps(CONTEXT))
    exit_condition("output.items.exists(i, i.qty > 0) && input.order_id == 'x'").holds(CONTEXT)
    assert before == CONTEXT


@pytest.mark.parametrize("expr", [
    "output.customer",
    "output.items",
    "output",
    "{'id': output.order_id, 'tags': input.tags}",
])
def test_a_composite_value_comes_back_as_plain_json_data(expr):
    # Regression: Condition.evaluate once left nested CEL accessor objects (from
    # result.value()) inside dicts and lists; they neither equalled the input data nor
    # serialized to JSON, so a `record:` of an object or list could not be stored.
    outcome = exit_condition(expr).evaluate(CONTEXT)
    expected = cel_directly(expr, CONTEXT)
    assert outcome.value == expected
    assert orjson.loads(orjson.dumps(outcome.value)) == expected


# --- narrowing: a condition is fed only the fields it reads ------------------------------------


@pytest.mark.parametrize(("expr", "reads"), [
    ("input.order_id == state.order_id", {"input": {"order_id"}, "state": {"order_id"}}),
    ("output.customer.name == 'Ada' && output.done",
     {"output": {"customer", "done"}}),
    ("has(output.partial)", {"output": {"partial"}}),
    ("output.items.exists(i, i.qty > 0)", {"output": {"items"}}),
    ("size(output) > 0", {"output": None}),
    ("output['order_id'] == 'x'", {"output": None}),
    ("'done' in output && output.done", {"output": None}),
    ("status == 200", {"status": None}),
])
def test_a_condition_reads_only_the_top_level_fields_it_names(expr, reads):
    cond = exit_condition(expr)
    assert {k: (set(v) if v is not None else None) for k, v in cond.reads.items()} == reads


NARROWING = [
    "input.order_id == state.order_id",
    "has(output.done) && output.done == true",
    "has(output.partial)",
    "has(state.confirmation_id)",
    "has(output.customer.tier)",
    "output.items.exists(i, i.qty > 0)",
    "output.items.all(i, i.qty > 0)",
    "output.items.exists_one(i, i.sku == 'b')",
    "output.items.map(i, i.qty).exists(q, q == 3)",
    "output.items.filter(i, i.qty > 0).size() == 1",
    "output.items[0].qty == 0",
    "output.items[1].sku + '-' + input.order_id",
    "size(output.items) == 2",
    "size(output) == 4",
    "output['customer'].name == 'Ada'",
    "'done' in output && output.done",
    "output.customer.name + '/' + output.customer.tier",
    "input.tags.exists(t, t == 'rush') && state.approved",
    "state.approved && input.qty > 1 && status == 200",
    "output.items.exists(state, state.qty > 2)",
    "output.nope == 1",
    "state.missing == 1",
    pytest.param("output.exists(k, k == 'done')", id="macro-on-output-itself"),
    pytest.param("output.all(k, k != 'done')", id="all-on-output-itself"),
    pytest.param("state.exists(k, k == 'slot_id')", id="macro-on-state-itself"),
    pytest.param("output.size() == 4", id="method-on-output-itself"),
]


@pytest.mark.parametrize("expr", NARROWING)
def test_narrowing_the_context_does_not_change_the_result(expr):
    # Regression, the last four: conditions._reads once took `output.exists(...)` and
    # `output.size()` for a field access `output.<field>`, narrowed the variable to a map
    # holding only a (non-existent) key "exists"/"size", and the macro or method saw an empty map.
    expected = cel_directly(expr, CONTEXT)
    outcome = exit_condition(expr).evaluate(CONTEXT)
    if expected is None:
        assert outcome.ok is False
    else:
        assert outcome.ok is True
        assert outcome.value == expected


def test_a_type_mismatch_names_no_missing_field():
    cond = compile_condition("input.order_id.startsWith('ord-')", ENTRY_VARIABLES, "shape")
    outcome = cond.holds({"input": {"order_id": 7}, "state": {}})
    assert not outcome.ok and outcome.missing is None
    assert "no matching overloads" in (outcome.error or "").lower()


def test_the_missing_field_is_the_one_not_found_not_an_absent_guarded_one():
    cond = compile_condition("(has(input.coupon) ? input.coupon != '' : true) && input.total > 0",
                             ENTRY_VARIABLES, "shape")
    outcome = cond.holds({"input": {"coupon": "c-1"}, "state": {}})
    assert outcome.missing == "input.total"
    outcome = cond.holds({"input": {}, "state": {}})
    assert outcome.missing == "input.total"
