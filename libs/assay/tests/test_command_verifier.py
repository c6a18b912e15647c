"""The `command` verifier (§10): exit code 0 in a sandbox passes; anything else fails, closed.

Also its place in the IR (validation, and workflow versions that do not move
for workflows that do not use it) and the sandbox settings.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from assay.kernel import (
    AttemptNo,
    AttemptState,
    BranchId,
    StepId,
    TaskId,
    TenantId,
    WorkflowVersion,
    new_run_id,
)
from assay.kernel.ids import WorkflowId
from assay.messages import AttemptView, Episode, Purpose, Role, RunRef, Usage, VerifierResult
from assay.runtime import Embedded
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.sandbox import Limits, LocalSandbox, NetworkPolicy
from assay.store import FsBlobStore
from assay.verification import verifier_registry, verify_episode
from assay.workflow import VerifierSpec, WorkflowDef, WorkflowInvalid, load_workflow, validate

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "workflows"
TENANT = TenantId(uuid.UUID(int=51))
OTHER = TenantId(uuid.UUID(int=52))


def workflow(*verifiers: dict[str, Any]) -> WorkflowDef:
    return WorkflowDef.model_validate(
        {
            "id": "arith",
            "steps": [{"id": "solve", "kind": "model", "prompt": "What is {{ task.question }}?"}],
            "verifiers": list(verifiers),
        }
    )


def episode_of(
    output: str, wf: WorkflowDef, *, tenant: TenantId = TENANT, workspace: str | None = None
) -> Episode:
    run_id = new_run_id()
    return Episode(
        run=RunRef(
            tenant=tenant,
            run_id=run_id,
            task_id=TaskId("t" * 64),
            idempotency_key=f"key-{run_id}",
            workflow_id=WorkflowId(wf.id),
            workflow_version=WorkflowVersion(wf.version),
            role=Role.CURRENT,
            purpose=Purpose.WORK,
        ),
        definition=wf.model_dump(mode="json", by_alias=True),
        input={"question": "(5 + 12) * 9", "answer": "153"},
        attempts=[
            AttemptView(
                step=StepId("solve"),
                attempt=AttemptNo(1),
                iteration=0,
                state=AttemptState.SUCCEEDED,
                output=output,
                usage=Usage(),
                duration_ms=1,
            )
        ],
        outputs={"solve": output},
        output=output,
        succeeded=True,
        usage=Usage(),
        workspace=workspace,
    )


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[LocalSandbox]:
    provider = LocalSandbox(tmp_path / "workspaces", FsBlobStore(tmp_path / "blobs"))
    yield provider
    leftovers = list((tmp_path / "workspaces").rglob("*"))
    assert leftovers == [], "a verifier left a workspace behind"


async def run_one(
    sandbox: LocalSandbox | None, output: str, check: dict[str, Any], **kw: Any
) -> VerifierResult:
    wf = workflow({"id": "cmd", "kind": "command", **check})
    [result] = await verify_episode(
        episode_of(output, wf, **kw), list(wf.verifiers), registry=verifier_registry(sandbox)
    )
    assert result.kind == "command"
    return result


# -- passes and fails ----------------------------------------------------------------------


async def test_exit_zero_passes_and_the_output_is_in_output_txt(sandbox: LocalSandbox) -> None:
    check = {"argv": ["sh", "-c", 'test "$(cat output.txt)" = "{{ task.answer }}"']}
    passed = await run_one(sandbox, "153", check)
    assert passed.passed, passed.evidence
    assert passed.verifier_version == "1"
    assert "exited with 0" in passed.evidence
    failed = await run_one(sandbox, "154", check)
    assert not failed.passed
    assert "exited with 1" in failed.evidence


async def test_templates_render_into_argv(sandbox: LocalSandbox) -> None:
    check = {"argv": ["test", "{{ steps.solve.output }}", "=", "{{ task.answer }}"]}
    assert (await run_one(sandbox, "153", check)).passed
    assert not (await run_one(sandbox, "7", check)).passed


async def test_stderr_is_the_evidence_of_a_fail(sandbox: LocalSandbox) -> None:
    check = {"argv": ["sh", "-c", "echo 'expected 153' >&2; exit 2"]}
    result = await run_one(sandbox, "x", check)
    assert not result.passed
    assert "exited with 2: expected 153" in result.evidence


async def test_a_timeout_fails(sandbox: LocalSandbox) -> None:
    result = await run_one(sandbox, "153", {"argv": ["sleep", "30"], "timeout_s": 0.5})
    assert not result.passed
    assert "timed out after 0.5s" in result.evidence


async def test_a_command_killed_by_its_limits_fails(tmp_path: Path) -> None:
    sandbox = LocalSandbox(tmp_path / "ws", FsBlobStore(tmp_path / "b"), limits=Limits(cpu_s=1))
    burn = await run_one(sandbox, "153", {"argv": ["sh", "-c", "while :; do :; done"]})
    assert not burn.passed
    assert "killed by signal" in burn.evidence
    missing = await run_one(sandbox, "153", {"argv": ["no-such-checker"]})
    assert not missing.passed
    assert "exited with 127" in missing.evidence


async def test_without_a_sandbox_the_check_fails_closed() -> None:
    result = await run_one(None, "153", {"argv": ["true"]})
    assert not result.passed
    assert result.evidence == "no sandbox is configured, so no command can run"
    [default] = await verify_episode(
        episode_of("153", workflow({"id": "c", "kind": "command", "argv": ["true"]})),
        [VerifierSpec(id="c", kind="command", argv=["true"])],
    )
    assert not default.passed


# -- the episode's workspace ---------------------------------------------------------------


async def test_the_episodes_workspace_snapshot_is_restored(sandbox: LocalSandbox) -> None:
    run_ws = await sandbox.open(TENANT, new_run_id(), BranchId(0))
    await run_ws.write_file("answer.txt", b"153\n")
    ref = await sandbox.snapshot(run_ws)
    await sandbox.discard(run_ws)
    check = {"argv": ["sh", "-c", "test $(cat answer.txt) = 153 && test ! -e output.txt"]}
    result = await run_one(sandbox, "anything", check, workspace=ref)
    assert result.passed, result.evidence


async def test_a_missing_or_foreign_snapshot_fails(sandbox: LocalSandbox) -> None:
    theirs = await sandbox.open(OTHER, new_run_id(), BranchId(0))
    await theirs.write_file("answer.txt", b"153\n")
    ref = await sandbox.snapshot(theirs)
    await sandbox.discard(theirs)
    foreign = await run_one(sandbox, "153", {"argv": ["true"]}, workspace=ref)
    assert not foreign.passed
    assert "SnapshotMissing" in foreign.evidence
    absent = await run_one(sandbox, "153", {"argv": ["true"]}, workspace="0" * 64)
    assert not absent.passed


async def test_verifiers_of_one_run_get_separate_workspaces(sandbox: LocalSandbox) -> None:
    # Each writes a marker and fails if the other's is there.
    wf = workflow(
        {"id": "a", "kind": "command", "argv": ["sh", "-c", "test ! -e b && touch a && sleep 1"]},
        {"id": "b", "kind": "command", "argv": ["sh", "-c", "test ! -e a && touch b && sleep 1"]},
    )
    results = await verify_episode(
        episode_of("153", wf), list(wf.verifiers), registry=verifier_registry(sandbox)
    )
    assert [r.passed for r in results] == [True, True], [r.evidence for r in results]


# -- the IR --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("check", "message"),
    [
        ({}, "needs a non-empty `argv`"),
        ({"argv": []}, "needs a non-empty `argv`"),
        ({"argv": [" "]}, "needs a non-empty `argv`"),
        ({"argv": ["echo", "{{ steps.nowhere.output }}"]}, "refers to 'steps.nowhere.output'"),
        ({"argv": ["echo", "{{ broken"]}, "malformed placeholder"),
    ],
)
def test_validation_of_command_verifiers(check: dict[str, Any], message: str) -> None:
    wf = workflow({"id": "cmd", "kind": "command", **check})
    with pytest.raises(WorkflowInvalid, match=message):
        validate(wf)


def test_a_valid_command_verifier_loads() -> None:
    wf = workflow({"id": "cmd", "kind": "command", "argv": ["true"], "timeout_s": 5})
    assert validate(wf) is wf
    with pytest.raises(ValueError, match="timeout_s"):
        workflow({"id": "cmd", "kind": "command", "argv": ["true"], "timeout_s": 0})


def test_workflow_versions_do_not_move_for_workflows_without_the_new_fields() -> None:
    # Pinned before `command`, `argv`, `timeout_s` and `params` existed.
    assert load_workflow(EXAMPLES / "arith-v1.yaml").version == (
        "eda0fb6fc6de0acd52a8334feb74056b98809ea9af972120c0fd9cf5cfa74319"
    )
    assert load_workflow(EXAMPLES / "arith-v2.yaml").version == (
        "a5b34ba1ee1c0a3140b9f6ae5bbcbe76cdb1cec03c33b360d191f656ed8526e7"
    )
    with_command = workflow({"id": "cmd", "kind": "command", "argv": ["true"]})
    dumped = with_command.model_dump(mode="json", by_alias=True)["verifiers"][0]
    assert dumped["argv"] == ["true"]
    assert "timeout_s" not in dumped
    assert WorkflowDef.model_validate(with_command.model_dump(by_alias=True)) == with_command


def test_an_episode_without_a_workspace_still_decodes() -> None:
    wf = workflow()
    doc = episode_of("1", wf).model_dump(mode="json")
    del doc["workspace"]
    assert Episode.model_validate(doc).workspace is None


# -- settings ------------------------------------------------------------------------------


def test_sandbox_settings_from_the_environment(tmp_path: Path) -> None:
    default = AssaySettings.from_env({}).sandbox
    assert default.network is NetworkPolicy.DENY
    assert default.limits == Limits()
    settings = AssaySettings.from_env(
        {
            "ASSAY_SANDBOX_ROOT": str(tmp_path / "elsewhere"),
            "ASSAY_SANDBOX_NETWORK": "allow",
            "ASSAY_SANDBOX_CPU_S": "5",
            "ASSAY_SANDBOX_PROCESSES": "16",
            "ASSAY_SANDBOX_MEMORY_BYTES": str(512 << 20),
            "ASSAY_SANDBOX_FILE_SIZE_BYTES": "4096",
        }
    ).sandbox
    assert settings.network is NetworkPolicy.ALLOW
    assert settings.limits == Limits(
        cpu_s=5, processes=16, address_space_bytes=512 << 20, file_size_bytes=4096
    )
    provider = settings.provider(FsBlobStore(tmp_path / "blobs"), tmp_path / "data")
    assert provider.base == tmp_path / "elsewhere"
    assert provider.capabilities.network_allowed
    under_data = default.provider(FsBlobStore(tmp_path / "blobs"), tmp_path / "data")
    assert under_data.base == tmp_path / "data" / "sandbox"
    for bad in ({"ASSAY_SANDBOX_NETWORK": "sometimes"}, {"ASSAY_SANDBOX_CPU_S": "0"}):
        with pytest.raises(SettingsInvalid, match="SANDBOX"):
            AssaySettings.from_env(bad)


def test_the_embedded_runtime_wires_the_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASSAY_SANDBOX_ROOT", raising=False)
    monkeypatch.delenv("ASSAY_SANDBOX_NETWORK", raising=False)
    deps = Embedded(tmp_path / "data").deps
    assert isinstance(deps.sandbox, LocalSandbox)
    assert deps.sandbox.base == tmp_path / "data" / "sandbox"
    assert {"command", "write_file", "http_request"} <= set(deps.tools)
    assert "command" in deps.verifier_kinds
    monkeypatch.setenv("ASSAY_SANDBOX_NETWORK", "nowhere")
    with pytest.raises(SettingsInvalid):
        Embedded(tmp_path / "data")
