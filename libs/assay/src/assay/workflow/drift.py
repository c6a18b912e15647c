"""A workflow's task-mix drift check, as declared (§12.5): which characteristics of its
tasks to watch, over how many tasks, and how far they may move.

A feature names a field of the task input by its dotted path (`input.language`,
`input.meta.difficulty`). Nothing else of a run is a task characteristic: a feature
rooted anywhere but `input` is refused at registration, and so is one the declared
`input_schema` (when the workflow gives one) has no property for. Without a schema, a
task that lacks the field counts in the bin `<missing>`: the check then also watches
how often producers leave it out. The class of the task's `TaskId` (the producer's
task key, or the hash of the input) is always watched beside the declared features.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

FEATURE_PATTERN = re.compile(r"^input(\.[A-Za-z0-9_-]+)+$")
"""A feature: `input.` then one or more dotted field names."""

TASK_ID_CLASS = "task_id.class"
"""The built-in feature: `task_key` (the producer named the task) or `content` (its
`TaskId` is the hash of its input)."""


class DriftSpec(BaseModel):
    """What ingest watches of the workflow's incoming tasks, and when the mix counts as
    drifted: the population stability index of a full window of tasks against the
    reference window (the mix the current version was promoted under) above
    `threshold`, for any feature."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    features: list[str] = Field(
        min_length=1,
        max_length=32,
        description="Task input fields to watch, by dotted path: `input.language`.",
    )
    window: int = Field(500, ge=20, le=100_000, description="Tasks in one window.")
    threshold: float = Field(
        0.2, gt=0, le=10, description="PSI above which a feature has drifted (0.1-0.25 usual)."
    )
    bins: int = Field(
        10, ge=2, le=50, description="Quantile bins of a numeric feature (of the reference)."
    )
    input_schema: dict[str, Any] | None = Field(
        None,
        description=(
            "JSON Schema of the task input: every feature must be a property path in it. "
            "Without one, a task lacking a feature counts as `<missing>`."
        ),
    )

    @field_validator("features")
    @classmethod
    def _in_the_input(cls, features: list[str]) -> list[str]:
        for f in features:
            if not FEATURE_PATTERN.match(f):
                raise ValueError(
                    f"drift feature {f!r} is not in the task input: name a field of it as "
                    "`input.<field>` (dotted for nested fields)"
                )
        if len(set(features)) != len(features):
            raise ValueError("drift features are named twice")
        return features

    @model_validator(mode="after")
    def _in_the_schema(self) -> DriftSpec:
        if self.input_schema is None:
            return self
        for f in self.features:
            node: Any = self.input_schema
            for name in f.split(".")[1:]:
                props = node.get("properties") if isinstance(node, dict) else None
                if not isinstance(props, dict) or name not in props:
                    raise ValueError(
                        f"drift feature {f!r} is not in the task input: its declared "
                        f"input_schema has no property {name!r} there"
                    )
                node = props[name]
        return self

    def tracked(self) -> list[str]:
        """Every feature watched: the declared ones, then the `TaskId` class."""
        return [*self.features, TASK_ID_CLASS]
