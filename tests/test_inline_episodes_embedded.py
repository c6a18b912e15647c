"""Blob requests of one graded run, end to end in embedded mode: execute writes the
episode once, and a small one travels inline in `RunExecuted` and `RunVerified`, so
verify and the tournament read no blob; an episode over `ASSAY_EPISODE_INLINE_MAX_BYTES`
goes by blob alone, and each of them reads it (in distributed mode, each request here is
an S3 request)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from assay.bus import EPISODES, RESULTS, TASKS, VERIFIED, WORKFLOWS
from assay.kernel import TenantId
from assay.kernel.canonical import canonical_bytes, digest
from assay.messages import (
    RunExecuted,
    RunResult,
    RunVerified,
    TaskSubmitted,
    WorkflowRegistered,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.runtime.settings import AssaySettings
from assay.store import FsBlobStore
from tests.test_model_context_embedded import TENANT, on_bus, until
from tests.test_spend_embedded import V1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


class CountingBlobs(FsBlobStore):
    """The embedded blob store, counting writes and reads by ref."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.puts: Counter[str] = Counter()
        self.gets: Counter[str] = Counter()

    async def put(self, tenant: TenantId, content: bytes) -> str:
        ref = await super().put(tenant, content)
        self.puts[ref] += 1
        return ref

    async def get(self, tenant: TenantId, ref: str) -> bytes | None:
        self.gets[ref] += 1
        return await super().get(tenant, ref)


async def graded_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inline_max_bytes: int
) -> tuple[CountingBlobs, RunExecuted, RunVerified]:
    """One task through every stage; the blob store, and what went to verify and grading."""
    monkeypatch.setattr("assay.runtime.embedded.FsBlobStore", CountingBlobs)
    settings = AssaySettings(episode_inline_max_bytes=inline_max_bytes)
    async with Embedded(tmp_path / "data", partitions=2, settings=settings) as rt:
        rt.start()
        definition = V1.model_dump(mode="json", by_alias=True)
        registered = WorkflowRegistered(tenant=TENANT, definition=definition)
        await rt.publish(WORKFLOWS, registered, TENANT)

        async def routed() -> bool:
            return await rt.logs["ingest"].get(StateKey(TENANT, "allocation", V1.id)) is not None

        await until(routed, "the workflow to be routed")
        task = {"question": "2 + 3", "answer": "5"}
        submitted = TaskSubmitted(tenant=TENANT, workflow_id=V1.id, idempotency_key="t", input=task)
        await rt.publish(TASKS, submitted, TENANT, idem="t")

        async def result() -> list[RunResult]:
            return [m for m in await on_bus(rt, RESULTS) if isinstance(m, RunResult)]

        (done,) = await until(result, "the run's result")
        assert done.verification
        assert all(v.kind != "snapshot" for v in done.verification)  # the episode was read
        (executed,) = [m for m in await on_bus(rt, EPISODES) if isinstance(m, RunExecuted)]
        (verified,) = [m for m in await on_bus(rt, VERIFIED) if isinstance(m, RunVerified)]
        assert isinstance(rt.blobs, CountingBlobs)
        return rt.blobs, executed, verified


async def test_a_small_episode_is_written_once_and_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blobs, executed, verified = await graded_run(tmp_path, monkeypatch, 64 * 1024)
    assert executed.episode_inline is not None
    assert digest(canonical_bytes(executed.episode_inline)) == executed.episode
    assert verified.episode_inline == executed.episode_inline
    assert blobs.puts[executed.episode] == 1  # the durable copy, written as before
    assert blobs.gets[executed.episode] == 0  # verify and the tournament took the copy
    assert sum(blobs.gets.values()) == 0
    stored = await blobs.get(TENANT, executed.episode)
    assert stored == canonical_bytes(executed.episode_inline)


async def test_an_episode_over_the_threshold_goes_by_blob_and_each_reader_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blobs, executed, verified = await graded_run(tmp_path, monkeypatch, 256)
    assert executed.episode_inline is None
    assert verified.episode_inline is None
    assert blobs.puts[executed.episode] == 1
    assert blobs.gets[executed.episode] == 2  # verify's read and the tournament's
    stored = await blobs.get(TENANT, executed.episode)
    assert stored is not None
    assert len(stored) > 256
