"""Runs for the console's tests: two tenants, hostile strings, produced onto an embedded
data directory's topics as the pipeline would, and folded by the console stage alone."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from assay.bus.topics import RESULTS, RUN_STATUS, RUNS
from assay.kernel import RunState
from assay.kernel.ids import RunId, TaskId, TenantId, WorkflowId, WorkflowVersion, run_id_from
from assay.kernel.schema import Versioned
from assay.kernel.scores import Ungraded, UngradedReason
from assay.messages import (
    Purpose,
    Role,
    RunRef,
    RunResult,
    RunSpawned,
    RunStatusChanged,
    Usage,
    VerifierResult,
)
from assay.runtime.embedded import Embedded

TENANT_A = TenantId(uuid.UUID("aaaaaaaa-0000-4000-8000-000000000001"))
TENANT_B = TenantId(uuid.UUID("bbbbbbbb-0000-4000-8000-000000000002"))
HOSTILE = "<script>window.__pwned=1</script><img src=x onerror=window.__pwned=2>"
T0_MS = 1_780_000_000_000
"""Creation time of the first seeded run; each next one is a second later."""


def run_ref(tenant: TenantId, n: int, *, workflow: str = "arith", key: str = "") -> RunRef:
    """The `n`-th seeded run of a tenant."""
    return RunRef(
        tenant=tenant,
        run_id=RunId(run_id_from(T0_MS + n * 1000, f"{tenant}:{n}")),
        task_id=TaskId(f"task-{n}"),
        idempotency_key=key or f"task-{n:03d}",
        workflow_id=WorkflowId(workflow),
        workflow_version=WorkflowVersion("v" * 64 if workflow == "arith" else "w" * 64),
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )


def messages(tenant: TenantId, count: int) -> list[tuple[str, Versioned, str]]:
    """`count` runs: even ones pass and are graded, odd ones fail; run 0 is hostile."""
    out: list[tuple[str, Versioned, str]] = []
    for n in range(count):
        hostile = n == 0
        ref = run_ref(
            tenant,
            n,
            workflow="other" if n % 3 == 2 else "arith",
            key=f"{HOSTILE}-{n}" if hostile else "",
        )
        passed = n % 2 == 0
        task_input = {"question": HOSTILE if hostile else f"{n} + 1"}
        out.append((RUNS, RunSpawned(run=ref, definition={}, input=task_input), f"s{n}"))
        for state in (RunState.RUNNING, RunState.VERIFYING):
            out.append((RUN_STATUS, RunStatusChanged(run=ref, state=state), f"{state}{n}"))
        verified = RunState.VERIFIED_PASS if passed else RunState.VERIFIED_FAIL
        out.append((RUN_STATUS, RunStatusChanged(run=ref, state=verified), f"v{n}"))
        end = RunState.UNGRADED
        out.append(
            (RUN_STATUS, RunStatusChanged(run=ref, state=end, detail="no_reference"), f"e{n}")
        )
        evidence = f"expected 1, got {HOSTILE}" if hostile else "ok"
        result = RunResult(
            tenant=tenant,
            run_id=ref.run_id,
            task_id=ref.task_id,
            idempotency_key=ref.idempotency_key,
            workflow_id=ref.workflow_id,
            workflow_version=ref.workflow_version,
            status="ungraded",
            passed=passed,
            verification=[
                VerifierResult(
                    verifier="correct",
                    kind="exact",
                    verifier_version="1",
                    passed=passed,
                    evidence=evidence,
                )
            ],
            score=Ungraded(reason=UngradedReason.NO_REFERENCE),
            usage=Usage(model_calls=1, prompt_tokens=3, completion_tokens=7),
            termination="succeeded",
            output=HOSTILE if hostile else str(n + 1),
            held_out=False,
        )
        out.append((RESULTS, result, f"r{n}"))
    return out


async def seed(data_dir: Path, counts: dict[TenantId, int]) -> None:
    """Produce the seeded runs and wait until the console stage has folded all of them."""
    async with Embedded(data_dir, stages=("console",), partitions=4) as rt:
        items = [
            (topic, msg, tenant, f"{tenant}:{idem}")
            for tenant, count in counts.items()
            for topic, msg, idem in messages(tenant, count)
        ]
        await rt.publish_many(items)
        rt.start()
        await until_folded(rt)


async def until_folded(rt: Embedded, timeout_s: float = 60) -> None:
    """Wait until the console stage has read every message on its topics."""
    runner, log = rt.runners["console"], rt.logs["console"]
    deadline = time.monotonic() + timeout_s
    while True:
        read = await log.positions()
        behind = False
        for topic in runner.spec.topics:
            ends = await rt.bus.end_offsets(topic)
            behind = behind or any(read.get((topic, p), 0) < end for p, end in ends.items())
        if not behind:
            return
        if time.monotonic() > deadline:
            raise TimeoutError("the console stage did not fold the seeded runs")
        await asyncio.sleep(0.02)  # the bus offers no wake-up for "a consumer caught up"
