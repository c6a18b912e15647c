"""`assay proposals`: the slow loop's proposed versions, and an operator's verdict on them.

- `assay proposals [--all]` lists proposals (pending ones, or every one) and, per
  workflow, why the last request for a proposal yielded none;
- `assay proposals show ID` prints one whole: its definition, rationale and the
  selection-set failures it was drafted from;
- `assay proposals approve ID` / `reject ID --reason R` put a `ReviewProposal` on
  `assay.workflows`. Approving registers the version (decide admits it to shadow);
  rejecting asks the proposer for the next one, with the reason as feedback.

Read from the decide stage's state (the data directory's SQLite file, or the
`decide` schema with `ASSAY_DATABASE_URL` set). A review goes to the Kafka cluster
`ASSAY_KAFKA_BOOTSTRAP` names; without it, the embedded pipeline runs in this
process on the data directory until decide has recorded the review.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from assay.bus.commands import Command, review_proposal
from assay.cli.logs import stage_state
from assay.kernel.errors import AssayError, Refused
from assay.kernel.ids import TenantId
from assay.record import StateKey
from assay.runtime.settings import AssaySettings
from assay.store.ports import EventLog

MISSING = "no workflow was registered there"
REVIEW_TIMEOUT_S = 30.0
SUMMARY = (
    "proposal_id",
    "tenant",
    "workflow_id",
    "status",
    "workflow_version",
    "parent",
    "after",
    "proposer",
    "rationale",
    "gated",
    "review",
)


class ReviewRefused(AssayError):
    """Decide refused the review (the reason says why)."""


async def _proposals(log: EventLog, tenant: TenantId | None) -> list[dict[str, Any]]:
    found = [
        doc for who, _, doc in await log.scan_kind("proposal") if tenant is None or who == tenant
    ]
    return sorted(found, key=lambda d: (d["tenant"], d["workflow_id"], d["proposal_id"]))


async def list_command(data_dir: Path, tenant: TenantId | None, every: bool) -> int:
    """Print proposals (pending, or every one with `every`) and the loop's last word per
    workflow as JSON."""
    async with stage_state(data_dir, "decide", MISSING) as log:
        found = await _proposals(log, tenant)
        idle = [
            {"tenant": str(who), "workflow_id": workflow, "reason": doc["reason"]}
            for who, workflow, doc in await log.scan_kind("unproposed")
            if tenant is None or who == tenant
        ]
    shown = [{k: d.get(k) for k in SUMMARY} for d in found if every or d["status"] == "pending"]
    print(json.dumps({"proposals": shown, "not_proposed": idle}, indent=2))
    return 0


async def find(data_dir: Path, proposal: str, tenant: TenantId | None) -> dict[str, Any]:
    """The proposal `proposal` (of `tenant`, when given).

    Raises:
        AssayError: no such proposal, or the id names proposals of several tenants.
    """
    async with stage_state(data_dir, "decide", MISSING) as log:
        found = [d for d in await _proposals(log, tenant) if d["proposal_id"] == proposal]
    if not found:
        whose = f" of tenant {tenant}" if tenant is not None else ""
        raise AssayError(f"no proposal {proposal}{whose}")
    if len(found) > 1:
        raise AssayError(
            f"proposal {proposal} exists under several tenants: name one with --tenant"
        )
    return found[0]


async def show_command(data_dir: Path, proposal: str, tenant: TenantId | None) -> int:
    """Print one proposal whole as JSON."""
    print(json.dumps(await find(data_dir, proposal, tenant), indent=2))
    return 0


async def review_command(
    data_dir: Path, proposal: str, tenant: TenantId | None, approve: bool, reason: str
) -> int:
    """Approve or reject a proposal; print what decide made of it."""
    doc = await find(data_dir, proposal, tenant)
    cmd = review_proposal(TenantId(doc["tenant"]), doc["workflow_id"], proposal, approve, reason)
    verb = "approve" if approve else "reject"
    if AssaySettings.from_env().kafka.bootstrap:
        from assay.cli.distributed import produce

        await produce([cmd.entry])
        print(f"asked to {verb} proposal {proposal}")
        return 0
    after = await _embedded(data_dir, doc, approve, cmd)
    print(json.dumps({k: after.get(k) for k in SUMMARY}, indent=2))
    return 0


async def _embedded(
    data_dir: Path, proposal: dict[str, Any], approve: bool, cmd: Command
) -> dict[str, Any]:
    """Run the embedded pipeline until decide recorded the review or refused it."""
    from assay.runtime.embedded import Embedded

    tenant, proposal_id = TenantId(proposal["tenant"]), proposal["proposal_id"]
    async with Embedded(data_dir) as rt:
        log = rt.logs["decide"]
        wanted = "approved" if approve else "rejected"

        async def reviewed() -> dict[str, Any] | None:
            doc = await log.get(StateKey(tenant, "proposal", proposal_id))
            if doc is None or doc["status"] != wanted:
                return None
            # approved: wait for decide to hold (or turn away) the registered version too
            held = await log.get(StateKey(tenant, "known", doc["workflow_version"]))
            return doc if not approve or held is not None else None

        try:
            return await rt.command(cmd.stage, cmd.entry, reviewed, REVIEW_TIMEOUT_S)
        except Refused as exc:
            raise ReviewRefused(f"review refused: {exc.reason}") from exc
        except TimeoutError as exc:
            raise AssayError(
                f"decide recorded no review of proposal {proposal_id} in {REVIEW_TIMEOUT_S:g}s"
            ) from exc
