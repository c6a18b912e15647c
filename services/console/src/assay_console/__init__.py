"""Assay's console: its read model (a stage that only folds), a JSON API and pages."""

from assay_console.stage import CONSOLE_EVENTS, RUNS_TABLE, RunRow, create_stage

__all__ = ["CONSOLE_EVENTS", "RUNS_TABLE", "RunRow", "create_stage"]
