"""Staged effects: a rollout sibling's unsafe external writes wait for its group's selection.

N siblings of one task would repeat an `Unsafe` external write N times (DESIGN §13;
the rollout-groups proposal's isolation rules). So a sibling does not perform such a
call: it stages it. One commit records `EffectStaged` — the tool, the effect key and
the hash of the arguments, which the attempt's own `AttemptStarted` holds — with the
attempt's end, `Succeeded` with the staged marker (`staged_output`) as its output: that
is what the agent's later steps, the episode and the verifiers see.

After selection, execute publishes the winner's staged effects and discards every
other sibling's (`assay_execute.publication`), on the sibling's commands stream:
`EffectPublishing` (the write-ahead intent, `Pending` then `Dispatched`, §8.4), then
`EffectPublished` (how the call ended, `Indeterminate` when nobody can tell) or
`EffectDiscarded`. Each staged effect ends in exactly one of those two records.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from assay.engine.context import RunSpec
from assay.engine.staged_events import (
    STAGING_EVENTS,
    EffectDiscarded,
    EffectPublished,
    EffectPublishing,
    EffectStaged,
    Publication,
    StagedEffectView,
    fold_staging,
)
from assay.engine.tools import Tool, Unsafe
from assay.kernel.canonical import content_hash
from assay.kernel.ids import StepId

__all__ = [
    "STAGING_EVENTS",
    "EffectDiscarded",
    "EffectPublished",
    "EffectPublishing",
    "EffectStaged",
    "Publication",
    "StagedEffectView",
    "args_hash",
    "effect_key",
    "fold_staging",
    "stageable",
    "staged_output",
]


def stageable(spec: RunSpec, tool: Tool) -> bool:
    """Whether `tool`'s call in run `spec` is staged instead of performed: an `Unsafe` call
    that reaches outside the sandbox, made by a rollout sibling as spawned (its branch 0,
    outside any sub-workflow: what its group's selection chose). Otherwise the call fails,
    as a shadow run's does: a tool that needs the sibling's workspace cannot be published
    outside it, and a fork's or a sub-workflow's staged call would never be selected."""
    return (
        isinstance(tool.effects, Unsafe)
        and spec.ref.rollout is not None
        and not tool.needs_sandbox
        and spec.branch == 0
        and spec.stream is None
    )


def effect_key(spec: RunSpec, step: StepId, iteration: int, tool: str) -> str:
    """The staged effect's idempotency key: one logical call of the run (neither the attempt
    nor the branch: a retry or a rewind that stages it again stages the same effect)."""
    ref = spec.ref
    return content_hash(
        {
            "tenant": str(ref.tenant),
            "run": str(ref.run_id),
            "step": step,
            "iteration": iteration,
            "tool": tool,
            "staged": True,
        }
    )


def args_hash(args: Mapping[str, str]) -> str:
    """The hash a staged effect's arguments are checked against when it is published."""
    return content_hash(dict(args))


def staged_output(tool: str, key: str) -> str:
    """What a staging attempt outputs, for the agent's later steps and the verifiers:
    `{"effect_key": "<key>", "staged": "<tool>"}` — the call is not made (yet)."""
    return json.dumps({"effect_key": key, "staged": tool}, sort_keys=True)
