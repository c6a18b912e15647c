"""The expression AST: immutable nodes, the references they hold, and the canonical printer.

Every node is a frozen dataclass. `unparse` prints a node so that `parse` reads the
same node back; parentheses appear only where precedence needs them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from assay.kernel.errors import AssayError

MAX_LENGTH: Final = 2_000
"""Longest expression text, in characters."""

MAX_DEPTH: Final = 32
"""Deepest nesting of parentheses, lists, calls and unary operators."""

FUNCTIONS: Final[Mapping[str, int]] = {
    "len": 1,
    "number": 1,
    "lower": 1,
    "contains": 2,
    "startswith": 2,
    "trim": 1,
}
"""The whitelist of callable functions and how many arguments each takes."""

Value: TypeAlias = "str | int | float | bool | tuple[Value, ...] | None"
"""What an expression evaluates to. Lists are tuples, so values are immutable."""

CompareOp: TypeAlias = Literal["==", "!=", "<", "<=", ">", ">=", "in", "not in"]
SumOp: TypeAlias = Literal["+", "-"]
ProductOp: TypeAlias = Literal["*", "/"]
StepAttr: TypeAlias = Literal["output", "succeeded"]


class ExprError(AssayError):
    """An expression cannot be evaluated: a type mismatch, an unknown reference, a bad number.

    The base of every error the expression language raises.
    """


class ExprSyntaxError(ExprError):
    """An expression does not parse. `column` is the 1-based character offset of the fault."""

    def __init__(self, message: str, column: int) -> None:
        super().__init__(f"column {column}: {message}")
        self.column = column
        self.reason = message


class Expr:
    """Base of every AST node. Nodes are immutable and compare by structure."""

    __slots__ = ()

    def children(self) -> tuple[Expr, ...]:
        """The direct sub-expressions, left to right."""
        return ()

    def references(self) -> frozenset[Reference]:
        """Every `task.*` and `steps.*` reference anywhere in the expression."""
        found: set[Reference] = set()
        stack: list[Expr] = [self]
        while stack:
            node = stack.pop()
            if isinstance(node, TaskRef | StepRef):
                found.add(node)
            stack.extend(node.children())
        return frozenset(found)

    def __str__(self) -> str:
        return unparse(self)


@dataclass(frozen=True, slots=True)
class String(Expr):
    """A string literal."""

    value: str


@dataclass(frozen=True, slots=True, eq=False)
class Number(Expr):
    """A non-negative number literal (the parser writes `-1` as `Neg(Number(1))`).

    Two numbers are the same node only if both are ints or both floats.
    """

    value: int | float

    def __post_init__(self) -> None:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise TypeError(f"Number holds an int or a float, not {type(v).__name__}")
        if not math.isfinite(v) or math.copysign(1, v) < 0:
            raise ValueError(f"Number holds a finite non-negative value, not {v!r}")

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Number)
            and type(self.value) is type(other.value)
            and self.value == other.value
        )

    def __hash__(self) -> int:
        return hash((type(self.value).__name__, self.value))


@dataclass(frozen=True, slots=True)
class Boolean(Expr):
    """`true` or `false`."""

    value: bool


@dataclass(frozen=True, slots=True)
class Null(Expr):
    """`null`."""


@dataclass(frozen=True, slots=True)
class ListExpr(Expr):
    """A list literal `[a, b]`."""

    items: tuple[Expr, ...]

    def children(self) -> tuple[Expr, ...]:
        return self.items


@dataclass(frozen=True, slots=True)
class TaskRef(Expr):
    """`task.<field>[.<field>...]`: a field of the run's input."""

    path: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StepRef(Expr):
    """`steps.<id>.output` (a string) or `steps.<id>.succeeded` (a boolean)."""

    step: str
    attr: StepAttr


Reference: TypeAlias = TaskRef | StepRef


