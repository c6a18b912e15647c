"""The soak figure: the embedded pipeline run continuously with shortened retention.

A fixed stream of tasks (the arithmetic examples, each sent again under a new
idempotency key every cycle) runs through every stage for `SOAK_S` seconds while
retention periods of a few seconds turn over many times. The runs are under the
token ceiling, so they are tiered unreduced as soon as their grading ended. The data directory's
stores (every SQLite file: the stage logs and `bus.sqlite`, WAL included) are
sampled once a second; `soak.bytes_growth_last_half` is their growth over the
second half, beside `soak.bytes_growth_first_half`. Blobs are reported apart:
tiered runs' archives are cold storage that retention keeps by design. At the
end every task must have its result and `assay rebuild --check` must pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from pathlib import Path

from assay.bus.topics import RESULTS, TASKS, WORKFLOWS
from assay.cli.rebuild import rebuild
from assay.cli.tasks import read_tasks
from assay.kernel import tenant_id
from assay.messages import MESSAGES, RunResult, WorkflowRegistered, open_envelope
from assay.record import StateKey
from assay.runtime.embedded import Embedded
from assay.runtime.settings import AssaySettings
from assay.workflow import load_workflow

ROOT = Path(__file__).resolve().parents[1]
TENANT = tenant_id("00000000-0000-4000-8000-00000000500a")
SOAK_S = float(__import__("os").environ.get("ASSAY_SOAK_S", "60"))
IN_FLIGHT = 32
RETENTION = {
    "ASSAY_RETENTION_TOPIC_RETENTION_S": "2",
    "ASSAY_RETENTION_INBOX_KEEP_S": "3",
    "ASSAY_RETENTION_RECORDS_KEEP_S": "4",
    "ASSAY_RETENTION_PRUNE_INTERVAL_S": "1",
    "ASSAY_RETENTION_TIER_AFTER_S": "0",
    "ASSAY_RETENTION_SWEEP_INTERVAL_S": "0.5",
}


def _store_bytes(data: Path) -> int:
    return sum(p.stat().st_size for p in data.glob("*.sqlite*") if p.is_file())


def _blob_bytes(data: Path) -> int:
    return sum(p.stat().st_size for p in (data / "blobs").rglob("*") if p.is_file())


async def _soak(data: Path) -> dict[str, float]:
    settings = AssaySettings.from_env({**RETENTION, "ASSAY_DATA_DIR": str(data)})
    wf = load_workflow(ROOT / "examples" / "workflows" / "arith-v1.yaml")
    tasks = read_tasks(ROOT / "examples" / "tasks" / "arith.jsonl", TENANT, wf.id)
    samples: list[tuple[float, int, int]] = []
    sent: set[str] = set()
    got: set[str] = set()
    async with Embedded(data, settings=settings) as rt:
        rt.start()
        definition = wf.model_dump(mode="json", by_alias=True)
        reg = WorkflowRegistered(tenant=TENANT, definition=definition)
        await rt.publish(WORKFLOWS, reg, TENANT, idem=wf.version)
        ingest = rt.logs["ingest"]
        while await ingest.get(StateKey(TENANT, "allocation", wf.id)) is None:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # ingest's state has no event to wait on
        offsets = dict.fromkeys(range(rt.partitions), 0)
        t0 = time.monotonic()
        cycle = n = 0
        next_sample = t0
        while (now := time.monotonic()) - t0 < SOAK_S:
            for p in range(rt.partitions):
                for m in await rt.bus.fetch(RESULTS, p, offsets[p], 500, 0.0):
                    offsets[p] = m.offset + 1
                    env = open_envelope(m.value)
                    res = MESSAGES.decode(env.type, env.schema_version, env.payload)
                    if isinstance(res, RunResult) and res.idempotency_key in sent:
                        got.add(res.idempotency_key)
            batch = []
            while len(sent) - len(got) < IN_FLIGHT:
                task = tasks[n % len(tasks)]
                cycle, n = (n + 1) // len(tasks), n + 1
                key = f"{task.idempotency_key}-soak-{cycle}-{n}"
                sent.add(key)
                batch.append((TASKS, task.model_copy(update={"idempotency_key": key}), TENANT, key))
            if batch:
                await rt.publish_many(batch)
            if now >= next_sample:
                samples.append((now - t0, _store_bytes(data), _blob_bytes(data)))
                next_sample += 1.0
            await asyncio.sleep(0.01)
        deadline = time.monotonic() + 30
        while got != sent and time.monotonic() < deadline:
            for p in range(rt.partitions):
                for m in await rt.bus.fetch(RESULTS, p, offsets[p], 500, 0.01):
                    offsets[p] = m.offset + 1
                    env = open_envelope(m.value)
                    res = MESSAGES.decode(env.type, env.schema_version, env.payload)
                    if isinstance(res, RunResult):
                        got.add(res.idempotency_key)
        await rt.stop()
    with contextlib.redirect_stdout(io.StringIO()):
        check = await rebuild(data, check=True)
    half = len(samples) // 2
    first, mid, last = samples[0][1], samples[half][1], samples[-1][1]
    return {
        "soak.seconds": round(samples[-1][0], 1),
        "soak.tasks": float(len(sent)),
        "soak.results_missing": float(len(sent - got)),
        "soak.store_bytes_start": float(first),
        "soak.store_bytes_mid": float(mid),
        "soak.store_bytes_end": float(last),
        "soak.bytes_growth_first_half": float(mid - first),
        "soak.bytes_growth_last_half": float(last - mid),
        "soak.blob_bytes_end": float(samples[-1][2]),
        "soak.rebuild_check_ok": float(check == 0),
    }


def soak_figures(workdir: Path) -> dict[str, float]:
    """The soak section's figures (see the module docstring)."""
    workdir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_soak(workdir / "data"))
