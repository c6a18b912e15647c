"""The model port and the deterministic stub model (DESIGN §9).

The stub is a small arithmetic agent whose reliability depends on its prompt,
so that prompt engineering measurably changes outcomes — what the demo's two
workflow versions exercise. Same (run, step, attempt, prompt) → same answer.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from assay.kernel.canonical import digest
from assay.kernel.errors import AssayError


@dataclass(frozen=True)
class Completion:
    """A model's answer and what it cost.

    `cost_usd` is the price of the call at the adapter's configured rates (0.0
    when no price is configured, as for the stub model).
    """

    text: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float = 0.0


class ModelError(AssayError):
    """The model call failed (the attempt fails; a retry may succeed)."""


@dataclass(frozen=True)
class Prices:
    """What a model's tokens cost, in US dollars per million tokens.

    Raises:
        ValueError: a negative or non-finite price.
    """

    prompt_per_mtok: float = 0.0
    completion_per_mtok: float = 0.0

    def __post_init__(self) -> None:
        for price in (self.prompt_per_mtok, self.completion_per_mtok):
            if not math.isfinite(price) or price < 0:
                raise ValueError(f"a price per million tokens must be finite and >= 0: {price}")

    @property
    def worst_per_mtok(self) -> float:
        """The higher of the two prices: what any token of a call may cost at most."""
        return max(self.prompt_per_mtok, self.completion_per_mtok)

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """The price of one call, in US dollars."""
        return (
            prompt_tokens * self.prompt_per_mtok + completion_tokens * self.completion_per_mtok
        ) / 1_000_000


FREE = Prices()
"""The prices of a model that declares none: every call costs 0.0."""


class Model(Protocol):
    """Chat-completion-like model. `seed` makes deterministic models deterministic.

    A model whose calls cost money also declares its `prices` (see `Priced`): the
    engine prices each call with them and bounds a call's worst case before making it.
    """

    name: str

    async def complete(self, prompt: str, *, max_tokens: int, seed: str) -> Completion:
        """Complete `prompt`, or raise `ModelError`."""
        ...


@runtime_checkable
class OffersTools(Protocol):
    """A model port that can offer tools with the prompt (a model step's `tools`): each
    an OpenAI-style function spec (`tools.offered`). A port without it gets the prompt
    alone."""

    async def complete_with_tools(
        self, prompt: str, *, max_tokens: int, seed: str, tools: Sequence[Mapping[str, Any]]
    ) -> Completion:
        """Complete `prompt` with `tools` offered, or raise `ModelError`."""
        ...


@runtime_checkable
class Priced(Protocol):
    """A model that declares its per-token prices (`Completion.cost_usd` uses the same)."""

    prices: Prices


@runtime_checkable
class Routable(Protocol):
    """A model port that can call another model by name at the same endpoint (a model step
    naming its `model`: a replay candidate's model variant)."""

    def routed(self, name: str) -> Model:
        """The same endpoint calling the model `name`."""
        ...


def model_for(model: Model, name: str | None) -> Model:
    """The model a step naming `name` calls: `model` itself when it names none or the
    same one, else `model.routed(name)`.

    Raises:
        ModelError: `model` cannot call another model (it is not `Routable`).
    """
    if name is None or name == model.name:
        return model
    if not isinstance(model, Routable):
        raise ModelError(f"the model port {model.name!r} cannot call another model ({name!r})")
    return model.routed(name)


def prices_of(model: object) -> Prices:
    """The model's per-token prices: its declared `prices`, else free (`FREE`)."""
    return model.prices if isinstance(model, Priced) else FREE


_EXPR = re.compile(r"[-(\d][\d\s+\-*/()]*\d\)*")


class _Parser:
    """Integer arithmetic with + - * and parentheses. No eval."""

    def __init__(self, text: str) -> None:
        self.tokens = re.findall(r"\d+|[-+*()]", text)
        self.i = 0

    def parse(self) -> int:
        value = self.expr()
        if self.i != len(self.tokens):
            raise ValueError("trailing tokens")
        return value

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = str(self.tokens[self.i])
        self.i += 1
        return tok

    def expr(self) -> int:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            value = value + self.term() if op == "+" else value - self.term()
        return value

    def term(self) -> int:
        value = self.atom()
        while self.peek() == "*":
            self.take()
            value *= self.atom()
        return value

    def atom(self) -> int:
        tok = self.take()
        if tok == "(":
            value = self.expr()
            if self.take() != ")":
                raise ValueError("unbalanced")
            return value
        if tok == "-":
            return -self.atom()
        return int(tok)


def solve(text: str) -> int | None:
    """The value of the longest arithmetic expression in `text`, or None."""
    candidates = sorted(_EXPR.findall(text), key=len, reverse=True)
    for cand in candidates:
        while cand:
            try:
                return _Parser(cand).parse()
            except (ValueError, IndexError):
                if not cand.endswith(")"):
                    break
                cand = cand[:-1]  # a closing parenthesis that belongs to the prose
    return None


class StubModel:
    """Deterministic arithmetic model whose accuracy and style follow the prompt.

    - Base error rate 35%; "step by step" in the prompt cuts it to 8%.
    - "only the number" makes it answer with the bare number; otherwise it
      answers in a sentence.
    - It finds the longest arithmetic expression in the prompt and solves it
      exactly, then errs (off by a small amount) with the error rate above.
    """

    name = "stub-arith-1"
    prices = FREE
    """The stub costs nothing."""

    def __init__(
        self, base_error: float = 0.35, careful_error: float = 0.08, delay_s: float = 0.0
    ) -> None:
        if not delay_s >= 0:
            raise ValueError(f"the stub model's delay must be >= 0 seconds, not {delay_s}")
        self.base_error = base_error
        self.careful_error = careful_error
        self.delay_s = delay_s
        """How long each call takes, as a remote model's would (the answer is the same)."""

    async def aclose(self) -> None:
        """Nothing to release; present so a runtime can close any model it built."""

    def routed(self, name: str) -> StubModel:
        """The stub answering as the model `name`: the same rules, its own draws (so a
        model variant's answers differ from the default stub's)."""
        other = StubModel(self.base_error, self.careful_error, self.delay_s)
        other.name = name
        return other

    async def complete(self, prompt: str, *, max_tokens: int, seed: str) -> Completion:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.name != StubModel.name:  # a routed stub draws apart from the default one
            seed = f"{self.name}\x1f{seed}"
        rng = random.Random(digest(f"{seed}\x1f{digest(prompt.encode())}".encode()))
        lowered = prompt.lower()
        value = solve(prompt)
        if value is None:
            text = "I could not find a problem to solve."
        else:
            careful = "step by step" in lowered
            if rng.random() < (self.careful_error if careful else self.base_error):
                value += rng.choice([-10, -2, -1, 1, 2, 10])
            text = (
                str(value)
                if "only the number" in lowered
                else (f"Let me see. The answer is {value}.")
            )
        words = text.split()[:max_tokens]
        return Completion(" ".join(words), self.name, max(1, len(prompt) // 4), len(words))
