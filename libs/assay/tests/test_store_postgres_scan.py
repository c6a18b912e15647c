"""Prefix scans of the Postgres event log read a range of the primary key, and find every
key with the prefix, past the last code points too."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from assay.devstack import Service
from assay.devstack.postgres import scratch_database
from assay.kernel.ids import TenantId, tenant_id
from assay.record import (
    BranchKey,
    Delete,
    Event,
    EventRegistry,
    LogRecord,
    Put,
    StateDelta,
    StateKey,
)
from assay.store import CommitBatch, PostgresEventLog
from assay.store.postgres import _after_prefix

pytestmark = pytest.mark.postgres


class ItemPut(Event):
    type: ClassVar[str] = "pgscan.ItemPut"
    version: ClassVar[int] = 1
    item: str
    value: dict[str, Any] | None


def fold(record: LogRecord) -> list[StateDelta]:
    """Items by name: put, or deleted by a put of nothing."""
    ev = record.event
    assert isinstance(ev, ItemPut)
    at = StateKey(record.key.tenant, "item", ev.item)
    return [Delete(at) if ev.value is None else Put(at, dict(ev.value))]


REGISTRY = EventRegistry([ItemPut])


def put(name: str, **value: Any) -> ItemPut:
    return ItemPut(item=name, value=value)


def on(key: BranchKey, *events: Event) -> CommitBatch:
    return CommitBatch(records=[(key, e) for e in events])


@pytest.fixture(scope="module")
def admin_dsn(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_pgscan") as dsn:
        yield dsn


@pytest.fixture
async def pg_log(admin_dsn: str) -> AsyncIterator[PostgresEventLog]:
    log = await PostgresEventLog(admin_dsn, f"scan_{uuid.uuid4().hex[:10]}", REGISTRY, fold).open()
    yield log
    await log.close()


def new_tenant() -> TenantId:
    return tenant_id(uuid.uuid4())


@settings(max_examples=500)
@given(st.text(max_size=4), st.lists(st.text(max_size=6), max_size=8))
def test_a_prefix_scan_s_range_holds_every_key_with_the_prefix(
    prefix: str, tails: list[str]
) -> None:
    after = _after_prefix(prefix)
    for key in [prefix + t for t in tails]:  # "C" collation: UTF-8 byte order
        assert key.encode() >= prefix.encode()
        assert after is None or key.encode() < after.encode(), (prefix, key, after)


async def test_a_prefix_scan_finds_keys_past_the_last_code_points(
    pg_log: PostgresEventLog,
) -> None:
    tenant = new_tenant()
    names = ["é", "é/1", "ê", "a\U0010ffff", "a\U0010ffff/x", "b", "a\ud7ff!", "a\ue000"]
    await pg_log.commit(on(BranchKey.main(tenant, "s"), *(put(n) for n in names)))
    for prefix in ["é", "a\U0010ffff", "a\ud7ff", "a", ""]:
        found = [k for k, _ in await pg_log.scan(tenant, "item", prefix)]
        assert found == sorted(n for n in names if n.startswith(prefix)), prefix
