"""A tenant's deletion at the storage ports: `CommitBatch.erase` on every `EventLog`
adapter, `BlobStore.delete_tenant` on every blob store, `discard_tenant` on the local
sandbox. Each deletes the one tenant's rows, objects or directories whole, leaves
another tenant's byte for byte, and is a no-op the second time."""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

from assay.kernel.ids import BranchId, MessageId, RunId, TenantId
from assay.kernel.spend import Spend, SpendLimit
from assay.record import StateKey
from assay.store import BlobStore, CommitBatch, ConsumerPosition, EventLog, OutboxEntry, connect
from assay.store.sqlite import TENANT_TABLES
from libs.assay.tests.test_store_contract import (
    EVENT_LOG_ADAPTERS,
    LogOpener,
    blobs,
    contract_database,
    event_log,
    main,
    new_tenant,
    on,
    opener,
    put,
)

__all__ = ["EVENT_LOG_ADAPTERS", "LogOpener", "blobs", "contract_database", "event_log", "opener"]


async def _fill(log: EventLog, tenant: TenantId, n: int) -> None:
    """Records, documents, a checkpoint, a lease, inbox entries and unshipped outbox rows."""
    for i in range(n):
        batch = on(main(tenant, f"s{i}"), put(f"item{i}", v=i))
        batch.inbox = (tenant, MessageId(f"m-{tenant}-{i}"))
        batch.outbox = [OutboxEntry("assay.runs", f"{tenant}:run-{i}", b"x")]
        await log.commit(batch)
    await log.commit(CommitBatch(outbox=[OutboxEntry("assay.usage", str(tenant), b"u")]))
    await log.put_checkpoint(main(tenant, "s0"), 0, b"snapshot")  # type: ignore[arg-type]
    assert await log.claim(tenant, "s0", "worker", ttl_ms=60_000) is not None
    held = await log.reserve(tenant, "grading", "2026-12-02", Spend(calls=1), SpendLimit())
    assert held is not None  # the spend ledger has the tenant's row too


async def _holding(log: EventLog, tenant: TenantId) -> list[object]:
    """Everything the port shows of `tenant` (the outbox by key)."""
    out: list[object] = []
    for i in range(3):
        out.append(await log.read(main(tenant, f"s{i}")))
        out.append(await log.get(StateKey(tenant, "item", f"item{i}")))
        out.append(await log.seen(tenant, MessageId(f"m-{tenant}-{i}")))
    out.append(await log.latest_checkpoint(main(tenant, "s0")))
    out.append(await log.scan(tenant, "last"))
    keys = [p.entry.key for p in await log.drain_outbox(1000)]
    out.append(sorted(k for k in keys if k.startswith(str(tenant))))
    return out


async def test_erase_deletes_every_row_of_one_tenant_and_leaves_the_other_as_it_was(
    event_log: EventLog,
) -> None:
    gone, kept = new_tenant(), new_tenant()
    await _fill(event_log, gone, 3)
    await _fill(event_log, kept, 3)
    before = await _holding(event_log, kept)

    position = ConsumerPosition("assay.tenants", 3, 8)
    tomb = on(main(gone, "tenant"), put("tombstone", why="asked"))
    tomb.erase, tomb.position, tomb.inbox = gone, position, (gone, MessageId("delete-1"))
    tomb.outbox = [OutboxEntry("assay.tenants", str(gone), b"answer")]
    assert await event_log.commit(tomb) == [0]  # the tenant's streams start over

    assert await _holding(event_log, kept) == before
    nothing: list[object] = [[], None, False] * 3
    tombstone_only = [("tenant/0", {"lsn": 0, "type": "contract.ItemPut"})]
    assert await _holding(event_log, gone) == [*nothing, None, tombstone_only, [str(gone)]]
    assert await event_log.get(StateKey(gone, "item", "tombstone")) == {"why": "asked"}
    assert [k.stream for k in await event_log.branches("tenant", gone)] == ["tenant"]
    assert await event_log.seen(gone, MessageId("delete-1"))
    assert await event_log.claim(gone, "s0", "other", ttl_ms=1000) is not None  # no lease left
    assert (await event_log.positions())[("assay.tenants", 3)] == 8
    outbox = [p.entry for p in await event_log.drain_outbox(1000)]
    assert [e.value for e in outbox if e.key == str(gone)] == [b"answer"]


async def test_erasing_a_tenant_with_nothing_is_a_no_op_for_everyone_else(
    event_log: EventLog,
) -> None:
    kept = new_tenant()
    await _fill(event_log, kept, 2)
    before = await _holding(event_log, kept)
    for _ in range(2):
        await event_log.commit(CommitBatch(erase=new_tenant()))
    assert await _holding(event_log, kept) == before


async def test_sqlite_erase_leaves_no_row_of_the_tenant_in_any_table(tmp_path: Path) -> None:
    lo = LogOpener("sqlite", tmp_path)
    log = await lo.open()
    gone, kept = new_tenant(), new_tenant()
    await _fill(log, gone, 2)
    await _fill(log, kept, 2)
    await log.commit(CommitBatch(erase=gone))
    await log.close()
    with closing(connect(tmp_path / "stage.sqlite")) as db:
        for table in TENANT_TABLES:
            rows = db.execute(f"SELECT tenant, COUNT(*) FROM {table} GROUP BY tenant").fetchall()
            assert dict(rows).get(str(gone)) is None, table
            assert dict(rows).get(str(kept)), table
        keys = [k for (k,) in db.execute("SELECT key FROM outbox")]
        assert keys
        assert not any(k.startswith(str(gone)) for k in keys)
        assert any(k.startswith(str(kept)) for k in keys)


async def test_a_tenants_blobs_go_whole_and_another_tenants_stay(blobs: BlobStore) -> None:
    gone, kept = new_tenant(), new_tenant()
    refs = [await blobs.put(gone, f"blob {i}".encode()) for i in range(3)]
    mine = [await blobs.put(kept, f"blob {i}".encode()) for i in range(3)]
    assert await blobs.delete_tenant(gone) == 3
    assert [await blobs.get(gone, r) for r in refs] == [None] * 3
    assert [await blobs.get(kept, r) for r in mine] == [f"blob {i}".encode() for i in range(3)]
    assert await blobs.delete_tenant(gone) == 0


async def test_a_tenants_workspaces_go_whole(tmp_path: Path) -> None:
    from assay.sandbox.local import LocalSandbox
    from assay.store import FsBlobStore

    sandbox = LocalSandbox(tmp_path / "ws", FsBlobStore(tmp_path / "blobs"))
    gone, kept = new_tenant(), new_tenant()
    for tenant in (gone, kept):
        for run in ("01JRUNAAAAAAAAAAAAAAAAAAAA", "01JRUNBBBBBBBBBBBBBBBBBBBB"):
            ws = await sandbox.open(tenant, RunId(run), BranchId(0))
            await ws.write_file("a.txt", b"hello")
    assert await sandbox.discard_tenant(gone) == 2
    assert not (tmp_path / "ws" / str(gone)).exists()
    assert len(list((tmp_path / "ws" / str(kept)).iterdir())) == 2
    assert await sandbox.discard_tenant(gone) == 0
