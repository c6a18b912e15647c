"""A proposer served by an OpenAI-compatible chat model (§12.1): the model-backed default.

`ChatProposer` shows the model the current version, the challenger that just ended
and why, the selection-set failures (never a held-out one: decide has none to give)
and operators' feedback on earlier proposals, and asks for one JSON object,
`{"rationale": "...", "definition": {...}}`, read as strictly as a judge's answer
(`judge_answers`: one object, or one fenced object, nothing else). The definition
must be a valid definition of the same workflow and differ from every version
tried; anything else fails the draft (`ProposerFailed`), which decide records.

One call per proposal, at temperature 0, with a seed derived from the prompt.
"""

from __future__ import annotations

import json
from typing import Any

from assay.grading.chat_judge import TEMPLATE_TOKENS, JudgeModel
from assay.grading.judge_answers import one_object
from assay.grading.judges import JudgeFailed
from assay.grading.proposers import (
    Proposal,
    ProposalInput,
    ProposerFailed,
    ProposerUsage,
    derived,
)
from assay.kernel.canonical import digest
from assay.kernel.errors import AssayError
from assay.workflow import WorkflowDef

SYSTEM = """\
You improve the definition of an AI-agent workflow. You are given its current \
version (JSON), the candidate version that just failed to replace it and why, and \
failures of recent runs: the verifiers each run failed with their evidence, Core \
rubric items it violated, and steps whose first attempt failed before a retry passed.

Propose ONE new version of the current definition that should fail less often. \
Change as little as you need. Keep the workflow's "id" and the id of every step \
you keep; keep the verifiers (they decide what passing means). Do not repeat a \
change that was already tried.

Answer with exactly one JSON object and nothing else:
{"rationale": "<one or two sentences: what you changed and why>", \
"definition": <the whole new definition, as JSON>}"""


def render(request: ProposalInput, max_failures: int) -> str:
    """The user message: the facts the request holds, and nothing else."""
    parts = [
        "Current version:",
        json.dumps(request.current.model_dump(mode="json", by_alias=True), sort_keys=True),
    ]
    if request.ended is not None:
        parts += [
            f"Candidate that ended ({request.outcome}: {request.reason}):",
            json.dumps(request.ended.model_dump(mode="json", by_alias=True), sort_keys=True),
        ]
    else:
        parts.append(f"What happened: {request.outcome}: {request.reason}")
    shown = request.failures[-max_failures:]
    parts.append(f"Failures of recent runs ({len(shown)} of {len(request.failures)}):")
    for f in shown:
        parts.append(
            json.dumps(f.model_dump(mode="json", exclude={"run_id", "task_id"}), sort_keys=True)
        )
    if request.feedback:
        parts.append("Operators rejected earlier proposals because:")
        parts += [f"- {reason}" for reason in request.feedback]
    return "\n".join(parts)


class ChatProposer:
    """A `Proposer` that asks a chat model and reads its answer strictly.

    The proposer owns `model`: `aclose()` closes it.

    Args:
        model: the chat model to ask.
        max_answer_tokens: completion tokens the answer may take.
        max_failures: failures shown, the most recent ones.
    """

    def __init__(
        self, model: JudgeModel, *, max_answer_tokens: int = 4096, max_failures: int = 8
    ) -> None:
        if max_answer_tokens < 1 or max_failures < 1:
            raise ValueError("max_answer_tokens and max_failures must be >= 1")
        self._model = model
        self.name = f"chat:{model.name}"
        self.model_id = model.name
        """The model every call names (what `assay.usage` records)."""
        self.max_answer_tokens = max_answer_tokens
        self.max_failures = max_failures
        self._prices: object = getattr(model, "prices", None)

    def worst_case(self, request: ProposalInput) -> ProposerUsage:
        """What drafting for `request` costs at most: one call whose prompt has no more
        tokens than its UTF-8 bytes (plus the chat template's), answering in at most
        `max_answer_tokens`, at the model's prices (0.0 without any)."""
        prompt = len(SYSTEM.encode()) + len(render(request, self.max_failures).encode())
        prompt += TEMPLATE_TOKENS
        price = getattr(self._prices, "cost", None)
        cost = price(prompt, self.max_answer_tokens) if callable(price) else 0.0
        return ProposerUsage(1, prompt, self.max_answer_tokens, float(cost))

    async def aclose(self) -> None:
        """Close the model."""
        await self._model.aclose()

    async def propose(self, request: ProposalInput) -> Proposal | None:
        if not request.failures:
            return None  # nothing to learn from: the loop waits for evidence
        user = render(request, self.max_failures)
        try:
            done = await self._model.complete(
                user,
                max_tokens=self.max_answer_tokens,
                seed="proposer:" + digest(f"{SYSTEM}\x1f{user}".encode()),
                system=SYSTEM,
            )
        except AssayError as exc:
            raise ProposerFailed(f"the model call failed ({type(exc).__name__}: {exc})") from exc
        usage = ProposerUsage(1, done.prompt_tokens, done.completion_tokens, done.cost_usd)
        try:
            doc = one_object(done.text, required={"rationale", "definition"}, optional=set())
        except JudgeFailed as exc:
            raise ProposerFailed(f"unusable answer: {exc}", usage) from exc
        rationale, definition = doc["rationale"], doc["definition"]
        if not isinstance(rationale, str) or not rationale.strip():
            raise ProposerFailed('"rationale" is not a non-empty string', usage)
        if not isinstance(definition, dict):
            raise ProposerFailed('"definition" is not a JSON object', usage)
        wf = _checked(definition, request, usage)
        return Proposal(wf, rationale.strip(), usage)


def _checked(
    definition: dict[str, Any], request: ProposalInput, usage: ProposerUsage
) -> WorkflowDef:
    try:
        wf = derived(definition, request.current, "the proposed definition")
    except ProposerFailed as exc:
        raise ProposerFailed(exc.reason, usage) from exc
    if wf.version == request.current.version:
        raise ProposerFailed("the proposed definition is the current version unchanged", usage)
    if wf.version in request.tried:
        raise ProposerFailed(
            f"the proposed definition is version {wf.version}, already tried", usage
        )
    return wf
