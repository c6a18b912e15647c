"""DeterministicGrader (§11.1): a number the user already computes, no judge.

It exists so that adopting Assay does not require adopting LLM-as-judge. The
number comes from the episode (its duration, attempts, token usage, or the
output itself / a key inside the output's JSON); the score is a `Ranked` delta
from control — the current version's episode on the same task — with a point
interval (nothing about it is estimated) and a group of two.
"""

from __future__ import annotations

import json
import math
from typing import Any

from assay.kernel.scores import Ranked
from assay.messages.episode import Episode


def metric_value(episode: Episode, metric: str) -> float | None:
    """The number `metric` names in `episode`, or None when the episode does not hold one.

    `duration_ms` sums every attempt's duration; `attempts` counts them;
    `usage.<field>` reads the run's model usage; `output` parses the run's output
    as a number; `output.<key>...` walks the output's JSON object by keys.
    """
    if metric == "duration_ms":
        return float(sum(v.duration_ms for v in episode.attempts))
    if metric == "attempts":
        return float(len(episode.attempts))
    if metric.startswith("usage."):
        return float(getattr(episode.usage, metric.removeprefix("usage.")))
    if episode.output is None:
        return None
    keys = metric.split(".")[1:]
    try:
        value: Any = json.loads(episode.output)
    except ValueError:
        return None
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def deterministic_rank(value: float, control: float, *, higher_is_better: bool) -> Ranked:
    """The episode's number as a delta from control's, signed so that better is positive."""
    delta = value - control if higher_is_better else control - value
    return Ranked(strength=delta, interval=(delta, delta), group_size=2, anchored=True)
