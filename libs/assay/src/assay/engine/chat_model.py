"""An OpenAI-compatible chat-completions model over HTTP (DESIGN §9).

vLLM, SGLang, Ollama and hosted APIs speak one wire format: POST
`{base_url}/chat/completions` with the model, the messages and the sampling
parameters; the answer is `choices[0].message.content`, the token counts are
`usage`. The adapter sends the prompt as one user message (after a system
message when the caller gives one), with a model step's offered tools as `tools`,
at temperature 0
with an integer seed derived from the driver's seed string, so a server that
honours seeds answers a retried call the same way.

Transient failures (429, 5xx, connection errors, timeouts) are retried a
bounded number of times with exponential backoff and jitter; a numeric
`Retry-After` is honoured up to a cap. Anything else fails at once. The answer
is parsed strictly: a body without the text or the token counts is an error,
never a guessed answer.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import random
import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from assay.engine.models import Completion, ModelError, Prices
from assay.engine.priority import CallPriority, PriorityLimiter
from assay.kernel.canonical import digest

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

_EXCERPT_CHARS = 200


class ModelUnavailable(ModelError):
    """Every attempt met a 429, a 5xx, a connection error or a timeout."""


class ModelRequestRefused(ModelError):
    """The endpoint refused the request with a status that retrying cannot change."""


class ModelResponseInvalid(ModelError):
    """The endpoint answered with a body that is not a chat completion with usage.

    Attributes:
        billed: what the call cost when the body did report its usage — a refusal, or a
            completion without text — with empty text; None when it did not.
    """

    def __init__(self, message: str, billed: Completion | None = None) -> None:
        super().__init__(message)
        self.billed = billed


@dataclass(frozen=True)
class RetryPolicy:
    """How a transiently failing request is retried.

    At most `max_retries` retries follow the first request. Before retry `n`
    (from 0) the adapter waits the server's numeric `Retry-After`, capped at
    `retry_after_cap_s`, or else a random delay in `[d/2, d]` where
    `d = min(backoff_cap_s, backoff_base_s * 2**n)`.

    Raises:
        ValueError: a negative count or delay.
    """

    max_retries: int = 4
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 8.0
    retry_after_cap_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0: {self.max_retries}")
        for delay in (self.backoff_base_s, self.backoff_cap_s, self.retry_after_cap_s):
            if not math.isfinite(delay) or delay < 0:
                raise ValueError(f"a retry delay must be finite and >= 0: {delay}")

    def delay(self, retry: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number `retry` (0 is the first retry)."""
        if retry_after is not None:
            return min(retry_after, self.retry_after_cap_s)
        ceiling = min(self.backoff_cap_s, self.backoff_base_s * 2.0**retry)
        return random.uniform(ceiling / 2, ceiling)  # jitter: replicas do not retry in step


def request_seed(seed: str) -> int:
    """The integer sampling seed sent for the driver's seed string.

    Deterministic across processes and machines, and in `[0, 2**31)` so that
    servers storing seeds as 32-bit integers accept it.
    """
    return int(digest(seed.encode())[:8], 16) & 0x7FFF_FFFF


