"""`assay up` / `assay down` (`make up` / `make down`): a complete local distributed
deployment without Docker — Postgres, a Kafka-protocol broker, an S3 API and the six
stages as separate processes that outlive the command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

from assay.devstack.base import Service
from assay.devstack.deployment import Deployment, deploy
from assay.devstack.postgres import create_database, resolve_postgres
from assay.devstack.s3 import resolve_s3

DATABASE = "assay"
STATE = "stack.json"


def _state(d: Deployment, s3: Service, postgres: Service) -> dict[str, object]:
    return {
        "settings": {k: v for k, v in d.env.items() if k.startswith("ASSAY_")},
        "database": d.admin_dsn.rpartition("@")[2],
        "stages": {
            stage: {"pid": proc.pid, "port": d.ports[stage], "log": str(d.workdir / f"{stage}.log")}
            for stage, proc in d.procs.items()
        },
        "infra": {s.name: {"address": s.address, "pid": s.pid} for s in (d.broker, s3, postgres)},
    }


async def up(workdir: Path) -> int:
    """Start everything, wait until every stage is healthy, print the addresses."""
    workdir = workdir.resolve()
    if (workdir / STATE).exists():
        print(f"a stack is already recorded in {workdir / STATE}; run `assay down` first")
        return 2
    postgres = await asyncio.to_thread(resolve_postgres, workdir / "postgres")
    s3 = await asyncio.to_thread(resolve_s3, workdir / "s3")
    try:
        # The local broker keeps its log in memory, so every `up` starts with empty
        # topics; stage positions from an earlier stack would point past their ends
        # and skip records. The database starts empty too.
        await create_database(postgres.address, DATABASE)
        d = await deploy(
            workdir,
            postgres,
            s3,
            int(os.environ.get("ASSAY_PARTITIONS", "12")),
            database=DATABASE,
            bucket="assay",
            detached=True,
        )
    except BaseException:
        s3.stop()
        postgres.stop()
        raise
    state = _state(d, s3, postgres)
    (workdir / STATE).write_text(json.dumps(state, indent=2))
    print("Assay is up (distributed, local processes):")
    print(f"  kafka bootstrap   {d.bootstrap}")
    print(f"  postgres          {state['database']}")
    print(f"  s3 endpoint       {s3.address}")
    for stage, proc in d.procs.items():
        print(f"  {stage:<17} http://127.0.0.1:{d.ports[stage]}/healthz  (pid {proc.pid})")
    print(f"  export ASSAY_KAFKA_BOOTSTRAP={d.bootstrap}")
    return 0


def _terminate(pid: int | None, timeout_s: float = 10) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


async def down(workdir: Path) -> int:
    """Stop the stages, then the services `up` started (a borrowed Postgres stays)."""
    path = workdir.resolve() / STATE
    if not path.exists():
        print("nothing to stop")
        return 0
    state = json.loads(path.read_text())
    for info in state["stages"].values():
        _terminate(info["pid"])
    for info in state["infra"].values():
        _terminate(info.get("pid"))
    path.unlink()
    print("Assay is down")
    return 0
