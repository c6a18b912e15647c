"""A replay tournament's candidate matrix (§11.1 `ReplayTournament`, DESIGN §13).

A rollout spec may carry `candidates`: N variants of the workflow — stored
versions, a model, or prompts — each run `samples` times (default once) on the
same task as siblings of the group, then ranked against a pinned control by the
tournament (Swiss pairing, Bradley-Terry with the Davidson tie term, a
candidate's siblings' comparisons pooled into its strength). Ingest resolves each
`Candidate` into a `PlannedCandidate` (the version it runs, the most it may
spend) and declares the group's `MatrixEstimate` before anything runs; the
result reports a `CandidateResult` per candidate.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from assay.kernel.ids import RunId, WorkflowVersion
from assay.kernel.schema import Versioned
from assay.kernel.scores import Ranked

CURRENT = "current"
"""A candidate's `version` naming the workflow's current version, whatever its hash."""

CandidateKind = Literal["version", "model", "prompt"]

NAME = r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,63}$"
"""What a candidate's name may be: short, printable, no spaces."""

MAX_SIBLINGS = 64
"""The most sibling runs one rollout group may run (`MAX_ROLLOUT`): so the most siblings
one candidate may ask for."""


def _one(samples: int) -> bool:
    # `samples` is left out at its default: a one-sibling candidate serialises as it always
    # did, so the messages, events and content addresses written before it are unchanged.
    return samples == 1


class Candidate(Versioned):
    """One variant of the workflow: exactly one of a stored `version`, a `model` its model
    steps call, or `prompt`s for its model steps (the last two vary the current version).

    Version 2 adds `samples`: how many siblings it runs (a version 1 candidate runs one).

    Raises (as a validation error):
        ValueError: none or several of `version`, `model` and `prompt`.
    """

    # `version` is the class's schema version: the field is `workflow_version`, written
    # `version` on the wire.
    model_config = ConfigDict(
        frozen=True, extra="forbid", populate_by_name=True, serialize_by_alias=True
    )
    type: ClassVar[str] = "Candidate"
    version: ClassVar[int] = 2
    name: str | None = Field(
        None,
        pattern=NAME,
        description=(
            "How the result names it (default: `version:<first 12 of the hash>`, `model:<name>`, "
            "or `prompt:<index>`); unique in the matrix."
        ),
    )
    workflow_version: str | None = Field(
        None,
        alias="version",
        min_length=1,
        max_length=64,
        description=(
            "A stored version of the workflow (its hash, or a prefix of it naming one version), "
            "or `current`."
        ),
    )
    model: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="The current version with every model step calling this model.",
    )
    prompt: str | dict[str, str] | None = Field(
        None,
        description=(
            "The current version with new prompts: a template for its one model step, or "
            "`{step id: template}`."
        ),
    )
    samples: int = Field(
        1,
        ge=1,
        exclude_if=_one,
        le=MAX_SIBLINGS,
        description=(
            "Siblings it runs on the task (its pass rate and strength pool them); left out while 1."
        ),
    )

    @model_validator(mode="after")
    def _exactly_one_variant(self) -> Candidate:
        given = [k for k in ("workflow_version", "model", "prompt") if getattr(self, k) is not None]
        if len(given) != 1:
            shown = ", ".join(g.replace("workflow_", "") for g in given) or "none"
            raise ValueError(
                f"a candidate is exactly one of version, model or prompt (given: {shown})"
            )
        if isinstance(self.prompt, dict) and not self.prompt:
            raise ValueError("a candidate's prompt mapping names no step")
        return self

    @property
    def kind(self) -> CandidateKind:
        """What it varies."""
        if self.workflow_version is not None:
            return "version"
        return "model" if self.model is not None else "prompt"

    def label(self, index: int) -> str:
        """Its name in the matrix: the given one, else one derived from the variant."""
        if self.name is not None:
            return self.name
        if self.workflow_version is not None:
            return f"version:{self.workflow_version[:12]}"
        if self.model is not None:
            return f"model:{self.model}"
        return f"prompt:{index}"


class PlannedCandidate(Versioned):
    """A candidate as ingest admitted it: what it runs and the most it may spend.

    Version 2 adds `samples`: its siblings are the `samples` consecutive indexes from
    `index` (a version 1 candidate has the one sibling `index`).
    """

    type: ClassVar[str] = "PlannedCandidate"
    version: ClassVar[int] = 2
    name: str = Field(description="Its name in the matrix.")
    index: int = Field(ge=0, description="Its first sibling's index in the group.")
    samples: int = Field(
        1,
        ge=1,
        exclude_if=_one,
        le=MAX_SIBLINGS,
        description="Siblings it runs: indexes index to index + samples - 1 (left out while 1).",
    )
    kind: CandidateKind = Field(description="What it varies (the control: `version`).")
    variant: str = Field(description="The variant, for people: the version, model or prompts.")
    workflow_version: WorkflowVersion = Field(description="The version its sibling runs.")
    control: bool = Field(description="The pinned control: every strength is a delta from it.")
    implicit: bool = Field(
        False, description="The current version, added as the control the matrix did not list."
    )
    max_model_calls: int = Field(ge=1, description="Model calls its sibling may make.")
    max_tokens: int | None = Field(None, ge=1, description="Tokens its sibling may use.")
    max_cost_usd: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="US dollars its sibling may spend."
    )

    @property
    def indexes(self) -> range:
        """Its siblings' indexes in the group."""
        return range(self.index, self.index + self.samples)


