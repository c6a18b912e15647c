"""The episode: a run's frozen, content-addressed record (§10.1, §10.2).

Execute writes it once when the run's steps are all terminal; verifiers and
judges read it and nothing else, so what they say is grounded in it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from assay.kernel.attempts import AttemptState
from assay.kernel.canonical import canonical_bytes
from assay.kernel.ids import AttemptNo, StepId
from assay.kernel.schema import Versioned
from assay.messages.models import RunRef, Usage


class ContextRef(BaseModel):
    """One piece of what a model call could read: a reference and its size, not a copy."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    ref: str = Field(description="What it is: `task.<field>`, `steps.<id>.output` or `plan`.")
    chars: int = Field(ge=0, description="Its size in characters, as it would be rendered.")


class ModelContext(BaseModel):
    """What one model call had (§10.1): what was packed into its context, what was
    available and not packed, what a budget dropped, and the tools it was offered."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    packed: list[ContextRef] = Field(description="Packed into the context, in prompt order.")
    available: list[ContextRef] = Field(description="Available to the call and not packed.")
    dropped: list[ContextRef] = Field(description="Packed, then dropped to fit a budget.")
    tools_offered: list[str] = Field(description="Tools the model was offered, by name.")

    def holds(self, ref: str) -> bool:
        """Whether `ref` was packed."""
        return any(r.ref == ref for r in self.packed)


class AttemptView(Versioned):
    """One attempt of one step, failed ones included (they are the learning signal)."""

    type: ClassVar[str] = "AttemptView"
    version: ClassVar[int] = 1
    step: StepId = Field(description="Step.")
    attempt: AttemptNo = Field(description="Attempt number (1-based).")
    iteration: int = Field(ge=0, description="How many times the step had run before.")
    state: AttemptState = Field(description="Terminal kernel state of the attempt.")
    prompt: str | None = Field(None, description="Rendered prompt (model steps).")
    output: str | None = Field(None, description="Output text, when it succeeded.")
    error: str | None = Field(None, description="Why it did not succeed.")
    usage: Usage = Field(description="Model usage of this attempt.")
    duration_ms: int = Field(ge=0, description="Wall-clock time of the attempt.")
    context: ModelContext | None = Field(
        None, description="A model attempt's context (None: a tool attempt, or not recorded)."
    )


class Episode(Versioned):
    """Everything a verifier or judge may look at for one run."""

    type: ClassVar[str] = "Episode"
    version: ClassVar[int] = 1
    run: RunRef = Field(description="The run.")
    definition: dict[str, Any] = Field(description="The pinned workflow IR.")
    input: dict[str, Any] = Field(description="The task input.")
    attempts: list[AttemptView] = Field(description="Every attempt, in order.")
    outputs: dict[str, str] = Field(description="Latest successful output per step.")
    output: str | None = Field(None, description="The run's output.")
    succeeded: bool = Field(description="Every step ended with a succeeded attempt.")
    failed_step: StepId | None = Field(None, description="Step whose attempts ran out.")
    usage: Usage = Field(description="Model usage of the run.")
    workspace: str | None = Field(
        None,
        description=(
            "Blob ref of the run's sandbox workspace snapshot (a tar archive, in the "
            "tenant's blobs), when the run had one; command verifiers start from it."
        ),
    )

    def encode(self) -> bytes:
        """Canonical bytes (what is stored and hashed)."""
        return canonical_bytes(self.model_dump(mode="json"))


class Elision(Versioned):
    """One text that reduction shortened: where it was, and how much of it is gone."""

    type: ClassVar[str] = "Elision"
    version: ClassVar[int] = 1
    path: str = Field(description="Where in the episode, e.g. `attempts[2].output`, `input.q`.")
    chars: int = Field(ge=0, description="Its length before, in characters.")
    elided: int = Field(ge=0, description="Characters removed (the marker says so in place).")


class ReducedEpisode(Versioned):
    """An episode reduced at its tenant's token ceiling (§8.6): the summary blob.

    Every transition is kept — every attempt with its step, number, iteration,
    state, usage and duration, the pinned definition, the run's identity, its
    outcome and workspace ref. Only long texts (task input strings, prompts,
    outputs, errors) are shortened, each to its head and tail around a marker
    naming how many characters were elided; `elisions` lists them. It can still be
    graded, attributed and structurally rewound, not replayed verbatim.
    """

    type: ClassVar[str] = "ReducedEpisode"
    version: ClassVar[int] = 1
    original: str = Field(description="BlobRef of the episode this stands for (deleted).")
    episode: Episode = Field(description="The episode with its long texts shortened.")
    elisions: list[Elision] = Field(description="Every text shortened, in episode order.")
    tokens_before: int = Field(ge=0, description="The original's tokens (retention's measure).")
    tokens_after: int = Field(ge=0, description="This episode's tokens, by the same measure.")

    def encode(self) -> bytes:
        """Canonical bytes (what is stored and hashed)."""
        return canonical_bytes(self.model_dump(mode="json"))
