"""The whole distributed pipeline on this machine with the stub model.

Six `assay serve` processes on a local broker, Postgres and S3. Throughput: a burst
of tasks produced at once, graded runs per second until the last result. Latency:
tasks paced well below that rate, produce-to-result time of each (both timestamps
are the broker's record times, from one clock). Memory: the peak resident set of
every stage process (VmHWM).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from assay.devstack.deployment import ASSAY, Deployment, deploy
from assay.devstack.postgres import resolve_postgres
from assay.devstack.s3 import resolve_s3

ROOT = Path(__file__).resolve().parents[1]
BURST = 1500
PACED = 100
PACED_PER_S = 10.0  # well below the measured throughput: latency without queueing


def _tasks(tenant: str, n: int, tag: str) -> list[tuple[str, bytes]]:
    rng = random.Random(tag)
    out = []
    for i in range(n):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        task = {
            "tenant": tenant,
            "workflow_id": "arith",
            "idempotency_key": f"{tag}-{i}",
            "input": {"question": f"{a} + {b}", "answer": str(a + b)},
        }
        out.append((f"{tenant}:{tag}-{i}", json.dumps(task).encode()))
    return out


async def _results(bootstrap: str, keys: set[str], timeout_s: float) -> dict[str, int]:
    """idempotency key -> broker timestamp (ms) of its first result."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    seen: dict[str, int] = {}
    try:
        await consumer.topics()
        parts = [
            TopicPartition("assay.results", p)
            for p in consumer.partitions_for_topic("assay.results") or ()
        ]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        deadline = time.monotonic() + timeout_s
        while not keys <= seen.keys() and time.monotonic() < deadline:
            for batch in (await consumer.getmany(timeout_ms=200, max_records=5000)).values():
                for r in batch:
                    key = json.loads(r.value)["payload"]["idempotency_key"]
                    seen.setdefault(key, r.timestamp)
    finally:
        await consumer.stop()
    missing = keys - seen.keys()
    if missing:
        raise RuntimeError(f"{len(missing)} task(s) got no result in {timeout_s}s")
    return seen


async def _produce(
    bootstrap: str, records: list[tuple[str, bytes]], per_s: float | None
) -> dict[str, int]:
    """Send tasks; return idempotency key -> the broker timestamp of its task record."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=2)
    await producer.start()
    sent: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        for i, (key, value) in enumerate(records):
            if per_s is not None:
                await asyncio.sleep(max(0.0, t0 + i / per_s - time.monotonic()))
            sent[key.split(":", 1)[1]] = await producer.send("assay.tasks", value, key=key.encode())
        await producer.flush()
        return {k: (await fut).timestamp for k, fut in sent.items()}
    finally:
        await producer.stop()


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _measure(d: Deployment) -> dict[str, float]:
    tenant = str(uuid.uuid4())
    registered = await asyncio.to_thread(
        subprocess.run,
        [ASSAY, "register", str(ROOT / "examples/workflows/arith-v2.yaml"), "--tenant", tenant],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert registered.returncode == 0, registered.stderr
    deadline = time.monotonic() + 60
    while not await d.query(
        "SELECT 1 FROM ingest.state WHERE tenant = $1 AND kind = 'allocation'", uuid.UUID(tenant)
    ):
        assert time.monotonic() < deadline, "the workflow was never allocated"
        await asyncio.sleep(0.1)
    warm = _tasks(tenant, 50, "warm")
    await _produce(d.bootstrap, warm, None)
    await _results(d.bootstrap, {k.split(":", 1)[1] for k, _ in warm}, 120)

    burst = _tasks(tenant, BURST, "burst")
    sent = await _produce(d.bootstrap, burst, None)
    done = await _results(d.bootstrap, set(sent), 600)
    runs_per_s = BURST / ((max(done.values()) - min(sent.values())) / 1000)

    paced = _tasks(tenant, PACED, "paced")
    sent = await _produce(d.bootstrap, paced, PACED_PER_S)
    done = await _results(d.bootstrap, set(sent), 300)
    latencies = sorted(done[k] - sent[k] for k in sent)
    return {
        "pipeline.runs_per_s": round(runs_per_s, 1),
        "pipeline.latency_p50_ms": float(statistics.median(latencies)),
        "pipeline.latency_p99_ms": float(latencies[int(0.99 * (len(latencies) - 1))]),
        "pipeline.max_stage_rss_mb": round(max(_peak_rss_mb(p.pid) for p in d.procs.values()), 1),
    }


def pipeline_figures(workdir: Path) -> dict[str, float]:
    """Deploy, measure, tear down."""
    postgres = resolve_postgres(workdir / "postgres")
    s3 = resolve_s3(workdir / "s3")
    try:
        d = asyncio.run(deploy(workdir / "pipeline", postgres, s3, partitions=12))
        try:
            return asyncio.run(_measure(d))
        finally:
            d.stop()
    finally:
        s3.stop()
        postgres.stop()
