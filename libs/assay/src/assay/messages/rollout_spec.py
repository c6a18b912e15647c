"""What a rollout group asks for, and what each of its runs carries (DESIGN §13).

A `TaskSubmitted` may carry a `RolloutSpec`: run the task N times, as sibling
runs from the same immutable snapshot, within a hierarchical budget, then
select a winner by an explicit, versioned policy. Each sibling's `RunRef`
carries a `RolloutRef` naming its group and index — a retried attempt is an
attempt of the same sibling, never another rollout.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from assay.kernel.schema import Versioned
from assay.messages.candidates import MAX_SIBLINGS, Candidate, check_matrix

MAX_ROLLOUT = MAX_SIBLINGS
"""The most sibling runs one rollout group may request."""

RolloutMode = Literal["best_of_n", "evaluation", "trajectory_collection", "shadow"]


class RolloutBudget(Versioned):
    """The group's hierarchical budget: total, per run, concurrency and a deadline.

    Version 2 adds the cost caps in US dollars (`run_max_cost_usd`, `group_max_cost_usd`).

    Raises (as a validation error):
        ValueError: a group cap without the per-run cap it is admitted by, or a per-run
            cost cap above the group's.
    """

    type: ClassVar[str] = "RolloutBudget"
    version: ClassVar[int] = 2
    max_concurrency: int | None = Field(
        None, ge=1, le=MAX_ROLLOUT, description="Siblings running at once (default: all)."
    )
    run_max_model_calls: int | None = Field(
        None, ge=1, description="Model calls one sibling may make (at most the workflow's)."
    )
    group_max_model_calls: int | None = Field(
        None,
        ge=1,
        description=(
            "Model calls the whole group may make; a sibling starts only when the calls spent "
            "plus every running sibling's maximum plus its own fit."
        ),
    )
    deadline_s: float | None = Field(
        None,
        gt=0,
        le=7 * 86400,
        description="Seconds after submission when the group stops: running siblings cancelled.",
    )
    run_max_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "Tokens one sibling may use: a model call is made only if the tokens used plus "
            "the prompt's UTF-8 bytes plus the step's max_tokens fit (a bound, not a guess)."
        ),
    )
    group_max_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "Tokens the whole group may use (needs run_max_tokens): a sibling starts only when "
            "the tokens used plus every running sibling's maximum plus its own fit."
        ),
    )
    run_max_cost_usd: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description=(
            "US dollars one sibling may spend: a model call is made only if the run's cost so "
            "far plus the call's worst-case price (the prompt's UTF-8 bytes and the step's "
            "max_tokens at the model's per-token prices) fit (a bound, not a guess)."
        ),
    )
    group_max_cost_usd: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description=(
            "US dollars the whole group may spend (needs run_max_cost_usd, at most this): a "
            "sibling starts only when the cost spent plus every running sibling's maximum plus "
            "its own fit."
        ),
    )

    @model_validator(mode="after")
    def _group_tokens_need_a_run_cap(self) -> RolloutBudget:
        if self.group_max_tokens is not None and self.run_max_tokens is None:
            raise ValueError("group_max_tokens needs run_max_tokens, the bound of each sibling")
        return self

    @model_validator(mode="after")
    def _group_cost_needs_a_run_cap_within_it(self) -> RolloutBudget:
        group, run = self.group_max_cost_usd, self.run_max_cost_usd
        if group is not None and run is None:
            raise ValueError("group_max_cost_usd needs run_max_cost_usd, the bound of each sibling")
        if group is not None and run is not None and run > group:
            raise ValueError(
                f"run_max_cost_usd ({run}) exceeds group_max_cost_usd ({group}): "
                "no sibling could start"
            )
        return self


class SelectionPolicy(Versioned):
    """How a winner is chosen; recorded with the result (name and version)."""

    type: ClassVar[str] = "SelectionPolicy"
    version: ClassVar[int] = 1
    name: Literal["verifier_then_judge"] = Field(
        "verifier_then_judge",
        description=(
            "Verifier outcome first (a pass beats a fail; a capped sibling never wins), then "
            "a Bradley-Terry tournament among the best outcome class, then the lowest index."
        ),
    )
    policy_version: int = Field(1, ge=1, description="Version of the named policy.")


class RolloutSpec(Versioned):
    """Run one task as N sibling runs and select among them."""

    type: ClassVar[str] = "RolloutSpec"
    version: ClassVar[int] = 1
    n: int = Field(ge=1, le=MAX_ROLLOUT, description="Sibling runs requested.")
    mode: RolloutMode = Field(
        "best_of_n",
        description=(
            "best_of_n: publish the winner; evaluation: pass@k over the siblings; "
            "trajectory_collection: keep every sibling, select none; shadow: like "
            "evaluation, for comparison only. Siblings never publish an unsafe effect."
        ),
    )
    admit: int | None = Field(
        None, ge=1, le=MAX_ROLLOUT, description="Admit at most this many of the n (policy)."
    )
    budget: RolloutBudget = Field(default_factory=RolloutBudget, description="The budget.")
    selection: SelectionPolicy = Field(
        default_factory=SelectionPolicy, description="The selection policy."
    )

    candidates: list[Candidate] | None = Field(
        None,
        min_length=1,
        max_length=MAX_ROLLOUT - 1,
        description=(
            "A candidate matrix (a replay tournament, §11.1): each candidate a variant of the "
            "workflow running `samples` siblings (default 1), ranked against the control. n "
            "defaults to their siblings added up; admitted whole or refused whole. Left out "
            "while unset."
        ),
    )
    control: str | None = Field(
        None,
        description=(
            "The candidate pinned as control (by name); default: the one that is the current "
            "version, else the current version is added as the control."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _n_defaults_to_the_matrix(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("n") is None and data.get("candidates"):
            siblings = _siblings(data["candidates"])
            if siblings > MAX_ROLLOUT:
                raise ValueError(
                    f"the candidates run {siblings} siblings, more than a group's {MAX_ROLLOUT}"
                )
            return {**data, "n": siblings}
        return data

    @model_validator(mode="after")
    def _admit_within_n(self) -> RolloutSpec:
        if self.admit is not None and self.admit > self.n:
            raise ValueError(f"admit ({self.admit}) exceeds n ({self.n})")
        return self

    @model_validator(mode="after")
    def _a_matrix_is_whole(self) -> RolloutSpec:
        check_matrix(self.candidates, self.control, n=self.n, admit=self.admit, mode=self.mode)
        return self

    @model_serializer(mode="wrap")
    def _omit_no_matrix(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out unless set: a homogeneous group's spec serialises as it always did.
        data: dict[str, Any] = handler(self)
        for name in ("candidates", "control"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


def _siblings(candidates: Any) -> int:
    """The siblings a matrix as given runs: each candidate's `samples` (default 1) added up;
    a `samples` that is not a whole number ≥ 1 counts 1 (its own validation refuses it)."""
    if not isinstance(candidates, list):
        return 0
    total = 0
    for c in candidates:
        k = (
            c.samples
            if isinstance(c, Candidate)
            else c.get("samples", 1)
            if isinstance(c, dict)
            else 1
        )
        total += k if isinstance(k, int) and not isinstance(k, bool) and k >= 1 else 1
    return total


class RolloutRef(Versioned):
    """A sibling run's place in its rollout group (version 2 adds `max_cost_usd`)."""

    type: ClassVar[str] = "RolloutRef"
    version: ClassVar[int] = 2
    group: str = Field(description="The group: its task's idempotency key.")
    index: int = Field(ge=0, description="Stable index among the siblings (0-based).")
    size: int = Field(ge=1, description="Siblings admitted.")
    mode: RolloutMode = Field(description="The group's mode.")
    max_model_calls: int | None = Field(
        None, ge=1, description="This sibling's model-call maximum (the group's per-run cap)."
    )
    max_tokens: int | None = Field(
        None, ge=1, description="This sibling's token maximum (the group's per-run cap)."
    )
    max_cost_usd: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="This sibling's cost maximum in US dollars (the group's per-run cap).",
    )

    @model_serializer(mode="wrap")
    def _omit_no_cost_cap(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out unless set: a sibling without a cost cap serialises as it always did, so
        # its messages and its episode's bytes (and content address) are unchanged.
        data: dict[str, Any] = handler(self)
        if data.get("max_cost_usd") is None:
            data.pop("max_cost_usd", None)
        return data
