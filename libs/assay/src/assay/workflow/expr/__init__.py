"""A small, safe expression language for workflow conditions.

Values are strings, numbers (int and float), booleans, `null` and lists (`[a, b]`).
References read the run's input (`task.<field>`, `task.<field>.<sub>`) and earlier
steps (`steps.<id>.output`, a string; `steps.<id>.succeeded`, a boolean). A reference
is one token: write `task.n - 1`, not `task.n-1`, which names the field `n-1`.

Operators, loosest binding first: `or`; `and`; `not`; one comparison (`==`, `!=`,
`<`, `<=`, `>`, `>=`, `in`, `not in`; no chaining); `+ -`; `* /`; unary `-`.
`and`, `or` and `not` short-circuit and take booleans only. Arithmetic takes
numbers only (`/` gives a float); ordering takes two numbers or two strings;
`==` compares values of one type, either side may be `null`; `in` finds an item
in a list or a substring in a string. Functions: `len(x)`, `number(s)`,
`lower(s)`, `contains(s, sub)`, `startswith(s, prefix)`, `trim(s)`.

Conditions are strict: they must evaluate to a boolean (`truthy`), never to
a string or number taken as true. Parsing is hand-written (no `eval`, no regex)
and bounded (`MAX_LENGTH` characters, `MAX_DEPTH` levels). Parsing raises only
`ExprSyntaxError`, which carries a column; evaluation raises only `ExprError`
(its base class).
"""

from assay.workflow.expr.evaluation import evaluate, holds, truthy
from assay.workflow.expr.nodes import (
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
    Reference,
    StepRef,
    String,
    Sum,
    TaskRef,
    Value,
    unparse,
)
from assay.workflow.expr.parser import parse

__all__ = [
    "FUNCTIONS",
    "MAX_DEPTH",
    "MAX_LENGTH",
    "And",
    "Boolean",
    "Call",
    "Compare",
    "Expr",
    "ExprError",
    "ExprSyntaxError",
    "ListExpr",
    "Neg",
    "Not",
    "Null",
    "Number",
    "Or",
    "Product",
    "Reference",
    "StepRef",
    "String",
    "Sum",
    "TaskRef",
    "Value",
    "evaluate",
    "holds",
    "parse",
    "truthy",
    "unparse",
]