@dataclass(frozen=True, slots=True)
class Call(Expr):
    """A call of a whitelisted function (see `FUNCTIONS`)."""

    name: str
    args: tuple[Expr, ...]

    def children(self) -> tuple[Expr, ...]:
        return self.args


@dataclass(frozen=True, slots=True)
class Neg(Expr):
    """Unary minus."""

    operand: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.operand,)


@dataclass(frozen=True, slots=True)
class Not(Expr):
    """Boolean negation."""

    operand: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.operand,)


@dataclass(frozen=True, slots=True)
class Compare(Expr):
    """One comparison. Comparisons do not chain: `a < b < c` is a syntax error."""

    op: CompareOp
    left: Expr
    right: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.left, self.right)


@dataclass(frozen=True, slots=True)
class Sum(Expr):
    """`first (+|-) x (+|-) y ...`, evaluated left to right."""

    first: Expr
    rest: tuple[tuple[SumOp, Expr], ...]

    def children(self) -> tuple[Expr, ...]:
        return (self.first, *(x for _, x in self.rest))


@dataclass(frozen=True, slots=True)
class Product(Expr):
    """`first (*|/) x (*|/) y ...`, evaluated left to right."""

    first: Expr
    rest: tuple[tuple[ProductOp, Expr], ...]

    def children(self) -> tuple[Expr, ...]:
        return (self.first, *(x for _, x in self.rest))


@dataclass(frozen=True, slots=True)
class And(Expr):
    """`a and b and ...`: short-circuit, every operand evaluated must be a boolean."""

    operands: tuple[Expr, ...]

    def children(self) -> tuple[Expr, ...]:
        return self.operands


@dataclass(frozen=True, slots=True)
class Or(Expr):
    """`a or b or ...`: short-circuit, every operand evaluated must be a boolean."""

    operands: tuple[Expr, ...]

    def children(self) -> tuple[Expr, ...]:
        return self.operands


# --- the printer ----------------------------------------------------------------------------------

_ATOM = 8


def _precedence(node: Expr) -> int:
    match node:
        case Or():
            return 1
        case And():
            return 2
        case Not():
            return 3
        case Compare():
            return 4
        case Sum():
            return 5
        case Product():
            return 6
        case Neg():
            return 7
        case _:
            return _ATOM


def _at_least(node: Expr, level: int) -> str:
    text = unparse(node)
    return text if _precedence(node) >= level else f"({text})"


def quote(text: str) -> str:
    """`text` as a double-quoted string literal that `parse` reads back unchanged."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif code < 0x20 or code == 0x7F or 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def unparse(node: Expr) -> str:
    """The canonical text of an expression: `parse(unparse(e)) == e` for every tree."""
    match node:
        case String(value):
            return quote(value)
        case Number(value):
            return repr(value)
        case Boolean(value):
            return "true" if value else "false"
        case Null():
            return "null"
        case ListExpr(items):
            return "[" + ", ".join(unparse(i) for i in items) + "]"
        case TaskRef(path):
            return "task." + ".".join(path)
        case StepRef(step, attr):
            return f"steps.{step}.{attr}"
        case Call(name, args):
            return f"{name}(" + ", ".join(unparse(a) for a in args) + ")"
        case Neg(operand):
            return "-" + _at_least(operand, 7)
        case Not(operand):
            return "not " + _at_least(operand, 3)
        case Compare(op, left, right):
            return f"{_at_least(left, 5)} {op} {_at_least(right, 5)}"
        case Sum(first, rest) | Product(first, rest):
            # Operands of a chain bind tighter than the chain itself; a chain of the same
            # level inside one came from parentheses, so it gets them back.
            level = _precedence(node) + 1
            parts = [_at_least(first, level)]
            parts.extend(f"{op} {_at_least(x, level)}" for op, x in rest)
            return " ".join(parts)
        case And(operands):
            return " and ".join(_at_least(x, 3) for x in operands)
        case Or(operands):
            return " or ".join(_at_least(x, 2) for x in operands)
        case _:
            raise TypeError(f"not an expression node: {node!r}")
