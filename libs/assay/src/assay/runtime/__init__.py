"""Runtime: stages, units of work, consumers, and the embedded (one-process) mode."""

from assay.runtime.chaos import RedeliveringSource
from assay.runtime.consumer import StageRunner, decode
from assay.runtime.embedded import (
    STAGES,
    DataDirBusy,
    Embedded,
    StageMissing,
    default_data_dir,
    discover_stages,
    stage_log,
)
from assay.runtime.harness import StageHarness
from assay.runtime.stage import Handler, StageDeps, StageFactory, StageSpec, UnitOfWork

__all__ = [
    "STAGES",
    "DataDirBusy",
    "Embedded",
    "Handler",
    "RedeliveringSource",
    "StageDeps",
    "StageFactory",
    "StageHarness",
    "StageMissing",
    "StageRunner",
    "StageSpec",
    "UnitOfWork",
    "decode",
    "default_data_dir",
    "discover_stages",
    "stage_log",
]
