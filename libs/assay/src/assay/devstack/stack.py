"""`assay up` / `assay down` (`make up` / `make down`): a complete local distributed
deployment without Docker — Postgres, a Kafka-protocol broker, an S3 API and the six
stages as separate processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import asyncpg

from assay.devstack.base import InfraUnavailable, Service, free_port, log_file
from assay.devstack.kafka import start_tansu
from assay.devstack.postgres import resolve_postgres
from assay.devstack.s3 import resolve_s3
from assay.runtime.embedded import STAGES
from assay.runtime.settings import Settings
from assay.store.pg_provision import provision_stage

DATABASE = "assay"
STATE = "stack.json"


def _assay() -> str:
    return str(Path(sys.executable).parent / "assay")


async def _ensure_database(admin_dsn: str, name: str) -> str:
    conn = await asyncpg.connect(admin_dsn)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    base, _, _ = admin_dsn.rpartition("/")
    return f"{base}/{name}"


def stage_env(settings: dict[str, str], dsn: str, port: int) -> dict[str, str]:
    """The environment of one `assay serve` process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSAY_")}
    return {**env, **settings, "ASSAY_DATABASE_URL": dsn, "ASSAY_HTTP_PORT": str(port)}


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
            return bool(json.loads(r.read()).get("ok"))
    except (OSError, ValueError):
        return False


async def up(workdir: Path) -> int:
    """Start everything, wait until every stage is healthy, print the addresses."""
    workdir = workdir.resolve()
    if (workdir / STATE).exists():
        print(f"a stack is already recorded in {workdir / STATE}; run `assay down` first")
        return 2
    workdir.mkdir(parents=True, exist_ok=True)
    started: list[Service] = []
    try:
        pg = resolve_postgres(workdir / "postgres")
        started.append(pg)
        kafka = start_tansu(workdir / "kafka")
        started.append(kafka)
        s3 = resolve_s3(workdir / "s3")
        started.append(s3)
        admin = await _ensure_database(pg.address, DATABASE)
        settings = {
            "ASSAY_KAFKA_BOOTSTRAP": kafka.address,
            "ASSAY_S3_ENDPOINT": s3.address,
            "ASSAY_S3_BUCKET": "assay",
            "ASSAY_S3_ACCESS_KEY_ID": s3.details.get("access_key_id", "testing"),
            "ASSAY_S3_SECRET_ACCESS_KEY": s3.details.get("secret_access_key", "testing"),
            "ASSAY_S3_REGION": s3.details.get("region", "us-east-1"),
            "ASSAY_PARTITIONS": os.environ.get("ASSAY_PARTITIONS", "12"),
        }
        from assay.runtime.distributed import create_topics

        await create_topics(Settings.from_env(settings))
        stages: dict[str, dict[str, Any]] = {}
        for stage in STAGES:
            dsn = await provision_stage(admin, stage, secrets.token_hex(12))
            port = free_port()
            out = open(log_file(workdir, f"stage-{stage}"), "ab")  # noqa: SIM115
            proc = subprocess.Popen(
                [_assay(), "serve", stage],
                env=stage_env(settings, dsn, port),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            stages[stage] = {"pid": proc.pid, "port": port, "log": out.name}
        deadline = time.monotonic() + 90
        for stage, info in stages.items():
            while not _healthy(info["port"]):
                if time.monotonic() > deadline:
                    raise InfraUnavailable(f"stage {stage} not healthy; see {info['log']}")
                await asyncio.sleep(0.2)
        state = {
            "settings": settings,
            "database": admin.rpartition("@")[2],
            "stages": stages,
            "infra": {s.name: {"address": s.address, "pid": s.pid} for s in started},
        }
        (workdir / STATE).write_text(json.dumps(state, indent=2))
    except BaseException:
        for info in locals().get("stages", {}).values():
            _terminate(info["pid"])
        for service in reversed(started):
            service.stop()
        raise
    print("Assay is up (distributed, local processes):")
    print(f"  kafka bootstrap   {kafka.address}")
    print(f"  postgres          {state['database']}")
    print(f"  s3 endpoint       {s3.address}")
    for stage, info in stages.items():
        print(f"  {stage:<17} http://127.0.0.1:{info['port']}/healthz  (pid {info['pid']})")
    print(f"  export ASSAY_KAFKA_BOOTSTRAP={kafka.address}")
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