class MatrixEstimate(Versioned):
    """The group's cost, declared at submission before anything runs: the sum of its
    siblings' per-run maxima (a bound, not a guess; None: a cap nobody set)."""

    type: ClassVar[str] = "MatrixEstimate"
    version: ClassVar[int] = 1
    model_calls: int = Field(ge=0, description="Model calls at most.")
    tokens: int | None = Field(None, ge=0, description="Tokens at most (when every run is capped).")
    cost_usd: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="US dollars at most (when every run is capped).",
    )
    replay_calls: int = Field(
        ge=0, description="Model calls reserved against the tenant's replay ceiling."
    )


class CandidateResult(Versioned):
    """One candidate in a replay tournament's result: its strength against the control,
    with its interval, its rank, and its pass rate.

    Version 2 adds `samples` (the siblings it asked for); `runs`, `verified`, `passes`,
    `pass_rate` and `strength` count every one of its siblings (a version 1 candidate ran
    one).
    """

    type: ClassVar[str] = "CandidateResult"
    version: ClassVar[int] = 2
    name: str = Field(description="Its name in the matrix.")
    kind: CandidateKind = Field(description="What it varies.")
    variant: str = Field(description="The variant, for people.")
    workflow_version: WorkflowVersion = Field(description="The version its siblings ran.")
    control: bool = Field(description="The pinned control (strength 0 when anchored).")
    samples: int = Field(
        1,
        ge=1,
        le=MAX_SIBLINGS,
        exclude_if=_one,
        description="Siblings it asked for (left out while 1).",
    )
    runs: list[RunId] = Field(description="Its siblings that started.")
    verified: int = Field(ge=0, description="Of which ran to verification.")
    passes: int = Field(ge=0, description="Of which every verifier passed.")
    pass_rate: float | None = Field(
        None, ge=0, le=1, description="passes / verified (None: none verified)."
    )
    capped: bool = Field(
        False,
        description=(
            "A sibling violated a `Core` rubric item: that sibling is not ranked (its other "
            "siblings are)."
        ),
    )
    strength: Ranked | None = Field(
        None,
        description=(
            "Bradley-Terry strength with its interval, a delta from the control when "
            "`anchored`, pooling every comparison of its ranked siblings (None: not ranked — "
            "cancelled, capped, or no comparison answered)."
        ),
    )
    rank: int | None = Field(
        None, ge=1, description="1 = strongest among the ranked candidates (ties share a rank)."
    )


def check_matrix(
    candidates: list[Candidate] | None, control: str | None, *, n: int, admit: int | None, mode: str
) -> None:
    """Refuse a matrix that cannot be admitted whole, whatever the deployment.

    Raises:
        ValueError: a control without a matrix or naming no candidate, two candidates with
            one name, `n` other than the number of siblings the candidates run (their
            `samples` added up), `admit` below it, or a mode that ranks nothing
            (`trajectory_collection`).
    """
    if candidates is None:
        if control is not None:
            raise ValueError("control names a candidate, and there is no candidate matrix")
        return
    names = [c.label(i) for i, c in enumerate(candidates)]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"candidate names must be unique in the matrix: {', '.join(twice)}")
    siblings = sum(c.samples for c in candidates)
    if n != siblings:
        raise ValueError(
            f"n ({n}) is not the number of siblings the candidates run ({siblings}: their "
            "samples added up)"
        )
    if siblings > MAX_SIBLINGS:
        raise ValueError(
            f"the candidates run {siblings} siblings, more than a group's {MAX_SIBLINGS}"
        )
    if admit is not None and admit < n:
        left_out = names[sibling_owner([c.samples for c in candidates], admit)]
        raise ValueError(
            f"admit ({admit}) would leave out a sibling of candidate {left_out!r}: a "
            "candidate matrix is admitted whole or refused"
        )
    if mode == "trajectory_collection":
        raise ValueError("a candidate matrix is ranked: trajectory_collection ranks nothing")
    if control is not None and control not in names:
        raise ValueError(f"control {control!r} names no candidate (candidates: {', '.join(names)})")


def sibling_owner(samples: list[int], index: int) -> int:
    """Which candidate runs sibling `index`, when the candidates (in order) run `samples`
    consecutive siblings each: the first candidate's first, then the next's."""
    start = 0
    for i, k in enumerate(samples):
        if index < start + k:
            return i
        start += k
    raise IndexError(f"sibling {index} is past the matrix's {start} siblings")
