"""What the declared capacity implies for this deployment (§14.2): the resident models,
each one's derived context ceiling, the judge's prompt budget and the retention
reduction target. Checked at start-up; printed by `assay capacity`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from assay.engine.retention import RetentionPolicy
from assay.grading.chat_judge import episode_chars_within
from assay.kernel.capacity import Capacity, CapacityExceeded, CapacityInvalid
from assay.runtime.sections import SettingsInvalid

if TYPE_CHECKING:
    from assay.runtime.settings import AssaySettings

JUDGE_ANSWER_TOKENS = 512
"""Completion tokens a judge's answer may take (`ChatJudge`'s default)."""


@dataclass(frozen=True)
class CapacityPlan:
    """The derived numbers of a declared deployment."""

    capacity: Capacity
    agent_model: str | None
    judge_model: str | None
    resident: tuple[str, ...]
    max_context_tokens: dict[str, int]
    """Per resident model: `(vram x devices - resident weights) / kv_bytes_per_token`."""
    judge_context_tokens: int | None
    """The judge model's ceiling: its whole prompt and answer must fit in it."""
    judge_episode_chars: int | None
    """Characters one episode takes in a judge prompt: the configured budget, or less so
    that two episodes fit the judge's ceiling."""
    retention_target_tokens: int | None
    """`judge_context_tokens / 2`: a run reduced to it can be read beside another."""

    def retention(self, policy: RetentionPolicy) -> RetentionPolicy:
        """`policy` with every ceiling at most the derived target (§8.6: the bound wins)."""
        target = self.retention_target_tokens
        if target is None:
            return policy
        return policy.model_copy(
            update={
                "token_ceiling": min(policy.token_ceiling, target),
                "ceilings": {t: min(c, target) for t, c in policy.ceilings.items()},
            }
        )

    def summary(self, retention: RetentionPolicy) -> dict[str, Any]:
        """The plan as JSON-ready data (`assay capacity --json`)."""
        limits = self.capacity.limits
        return {
            "vram_bytes_per_device": int(limits.vram_bytes_per_device),
            "devices": limits.devices,
            "vram_bytes": limits.total_vram_bytes,
            "max_resident_models": limits.max_resident_models,
            "pinned": list(limits.pinned),
            "agent_model": self.agent_model,
            "judge_model": self.judge_model,
            "resident": [
                {
                    "model": m,
                    "weights_bytes": int(self.capacity.profile(m).weights_bytes),
                    "kv_bytes_per_token": int(self.capacity.profile(m).kv_bytes_per_token),
                    "devices_required": self.capacity.profile(m).devices_required,
                    "max_context_tokens": self.max_context_tokens[m],
                }
                for m in self.resident
            ],
            "resident_weights_bytes": self.capacity.weights_bytes(self.resident),
            "judge_context_tokens": self.judge_context_tokens,
            "judge_episode_chars": self.judge_episode_chars,
            "retention_target_tokens": self.retention_target_tokens,
            "retention_configured_tokens": retention.token_ceiling,
            "retention_effective_tokens": self.retention(retention).token_ceiling,
        }


def endpoint_model(url: str | None, name: str | None) -> str | None:
    """The model an endpoint serves (None: the stub, which needs no VRAM)."""
    return name if url is not None and name else None


def plan_capacity(settings: AssaySettings) -> CapacityPlan | None:
    """The plan of the declared capacity (None when none is declared), with the
    invariant checked for the agent's, the judge's and the proposer's models resident.

    Raises:
        SettingsInvalid: the declaration contradicts itself, a model has no profile, the
            resident models do not fit, or no judge call fits beside them; the message
            names the setting and the numbers.
    """
    agent = endpoint_model(settings.model.url, settings.model.name)
    judge = endpoint_model(settings.judge.url, settings.judge.name)
    proposer = endpoint_model(settings.proposer.url, settings.proposer.name)
    try:
        capacity = settings.capacity.declared(agent)
    except ValueError as exc:
        raise SettingsInvalid(f"invalid ASSAY_CAPACITY_* settings: {exc}") from exc
    if capacity is None:
        return None
    named = {"ASSAY_MODEL_NAME": agent, "ASSAY_JUDGE_NAME": judge}
    named["ASSAY_PROPOSER_NAME"] = proposer
    for variable, model in named.items():
        if model is None:
            continue
        try:
            capacity.profile(model)
        except CapacityInvalid as exc:
            raise SettingsInvalid(f"{variable}: {exc}; describe it in ASSAY_CAPACITY_FILE") from exc
    resident = capacity.resident_with(*(m for m in (agent, judge, proposer) if m))
    try:
        capacity.check(resident)
    except CapacityExceeded as exc:
        raise SettingsInvalid(f"capacity: the resident models do not fit: {exc}") from exc
    ceilings = {m: capacity.max_context_tokens(m, resident) for m in resident}
    judge_ceiling = ceilings[judge] if judge is not None else None
    episode_chars = None
    if judge_ceiling is not None:
        try:
            fitting = episode_chars_within(
                judge_ceiling,
                rubric_chars=settings.judge.rubric_chars,
                max_answer_tokens=JUDGE_ANSWER_TOKENS,
            )
        except ValueError as exc:
            raise SettingsInvalid(f"capacity: judge model {judge!r}: {exc}") from exc
        episode_chars = min(settings.judge.episode_chars, fitting)
    return CapacityPlan(
        capacity=capacity,
        agent_model=agent,
        judge_model=judge,
        resident=resident,
        max_context_tokens=ceilings,
        judge_context_tokens=judge_ceiling,
        judge_episode_chars=episode_chars,
        retention_target_tokens=None if judge_ceiling is None else judge_ceiling // 2,
    )
