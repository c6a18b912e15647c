"""A rollout group whose siblings both call an `Unsafe` tool with an outside effect, for the
winner-only-effects tests (in process, and as a process the crash tests kill).

The effect is real: the built-in `http_request` tool POSTs to a loopback HTTP
endpoint (`Ledger`, the standard library's threading server) that records every
request it receives and answers each with a receipt of its own. The ledger lives in
the test's process, so it outlives a killed pipeline: it is the outside world's
record of what happened, independent of Assay's logs.

Run as a module (`python -m tests.winner_effects DATA URL`), it submits the group to
an embedded runtime on DATA and exits 0 once the group's result is out and every
staged effect is settled; a restart on the same DATA submits nothing new.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from assay.bus import RESULTS, TASKS, WORKFLOWS
from assay.engine.events import commands_stream
from assay.engine.staging import (
    EffectDiscarded,
    EffectPublished,
    EffectPublishing,
    EffectStaged,
    StagedEffectView,
)
from assay.kernel import BranchId, RunId, TenantId, tenant_id
from assay.messages import (
    MESSAGES,
    Episode,
    RolloutBudget,
    RolloutResult,
    RolloutSpec,
    TaskSubmitted,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import BranchKey, Event, StateKey
from assay.runtime import Embedded
from assay.workflow import WorkflowDef, from_document

TENANT = tenant_id(uuid.UUID("5d0c2a4e-8b1f-4c3d-9e7a-6f5b4a3c2d01"))
GROUP = "notify-1"
SETTLED = {"published", "failed", "indeterminate", "discarded"}

WORKFLOW: WorkflowDef = from_document(
    {
        "id": "notify",
        "steps": [
            {
                "id": "solve",
                "kind": "model",
                "prompt": "What is {{ task.question }}?",
                "max_tokens": 32,
            },
            {
                "id": "notify",
                "kind": "tool",
                "tool": "http_request",
                "args": {
                    "method": "POST",
                    "url": "{{ task.url }}",
                    "body": "{{ steps.solve.output }}",
                },
                "timeout_s": 5,
            },
        ],
        "verifiers": [
            {
                "id": "staged",
                "kind": "regex",
                "step": "notify",
                "pattern": '\\{"effect_key": "[0-9a-f]{64}", "staged": "http_request"\\}',
            }
        ],
    }
)


@dataclass(frozen=True)
class Entry:
    """One request the ledger received, and the receipt it answered."""

    method: str
    body: str
    receipt: str


class Ledger:
    """A loopback HTTP endpoint recording every request; serves while used as a context
    manager."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._lock = threading.Lock()
        ledger = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(size).decode()
                with ledger._lock:
                    receipt = f"receipt-{len(ledger.entries) + 1}"
                    ledger.entries.append(Entry("POST", body, receipt))
                data = receipt.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/notify"

    def __enter__(self) -> Ledger:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


async def wait_for(check: Callable[[], Awaitable[Any]], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := await check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return found


async def submit(rt: Embedded, url: str, tenant: TenantId = TENANT) -> None:
    """Register the workflow and submit the group (both idempotent: a restart adds nothing)."""
    document = WORKFLOW.model_dump(mode="json", by_alias=True)
    registered = WorkflowRegistered(tenant=tenant, definition=document)
    await rt.publish(WORKFLOWS, registered, tenant, idem=WORKFLOW.version)

    async def current() -> bool:
        key = StateKey(tenant, "allocation", WORKFLOW.id)
        return await rt.logs["ingest"].get(key) is not None

    await wait_for(current, 30, "the workflow to be current")
    task = TaskSubmitted(
        tenant=tenant,
        workflow_id=WORKFLOW.id,
        idempotency_key=GROUP,
        input={"question": "17 * 23", "url": url},
        rollout=RolloutSpec(n=2, budget=RolloutBudget(max_concurrency=2)),
    )
    await rt.publish(TASKS, task, tenant, idem=GROUP)


async def rollout_result(rt: Embedded) -> RolloutResult | None:
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(RESULTS, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            if env.type == RolloutResult.type:
                msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
                assert isinstance(msg, RolloutResult)
                return msg
    return None


async def staged_effects(rt: Embedded) -> dict[str, StagedEffectView]:
    """Every staged effect's document, by `<run>/<branch>/<effect key>`."""
    found = await rt.logs["execute"].scan(TENANT, StagedEffectView.kind)
    return {key: StagedEffectView.model_validate(doc) for key, doc in found}


async def settled(rt: Embedded) -> RolloutResult | None:
    """The group's result, once it is out and both siblings' staged effects are settled."""
    result = await rollout_result(rt)
    effects = await staged_effects(rt)
    if result is None or len(effects) < 2:
        return None
    return result if all(e.state in SETTLED for e in effects.values()) else None


async def settlement(rt: Embedded, run: RunId) -> list[Event]:
    """The publication records on a sibling's commands stream."""
    records = await rt.logs["execute"].read(BranchKey.main(TENANT, commands_stream(run)))
    kinds = EffectPublishing | EffectPublished | EffectDiscarded
    return [r.event for r in records if isinstance(r.event, kinds)]


async def staged_records(rt: Embedded, run: RunId) -> list[EffectStaged]:
    records = await rt.logs["execute"].read(BranchKey.for_run(TENANT, run, BranchId(0)))
    return [r.event for r in records if isinstance(r.event, EffectStaged)]


async def episode_of(rt: Embedded, run: RunId) -> Episode:
    """A sibling's verified episode, as the tournament stage keeps it."""
    for _, doc in await rt.logs["tournament"].scan(TENANT, "sibling"):
        if doc["run"]["run_id"] == run:
            raw = await rt.blobs.get(TENANT, doc["episode"])
            assert raw is not None
            return Episode.model_validate_json(raw)
    raise AssertionError(f"no verified episode of {run}")


async def main(data: Path, url: str) -> int:
    async with Embedded(data) as rt:
        rt.start()
        await submit(rt, url)
        await wait_for(lambda: settled(rt), 120, "the group to settle")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(Path(sys.argv[1]), sys.argv[2])))
