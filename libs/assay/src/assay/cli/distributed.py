"""CLI commands of distributed mode: serve a stage, provision, topics, submit, results.

Each command imports its clients itself: `assay db provision` loads no Kafka client,
`assay cancel` no Postgres driver.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from assay.bus import commands
from assay.bus.topics import RESULTS
from assay.cli.candidates import with_matrix
from assay.cli.logs import tenant_arg
from assay.cli.tasks import read_tasks
from assay.kernel.ids import WorkflowId
from assay.messages import MESSAGES, open_envelope
from assay.runtime.sections import STAGE_ROLES
from assay.runtime.settings import AssaySettings
from assay.workflow import load_workflow

if TYPE_CHECKING:
    from assay.store.ports import OutboxEntry


async def serve_command(stage: str) -> int:
    """`assay serve STAGE`: run until SIGTERM or SIGINT, then stop cleanly.

    A stop that takes longer than `ASSAY_SHUTDOWN_GRACE_S` ends the process at once
    (status 1): whatever it was waiting for, the protocol makes a restart safe. A stage
    that gave up on a service it needs exits with status 3, for its supervisor to
    restart it.
    """
    from assay.runtime.distributed import StageGaveUp, serve

    settings = AssaySettings.from_env()
    logging.getLogger().setLevel(settings.log_level.upper())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    grace = asyncio.create_task(_grace(stage, stop, settings.shutdown_grace_s))
    try:
        await serve(stage, settings, stop)
    except StageGaveUp as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    finally:
        grace.cancel()
    return 0


async def _grace(stage: str, stop: asyncio.Event, seconds: float) -> None:
    """Once the stage is asked to stop (a signal, or it gave up), give it `seconds`."""
    await stop.wait()
    # A thread, so that even a loop that no longer turns is ended.
    timer = threading.Timer(seconds, _out_of_grace, [stage])
    timer.daemon = True
    timer.start()
    try:
        await asyncio.Event().wait()
    finally:
        timer.cancel()


def _out_of_grace(stage: str) -> None:
    print(f"error: stage {stage} did not stop within its grace period; exiting", file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)


async def provision_command() -> int:
    """`assay db provision`: each stage's role and schema, idempotently; prints nothing secret."""
    from assay.store.pg_provision import provision_stage

    settings = AssaySettings.from_env()
    settings.require("database.admin_url")
    assert settings.database.admin_url is not None
    for stage in STAGE_ROLES:
        await provision_stage(
            settings.database.admin_url, stage, settings.database.stage_password_for(stage)
        )
        print(f"provisioned role assay_{stage} and schema {stage}")
    return 0


async def topics_command() -> int:
    """`assay topics create`: every topic, with the configured partition count."""
    from assay.runtime.distributed import create_topics

    settings = AssaySettings.from_env()
    for name in await create_topics(settings):
        print(name)
    return 0


async def produce(entries: list[OutboxEntry]) -> None:
    """Produce `entries` to the Kafka cluster `ASSAY_KAFKA_BOOTSTRAP` names."""
    from assay.bus.kafka import KafkaTransport

    settings = AssaySettings.from_env()
    settings.require("kafka.bootstrap")
    assert settings.kafka.bootstrap is not None
    transport = KafkaTransport(settings.kafka.bootstrap, client_id="assay-cli")
    await transport.open()
    try:
        await transport.publish(entries)
    finally:
        await transport.close()


async def register_command(
    path: Path, tenant: str, rewrite: bool, parents: list[str] | None = None
) -> int:
    """`assay register WORKFLOW --tenant T [--parent V ...]`: put the definition on
    `assay.workflows`, naming the versions it derives from (default: the latest).

    Raises:
        AssayError: a parent is not a version hash.
    """
    wf = load_workflow(path)
    definition = wf.model_dump(mode="json", by_alias=True)
    cmd = commands.register_workflow(
        tenant_arg(tenant), definition, wf.version, rewrite=rewrite, parents=parents
    )
    await produce([cmd.entry])
    print(f"registered {wf.id} version {wf.version}")
    return 0


