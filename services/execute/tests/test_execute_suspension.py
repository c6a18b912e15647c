"""Execute wires resident sandbox suspension from the settings, and exports its metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from assay.engine import StubModel
from assay.engine.tools import BUILTIN_TOOLS
from assay.grading import StubJudge
from assay.kernel import Refused
from assay.runtime import StageDeps
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.sandbox import LocalSandbox, SuspendPolicy
from assay.store import FsBlobStore
from assay_execute.stage import create_stage


def deps(tmp_path: Path, suspend: SuspendPolicy | None, *, sandbox: bool = True) -> StageDeps:
    blobs = FsBlobStore(tmp_path / "blobs")
    return StageDeps(
        blobs=blobs,
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        sandbox=LocalSandbox(tmp_path / "sandbox", blobs) if sandbox else None,
        suspend=suspend,
    )


def test_suspension_is_off_by_default_and_the_setting_turns_it_on() -> None:
    assert AssaySettings.from_env({}).sandbox.suspend is None
    on = AssaySettings.from_env(
        {
            "ASSAY_SANDBOX_SUSPEND_IDLE_AFTER_S": "2.5",
            "ASSAY_SANDBOX_RESIDENT_MEMORY_BYTES": "1048576",
        }
    )
    assert on.sandbox.suspend == SuspendPolicy(idle_after_s=2.5, resident_memory_bytes=1 << 20)
    stub = AssaySettings.from_env({"ASSAY_MODEL_STUB_DELAY_S": "0.5"}).model.build()
    assert isinstance(stub, StubModel)
    assert stub.delay_s == 0.5


def test_a_negative_idle_after_is_refused_by_name() -> None:
    with pytest.raises(SettingsInvalid, match="SUSPEND_IDLE_AFTER_S"):
        AssaySettings.from_env({"ASSAY_SANDBOX_SUSPEND_IDLE_AFTER_S": "-1"})


def test_execute_exports_the_suspension_metrics_only_when_it_is_on(tmp_path: Path) -> None:
    assert create_stage(deps(tmp_path, None)).metrics == ()
    spec = create_stage(deps(tmp_path, SuspendPolicy(idle_after_s=1.0)))
    assert spec.deps.driver.suspension is not None
    (registry,) = spec.metrics
    names = {m.name for m in registry.collect()}
    assert {
        "assay_sandbox_suspensions",
        "assay_sandbox_resumes",
        "assay_sandbox_resume_seconds",
        "assay_sandbox_resident_memory_byte_seconds",
    } <= names


def test_suspension_without_a_sandbox_is_refused(tmp_path: Path) -> None:
    with pytest.raises(Refused, match="resident sandbox"):
        create_stage(deps(tmp_path, SuspendPolicy(idle_after_s=1.0), sandbox=False))
