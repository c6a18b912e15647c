"""The recursive-descent parser. Hand-written: no regex, no eval, no Python parser.

Grammar, loosest binding first (see the package docstring for the values)::

    expr     := or
    or       := and ("or" and)*
    and      := not ("and" not)*
    not      := "not" not | compare
    compare  := sum (("==" | "!=" | "<" | "<=" | ">" | ">=" | "in" | "not" "in") sum)?
    sum      := product (("+" | "-") product)*
    product  := unary (("*" | "/") unary)*
    unary    := "-" unary | primary
    primary  := NUMBER | STRING | "true" | "false" | "null"
              | "[" (expr ("," expr)* ","?)? "]"
              | FUNCTION "(" (expr ("," expr)*)? ")"
              | "task" ("." SEGMENT)+ | "steps" "." SEGMENT "." ("output" | "succeeded")
              | "(" expr ")"
"""

from __future__ import annotations

from assay.workflow.expr.lexer import Token, TokenKind, tokenize
from assay.workflow.expr.nodes import (
    FUNCTIONS,
    MAX_DEPTH,
    And,
    Boolean,
    Call,
    Compare,
    CompareOp,
    Expr,
    ExprSyntaxError,
    ListExpr,
    Neg,
    Not,
    Null,
    Number,
    Or,
    Product,
    ProductOp,
    StepRef,
    String,
    Sum,
    SumOp,
    TaskRef,
)

_KEYWORDS = frozenset({"and", "or", "not", "in", "true", "false", "null"})
_COMPARISONS: dict[str, CompareOp] = {
    "==": "==",
    "!=": "!=",
    "<": "<",
    "<=": "<=",
    ">": ">",
    ">=": ">=",
}


def _describe(tok: Token) -> str:
    match tok.kind:
        case "end":
            return "the end of the expression"
        case "string":
            return "a string"
        case "number":
            return f"the number {tok.text}"
        case _:
            return repr(tok.text)


