"""A distributed deployment on one machine: the six stages (and the console, for
`assay up`) as OS processes on a broker,
a database and an S3 bucket of their own. Used by `assay up`, the end-to-end tests
and the pipeline benchmark."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from assay.devstack.base import Service, free_port, run_apart
from assay.devstack.kafka import start_tansu
from assay.devstack.postgres import create_database, drop_database, drop_roles, ensure_database
from assay.kernel.errors import AssayError
from assay.runtime.embedded import STAGES
from assay.runtime.sections import STAGE_ROLES
from assay.runtime.settings import AssaySettings
from assay.store.pg_provision import provision_stage, stage_role

ASSAY = str(Path(sys.executable).parent / "assay")
MAX_REPLICAS = 16
"""More processes of one stage than this on one machine is a typo, not a deployment."""


class ReplicasInvalid(AssayError):
    """A replica count does not parse, names no stage, or is out of range."""


def parse_replicas(text: str) -> dict[str, int]:
    """`execute=3 tournament=2` (spaces or commas between): processes per stage; a stage
    not named runs one. The first replica is named for its stage, the others
    `<stage>-2`, `<stage>-3`, …; every replica joins the stage's consumer group, which
    spreads the topics' partitions across them.

    Raises:
        ReplicasInvalid: an entry is not `stage=count`, names no stage, repeats one, or
            its count is not a whole number from 1 to `MAX_REPLICAS`.
    """
    counts: dict[str, int] = {}
    for entry in text.replace(",", " ").split():
        stage, eq, count = entry.partition("=")
        if not eq or stage not in STAGES:
            raise ReplicasInvalid(
                f"replicas: {entry!r} is not stage=count with a stage among {', '.join(STAGES)}"
            )
        if stage in counts:
            raise ReplicasInvalid(f"replicas: {stage} is given twice")
        if not count.isdigit() or not 1 <= int(count) <= MAX_REPLICAS:
            raise ReplicasInvalid(
                f"replicas: {stage}={count!r}: the count is a whole number from 1 to {MAX_REPLICAS}"
            )
        counts[stage] = int(count)
    return counts


def replica_names(stage: str, count: int) -> list[str]:
    """The process names of a stage's replicas: the stage's own, then `<stage>-<n>`."""
    return [stage, *(f"{stage}-{n}" for n in range(2, count + 1))]


@dataclass
class Deployment:
    """Six `assay serve` processes and what they run on."""

    workdir: Path
    broker: Service
    admin_dsn: str
    env: dict[str, str]
    dsns: dict[str, str]
    detached: bool = False
    """Stage processes outlive the caller (their own session), as `assay up` needs."""
    owned_database: tuple[str, str] | None = None
    """(server admin DSN, name) of a database made for this deployment, dropped at stop."""
    roles: dict[str, str] = field(default_factory=dict)
    """Each stage's login role."""
    owned_roles: bool = False
    """The roles were made for this deployment, and are dropped at stop with its database."""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    """Stage processes by name: the stage's, or a replica's (`start(stage, name=...)`)."""
    ports: dict[str, int] = field(default_factory=dict)
    console_url: str | None = None
    """The console's pages and API, once `start("console")` started it."""

    @property
    def bootstrap(self) -> str:
        """The broker's bootstrap address."""
        return self.broker.address

    def start(
        self, stage: str, *, name: str | None = None, env: Mapping[str, str] | None = None
    ) -> None:
        """Start (or restart) one stage process; `wait_healthy` waits for it.

        Args:
            name: the process's name in `procs`, `ports` and `log` (default: the
                stage's); two names for one stage run two replicas of it.
            env: variables set for this process only, over the deployment's.
        """
        name = name or stage
        port = free_port()
        process_env = {
            **self.env,
            "ASSAY_DATABASE_URL": self.dsns[stage],
            "ASSAY_HTTP_PORT": str(port),
            **(self._console_env() if stage == "console" else {}),
            **(env or {}),
        }
        with open(self.workdir / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(
                [ASSAY, "serve", stage],
                env=process_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=self.detached,
            )
        self.ports[name] = port

    def _console_env(self) -> dict[str, str]:
        """The console on a free loopback port (open: no token, loopback only), asking
        execute's status port for a run's full log, and reading the health and lag of
        every process started before it (each replica by its name) on its status port."""
        port = free_port()
        self.console_url = f"http://127.0.0.1:{port}/"
        env = {"ASSAY_CONSOLE_HOST": "127.0.0.1", "ASSAY_CONSOLE_PORT": str(port)}
        if "execute" in self.ports:
            env["ASSAY_CONSOLE_EXECUTE_URL"] = f"http://127.0.0.1:{self.ports['execute']}"
        stages = [(n, p) for n, p in self.ports.items() if n != "console"]
        if stages:
            urls = (f"{name}=http://127.0.0.1:{p}" for name, p in stages)
            env["ASSAY_CONSOLE_STAGE_URLS"] = ",".join(urls)
        return env

    def wait_healthy(self, timeout_s: float = 120) -> None:
        """Block until every started process answers /healthz with ok (the console's
        process on its pages' port too: it binds that one after its status port)."""

        def healthy(name: str) -> tuple[bool, str]:
            urls = [f"http://127.0.0.1:{self.ports[name]}/healthz"]
            if name == "console" and self.console_url is not None:
                urls.append(f"{self.console_url}healthz")
            try:
                if all(_ok(url) for url in urls):
                    return True, ""
            except OSError:
                pass
            return False, self.log(name)[-2000:]

        self._wait_each(healthy, "not healthy", timeout_s)

    def readiness(self, name: str) -> tuple[bool, dict[str, Any]]:
        """A process's `/readyz`: whether it is ready, and the document it answered."""
        url = f"http://127.0.0.1:{self.ports[name]}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return True, dict(json.loads(r.read()))
        except urllib.error.HTTPError as exc:
            return False, dict(json.loads(exc.read() or b"{}"))

    def wait_ready(self, timeout_s: float = 120) -> None:
        """Block until every started process answers /readyz with ready."""

        def ready(name: str) -> tuple[bool, str]:
            try:
                ok, doc = self.readiness(name)
            except OSError as exc:
                return False, repr(exc)
            return ok, str(doc)

        self._wait_each(ready, "not ready", timeout_s)

    def _wait_each(
        self, check: Callable[[str], tuple[bool, str]], failing: str, timeout_s: float
    ) -> None:
        """Poll `check` on every started process until it passes; fail with what it said
        last once `timeout_s` has passed, or at once if the process exited."""
        deadline = time.monotonic() + timeout_s
        for name in self.ports:
            while True:
                if self.procs[name].poll() is not None:
                    raise AssertionError(f"{name} exited: {self.log(name)[-2000:]}")
                ok, detail = check(name)
                if ok:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"{name} {failing}: {detail}")
                time.sleep(0.1)

    def kill(self, name: str) -> None:
        """SIGKILL one stage process."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def log(self, name: str) -> str:
        """What a stage process printed."""
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        """Terminate every stage, then the broker; drop a database made for this deployment."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped process would not see SIGTERM
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.broker.stop()
        if self.owned_database is not None:
            server, name = self.owned_database
            run_apart(drop_database(server, name))
            if self.owned_roles:
                run_apart(drop_roles(server, list(self.roles.values())))

    async def query(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        """Run a query as the database's superuser."""
        conn = await asyncpg.connect(self.admin_dsn)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()


def _ok(url: str) -> bool:
    """Whether `url` answers a JSON document with `"ok": true`."""
    with urllib.request.urlopen(url, timeout=1) as r:
        return bool(json.loads(r.read()).get("ok"))


async def deploy(
    workdir: Path,
    postgres: Service,
    s3: Service,
    partitions: int = 4,
    *,
    database: str | None = None,
    bucket: str | None = None,
    detached: bool = False,
    stages: Sequence[str] = STAGES,
    extra_env: dict[str, str] | None = None,
    roles: Mapping[str, str] | None = None,
    replicas: Mapping[str, int] | None = None,
) -> Deployment:
    """Start a broker, provision a database and a bucket, and start the six stages.

    Args:
        database: a database to use (created if missing, kept if present); by
            default a fresh, uniquely named one.
        bucket: the blob bucket; by default a uniquely named one.
        detached: stage processes run in their own sessions, outliving the caller.
        stages: the stages started here (every stage, and the console, is provisioned);
            a test that needs fewer, or replicas, starts them with `Deployment.start`;
            `console` after `execute` serves the console too (`console_url`).
        extra_env: more environment for every stage process (settings, PYTHONPATH).
        roles: each stage's login role (created or altered by provisioning: roles are
            the server's, not the database's). By default, with a fresh database, roles
            named for it (`assay_<database>_<stage>`) dropped at stop with it, so that
            deployments sharing a server never reset each other's passwords; with a
            given `database`, `assay_<stage>`.
        replicas: processes per stage (`parse_replicas`); one where not given.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    async with contextlib.AsyncExitStack() as undo:  # a deployment that never came up
        broker = await asyncio.to_thread(start_tansu, workdir / "kafka")  # leaves nothing
        undo.callback(broker.stop)
        owned: tuple[str, str] | None = None
        owned_roles = False
        if database is None:
            name = f"e2e_{uuid.uuid4().hex[:10]}"
            if roles is None:  # dropped last: once the database they own things in is gone
                roles, owned_roles = {s: f"assay_{name}_{s}" for s in STAGE_ROLES}, True
                undo.push_async_callback(drop_roles, postgres.address, list(roles.values()))
            admin = await create_database(postgres.address, name)
            owned = (postgres.address, name)
            undo.push_async_callback(drop_database, *owned)
        else:
            admin = await ensure_database(postgres.address, database)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASSAY_")}
        env.update(extra_env or {})
        env.update(
            {
                "ASSAY_KAFKA_BOOTSTRAP": broker.address,
                "ASSAY_S3_ENDPOINT": s3.address,
                "ASSAY_S3_BUCKET": bucket or f"e2e-{uuid.uuid4().hex[:10]}",
                "ASSAY_S3_ACCESS_KEY_ID": s3.details["access_key_id"],
                "ASSAY_S3_SECRET_ACCESS_KEY": s3.details["secret_access_key"],
                "ASSAY_S3_REGION": s3.details.get("region", "us-east-1"),
                "ASSAY_PARTITIONS": str(partitions),
                "ASSAY_LOG_LEVEL": "WARNING",
            }
        )
        from assay.runtime.distributed import create_topics

        await create_topics(AssaySettings.from_env(env))
        named = {s: (roles or {}).get(s) or stage_role(s) for s in STAGE_ROLES}
        dsns = {
            s: await provision_stage(admin, s, f"pw-{s}-{uuid.uuid4().hex[:6]}", role=named[s])
            for s in STAGE_ROLES
        }
        d = Deployment(
            workdir,
            broker,
            admin,
            env,
            dsns,
            detached=detached,
            owned_database=owned,
            roles=named,
            owned_roles=owned_roles,
        )
        undo.pop_all()  # from here the deployment's own stop undoes it all
    try:
        for stage in stages:
            for name in replica_names(stage, (replicas or {}).get(stage, 1)):
                d.start(stage, name=name)
        await asyncio.to_thread(d.wait_healthy)
    except BaseException:
        await asyncio.to_thread(d.stop)
        raise
    return d
