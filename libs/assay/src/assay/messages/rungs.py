"""The promotion ladders and their rungs (§12.3), apart from the loop's messages: the
ladder policy in the settings names them, and settings load no message model.
"""

from __future__ import annotations

import enum


class Rung(enum.Enum):
    """Where a challenger stands on the promotion ladder (§12.3)."""

    SHADOW = "shadow"
    """0% of live tasks: replayed beside the current version for comparison only."""
    TRIAL = "trial"
    """Default ladder: serves a small share of live tasks (5%)."""
    CANARY = "canary"
    """Resourced ladder: serves a small share once its strength beats the current's."""
    RAMP = "ramp"
    """Resourced ladder: serves a growing share (20%, then 50%)."""


class Ladder(enum.Enum):
    """Which promotion ladder a challenger climbs, by its grading strategy."""

    DEFAULT = "default"
    """Pairwise or deterministic grading: shadow -> trial -> current, on the sequential test."""
    RESOURCED = "resourced"
    """Tournament grading: shadow -> canary -> ramp -> current, on Bradley-Terry strengths."""