async def submit_command(
    path: Path,
    tenant: str | None,
    workflow: str | None,
    matrix: dict[str, Any] | None = None,
    wait: bool | None = None,
    wait_s: float = 60.0,
) -> int:
    """`assay submit FILE.jsonl`: one `TaskSubmitted` per line onto `assay.tasks`.

    A line is a whole TaskSubmitted, or `{"idempotency_key", "input"}` completed
    by `--tenant` and `--workflow`. A candidate `matrix` (`--candidate`, `--candidates`)
    makes every task a replay tournament.

    With `wait` (the default when a matrix is given), it then waits up to `wait_s` for
    ingest's verdict on each task and prints it: 0 when every task was admitted, 1 when
    ingest refused one (its reason printed), else 3 when a verdict did not come in time.
    """
    tasks = with_matrix(
        read_tasks(
            path,
            tenant_arg(tenant) if tenant else None,
            WorkflowId(workflow) if workflow else None,
        ),
        matrix,
    )
    entries = [commands.submit_task(task).entry for task in tasks]
    if not (matrix is not None if wait is None else wait):
        await produce(entries)
        print(f"submitted {len(entries)} task(s)")
        return 0
    from assay.cli.verdicts import produce_and_await

    settings = AssaySettings.from_env()
    settings.require("kafka.bootstrap")
    assert settings.kafka.bootstrap is not None
    pairs = zip(entries, tasks, strict=True)
    keys = {str(open_envelope(e.value).id): t.idempotency_key for e, t in pairs}
    verdicts = await produce_and_await(
        settings.kafka.bootstrap, [e.value for e in entries], lambda: produce(entries), wait_s
    )
    print(f"submitted {len(entries)} task(s)")
    refused = missing = False
    for message, key in keys.items():
        verdict = verdicts.get(message)
        if verdict is None:
            print(
                f"assay: task {key!r}: no verdict from ingest within {wait_s:g} s (ingest is"
                " behind, or the key repeats a task already accepted); its result, if any,"
                " comes on assay.results",
                file=sys.stderr,
            )
            missing = True
        elif verdict.admitted:
            print(f"task {key!r} admitted")
        else:
            print(f"assay: error: task {key!r} refused: {verdict.reason}", file=sys.stderr)
            refused = True
    return 1 if refused else 3 if missing else 0  # a refusal is certain; a missing verdict not


async def cancel_command(run: str, tenant: str, reason: str) -> int:
    """`assay cancel RUN`: a `CancelRun` onto `assay.run-commands`."""
    await produce([commands.cancel_run(tenant_arg(tenant), run, reason).entry])
    print(f"asked to cancel run {run}")
    return 0


async def cancel_rollout_command(group: str, tenant: str, reason: str) -> int:
    """`assay cancel --rollout KEY`: a `CancelRollout` onto `assay.tasks`, keyed like the task."""
    await produce([commands.cancel_rollout(tenant_arg(tenant), group, reason).entry])
    print(f"asked to cancel rollout group {group}")
    return 0


async def signal_command(run: str, tenant: str, name: str, payload: str) -> int:
    """`assay approve RUN` / `assay signal RUN NAME`: a `SignalRun` onto `assay.run-commands`."""
    await produce([commands.signal_run(tenant_arg(tenant), run, name, payload).entry])
    print(f"sent {name!r} to run {run}")
    return 0


async def rewind_command(run: str, tenant: str, at: int, branch: int | None, reason: str) -> int:
    """`assay rewind RUN --at LSN`: a `RewindRun` onto `assay.run-commands`."""
    await produce([commands.rewind_run(tenant_arg(tenant), run, at, branch, reason).entry])
    print(f"asked to rewind run {run} at LSN {at}")
    return 0


async def results_command(follow: bool, tenant: str | None) -> int:
    """`assay results [--follow]`: print each task's `RunResult` or `RolloutResult` as JSON lines,
    from the beginning."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from assay.bus.kafka import log_end

    settings = AssaySettings.from_env()
    settings.require("kafka.bootstrap")
    only = tenant_arg(tenant) if tenant else None
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap,
        enable_auto_commit=False,
        client_id=f"assay-results-{uuid.uuid4().hex[:8]}",
    )
    await consumer.start()
    try:
        await consumer.topics()  # fetches the cluster's metadata
        parts = [
            TopicPartition(RESULTS, p)
            for p in sorted(consumer.partitions_for_topic(RESULTS) or set())
        ]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        end = await consumer.end_offsets(parts)
        seen: set[str] = set()
        while True:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for r in records:
                    env = open_envelope(r.value)
                    if env.id in seen or (only is not None and env.tenant != only):
                        continue  # a relay re-publish carries the same id: one result
                    seen.add(env.id)
                    msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
                    sys.stdout.write(msg.model_dump_json() + "\n")
            sys.stdout.flush()
            if not follow:
                positions = [await consumer.position(tp) for tp in parts]
                ends = [log_end(consumer, tp, end[tp]) for tp in parts]
                if all(pos >= e for pos, e in zip(positions, ends, strict=True)):
                    return 0
    finally:
        await consumer.stop()


def default_tenant() -> str:
    """The tenant of CLI conveniences when --tenant is not given."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "assay:local"))
