"""The log records of staged effects (`assay.engine.staging`) and their fold.

`EffectStaged` is recorded on a rollout sibling's branch with the attempt that staged
it; `EffectPublishing`, `EffectPublished` and `EffectDiscarded` on the sibling's
commands stream, by execute's publication after the group's selection.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Literal

from pydantic import Field

from assay.kernel.ids import AttemptNo, StepId
from assay.kernel.intents import IntentState
from assay.record.events import Event, LogRecord
from assay.record.state import Patch, ReadModel, StateDelta


class EffectStaged(Event):
    """A rollout sibling's call of an `Unsafe` tool that reaches outside its sandbox was
    staged, not performed: committed with the attempt's end (`Succeeded`, the staged
    marker as its output). Its arguments are the attempt's `AttemptStarted.args`."""

    type: ClassVar[str] = "EffectStaged"
    version: ClassVar[int] = 1
    step: StepId = Field(description="Step of the attempt that staged it.")
    attempt: AttemptNo = Field(description="That attempt (its `AttemptStarted` holds the args).")
    iteration: int = Field(ge=0, description="Times the step had run before.")
    tool: str = Field(description="The tool to call when the effect is published.")
    effect: str = Field("unsafe", description="Its declared effect class (always `unsafe`).")
    effect_key: str = Field(
        description="The effect's idempotency key: derived from tenant, run, step, iteration "
        "and tool, the same on every recovery; the tool receives it when published."
    )
    args_hash: str = Field(description="blake3 of the canonical arguments, checked at publication.")


class EffectPublishing(Event):
    """The write-ahead intent of publishing a staged effect (§8.4): `Pending` before the
    call is issued, `Dispatched` just before it is; `EffectPublished` commits its end.
    Recorded on the sibling's commands stream."""

    type: ClassVar[str] = "EffectPublishing"
    version: ClassVar[int] = 1
    branch: int = Field(ge=0, description="The sibling's branch that staged the effect.")
    effect_key: str = Field(description="The staged effect.")
    state: IntentState = Field(description="Intent state entered (pending or dispatched).")
    tool: str = Field(description="The tool called.")
    effect: str = Field("unsafe", description="Its declared effect class.")
    request_id: str = Field(description="Names this call, as the tool sees it.")


class Publication(enum.Enum):
    """How the publication of a staged effect ended."""

    PUBLISHED = "published"
    """The tool answered: the effect happened."""
    FAILED = "failed"
    """The tool answered with a failure: nothing happened."""
    INDETERMINATE = "indeterminate"
    """Dispatched and never answered: nobody knows whether it happened (an operator alert)."""


class EffectPublished(Event):
    """The publication of a staged effect ended (the intent's `Committed`): recorded once,
    on the selected sibling's commands stream. Never retried: the tool is `Unsafe`."""

    type: ClassVar[str] = "EffectPublished"
    version: ClassVar[int] = 1
    branch: int = Field(ge=0, description="The sibling's branch that staged the effect.")
    effect_key: str = Field(description="The staged effect.")
    tool: str = Field(description="The tool called.")
    state: Publication = Field(description="How it ended.")
    output: str | None = Field(None, description="The tool's output, when it was published.")
    error: str | None = Field(None, description="Why it failed, or why its outcome is unknown.")


class EffectDiscarded(Event):
    """A staged effect that will never be published: its sibling was not selected, or its
    group publishes nothing (trajectory collection, shadow, a cancelled group). Recorded
    once, on the sibling's commands stream; nothing was ever dispatched."""

    type: ClassVar[str] = "EffectDiscarded"
    version: ClassVar[int] = 1
    branch: int = Field(ge=0, description="The sibling's branch that staged the effect.")
    effect_key: str = Field(description="The staged effect.")
    tool: str = Field(description="The tool it would have called.")
    reason: str = Field(description="Why it is discarded, for people.")


STAGING_EVENTS: tuple[type[Event], ...] = (
    EffectStaged,
    EffectPublishing,
    EffectPublished,
    EffectDiscarded,
)

StagedState = Literal[
    "staged", "pending", "dispatched", "published", "failed", "indeterminate", "discarded"
]


class StagedEffectView(ReadModel):
    """A staged effect and how far its publication got. Keyed `<run>/<branch>/<effect key>`."""

    kind: ClassVar[str] = "staged-effect"
    state: StagedState
    tool: str
    step: StepId | None = None
    iteration: int | None = None
    detail: str | None = None
    """The tool's error, or why the effect was discarded."""


def fold_staging(record: LogRecord) -> list[StateDelta]:
    """The `StagedEffectView` documents, from one staging or publication record."""
    t, stream, branch = record.key.tenant, record.key.stream, record.key.branch
    run = stream.removesuffix("/commands")
    match record.event:
        case EffectStaged(step=step, iteration=i, tool=tool, effect_key=key):
            view = StagedEffectView(state="staged", tool=tool, step=step, iteration=i)
            return [view.put(t, f"{run}/{branch}/{key}")]
        case EffectPublishing(branch=b, effect_key=key, state=state):
            return [Patch(StagedEffectView.at(t, f"{run}/{b}/{key}"), {"state": state.value})]
        case EffectPublished(branch=b, effect_key=key, state=state, error=error):
            fields = {"state": state.value, "detail": error}
            return [Patch(StagedEffectView.at(t, f"{run}/{b}/{key}"), fields)]
        case EffectDiscarded(branch=b, effect_key=key, reason=reason):
            fields = {"state": "discarded", "detail": reason}
            return [Patch(StagedEffectView.at(t, f"{run}/{b}/{key}"), fields)]
    return []
