"""Driving a distributed deployment from outside, as a user's own code would: register
workflows with the CLI, produce tasks and read results with plain aiokafka clients, and
read a stage's state with SQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from assay.devstack.deployment import ASSAY, Deployment
from assay.workflow import load_workflow

ROOT = Path(__file__).resolve().parents[1]
V1 = ROOT / "examples" / "workflows" / "arith-v1.yaml"
V2 = ROOT / "examples" / "workflows" / "arith-v2.yaml"
TASKS = [json.loads(line) for line in (ROOT / "examples" / "tasks" / "arith.jsonl").open()]
DISTRIBUTED = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.postgres, pytest.mark.s3]
"""What a test of a whole deployment needs."""
RECOVERY_S = 45.0
"""The longest a fault test allows from the heal of a fault to the last result of the tasks
produced around it (each test's module states what it measured on two cores)."""


def register(d: Deployment, tenant: str, path: Path) -> None:
    done = subprocess.run(
        [ASSAY, "register", str(path), "--tenant", tenant],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


async def allocation(d: Deployment, tenant: str, workflow: str = "arith") -> dict[str, Any] | None:
    rows = await d.query(
        "SELECT value FROM ingest.state WHERE tenant = $1 AND kind = 'allocation' AND key = $2",
        uuid.UUID(tenant),
        workflow,
    )
    return json.loads(rows[0]["value"]) if rows else None


async def wait_for(what: str, check: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def set_up_tenant(
    d: Deployment, *, challenger: bool, versions: tuple[Path, Path] = (V1, V2)
) -> str:
    tenant = str(uuid.uuid4())
    workflow = str(load_workflow(versions[0]).id)
    register(d, tenant, versions[0])

    async def current() -> bool:
        return await allocation(d, tenant, workflow) is not None

    await wait_for("v1 to become current", current)
    if challenger:
        register(d, tenant, versions[1])

        async def has_challenger() -> bool:
            a = await allocation(d, tenant, workflow)
            return a is not None and a.get("challenger") is not None

        await wait_for("v2 to become the challenger", has_challenger)
    return tenant


async def produce(bootstrap: str, records: list[tuple[str, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for key, value in records:
            await producer.send("assay.tasks", value, key=key.encode())
        await producer.flush()
    finally:
        await producer.stop()


def task_records(
    tenant: str, tasks: list[dict[str, Any]], workflow: str = "arith"
) -> list[tuple[str, bytes]]:
    return [
        (
            f"{tenant}:{t['idempotency_key']}",
            json.dumps({"tenant": tenant, "workflow_id": workflow, **t}).encode(),
        )
        for t in tasks
    ]


async def read_topic(bootstrap: str, topic: str, until: Any, timeout_s: float) -> list[Any]:
    """Every record of a topic from the beginning, until `until(records)` or the timeout."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    records: list[Any] = []
    try:
        await consumer.topics()  # fetches the cluster's metadata
        parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        deadline = time.monotonic() + timeout_s
        while not until(records) and time.monotonic() < deadline:
            for batch in (await consumer.getmany(timeout_ms=300)).values():
                records.extend(batch)
    finally:
        await consumer.stop()
    return records


def results_by_task(records: list[Any], tenants: set[str]) -> dict[tuple[str, str], set[str]]:
    """(tenant, idempotency key) -> distinct result ids (a re-publish keeps its id)."""
    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for r in records:
        body = json.loads(r.value)
        payload = body["payload"]
        if payload["tenant"] in tenants:
            found[(payload["tenant"], payload["idempotency_key"])].add(body["id"])
    return found


async def await_results(
    d: Deployment, expected: set[tuple[str, str]], timeout_s: float = 180
) -> list[Any]:
    tenants = {t for t, _ in expected}

    def complete(records: list[Any]) -> bool:
        return expected <= set(results_by_task(records, tenants))

    records = await read_topic(d.bootstrap, "assay.results", complete, timeout_s)
    missing = expected - set(results_by_task(records, tenants))
    assert not missing, f"{len(missing)} task(s) without a result, e.g. {sorted(missing)[:3]}"
    return records


class ResultWatch:
    """Reads `assay.results` from the beginning in the background, as a user's consumer
    would, so a test can wait for the n-th result of a tenant while faults come and go."""

    def __init__(self, bootstrap: str, tenant: str) -> None:
        self.bootstrap = bootstrap
        self.tenant = tenant
        self.found: dict[str, set[str]] = defaultdict(set)
        """Idempotency key -> distinct result ids."""
        self.last_at = 0.0
        """`time.monotonic()` when a new task last got its first result."""
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    async def __aenter__(self) -> ResultWatch:
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _read(self) -> None:
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            await consumer.topics()
            topic = "assay.results"
            parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
            consumer.assign(parts)
            await consumer.seek_to_beginning(*parts)
            while True:
                try:
                    fetched = await consumer.getmany(timeout_ms=300)
                except Exception:  # the broker is paused or away: read on when it is back
                    await asyncio.sleep(0.2)
                    continue
                for batch in fetched.values():
                    for r in batch:
                        body = json.loads(r.value)
                        payload = body["payload"]
                        if payload["tenant"] != self.tenant:
                            continue
                        key = payload["idempotency_key"]
                        if key not in self.found:
                            self.last_at = time.monotonic()
                        self.found[key].add(body["id"])
                        self._changed.set()
        finally:
            await consumer.stop()

    async def until(self, n: int, timeout_s: float) -> None:
        """Wait until `n` tasks have a result."""
        deadline = time.monotonic() + timeout_s
        while len(self.found) < n:
            left = deadline - time.monotonic()
            assert left > 0, f"{len(self.found)} of {n} results after {timeout_s} s"
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def exactly_once(self, keys: set[str]) -> None:
        """Every key has one result, and nothing else has any."""
        assert set(self.found) == keys, f"missing {sorted(keys - set(self.found))[:5]}"
        doubled = {k: v for k, v in self.found.items() if len(v) > 1}
        assert not doubled, f"tasks with two different results: {doubled}"


async def refold_identical(d: Deployment) -> None:
    """Every stage's state, re-folded from its log (read-only), equals the stored state:
    `assay rebuild --check` against the deployment's database."""
    done = await asyncio.to_thread(
        subprocess.run,
        [ASSAY, "rebuild", "--check", "--database-url", d.admin_dsn],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
