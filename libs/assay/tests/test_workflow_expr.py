"""The workflow expression language: grammar, strict evaluation, typed errors, limits."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from assay.workflow.expr import (
    FUNCTIONS,
    MAX_DEPTH,
    MAX_LENGTH,
    And,
    Boolean,
    Call,
    Compare,
    Expr,
    ExprError,
    ExprSyntaxError,
    ListExpr,
    Neg,
    Not,
    Null,
    Number,
    Or,
    Product,
    StepRef,
    String,
    Sum,
    TaskRef,
    Value,
    evaluate,
    holds,
    parse,
    truthy,
    unparse,
)
from assay.workflow.expr import evaluation as evaluation_module

CONTEXT: dict[str, Any] = {
    "task": {
        "n": 3,
        "x": 2.5,
        "q": "What is 2 + 2?",
        "tags": ["math", "easy"],
        "flag": True,
        "none": None,
        "nested": {"deep": {"value": 7}},
        "obj": {"a": 1},
        "my-field": "dashed",
    },
    "steps": {
        "solve": {"output": " 42 "},
        "judge": {"output": "PASS", "succeeded": True},
        "flaky": {"succeeded": False},
        "s-1": {"output": "dash"},
    },
}


def ev(text: str) -> Value:
    return evaluate(parse(text), CONTEXT)


# --- a table of expressions and what they evaluate to ---------------------------------------------

TABLE: list[tuple[str, Value]] = [
    # literals
    ("1", 1),
    ("2.5", 2.5),
    ("1e3", 1000.0),
    ("1.5E-2", 0.015),
    ('"double"', "double"),
    ("'single'", "single"),
    (r'"a\"b\\c\n\t\r\u00e9"', 'a"b\\c\n\t\ré'),
    ("true", True),
    ("false", False),
    ("null", None),
    ("[]", ()),
    ("[1, 'a', [true, null]]", (1, "a", (True, None))),
    ("[1, 2,]", (1, 2)),
    # arithmetic: precedence, left to right, unary minus, `/` gives a float
    ("1 + 2 * 3", 7),
    ("(1 + 2) * 3", 9),
    ("10 - 4 - 3", 3),
    ("2 * 3 / 4", 1.5),
    ("7 / 2", 3.5),
    ("4 / 2", 2.0),
    ("-3 + 1", -2),
    ("--3", 3),
    ("2 * -task.n", -6),
    ("task.n - 1", 2),
    ("task.x * 2", 5.0),
    # comparisons
    ("1 == 1.0", True),
    ("1 != 2", True),
    ("2 < 3", True),
    ("3 <= 3", True),
    ("2.5 > 3", False),
    ("3 >= 3.0", True),
    ("'abc' < 'abd'", True),
    ("'B' < 'a'", True),
    ("null == null", True),
    ("task.none == null", True),
    ("task.q == null", False),
    ("task.q != null", True),
    ("[1, [2]] == [1.0, [2]]", True),
    ("[1, 'a'] == [1, 2]", False),
    ("[1] == [1, 1]", False),
    ("true == true", True),
    # membership
    ("'math' in task.tags", True),
    ("'hard' not in task.tags", True),
    ("3 in [1, 2, 3]", True),
    ("3 in [1, 'x', [3]]", False),
    ("'2 + 2' in task.q", True),
    ("'' in ''", True),
    # logic, short-circuit
    ("true and false", False),
    ("true or false", True),
    ("not false", True),
    ("not not true", True),
    ("not 1 == 2", True),
    ("false and 1 / 0 == 1", False),
    ("true or task.absent == 1", True),
    ("false or true and false", False),
    ("(false or true) and true", True),
    ("1 < 2 and 2 < 3 and 3 < 4", True),
    # references
    ("task.n", 3),
    ("task.tags", ("math", "easy")),
    ("task.nested.deep.value", 7),
    ("task.my-field", "dashed"),
    ("task.flag", True),
    ("steps.solve.output", " 42 "),
    ("steps.s-1.output", "dash"),
    ("steps.solve.succeeded", True),
    ("steps.judge.succeeded", True),
    ("steps.flaky.succeeded", False),
    ("steps.never_ran.succeeded", False),
    ("steps.judge.output == 'PASS'", True),
    # functions
    ("len('héllo')", 5),
    ("len(task.tags)", 2),
    ("len([])", 0),
    ("number(steps.solve.output)", 42),
    ("number(' -1.5e2 ')", -150.0),
    ("number('+7')", 7),
    ("number(3.5)", 3.5),
    ("number(trim(steps.solve.output)) == 42", True),
    ("lower('MiXeD')", "mixed"),
    ("contains(task.q, '2 + 2')", True),
    ("contains('abc', 'd')", False),
    ("startswith(steps.judge.output, 'PA')", True),
    ("trim('  x \\n')", "x"),
    # whitespace and layout do not matter
    ("  1\n+\t2 ", 3),
]


@pytest.mark.parametrize(("text", "expected"), TABLE, ids=[t for t, _ in TABLE])
def test_expression_evaluates_to(text: str, expected: Value) -> None:
    result = ev(text)
    assert result == expected
    assert type(result) is type(expected)


# --- syntax errors carry the column of the fault --------------------------------------------------

SYNTAX_ERRORS: list[tuple[str, int, str]] = [
    ("", 1, "unexpected the end of the expression"),
    ("1 +", 4, "unexpected the end"),
    ("(1 + 2", 7, "')' to close the '(' at column 1"),
    ("[1, 2", 6, "',' or ']' to close the '[' at column 1"),
    ("1 2", 3, "unexpected the number 2"),
    ("x == 1", 1, "unknown name 'x'"),
    ("task.n = 1", 8, "'=' is not an operator"),
    ("!true", 1, "'!' is not an operator"),
    ("1 < 2 < 3", 7, "comparisons do not chain"),
    ("1 == 2 != 3", 8, "comparisons do not chain"),
    ("'abc", 1, "unterminated string"),
    ("'ab\\q'", 4, "unknown escape \\q"),
    ("'\\u12'", 2, "\\u needs four hex digits"),
    ("1.", 1, "malformed number"),
    ("1e", 1, "malformed number"),
    ("1e999", 1, "out of range"),
    ("steps.solve", 1, "steps.<id>.output or steps.<id>.succeeded"),
    ("steps.solve.input", 1, "steps.<id>.output or steps.<id>.succeeded"),
    ("task.", 6, "expected a name after 'task.'"),
    ("task", 1, "write task.<field>"),
    ("1 + steps", 5, "write task.<field>"),
    ("len", 1, "len is a function; call it as len(...)"),
    ("len(1, 2)", 1, "len() takes 1 argument, got 2"),
    ("  contains('a')", 3, "contains() takes 2 arguments, got 1"),
    ("eval('1')", 1, "unknown function 'eval'"),
    ("__import__('os')", 1, "unknown function '__import__'"),
    ("a.b", 2, "unexpected character '.'"),
    ("steps.a.output.x", 15, "unexpected character '.'"),
    ("1 and", 6, "unexpected the end"),
    ("not", 4, "unexpected the end"),
    ("1 in", 5, "unexpected the end"),
    ("1 not 2", 3, "unexpected 'not'"),
    ("and", 1, "unexpected 'and'"),
    ("(1))", 4, "unexpected ')'"),
    ("[,]", 2, "unexpected ','"),
    ("1 ? 2", 3, "unexpected character '?'"),
    ("tâsk.n", 2, "unexpected character 'â'"),
    ("1 == 1 ;", 8, "unexpected character ';'"),
]


@pytest.mark.parametrize(
    ("text", "column", "message"), SYNTAX_ERRORS, ids=[t for t, *_ in SYNTAX_ERRORS]
)
def test_a_syntax_error_names_its_column(text: str, column: int, message: str) -> None:
    with pytest.raises(ExprSyntaxError) as info:
        parse(text)
    assert info.value.column == column
    assert message in str(info.value)
    assert str(info.value).startswith(f"column {column}: ")


def test_a_syntax_error_is_an_expr_error() -> None:
    with pytest.raises(ExprError):
        parse("(")


# --- evaluation errors are ExprError, never a syntax error or anything else --------------------

EVAL_ERRORS: list[tuple[str, str]] = [
    ("task.missing", "unknown reference task.missing"),
    ("task.n-1", "write 'task.a - 1' to subtract"),
    ("task.n.deeper", "unknown reference task.n.deeper"),
    ("task.obj", "task.obj is dict"),
    ("steps.nope.output", "unknown reference steps.nope.output"),
    ("steps.flaky.output", "step 'flaky' has no output"),
    (
        "steps.solve.output == 42",
        "cannot compare a string with a number; convert text with number()",
    ),
    ("1 == true", "cannot compare a number with a boolean"),
    ("[1] == 'a'", "cannot compare a list with a string"),
    ("1 < 'a'", "orders two numbers or two strings"),
    ("true < false", "orders two numbers or two strings"),
    ("[1] < [2]", "orders two numbers or two strings"),
    ("1 + 'a'", "'+' needs two numbers"),
    ("'a' + 'b'", "convert text with number()"),
    ("true * 2", "'*' needs two numbers"),
    ("-'a'", "unary '-' needs a number"),
    ("-true", "unary '-' needs a number"),
    ("1 / 0", "division by zero"),
    ("1.5 / 0.0", "division by zero"),
    ("1e300 * 1e300", "out of range"),
    ("1 in 1", "'in' needs a list or a string on its right"),
    ("1 in 'abc'", "'in' looks for a string in a string"),
    ("not 1", "a condition must be true or false, got a number"),
    ("1 and true", "got a number"),
    ("true and 'yes'", "got a string"),
    ("false or null", "got null"),
    ("len(3)", "len() needs a string or a list"),
    ("number('4x')", "cannot read '4x' as a number"),
    ("number('')", "cannot read '' as a number"),
    ("number('1_000')", "cannot read"),
    ("number('nan')", "cannot read"),
    ("number('١٢')", "cannot read"),
    ("number('1e999')", "out of range"),
    ("number(true)", "number() needs a string"),
    ("lower(1)", "lower() needs a string"),
    ("contains('a', 1)", "contains() needs a string"),
    ("startswith(null, 'a')", "startswith() needs a string"),
    ("trim([])", "trim() needs a string"),
]


@pytest.mark.parametrize(("text", "message"), EVAL_ERRORS, ids=[t for t, _ in EVAL_ERRORS])
def test_an_evaluation_error_is_an_expr_error(text: str, message: str) -> None:
    expr = parse(text)
    with pytest.raises(ExprError) as info:
        evaluate(expr, CONTEXT)
    assert not isinstance(info.value, ExprSyntaxError)
    assert message in str(info.value)


def test_number_with_too_many_digits_is_an_expr_error() -> None:
    with pytest.raises(ExprError, match="too many digits"):
        evaluate(parse("number(task.big)"), {"task": {"big": "9" * 5000}})


@pytest.mark.parametrize(
    ("context", "text"),
    [
        ({}, "task.x"),
        ({"task": "text"}, "task.x"),
        ({"steps": {"a": "not a record"}}, "steps.a.output"),
        ({"steps": {"a": "not a record"}}, "steps.a.succeeded"),
        ({"steps": []}, "steps.a.output"),
    ],
)
def test_a_malformed_context_is_an_expr_error(context: dict[str, Any], text: str) -> None:
    with pytest.raises(ExprError):
        evaluate(parse(text), context)


def test_context_values_of_the_wrong_type_are_expr_errors() -> None:
    with pytest.raises(ExprError, match="not a string"):
        evaluate(parse("steps.a.output"), {"steps": {"a": {"output": 3}}})
    with pytest.raises(ExprError, match="not a boolean"):
        evaluate(parse("steps.a.succeeded"), {"steps": {"a": {"succeeded": "yes"}}})
    with pytest.raises(ExprError, match="not a finite number"):
        evaluate(parse("task.x"), {"task": {"x": math.nan}})


# --- conditions are strict booleans ---------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, "", "false", None, (), (False,), 0.0])
def test_only_a_boolean_is_a_condition(value: Value) -> None:
    with pytest.raises(ExprError, match="a condition must be true or false"):
        truthy(value)


def test_truthy_returns_the_boolean_and_holds_evaluates_a_condition() -> None:
    assert truthy(True) is True
    assert truthy(False) is False
    assert holds(parse("steps.judge.output == 'PASS'"), CONTEXT) is True
    with pytest.raises(ExprError, match="got a string"):
        holds(parse("steps.judge.output"), CONTEXT)


# --- references -----------------------------------------------------------------------------------


def test_references_collects_task_fields_and_steps_from_everywhere() -> None:
    expr = parse(
        "len(task.q) > 3 and [steps.a.output, -task.n.m] != [] or not steps.b.succeeded"
        " and steps.a.output in task.tags"
    )
    assert expr.references() == {
        TaskRef(("q",)),
        TaskRef(("n", "m")),
        TaskRef(("tags",)),
        StepRef("a", "output"),
        StepRef("b", "succeeded"),
    }
    assert parse("1 + 2").references() == frozenset()


# --- the AST is immutable and the printer is canonical -------------------------------------------


def test_the_ast_is_immutable_and_hashable() -> None:
    expr = parse("1 + task.n")
    assert isinstance(expr, Sum)
    with pytest.raises(AttributeError):
        expr.first = Number(2)  # type: ignore[misc]
    assert hash(expr) == hash(parse("1+task.n"))
    assert {parse("[1, 'a']"), parse("[1,'a']")} == {parse("[1, 'a']")}


def test_int_and_float_literals_are_different_nodes() -> None:
    assert Number(1) != Number(1.0)
    assert parse("1") == Number(1)
    assert parse("1.0") == Number(1.0)
    with pytest.raises(ValueError, match="non-negative"):
        Number(-1)
    with pytest.raises(TypeError):
        Number(True)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("1+2*3", "1 + 2 * 3"),
        ("(1+2)*3", "(1 + 2) * 3"),
        ("1-(2-3)", "1 - (2 - 3)"),
        ("(1-2)-3", "(1 - 2) - 3"),
        ("-(1+2)", "-(1 + 2)"),
        ("not (true and false)", "not (true and false)"),
        ("not(1 == 2)", "not 1 == 2"),
        ("(not true) == false", "(not true) == false"),
        ("(1 < 2) == true", "(1 < 2) == true"),
        ('"it\'s"', '"it\'s"'),
        ("'a\"b'", '"a\\"b"'),
        ("[1,[2,3]]", "[1, [2, 3]]"),
        ("1e16", "1e+16"),
        ("0.5", "0.5"),
        ("steps.s-1.output not in task.tags", "steps.s-1.output not in task.tags"),
    ],
)
def test_unparse_prints_the_canonical_form(text: str, canonical: str) -> None:
    assert unparse(parse(text)) == canonical
    assert str(parse(text)) == canonical
    assert parse(canonical) == parse(text)


# --- limits ---------------------------------------------------------------------------------------


def test_an_expression_longer_than_the_cap_is_refused() -> None:
    parse("1" + " " * (MAX_LENGTH - 1))
    with pytest.raises(ExprSyntaxError, match=f"the limit is {MAX_LENGTH}") as info:
        parse("1" + " " * MAX_LENGTH)
    assert info.value.column == MAX_LENGTH + 1


@pytest.mark.parametrize(
    "build",
    [
        lambda n: "(" * n + "1" + ")" * n,
        lambda n: "[" * n + "]" * n,
        lambda n: "-" * n + "1",
        lambda n: "not " * n + "true",
        lambda n: "len(" * n + "'x'" + ")" * n,
    ],
    ids=["parens", "lists", "minus", "not", "calls"],
)
def test_nesting_deeper_than_the_cap_is_refused(build: Callable[[int], str]) -> None:
    parse(build(MAX_DEPTH - 1))
    with pytest.raises(ExprSyntaxError, match=f"more than {MAX_DEPTH} levels"):
        parse(build(MAX_DEPTH + 1))


def test_long_flat_chains_within_the_cap_parse_and_evaluate() -> None:
    terms = (MAX_LENGTH - 1) // 2
    assert ev("+".join(["1"] * terms)) == terms
    assert ev(" and ".join(["true"] * 200)) is True
    assert ev(" or ".join(["false"] * 200)) is False


def test_the_implementation_never_calls_eval_and_uses_no_regex() -> None:
    package = Path(evaluation_module.__file__).parent
    forbidden = {"eval", "exec", "compile", "literal_eval", "__import__", "getattr"}
    for source in package.glob("*.py"):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Name | ast.Attribute):
                name = node.id if isinstance(node, ast.Name) else node.attr
                assert name not in forbidden, f"{source.name} uses {name}"
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                modules.append(getattr(node, "module", None) or "")
                assert not {"re", "ast", "regex"} & set(modules), f"{source.name} imports {modules}"


def test_every_whitelisted_function_has_an_implementation() -> None:
    assert set(FUNCTIONS) == set(evaluation_module.FUNCTIONS)


# --- properties -----------------------------------------------------------------------------------

SOUP = [
    "1", "2.5", "1e3", "'s'", '"t"', "true", "false", "null", "task.n", "task.q",
    "steps.solve.output", "steps.flaky.succeeded", "task.tags", "(", ")", "[", "]", ",",
    "+", "-", "*", "/", "==", "!=", "<", "<=", ">", ">=", "in", "not", "and", "or",
    "len(", "number(", "lower(", "contains(", "startswith(", "trim(",
    " ", ".", "=", "!", "\\", "'", '"', "e", "x", "steps.", "task.",
]  # fmt: skip


def _parse_and_evaluate(text: str) -> None:
    try:
        expr = parse(text)
    except ExprSyntaxError as exc:
        column = exc.column
    else:
        try:
            evaluate(expr, CONTEXT)
        except ExprSyntaxError:
            pytest.fail("evaluation raised a syntax error")
        except ExprError:
            pass
        return
    assert 1 <= column <= len(text) + 1


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=60))
@example("(" * 500)
@example("-" * 2000)
@example("\x00\ud800")
def test_random_text_raises_nothing_but_expr_errors(text: str) -> None:
    _parse_and_evaluate(text)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(SOUP), max_size=25).map("".join))
def test_random_token_soup_raises_nothing_but_expr_errors(text: str) -> None:
    _parse_and_evaluate(text)


segments = st.text(alphabet="abxyz_-019", min_size=1, max_size=5)
tricky_text = st.text(
    alphabet=st.characters(codec=None) | st.sampled_from(['"', "'", "\\", "\n", "\x00", "\ud800"]),
    max_size=8,
)
non_negative_floats = st.floats(min_value=0, allow_nan=False, allow_infinity=False).filter(
    lambda x: math.copysign(1, x) > 0
)
leaves: st.SearchStrategy[Expr] = st.one_of(
    st.builds(String, tricky_text),
    st.builds(Number, st.integers(min_value=0, max_value=10**40)),
    st.builds(Number, non_negative_floats),
    st.builds(Boolean, st.booleans()),
    st.just(Null()),
    st.builds(TaskRef, st.lists(segments, min_size=1, max_size=3).map(tuple)),
    st.builds(StepRef, segments, st.sampled_from(["output", "succeeded"])),
)
COMPARE_OPS = ["==", "!=", "<", "<=", ">", ">=", "in", "not in"]


def _extend(children: st.SearchStrategy[Expr]) -> st.SearchStrategy[Expr]:
    some = st.lists(children, min_size=2, max_size=3).map(tuple)
    return st.one_of(
        st.builds(ListExpr, st.lists(children, max_size=3).map(tuple)),
        st.sampled_from(sorted(FUNCTIONS.items())).flatmap(
            lambda f: st.builds(
                Call, st.just(f[0]), st.lists(children, min_size=f[1], max_size=f[1]).map(tuple)
            )
        ),
        st.builds(Neg, children),
        st.builds(Not, children),
        st.builds(Compare, st.sampled_from(COMPARE_OPS), children, children),
        st.builds(
            Sum,
            children,
            st.lists(st.tuples(st.sampled_from(["+", "-"]), children), min_size=1, max_size=3).map(
                tuple
            ),
        ),
        st.builds(
            Product,
            children,
            st.lists(st.tuples(st.sampled_from(["*", "/"]), children), min_size=1, max_size=3).map(
                tuple
            ),
        ),
        st.builds(And, some),
        st.builds(Or, some),
    )


def _height(expr: Expr) -> int:
    return 1 + max((_height(c) for c in expr.children()), default=0)


expressions = st.recursive(leaves, _extend, max_leaves=24).filter(lambda e: _height(e) <= 20)


@settings(max_examples=500, deadline=None)
@given(expressions)
def test_a_printed_tree_parses_back_to_the_same_tree(expr: Expr) -> None:
    text = unparse(expr)
    assert parse(text) == expr
    assert unparse(parse(text)) == text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(segments, inner, max_size=3),
    max_leaves=8,
)
contexts = st.fixed_dictionaries(
    {
        "task": st.dictionaries(segments, json_values, max_size=4),
        "steps": st.dictionaries(
            segments,
            st.fixed_dictionaries(
                {}, optional={"output": st.text(max_size=5), "succeeded": st.booleans()}
            ),
            max_size=4,
        ),
    }
)


@settings(max_examples=500, deadline=None)
@given(expressions, contexts)
def test_evaluating_any_tree_gives_a_value_or_an_expr_error(
    expr: Expr, context: dict[str, Any]
) -> None:
    try:
        result = evaluate(expr, context)
    except ExprSyntaxError:
        pytest.fail("evaluation raised a syntax error")
    except ExprError:
        return
    assert result is None or isinstance(result, str | int | float | bool | tuple)


numbers = st.integers(min_value=-(10**30), max_value=10**30) | st.floats(
    allow_nan=False, allow_infinity=False
)
PYTHON_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}


def _literal(x: int | float) -> str:
    return "-" + repr(-x) if math.copysign(1, x) < 0 else repr(x)


@settings(max_examples=600, deadline=None)
@given(numbers, numbers, st.sampled_from(sorted(PYTHON_OPS)))
@example(1, 1.0, "==")
@example(10**20, 1e20, "==")
@example(0.0, -0.0, "<")
@example(2**53 + 1, float(2**53), ">")
def test_numeric_operators_agree_with_python(a: int | float, b: int | float, op: str) -> None:
    text = f"{_literal(a)} {op} {_literal(b)}"
    try:
        expected = PYTHON_OPS[op](a, b)
    except OverflowError:
        expected = None
    if isinstance(expected, float) and not math.isfinite(expected):
        expected = None
    if expected is None:
        with pytest.raises(ExprError, match="out of range"):
            evaluate(parse(text), {})
    else:
        result = evaluate(parse(text), {})
        assert result == expected
        assert type(result) is type(expected)


@settings(max_examples=200, deadline=None)
@given(numbers)
def test_number_reads_back_what_a_number_prints_as(x: int | float) -> None:
    assert evaluate(Call("number", (String(repr(x)),)), {}) == x
