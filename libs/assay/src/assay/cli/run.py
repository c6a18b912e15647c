"""`assay run`: one durable run of a workflow, with the library alone."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from assay.engine import (
    WORK_EVENTS,
    Driver,
    LogJournal,
    RunFinished,
    RunSpec,
    RunSuspended,
    check_executable,
)
from assay.engine.events import fold_work
from assay.kernel import (
    BranchId,
    TaskId,
    content_hash,
    new_run_id,
    tenant_id,
)
from assay.kernel.errors import AssayError
from assay.messages import Purpose, Role, RunRef
from assay.runtime.bootstrap import model_for, sandbox_for
from assay.runtime.plugins import load_tools, load_verifiers
from assay.runtime.settings import AssaySettings
from assay.store import FsBlobStore, SqliteEventLog
from assay.verification import verifier_registry, verify_episode
from assay.workflow import SubworkflowStep, load_workflow
from assay.workflow.ir import BUILTIN_VERIFIER_KINDS

LOCAL_TENANT = uuid.uuid5(uuid.NAMESPACE_URL, "assay:local")


async def run_once(data_dir: Path, workflow: Path, task_input: dict[str, Any]) -> int:
    """Execute and verify one run; print the episode and verdict as JSON. 0 if it passed."""
    settings = AssaySettings.from_env()
    tools = load_tools(network=settings.sandbox.network)
    installed = load_verifiers()
    wf = load_workflow(workflow, frozenset(tools), BUILTIN_VERIFIER_KINDS | frozenset(installed))
    if any(isinstance(step, SubworkflowStep) for step in wf.steps):
        raise AssayError(
            "`assay run` runs one workflow on its own: sub-workflow steps call registered "
            "workflows, so run it in the pipeline (assay register, assay submit)"
        )
    check_executable(wf)
    tenant = settings.tenant or tenant_id(LOCAL_TENANT)
    task_id = TaskId(content_hash(task_input))
    run_id = new_run_id()
    ref = RunRef(
        tenant=tenant,
        run_id=run_id,
        task_id=task_id,
        idempotency_key=run_id,
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    model = model_for(settings)
    log = await SqliteEventLog(data_dir / "local-runs.sqlite", WORK_EVENTS, fold_work).open()
    blobs = FsBlobStore(data_dir / "blobs")
    sandbox = sandbox_for(settings, blobs, data_dir)
    try:
        spec = RunSpec(ref=ref, definition=wf, input=task_input, branch=BranchId(0))
        try:
            journal = LogJournal(log, defers=True)  # Pure steps ride with the next commit
            episode = await Driver(model, tools, sandbox).drive(spec, journal)
        except RunSuspended as waiting:
            raise AssayError(
                f"the run waits at step {waiting.suspended.step!r} for "
                f"{waiting.suspended.signal!r}; `assay run` cannot resume it — run the workflow "
                "in the pipeline and use `assay approve` or `assay signal`"
            ) from waiting
        blob = await blobs.put(tenant, episode.encode())
        finished = RunFinished(
            succeeded=episode.succeeded,
            failed_step=episode.failed_step,
            episode=blob,
            usage=episode.usage,
        )
        await journal.record_and_commit(spec.key, finished)
        registry = verifier_registry(sandbox, installed)
        results = await verify_episode(episode, list(wf.verifiers), registry=registry)
    finally:
        await log.close()
        aclose = getattr(model, "aclose", None)
        if callable(aclose):
            await aclose()
    passed = episode.succeeded and all(r.passed for r in results)
    print(
        json.dumps(
            {
                "episode": episode.model_dump(mode="json"),
                "episode_ref": blob,
                "passed": passed,
                "verification": [r.model_dump(mode="json") for r in results],
            },
            indent=2,
        )
    )
    return 0 if passed else 1
