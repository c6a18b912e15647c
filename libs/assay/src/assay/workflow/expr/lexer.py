"""The tokenizer: hand-written, one pass, no regex. Every failure is an `ExprSyntaxError`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, TypeAlias

from assay.workflow.expr.nodes import MAX_LENGTH, ExprSyntaxError

TokenKind: TypeAlias = Literal["number", "string", "name", "task", "step", "op", "end"]
_OPERATORS_2 = ("==", "!=", "<=", ">=")
_OPERATORS_1 = "<>+-*/()[],"
_ESCAPES = {'"': '"', "'": "'", "\\": "\\", "n": "\n", "t": "\t", "r": "\r"}
_HEX = "0123456789abcdefABCDEF"


@dataclass(frozen=True, slots=True)
class Token:
    """One token: its kind, source text (a string's decoded value), 1-based column."""

    kind: TokenKind
    text: str
    column: int
    number: int | float = 0
    path: tuple[str, ...] = ()


def _digit(ch: str) -> bool:
    return "0" <= ch <= "9"


def _name_start(ch: str) -> bool:
    return ch == "_" or "a" <= ch <= "z" or "A" <= ch <= "Z"


def _name_char(ch: str) -> bool:
    return _name_start(ch) or _digit(ch)


def _segment_char(ch: str) -> bool:
    return _name_char(ch) or ch == "-"


def scan_number(text: str, i: int) -> int | None:
    """End of the number literal starting at `i` (`digits [. digits] [e [+-] digits]`).

    Returns None when the text at `i` is not a complete number literal.
    """
    n = len(text)
    j = i
    while j < n and _digit(text[j]):
        j += 1
    if j == i:
        return None
    if j < n and text[j] == ".":
        k = j + 1
        while k < n and _digit(text[k]):
            k += 1
        if k == j + 1:
            return None
        j = k
    if j < n and text[j] in "eE":
        k = j + 1
        if k < n and text[k] in "+-":
            k += 1
        start = k
        while k < n and _digit(text[k]):
            k += 1
        if k == start:
            return None
        j = k
    return j


def _read_string(text: str, i: int) -> tuple[str, int]:
    quote, n = text[i], len(text)
    out: list[str] = []
    j = i + 1
    while j < n:
        ch = text[j]
        if ch == quote:
            return "".join(out), j + 1
        if ch != "\\":
            out.append(ch)
            j += 1
            continue
        if j + 1 >= n:
            break
        esc = text[j + 1]
        if esc in _ESCAPES:
            out.append(_ESCAPES[esc])
            j += 2
        elif esc == "u":
            digits = text[j + 2 : j + 6]
            if len(digits) != 4 or any(d not in _HEX for d in digits):
                raise ExprSyntaxError("\\u needs four hex digits", j + 1)
            out.append(chr(int(digits, 16)))
            j += 6
        else:
            raise ExprSyntaxError(f"unknown escape \\{esc}", j + 1)
    raise ExprSyntaxError("unterminated string", i + 1)


def _read_path(text: str, i: int, root: str, column: int) -> tuple[tuple[str, ...], int]:
    """Segments after `task` or `steps`, starting at the `.` at `i`."""
    n = len(text)
    segments: list[str] = []
    while i < n and text[i] == ".":
        # The attribute of a step reference is a plain name, so `steps.a.output-1` subtracts.
        last_of_step = root == "steps" and len(segments) == 1
        ok = _name_char if last_of_step else _segment_char
        j = i + 1
        while j < n and ok(text[j]):
            j += 1
        if j == i + 1:
            raise ExprSyntaxError(f"expected a name after '{root}.'", j + 1)
        segments.append(text[i + 1 : j])
        i = j
        if last_of_step:
            break
    if root == "steps" and (len(segments) != 2 or segments[1] not in ("output", "succeeded")):
        raise ExprSyntaxError(
            "a step reference is steps.<id>.output or steps.<id>.succeeded", column
        )
    return tuple(segments), i


def tokenize(text: str) -> list[Token]:
    """Split `text` into tokens, ending with an `end` token.

    Raises:
        ExprSyntaxError: text too long, an unknown character, a malformed literal.
    """
    if len(text) > MAX_LENGTH:
        raise ExprSyntaxError(
            f"expression is {len(text)} characters long; the limit is {MAX_LENGTH}",
            MAX_LENGTH + 1,
        )
    out: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        ch, col = text[i], i + 1
        if ch in " \t\r\n":
            i += 1
        elif _digit(ch):
            end = scan_number(text, i)
            if end is None:
                raise ExprSyntaxError("malformed number", col)
            literal = text[i:end]
            value: int | float
            if "." in literal or "e" in literal or "E" in literal:
                value = float(literal)
                if not math.isfinite(value):
                    raise ExprSyntaxError("number is out of range", col)
            else:
                value = int(literal)
            out.append(Token("number", literal, col, number=value))
            i = end
        elif ch in "\"'":
            value_text, end = _read_string(text, i)
            out.append(Token("string", value_text, col))
            i = end
        elif _name_start(ch):
            j = i + 1
            while j < n and _name_char(text[j]):
                j += 1
            name = text[i:j]
            if name in ("task", "steps") and j < n and text[j] == ".":
                path, j = _read_path(text, j, name, col)
                out.append(Token("task" if name == "task" else "step", text[i:j], col, path=path))
            else:
                out.append(Token("name", name, col))
            i = j
        elif text.startswith(_OPERATORS_2, i):
            out.append(Token("op", text[i : i + 2], col))
            i += 2
        elif ch in _OPERATORS_1:
            out.append(Token("op", ch, col))
            i += 1
        elif ch == "=":
            raise ExprSyntaxError("'=' is not an operator; compare with '=='", col)
        elif ch == "!":
            raise ExprSyntaxError("'!' is not an operator; write '!=' or 'not'", col)
        else:
            raise ExprSyntaxError(f"unexpected character {ch!r}", col)
    out.append(Token("end", "", n + 1))
    return out
