"""Runtime: stages, units of work, consumers, and the embedded (one-process) mode."""

from typing import TYPE_CHECKING

from assay.kernel.lazy import lazy_exports

if TYPE_CHECKING:
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
    from assay.runtime.plugins import PluginInvalid, load_tools, load_verifiers
    from assay.runtime.settings import AssaySettings, SandboxSettings, SettingsInvalid
    from assay.runtime.stage import (
        Gauge,
        Handler,
        HandlerInvalid,
        StageDeps,
        StageFactory,
        StageSpec,
        UnitOfWork,
        routes,
    )
else:
    __getattr__ = lazy_exports(
        __name__,
        {
            "assay.runtime.chaos": ["RedeliveringSource"],
            "assay.runtime.consumer": ["StageRunner", "decode"],
            "assay.runtime.embedded": [
                "STAGES",
                "DataDirBusy",
                "Embedded",
                "StageMissing",
                "default_data_dir",
                "discover_stages",
                "stage_log",
            ],
            "assay.runtime.harness": ["StageHarness"],
            "assay.runtime.plugins": ["PluginInvalid", "load_tools", "load_verifiers"],
            "assay.runtime.settings": ["AssaySettings", "SandboxSettings", "SettingsInvalid"],
            "assay.runtime.stage": [
                "Gauge",
                "Handler",
                "HandlerInvalid",
                "StageDeps",
                "StageFactory",
                "StageSpec",
                "UnitOfWork",
                "routes",
            ],
        },
    )

__all__ = [
    "STAGES",
    "AssaySettings",
    "DataDirBusy",
    "Embedded",
    "Gauge",
    "Handler",
    "HandlerInvalid",
    "PluginInvalid",
    "RedeliveringSource",
    "SandboxSettings",
    "SettingsInvalid",
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
    "load_tools",
    "load_verifiers",
    "routes",
    "stage_log",
]
