"""The error text of cel-expr-python that contracts/conditions.py reads (issue 24, §6): which key
was missing, a field of a non-object, a bad regular expression, a compile error's head and an
undeclared var. Checked on the installed cel-expr-python, raw, before conditions.py reads it;
pyproject.toml bounds the package below its next minor release, and a failure here names the
text that changed."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import pytest
from cel_expr_python import cel

from stepguard.contracts import conditions

CEL = version("cel-expr-python")
ENV = cel.NewEnv(variables={"input": cel.Type.DYN})


def guard(holds: bool, what: str, text: str) -> None:
    if not holds:
        pytest.fail(f"cel-expr-python {CEL} changed its error text: {what}; it now reads "
                    f"{text!r}. Adapt contracts/conditions.py and keep pyproject.toml's "
                    "cel-expr-python bound below this version until it does.", pytrace=False)


def evaluation_error(expr: str, data: dict[str, Any]) -> str:
    result = ENV.compile(expr).eval(data=data)
    assert result.type() == cel.Type.ERROR, f"{expr} did not fail on {data}"
    return str(result.value())


def compile_error(expr: str) -> str:
    with pytest.raises(RuntimeError) as raised:
        ENV.compile(expr)
    return str(raised.value)


def test_a_missing_key_is_named_as_conditions_reads_it() -> None:
    text = evaluation_error("input.order_id == 'x'", {"input": {}})
    found = conditions._KEY_NOT_FOUND.search(text)
    guard(found is not None and found.group(1) == "order_id",
          f"a missing key no longer matches {conditions._KEY_NOT_FOUND.pattern!r}", text)


def test_a_field_of_a_non_object_is_told_as_conditions_reads_it() -> None:
    text = evaluation_error("input.order.id == 'x'", {"input": {"order": "a string"}})
    guard(conditions._NOT_AN_OBJECT in text,
          f"a field of a non-object no longer says {conditions._NOT_AN_OBJECT!r}", text)


def test_a_bad_regular_expression_is_told_before_the_pattern() -> None:
    text = evaluation_error("input.s.matches(input.p)", {"input": {"s": "x", "p": "(secret"}})
    guard(conditions._REGEX_ERROR in text and text.index(conditions._REGEX_ERROR)
          < text.index("secret"),
          f"a bad pattern no longer says {conditions._REGEX_ERROR!r} before quoting it", text)
    guard(conditions.scrub(text).endswith(conditions._REGEX_ERROR), "scrub keeps the pattern",
          text)


def test_an_undeclared_var_is_told_as_conditions_reads_it() -> None:
    text = compile_error("vars.limit == 1")
    guard(conditions._UNDECLARED_VAR.search(text) is not None,
          f"an undeclared var no longer matches {conditions._UNDECLARED_VAR.pattern!r}", text)


def test_a_compile_error_s_first_line_is_its_message_after_its_prefixes() -> None:
    text = compile_error("input.a ==")
    head = conditions._compile_message(text)
    guard(text.startswith("INVALID_ARGUMENT: ERROR: ") and head.startswith("<input>:1:")
          and "Syntax error" in head,
          "a compile error no longer starts INVALID_ARGUMENT: ERROR: <input>:LINE:COL", text)