class _Parser:
    def __init__(self, tokens: list[Token]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0

    def peek(self, ahead: int = 0) -> Token:
        return self.tokens[min(self.pos + ahead, len(self.tokens) - 1)]

    def advance(self) -> Token:
        tok = self.peek()
        self.pos += 1
        return tok

    def at(self, kind: TokenKind, text: str, ahead: int = 0) -> bool:
        tok = self.peek(ahead)
        return tok.kind == kind and tok.text == text

    def fail(self, tok: Token, expected: str) -> ExprSyntaxError:
        return ExprSyntaxError(f"unexpected {_describe(tok)}; expected {expected}", tok.column)

    def expect(self, symbol: str, expected: str) -> Token:
        if not self.at("op", symbol):
            raise self.fail(self.peek(), expected)
        return self.advance()

    def nest(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ExprSyntaxError(
                f"expression nests more than {MAX_DEPTH} levels deep", self.peek().column
            )

    def whole(self) -> Expr:
        node = self.expression()
        if self.peek().kind != "end":
            raise self.fail(self.peek(), "an operator or the end of the expression")
        return node

    def expression(self) -> Expr:
        self.nest()
        node = self.disjunction()
        self.depth -= 1
        return node

    def disjunction(self) -> Expr:
        operands = [self.conjunction()]
        while self.at("name", "or"):
            self.advance()
            operands.append(self.conjunction())
        return operands[0] if len(operands) == 1 else Or(tuple(operands))

    def conjunction(self) -> Expr:
        operands = [self.negation()]
        while self.at("name", "and"):
            self.advance()
            operands.append(self.negation())
        return operands[0] if len(operands) == 1 else And(tuple(operands))

    def negation(self) -> Expr:
        if not self.at("name", "not"):
            return self.comparison()
        self.advance()
        self.nest()
        node = Not(self.negation())
        self.depth -= 1
        return node

    def comparison_op(self) -> CompareOp | None:
        tok = self.peek()
        if tok.kind == "op" and tok.text in _COMPARISONS:
            self.advance()
            return _COMPARISONS[tok.text]
        if self.at("name", "in"):
            self.advance()
            return "in"
        if self.at("name", "not") and self.at("name", "in", ahead=1):
            self.pos += 2
            return "not in"
        return None

    def comparison(self) -> Expr:
        left = self.sum()
        op = self.comparison_op()
        if op is None:
            return left
        node = Compare(op, left, self.sum())
        tok = self.peek()
        if self.comparison_op() is not None:
            raise ExprSyntaxError("comparisons do not chain; join them with 'and'", tok.column)
        return node

    def sum(self) -> Expr:
        first = self.product()
        rest: list[tuple[SumOp, Expr]] = []
        while self.peek().kind == "op" and self.peek().text in ("+", "-"):
            op: SumOp = "+" if self.advance().text == "+" else "-"
            rest.append((op, self.product()))
        return Sum(first, tuple(rest)) if rest else first

    def product(self) -> Expr:
        first = self.unary()
        rest: list[tuple[ProductOp, Expr]] = []
        while self.peek().kind == "op" and self.peek().text in ("*", "/"):
            op: ProductOp = "*" if self.advance().text == "*" else "/"
            rest.append((op, self.unary()))
        return Product(first, tuple(rest)) if rest else first

    def unary(self) -> Expr:
        if not self.at("op", "-"):
            return self.primary()
        self.advance()
        self.nest()
        node = Neg(self.unary())
        self.depth -= 1
        return node

    def primary(self) -> Expr:
        tok = self.advance()
        match tok.kind:
            case "number":
                return Number(tok.number)
            case "string":
                return String(tok.text)
            case "task":
                return TaskRef(tok.path)
            case "step":
                step, attr = tok.path
                return StepRef(step, "output" if attr == "output" else "succeeded")
            case "name":
                return self.named(tok)
            case "op" if tok.text == "(":
                node = self.expression()
                self.expect(")", f"')' to close the '(' at column {tok.column}")
                return node
            case "op" if tok.text == "[":
                return ListExpr(self.items("]", tok))
        raise self.fail(tok, "a value, a reference, a function call, '(' or '['")

    def named(self, tok: Token) -> Expr:
        name = tok.text
        if name in ("true", "false"):
            return Boolean(name == "true")
        if name == "null":
            return Null()
        if name in FUNCTIONS:
            if not self.at("op", "("):
                raise ExprSyntaxError(f"{name} is a function; call it as {name}(...)", tok.column)
            opening = self.advance()
            args = self.items(")", opening)
            if len(args) != FUNCTIONS[name]:
                want = FUNCTIONS[name]
                raise ExprSyntaxError(
                    f"{name}() takes {want} argument{'s' if want > 1 else ''}, got {len(args)}",
                    tok.column,
                )
            return Call(name, args)
        if name in ("task", "steps"):
            raise ExprSyntaxError(
                "write task.<field>, steps.<id>.output or steps.<id>.succeeded", tok.column
            )
        if name in _KEYWORDS:
            raise self.fail(tok, "a value, a reference, a function call, '(' or '['")
        if self.at("op", "("):
            raise ExprSyntaxError(
                f"unknown function {name!r}; the functions are {', '.join(sorted(FUNCTIONS))}",
                tok.column,
            )
        raise ExprSyntaxError(
            f"unknown name {name!r}; refer to task.<field> or steps.<id>.output", tok.column
        )

    def items(self, closing: str, opening: Token) -> tuple[Expr, ...]:
        """Comma-separated expressions up to `closing`; a trailing comma is allowed."""
        out: list[Expr] = []
        expected = f"',' or '{closing}' to close the '{opening.text}' at column {opening.column}"
        while not self.at("op", closing):
            out.append(self.expression())
            if self.at("op", ","):
                self.advance()
            elif not self.at("op", closing):
                raise self.fail(self.peek(), expected)
        self.advance()
        return tuple(out)


def parse(text: str) -> Expr:
    """Parse expression text into an immutable AST.

    Raises:
        ExprSyntaxError: the text is not a well-formed expression, is longer than
            `MAX_LENGTH` or nests deeper than `MAX_DEPTH`; `column` locates the fault.
    """
    return _Parser(tokenize(text)).whole()
