"""Evaluation: strict types, short-circuit logic, whitelisted functions, `ExprError` only."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from assay.workflow.expr.lexer import scan_number
from assay.workflow.expr.nodes import FUNCTIONS as ARITY
from assay.workflow.expr.nodes import (
    And,
    Boolean,
    Call,
    Compare,
    CompareOp,
    Expr,
    ExprError,
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
)


def describe(value: Value) -> str:
    """The type of a value in the language's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, tuple):
        return "a list"
    return "a number"


def _is_number(value: Value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _family(value: Value) -> str:
    return describe(value).removeprefix("a ")


def truthy(value: Value) -> bool:
    """The truth of a condition. Strict: only a boolean is a condition.

    There is no implicit truthiness: an empty string, `0` or `null` is not false,
    it is a mistake, so a condition that forgot a comparison fails loudly.

    Raises:
        ExprError: `value` is not a boolean.
    """
    if isinstance(value, bool):
        return value
    raise ExprError(f"a condition must be true or false, got {describe(value)}")


def _same(a: Value, b: Value) -> bool:
    """Equality inside lists: values of different types are simply different."""
    if _is_number(a) and _is_number(b):
        return a == b
    if _family(a) != _family(b):
        return False
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _equal(op: str, a: Value, b: Value) -> bool:
    if a is not None and b is not None and _family(a) != _family(b):
        mixed = {_family(a), _family(b)} == {"string", "number"}
        hint = "; convert text with number()" if mixed else ""
        raise ExprError(f"'{op}' cannot compare {describe(a)} with {describe(b)}{hint}")
    return _same(a, b)


def _member(op: str, a: Value, b: Value) -> bool:
    if isinstance(b, tuple):
        return any(_same(a, x) for x in b)
    if isinstance(b, str):
        if not isinstance(a, str):
            raise ExprError(f"'{op}' looks for a string in a string, got {describe(a)}")
        return a in b
    raise ExprError(f"'{op}' needs a list or a string on its right, got {describe(b)}")


def _order(op: str, a: Value, b: Value) -> bool:
    if not ((_is_number(a) and _is_number(b)) or (isinstance(a, str) and isinstance(b, str))):
        raise ExprError(
            f"'{op}' orders two numbers or two strings, not {describe(a)} and {describe(b)}"
        )
    x: Any = a
    y: Any = b
    match op:
        case "<":
            return bool(x < y)
        case "<=":
            return bool(x <= y)
        case ">":
            return bool(x > y)
        case _:
            return bool(x >= y)


def compare(op: CompareOp, a: Value, b: Value) -> bool:
    """Apply a comparison operator.

    `==`/`!=` compare values of one type (numbers by value, lists item by item);
    either side may be `null`. Ordering takes two numbers or two strings. `in`
    looks for an item in a list or a substring in a string.

    Raises:
        ExprError: the operands' types do not fit the operator.
    """
    match op:
        case "==":
            return _equal(op, a, b)
        case "!=":
            return not _equal(op, a, b)
        case "in":
            return _member(op, a, b)
        case "not in":
            return not _member(op, a, b)
        case _:
            return _order(op, a, b)


def _finite(result: int | float) -> int | float:
    if isinstance(result, float) and not math.isfinite(result):
        raise ExprError("number out of range")
    return result


def arithmetic(op: str, a: Value, b: Value) -> int | float:
    """`a op b` for `+ - * /` on numbers; `/` always gives a float.

    Raises:
        ExprError: an operand is not a number, division by zero, or a result out of range.
    """
    if (
        isinstance(a, bool)
        or isinstance(b, bool)
        or not isinstance(a, int | float)
        or not isinstance(b, int | float)
    ):
        hint = "; convert text with number()" if isinstance(a, str) or isinstance(b, str) else ""
        raise ExprError(f"'{op}' needs two numbers, got {describe(a)} and {describe(b)}{hint}")
    try:
        match op:
            case "+":
                return _finite(a + b)
            case "-":
                return _finite(a - b)
            case "*":
                return _finite(a * b)
            case _:
                if b == 0:
                    raise ExprError("division by zero")
                return _finite(a / b)
    except OverflowError:
        raise ExprError("number out of range") from None


def parse_number(text: str) -> int | float:
    """`number(text)`: surrounding whitespace, an optional sign, then a number literal.

    Raises:
        ExprError: anything else, or a value out of range.
    """
    body = text.strip()
    start = 1 if body[:1] in ("+", "-") else 0
    if not body or scan_number(body, start) != len(body):
        shown = body if len(body) <= 40 else body[:37] + "..."
        raise ExprError(f"number() cannot read {shown!r} as a number")
    try:
        if any(c in body for c in ".eE"):
            return _finite(float(body))
        return int(body)
    except ValueError:  # more digits than int() converts
        raise ExprError("number() got a number with too many digits") from None


def _text(name: str, value: Value) -> str:
    if not isinstance(value, str):
        raise ExprError(f"{name}() needs a string, got {describe(value)}")
    return value


def _len(value: Value) -> Value:
    if isinstance(value, str | tuple):
        return len(value)
    raise ExprError(f"len() needs a string or a list, got {describe(value)}")


def _number(value: Value) -> Value:
    if _is_number(value):
        return value
    return parse_number(_text("number", value))


FUNCTIONS: Mapping[str, Callable[..., Value]] = {
    "len": _len,
    "number": _number,
    "lower": lambda s: _text("lower", s).lower(),
    "contains": lambda s, sub: _text("contains", sub) in _text("contains", s),
    "startswith": lambda s, p: _text("startswith", s).startswith(_text("startswith", p)),
    "trim": lambda s: _text("trim", s).strip(),
}
"""Implementations of the whitelisted functions (the same names as `nodes.FUNCTIONS`)."""


def _value_of(raw: object, where: str) -> Value:
    """A context value as an expression value: JSON-like data only."""
    if raw is None:
        return None
    if isinstance(raw, str | bool | int):
        return raw
    if isinstance(raw, float):
        if not math.isfinite(raw):
            raise ExprError(f"{where} is not a finite number")
        return raw
    if isinstance(raw, list | tuple):
        return tuple(_value_of(x, where) for x in raw)
    raise ExprError(
        f"{where} is {type(raw).__name__}; expressions handle strings, numbers, "
        "booleans, null and lists"
    )


class _Evaluator:
    def __init__(self, context: Mapping[str, Any]) -> None:
        self.context = context

    def run(self, node: Expr) -> Value:
        match node:
            case String(value) | Boolean(value):
                return value
            case Number(value):
                return value
            case Null():
                return None
            case ListExpr(items):
                return tuple(self.run(i) for i in items)
            case TaskRef(path):
                return self.task(path)
            case StepRef(step, attr):
                return self.step(step, attr)
            case Call(name, args):
                fn = FUNCTIONS.get(name)
                if fn is None or len(args) != ARITY[name]:
                    raise ExprError(f"no function {name}() of {len(args)} arguments")
                return fn(*(self.run(a) for a in args))
            case Neg(operand):
                inner = self.run(operand)
                if isinstance(inner, bool) or not isinstance(inner, int | float):
                    raise ExprError(f"unary '-' needs a number, got {describe(inner)}")
                return -inner
            case Not(operand):
                return not truthy(self.run(operand))
            case And(operands):
                return all(truthy(self.run(x)) for x in operands)
            case Or(operands):
                return any(truthy(self.run(x)) for x in operands)
            case Compare(op, left, right):
                return compare(op, self.run(left), self.run(right))
            case Sum(first, rest) | Product(first, rest):
                acc = self.run(first)
                for sign, x in rest:
                    acc = arithmetic(sign, acc, self.run(x))
                return acc
        raise ExprError(f"not an expression node: {type(node).__name__}")

    def task(self, path: tuple[str, ...]) -> Value:
        where = "task." + ".".join(path)
        value: object = self.context.get("task")
        for part in path:
            if not (isinstance(value, Mapping) and part in value):
                hint = "; write 'task.a - 1' to subtract" if "-" in where else ""
                raise ExprError(f"unknown reference {where}: the task has no such field{hint}")
            value = value[part]
        return _value_of(value, where)

    def step(self, step: str, attr: str) -> Value:
        where = f"steps.{step}.{attr}"
        steps = self.context.get("steps")
        entry = steps.get(step) if isinstance(steps, Mapping) else None
        if entry is not None and not isinstance(entry, Mapping):
            raise ExprError(f"{where}: the context holds no record for step {step!r}")
        if attr == "succeeded":
            if entry is None:
                return False  # a step that has not run has not succeeded
            done = entry.get("succeeded", "output" in entry)
            if not isinstance(done, bool):
                raise ExprError(f"{where} is not a boolean in the context")
            return done
        if entry is None or "output" not in entry:
            raise ExprError(f"unknown reference {where}: step {step!r} has no output")
        output = entry["output"]
        if not isinstance(output, str):
            raise ExprError(f"{where} is not a string in the context")
        return output


def evaluate(expr: Expr, context: Mapping[str, Any]) -> Value:
    """Evaluate `expr` against a context shaped like a template's.

    The context holds `task` (the run's input, a mapping) and `steps` (step id ->
    `{"output": str, "succeeded": bool}`; `succeeded` defaults to whether an output
    is present, and a step missing from `steps` has not succeeded).

    Raises:
        ExprError: a type mismatch, an unknown reference, a bad number, a division
            by zero or an out-of-range result. Never any other exception.
    """
    try:
        return _Evaluator(context).run(expr)
    except RecursionError:  # only a hand-built tree or deeply nested input data gets here
        raise ExprError("the expression or its data nests too deeply to evaluate") from None


def holds(expr: Expr, context: Mapping[str, Any]) -> bool:
    """Evaluate a condition: `truthy(evaluate(expr, context))`.

    Raises:
        ExprError: evaluation fails or the result is not a boolean.
    """
    return truthy(evaluate(expr, context))
