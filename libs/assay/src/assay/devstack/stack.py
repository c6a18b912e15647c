"""`assay up` / `assay down` (`make up` / `make down`): a complete local distributed
deployment without Docker — Postgres, a Kafka-protocol broker, an S3 API and the six
stages as separate processes that outlive the command.

A stack touches only what it made. On a Postgres server it did not start it uses a
database and roles named for the stack, created by it and recorded in `owned.json`
(`ownership`); `assay down` signals only processes that are still the ones `up`
started (`processes`); `assay down --purge` also drops the recorded database and
roles.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from assay.devstack.base import Service
from assay.devstack.deployment import Deployment, deploy
from assay.devstack.ownership import (
    StackObjects,
    claim,
    load_objects,
    purge,
    server_name,
)
from assay.devstack.postgres import create_database, resolve_postgres
from assay.devstack.processes import (
    IdentityInvalid,
    ProcessIdentity,
    Stop,
    identify,
    terminate_all,
)
from assay.devstack.s3 import resolve_s3
from assay.runtime.embedded import STAGES
from assay.runtime.sections import STAGE_ROLES

STATE = "stack.json"
"""The running stack: its settings, addresses, and each process it started."""


def _identity(pid: int | None) -> dict[str, object] | None:
    found = identify(pid) if pid is not None else None
    return None if found is None else found.to_json()


def _without_password(dsn: str) -> str:
    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn
    user, _, at = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user.partition(':')[0]}:***@{at}"))


def _state(
    d: Deployment, s3: Service, postgres: Service, objects: StackObjects, borrowed: bool
) -> dict[str, object]:
    return {
        "stack": objects.stack,
        "settings": {k: v for k, v in d.env.items() if k.startswith("ASSAY_")},
        "database": d.admin_dsn.rpartition("@")[2],
        "postgres": {
            "database": objects.database_name,
            "roles": {stage: objects.role(stage) for stage in STAGE_ROLES},
            "server_started": not borrowed,
        },
        "console": d.console_url,
        "stages": {
            stage: {
                "pid": proc.pid,
                "process": _identity(proc.pid),
                "port": d.ports[stage],
                "log": str(d.workdir / f"{stage}.log"),
            }
            for stage, proc in d.procs.items()
        },
        "infra": {
            s.name: {"address": s.address, "pid": s.pid, "process": _identity(s.pid)}
            for s in (d.broker, s3, postgres)
        },
    }


async def up(workdir: Path, replicas: Mapping[str, int] | None = None) -> int:
    """Start everything, wait until every stage is healthy, print the addresses (the
    console's too: it runs like a stage, on loopback without a token). `replicas`:
    processes per stage (`deployment.parse_replicas`), one where not given.

    On a Postgres server it did not start, the stack's database and roles are its own
    (`ownership.claim`); returns 2 when a stack is already recorded in `workdir`.

    Raises:
        StackConflict: the server holds a database or role of the stack's names that
            this stack did not create (nothing is touched; the message says what to do).
        InfraUnavailable: a service could not be found or started.
    """
    workdir = workdir.resolve()
    if (workdir / STATE).exists():
        print(f"a stack is already recorded in {workdir / STATE}; run `assay down` first")
        return 2
    objects = load_objects(workdir)
    postgres = await asyncio.to_thread(resolve_postgres, workdir / "postgres")
    s3 = await asyncio.to_thread(resolve_s3, workdir / "s3")
    borrowed = postgres.process is None and postgres.stop_hook is None
    try:
        # The local broker keeps its log in memory, so every `up` starts with empty
        # topics; stage positions from an earlier stack would point past their ends
        # and skip records. The database starts empty too.
        if borrowed:
            await claim(postgres.address, workdir, objects, STAGE_ROLES)
        else:  # a server of our own: nobody else's objects are on it
            await create_database(postgres.address, objects.database_name)
        d = await deploy(
            workdir,
            postgres,
            s3,
            int(os.environ.get("ASSAY_PARTITIONS", "12")),
            database=objects.database_name,
            bucket=f"assay-{objects.stack}",
            detached=True,
            roles={stage: objects.role(stage) for stage in STAGE_ROLES},
            stages=(*STAGES, "console"),
            replicas=replicas,
            extra_env={
                name: os.environ[name]
                for name in ("ASSAY_CONTROL_PARTITIONS",)
                if os.environ.get(name)
            },
        )
    except BaseException:
        s3.stop()
        postgres.stop()
        raise
    state = _state(d, s3, postgres, objects, borrowed)
    (workdir / STATE).write_text(json.dumps(state, indent=2))
    print(f"Assay is up (distributed, local processes; stack {objects.stack}):")
    print(f"  kafka bootstrap   {d.bootstrap}")
    print(f"  postgres          {state['database']}")
    print(f"  s3 endpoint       {s3.address}")
    for stage, proc in d.procs.items():
        print(f"  {stage:<17} http://127.0.0.1:{d.ports[stage]}/healthz  (pid {proc.pid})")
    print(f"  console on {d.console_url} (open: no token configured, loopback only)")
    print(f"  export ASSAY_KAFKA_BOOTSTRAP={d.bootstrap}")
    print(f"  check: assay rebuild --check --database-url {_without_password(d.admin_dsn)}")
    return 0


def _stop_recorded(state: dict[str, object]) -> int:
    """Stop every recorded process that is still the one `up` started: the stages
    together, then the services under them. A pid that now names another process is
    left alone and reported. 1 if one of ours outlived SIGKILL."""
    code = 0
    for group in (state.get("stages"), state.get("infra")):
        if not isinstance(group, dict):
            continue
        names: list[str] = []
        recorded: list[ProcessIdentity] = []
        for name, info in group.items():
            pid = info.get("pid") if isinstance(info, dict) else None
            if pid is None:
                continue  # borrowed: not ours to stop
            try:
                recorded.append(ProcessIdentity.from_json(info.get("process")))
            except IdentityInvalid:
                print(
                    f"{name}: pid {pid} was recorded without its identity, so it is left"
                    " alone; stop it yourself if it is still Assay's"
                )
                continue
            names.append(name)
        for name, (outcome, line) in zip(names, terminate_all(recorded), strict=True):
            if outcome in (Stop.NOT_OURS, Stop.SURVIVED):
                print(f"{name}: {line}")
            code |= outcome is Stop.SURVIVED
    return code


async def down(workdir: Path, *, purge_objects: bool = False) -> int:
    """Stop the processes `up` started (a borrowed Postgres stays), checking each pid
    still names the process that was started; with `purge_objects`, also drop the
    database and roles the stack created on a server it did not start.

    Returns:
        0, or 1 when a process of ours survived or a recorded object could not be dropped.

    Raises:
        AssayError: `purge_objects` and the server cannot be reached, or its record is
            unreadable.
    """
    workdir = workdir.resolve()
    path = workdir / STATE
    code = 0
    if path.exists():
        code = _stop_recorded(json.loads(path.read_text()))
        path.unlink()
        print("Assay is down")
    else:
        print("nothing to stop")
    if purge_objects:
        objects = load_objects(workdir)
        report = await purge(workdir)
        for what in report.dropped:
            print(f"dropped {what}")
        for what in report.kept:
            print(f"kept {what}")
        if not report.dropped and not report.kept:
            print("nothing to purge: no database or role of this stack is recorded")
        elif objects.server is not None:
            print(f"purged stack {objects.stack} from {server_name(objects.server)}")
        code |= bool(report.kept)
    return code