class ChatCompletionsModel:
    """A `Model` served by any OpenAI-compatible `/chat/completions` endpoint.

    One `httpx.AsyncClient` serves every call of the instance; release it with
    `aclose()` (or use the instance as an async context manager).

    Args:
        base_url: the API root, such as `http://127.0.0.1:11434/v1`.
        name: the model id the server knows (sent as `model`).
        api_key: sent as `Authorization: Bearer <key>` when given.
        timeout_s: deadline of one HTTP request, connection included.
        retry: how transient failures are retried.
        prices: what tokens cost; `Completion.cost_usd` is computed from them.
        temperature: sampling temperature (0: the most likely answer).
        limiter: the endpoint's limiter, shared with the other models calling it (each
            HTTP request holds one of its slots; None: no limit).
        priority: who calls through this instance (agent calls go first).
    """

    def __init__(
        self,
        base_url: str,
        name: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
        prices: Prices | None = None,
        temperature: float = 0.0,
        limiter: PriorityLimiter | None = None,
        priority: CallPriority = CallPriority.AGENT,
    ) -> None:
        if not name:
            raise ValueError("a chat-completions model needs a model name")
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be finite and > 0: {timeout_s}")
        self.name = name
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.prices = prices or Prices()
        self.temperature = temperature
        self.limiter = limiter
        self.priority = priority
        import httpx  # here: a process whose models are all stubs does not load it

        headers = {"Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), headers=headers)

    def routed(self, name: str) -> ChatCompletionsModel:
        """The same endpoint, client, limiter and prices, calling the model `name` (a
        model step naming its model). Close only the instance it was routed from."""
        if not name:
            raise ValueError("a chat-completions model needs a model name")
        other = copy.copy(self)
        other.name = name
        return other

    async def __aenter__(self) -> ChatCompletionsModel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client and its connections. The model is unusable after."""
        await self._client.aclose()

    async def complete(
        self, prompt: str, *, max_tokens: int, seed: str, system: str | None = None
    ) -> Completion:
        """Ask the endpoint to complete `prompt`.

        `system`, when given, is sent as a system message before the prompt's user
        message (a judge's fixed instructions, kept apart from the material it
        judges and first, where a server's prefix cache can reuse it).

        Raises:
            ModelUnavailable: 429, 5xx, connection errors or timeouts on every attempt.
            ModelRequestRefused: any other non-2xx status (not retried).
            ModelResponseInvalid: a 2xx whose body lacks the text or the token counts.
        """
        return await self._complete(prompt, max_tokens, seed, system, ())

    async def complete_with_tools(
        self, prompt: str, *, max_tokens: int, seed: str, tools: Sequence[Mapping[str, Any]]
    ) -> Completion:
        """`complete`, with `tools` (OpenAI-style function specs) sent as the request's
        `tools`. The engine does not run a model's tool calls: an answer that makes
        one is `ModelResponseInvalid` naming the tools called (billed when it reports
        its usage), never taken for the step's output."""
        return await self._complete(prompt, max_tokens, seed, None, tools)

    async def _complete(
        self,
        prompt: str,
        max_tokens: int,
        seed: str,
        system: str | None,
        tools: Sequence[Mapping[str, Any]],
    ) -> Completion:
        import httpx

        messages = [{"role": "user", "content": prompt}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        body: dict[str, Any] = {
            "model": self.name,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "seed": request_seed(seed),
        }
        if tools:
            body["tools"] = [dict(t) for t in tools]
        attempts = self.retry.max_retries + 1
        failure = ""
        for attempt in range(attempts):
            retry_after: float | None = None
            try:
                # httpx's timeout bounds each phase; this bounds the whole request, once
                # the endpoint has a slot for it.
                async with self._slot(), asyncio.timeout(self.timeout_s):
                    response = await self._client.post(self.url, json=body)
            except (httpx.TimeoutException, TimeoutError):
                failure = f"no answer within {self.timeout_s}s"
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if response.is_success:
                    return self._completion(response)
                status = response.status_code
                failure = f"HTTP {status}: {_excerpt(response.text)}"
                if status != 429 and status < 500:
                    raise ModelRequestRefused(f"{self.url} refused the request: {failure}")
                retry_after = _retry_after(response.headers.get("retry-after"))
            if attempt + 1 < attempts:
                delay = self.retry.delay(attempt, retry_after)
                log.warning(
                    "model call to %s failed (%s); retry %d/%d in %.2fs",
                    self.url,
                    failure,
                    attempt + 1,
                    self.retry.max_retries,
                    delay,
                )
                await asyncio.sleep(delay)
        raise ModelUnavailable(f"{self.url}: gave up after {attempts} attempt(s); last: {failure}")

    def _slot(self) -> AbstractAsyncContextManager[None]:
        """A slot of the endpoint's limiter (none to wait for without one)."""
        if self.limiter is None:
            return nullcontext()
        return self.limiter.slot(self.priority)

    def _completion(self, response: httpx.Response) -> Completion:
        try:
            doc = response.json()
        except ValueError as exc:
            raise ModelResponseInvalid(
                f"{self.url} answered HTTP {response.status_code} with a body that is not "
                f"JSON: {_excerpt(response.text)}"
            ) from exc
        called = _tool_calls(_field(doc, ("choices", 0, "message"), self.url))
        if called:
            raise ModelResponseInvalid(
                f"{self.url}: the model answered with a call of {', '.join(called)}; the "
                "engine offers tools but does not run a model's tool calls",
                billed=self._billed(doc),
            )
        text = _field(doc, ("choices", 0, "message", "content"), self.url)
        if not isinstance(text, str):
            refusal = doc["choices"][0]["message"].get("refusal")
            what = (
                f"the model refused: {_excerpt(refusal)}"
                if isinstance(refusal, str) and refusal
                else f"choices[0].message.content is {_kind(text)}, not text"
            )
            raise ModelResponseInvalid(f"{self.url}: {what}", billed=self._billed(doc))
        tokens = [
            _field(doc, ("usage", name), self.url)
            for name in ("prompt_tokens", "completion_tokens")
        ]
        for name, value in zip(("prompt_tokens", "completion_tokens"), tokens, strict=True):
            if not _is_count(value):
                raise ModelResponseInvalid(
                    f"{self.url}: usage.{name} is {_kind(value)}, not a count of tokens"
                )
        prompt_tokens, completion_tokens = tokens
        return self._priced(doc, text, prompt_tokens, completion_tokens)

    def _priced(
        self, doc: Any, text: str, prompt_tokens: int, completion_tokens: int
    ) -> Completion:
        served_by = doc.get("model")
        return Completion(
            text=text,
            model=served_by if isinstance(served_by, str) and served_by else self.name,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cost_usd=self.prices.cost(prompt_tokens, completion_tokens),
        )

    def _billed(self, doc: Any) -> Completion | None:
        """What a body without usable text cost, when it reports its usage."""
        usage = doc.get("usage")
        if not isinstance(usage, dict):
            return None
        prompt_tokens: Any = usage.get("prompt_tokens")
        completion_tokens: Any = usage.get("completion_tokens")
        if not (_is_count(prompt_tokens) and _is_count(completion_tokens)):
            return None
        return self._priced(doc, "", prompt_tokens, completion_tokens)


def _tool_calls(message: Any) -> list[str]:
    """The names of the tools a chat message calls (`tool_calls`), in order."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list):
        return []
    names = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        names.append(name if isinstance(name, str) and name else "an unnamed tool")
    return names


def _is_count(value: Any) -> bool:
    """A token count: a non-negative int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _field(doc: Any, path: tuple[str | int, ...], url: str) -> Any:
    """`doc` at `path`, or `ModelResponseInvalid` naming the first missing part."""
    here = doc
    for depth, part in enumerate(path):
        if isinstance(part, int):
            present = isinstance(here, list) and len(here) > part
        else:
            present = isinstance(here, dict) and part in here
        if not present:
            raise ModelResponseInvalid(f"{url}: the response has no {_path(path[: depth + 1])}")
        here = here[part]
    return here


def _path(parts: tuple[str | int, ...]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"


def _excerpt(text: str) -> str:
    flat = re.sub(r"\s+", " ", text).strip()
    if not flat:
        return "(empty body)"
    return flat if len(flat) <= _EXCERPT_CHARS else flat[:_EXCERPT_CHARS] + "…"


def _retry_after(value: str | None) -> float | None:
    """A numeric `Retry-After` in seconds; None when absent or an HTTP date."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None
