"""`assay ladder ack-drift WORKFLOW`: accept a workflow's drifted task mix (§12.5).

Ingest compares each full window of a workflow's tasks with the mix its current version
was promoted under; a drift holds the challenger's promotion in decide. Acknowledging
puts an `AcknowledgeDrift` on `assay.workflows`: ingest takes the drifted mix (its last
full window) as the new reference and says so, which releases decide's hold — and
promotes at once a challenger the drift held, whose promotion retakes the reference
(its cause then reads `promoted`).

The workflow's watch is read from the ingest stage's state (the data directory's SQLite
file, or the `ingest` schema with `ASSAY_DATABASE_URL` set). The acknowledgement goes to
the Kafka cluster `ASSAY_KAFKA_BOOTSTRAP` names; without it, the embedded pipeline runs
in this process on the data directory until ingest took the new reference and decide
released its hold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from assay.bus.commands import acknowledge_drift
from assay.cli.logs import stage_state
from assay.kernel.errors import AssayError, Refused
from assay.kernel.ids import TenantId
from assay.record import StateKey
from assay.runtime.settings import AssaySettings

ACK_TIMEOUT_S = 30.0
MISSING = "no workflow was registered there"


async def watch_of(data_dir: Path, workflow: str, tenant: TenantId | None) -> tuple[TenantId, Any]:
    """The workflow's task-mix watch (of `tenant`, when given) and its tenant.

    Raises:
        AssayError: no watch of that workflow, one under several tenants, or no drift.
    """
    async with stage_state(data_dir, "ingest", MISSING) as log:
        found = [
            (who, doc)
            for who, key, doc in await log.scan_kind("task_mix")
            if key == workflow and (tenant is None or who == tenant)
        ]
    if not found:
        raise AssayError(f"workflow {workflow!r} watches no task mix (it declares no drift)")
    if len(found) > 1:
        raise AssayError(f"workflow {workflow!r} exists under several tenants: name one")
    who, doc = found[0]
    if not doc.get("drifted"):
        raise AssayError(f"workflow {workflow!r} has no task-mix drift to acknowledge")
    return who, doc


RETAKEN = ("acknowledged", "promoted")
"""Why the reference was retaken once acknowledged: the acknowledgement itself, or the
promotion it released (which retakes it again)."""


async def ack_drift_command(
    data_dir: Path, workflow: str, tenant: TenantId | None, reason: str
) -> int:
    """Acknowledge a workflow's drift; print the watch once ingest took the new reference."""
    who, doc = await watch_of(data_dir, workflow, tenant)
    cmd = acknowledge_drift(who, workflow, int(doc.get("measured_at") or 0), reason)
    if AssaySettings.from_env().kafka.bootstrap:
        from assay.cli.distributed import produce

        await produce([cmd.entry])
        print(f"asked to acknowledge the task-mix drift of {workflow}")
        return 0
    from assay.runtime.embedded import Embedded

    async with Embedded(data_dir) as rt:
        ingest, decide = rt.logs["ingest"], rt.logs["decide"]

        async def released() -> dict[str, Any] | None:
            mix = await ingest.get(StateKey(who, "task_mix", workflow))
            if mix is None or mix.get("cause") not in RETAKEN or mix.get("drifted"):
                return None
            held = await decide.get(StateKey(who, "task_mix_hold", workflow))
            return mix if held is None else None

        try:
            mix = await rt.command(cmd.stage, cmd.entry, released, ACK_TIMEOUT_S)
        except Refused as exc:
            raise AssayError(f"acknowledgement refused: {exc.reason}") from exc
        except TimeoutError as exc:
            raise AssayError(
                f"ingest took no new reference for {workflow} in {ACK_TIMEOUT_S:g}s"
            ) from exc
    print(json.dumps(summary(mix), indent=2))
    return 0


def summary(
    mix: dict[str, Any] | None, hold: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """What `assay ladder` shows of a workflow's task-mix watch (None: it keeps none)."""
    if mix is None:
        return None
    reference = mix.get("reference")
    return {
        "sampled": mix.get("sampled", 0),
        "window": mix.get("window"),
        "features": mix.get("features", []),
        "reference_tasks": reference["tasks"] if reference else None,
        "reference_cause": mix.get("cause"),
        "psi": mix.get("psi"),
        "threshold": mix.get("threshold"),
        "drifted": bool(mix.get("drifted")),
        "holds_promotion": hold is not None,
    }
