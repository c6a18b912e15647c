"""`assay tenant delete TENANT` and `assay tenant status TENANT`.

A tenant is known when ingest holds a workflow of it (`workflow` documents: a tenant's
tasks are admitted only for a registered workflow, so a tenant with any data has one)
or its tombstone. Deleting an unknown tenant is an error and publishes nothing;
deleting a tenant every stage already deleted is a no-op that publishes nothing.

The command is a `TenantDeleted` on `assay.tenants`; each stage deletes its own part
and records a tombstone (`assay.record.erasure`), which is what `status` reads, stage
by stage:

- **Embedded** (no `ASSAY_KAFKA_BOOTSTRAP`): the pipeline runs in this process on the
  data directory, as `assay branch` does, until every stage holds the tombstone, and
  then deletes the tenant's records from the embedded bus
  (`Embedded.forget_deleted_tenants`; `--no-wait`: the command is left on the bus for
  the next run, which does both). A data directory an
  `assay serve-embedded` holds is deleted through its console's API instead.
- **Distributed**: ingest's state and each stage's tombstone are read from the stages'
  schemas in `ASSAY_DATABASE_URL` (read only); the command is produced to Kafka.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from assay.bus import commands
from assay.cli.logs import postgres_log, stage_state, tenant_arg
from assay.kernel.errors import AssayError, Refused
from assay.kernel.ids import TenantId
from assay.record.erasure import Tombstone, tombstone_at
from assay.runtime.sections import PIPELINE_STAGES, STAGE_ROLES
from assay.runtime.settings import AssaySettings
from assay.store.ports import EventLog

WORKFLOW_KIND = "workflow"
"""Ingest's documents of a tenant's registered workflows: what makes a tenant known."""


class TenantUnknown(AssayError):
    """No stage knows the tenant: there is nothing to delete."""


@dataclass(frozen=True)
class Progress:
    """Which stages deleted a tenant (a stage maps to its tombstone, or None: not yet)."""

    tenant: TenantId
    stages: dict[str, Tombstone | None]

    @property
    def done(self) -> bool:
        """Every stage deleted its part."""
        return all(t is not None for t in self.stages.values())

    def to_json(self) -> dict[str, object]:
        """The JSON form `--json` prints."""
        return {
            "tenant": str(self.tenant),
            "deleted": self.done,
            "stages": {
                s: None if t is None else t.model_dump(mode="json") for s, t in self.stages.items()
            },
        }

    def render(self) -> str:
        """The text form."""
        count = sum(t is not None for t in self.stages.values())
        lines = [f"tenant {self.tenant}: deleted in {count} of {len(self.stages)} stages"]
        for stage, stone in self.stages.items():
            if stone is None:
                lines.append(f"  {stage:<10}  pending")
                continue
            when = datetime.fromtimestamp(stone.at_ms / 1000, UTC).isoformat(timespec="seconds")
            lines.append(f"  {stage:<10}  deleted {when}  command {stone.command}")
        return "\n".join(lines) + "\n"


async def progress_of(logs: Mapping[str, EventLog], tenant: TenantId) -> Progress:
    """Each stage's tombstone of `tenant`, from its own store."""
    stages: dict[str, Tombstone | None] = {}
    for stage, log in logs.items():
        doc = await log.get(tombstone_at(tenant))
        stages[stage] = None if doc is None else Tombstone.model_validate(doc)
    return Progress(tenant, stages)


async def known(ingest: EventLog, tenant: TenantId) -> bool:
    """Whether ingest holds a workflow of `tenant`, or its tombstone."""
    if await ingest.get(tombstone_at(tenant)) is not None:
        return True
    return bool(await ingest.scan(tenant, WORKFLOW_KIND))


async def delete_command(
    data_dir: Path, tenant: str, *, reason: str, wait: bool, timeout_s: float, as_json: bool
) -> int:
    """Delete `tenant` (see the module's docstring) and print where it stands.

    Raises:
        TenantUnknown: no workflow of the tenant in ingest; nothing was published.
        AssayError: bad input, a refused command, or not every stage done in time.
    """
    who = tenant_arg(tenant)
    settings = AssaySettings.from_env()
    if settings.kafka.bootstrap:
        found = await _distributed(settings, who, reason, wait, timeout_s)
    else:
        found = await _embedded(data_dir, who, reason, wait, timeout_s)
    print(json.dumps(found.to_json(), indent=2) if as_json else found.render(), end="")
    return 0


