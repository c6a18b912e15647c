"""The health of one path of a process (a store, a relay): failing since when, and why."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Failing:
    """One path's health: since when it has failed without a success in between."""

    since: float | None = None
    last_error: str = ""

    def ok(self) -> None:
        """It worked."""
        self.since = None

    def failed(self, error: str, now: float) -> None:
        """It failed (the first failure of a run of them dates it)."""
        if self.since is None:
            self.since = now
        self.last_error = error

    def failing_for(self, now: float) -> float:
        """Seconds it has been failing (0 when it works)."""
        return 0.0 if self.since is None else now - self.since