async def status_command(data_dir: Path, tenant: str, *, as_json: bool) -> int:
    """Print which stages deleted `tenant`, from each stage's own store.

    Raises:
        TenantUnknown: the tenant is neither known nor deleted anywhere.
    """
    who = tenant_arg(tenant)
    async with _stores(data_dir) as logs:
        found = await progress_of(logs, who)
        if (
            "ingest" in logs
            and not await known(logs["ingest"], who)
            and not any(found.stages.values())
        ):
            raise TenantUnknown(f"no tenant {who}: ingest holds no workflow of it")
    print(json.dumps(found.to_json(), indent=2) if as_json else found.render(), end="")
    return 0


async def deployed(url: str) -> list[str]:
    """The stages whose schema the database at `url` holds (the console is optional)."""
    import asyncpg

    try:
        conn = await asyncpg.connect(url)
    except (OSError, asyncpg.PostgresError) as exc:
        raise AssayError(f"cannot connect to $ASSAY_DATABASE_URL: {exc}") from exc
    try:
        found = [
            stage
            for stage in STAGE_ROLES
            if await conn.fetchval("SELECT to_regclass($1)", f"{stage}.state") is not None
        ]
    finally:
        await conn.close()
    if "ingest" not in found:
        raise AssayError("no ingest schema in $ASSAY_DATABASE_URL's database")
    return found


@asynccontextmanager
async def _stores(data_dir: Path) -> AsyncIterator[dict[str, EventLog]]:
    """Every stage's store there is, read only: its schema in `ASSAY_DATABASE_URL`, else
    its SQLite file in `data_dir` (a stage without one is left out)."""
    url = AssaySettings.from_env().database.url
    stages = await deployed(url) if url else STAGE_ROLES
    async with AsyncExitStack() as stack:
        logs: dict[str, EventLog] = {}
        for stage in stages:
            if not url and not (data_dir / f"{stage}.sqlite").is_file():
                continue
            logs[stage] = await stack.enter_async_context(
                stage_state(data_dir, stage, "run the pipeline first")
            )
        if "ingest" not in logs:
            raise TenantUnknown(f"no ingest state in {data_dir}: no tenant is known there")
        yield logs


def _unknown(tenant: TenantId) -> TenantUnknown:
    return TenantUnknown(
        f"no tenant {tenant}: ingest holds no workflow of it (nothing was published)"
    )


async def _embedded(
    data_dir: Path, tenant: TenantId, reason: str, wait: bool, timeout_s: float
) -> Progress:
    from assay.cli.console import console_installed
    from assay.runtime.embedded import Embedded

    if not (data_dir / "ingest.sqlite").is_file():
        raise _unknown(tenant)
    stages = STAGE_ROLES if console_installed() else PIPELINE_STAGES
    async with Embedded(data_dir, stages=stages) as rt:
        logs: dict[str, EventLog] = dict(rt.logs)
        now = await progress_of(logs, tenant)
        if now.done:
            await rt.forget_deleted_tenants()  # the bus's part, had a crash stopped it
            return now  # deleted before: nothing to publish
        if not await known(logs["ingest"], tenant):
            raise _unknown(tenant)
        command = commands.delete_tenant(tenant, reason)
        if not wait:
            await rt.bus.publish([command.entry])
            return now

        async def finished() -> Progress | None:
            found = await progress_of(logs, tenant)
            return found if found.done else None

        try:
            done = await rt.command("ingest", command.entry, finished, timeout_s)
            await rt.forget_deleted_tenants()  # its records on the bus, now every stage is done
            return done
        except Refused as exc:
            raise AssayError(f"tenant deletion refused: {exc.reason}") from exc
        except TimeoutError as exc:
            raise AssayError(
                f"tenant {tenant} not deleted by every stage within {timeout_s:g}s; "
                f"`assay tenant status {tenant}` shows which are done"
            ) from exc


async def _distributed(
    settings: AssaySettings, tenant: TenantId, reason: str, wait: bool, timeout_s: float
) -> Progress:
    from assay.cli.distributed import produce

    url = settings.database.url
    if not url:
        raise AssayError("set ASSAY_DATABASE_URL: whether a tenant is known is read from ingest")
    async with AsyncExitStack() as stack:
        logs: dict[str, EventLog] = {
            stage: await stack.enter_async_context(postgres_log(url, stage))
            for stage in await deployed(url)
        }
        now = await progress_of(logs, tenant)
        if now.done:
            return now
        if not await known(logs["ingest"], tenant):
            raise _unknown(tenant)
        await produce([commands.delete_tenant(tenant, reason).entry])
        deadline = time.monotonic() + timeout_s
        while wait and not (now := await progress_of(logs, tenant)).done:
            if time.monotonic() > deadline:
                raise AssayError(
                    f"tenant {tenant} not deleted by every stage within {timeout_s:g}s; "
                    f"`assay tenant status {tenant}` shows which are done"
                )
            await asyncio.sleep(0.5)
        return now
