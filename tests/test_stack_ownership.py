"""`assay up` on a Postgres server it did not start touches only what it created, and
`assay down --purge` removes only that; `assay rebuild --check` checks a distributed
deployment's stage schemas read-only.

The server is a throwaway cluster of this module's own (`own_postgres`): the names
under test — a database `assay`, a role `assay_execute` — are server-wide, and tests
sharing a server provision `assay_<stage>` roles meanwhile. To `assay up` it is a
server it did not start, exactly like the one on 127.0.0.1:5432. One `assay up` serves
the module.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from assay.devstack import Service
from assay.devstack.ownership import (
    OWNED,
    StackConflict,
    StackObjects,
    claim,
    load_objects,
    new_stack_id,
    purge,
)
from assay.devstack.postgres import with_database
from assay.devstack.processes import ProcessIdentity, identify
from assay.runtime.embedded import STAGES
from assay.runtime.sections import STAGE_ROLES
from assay.store.pg_provision import role_dsn

ASSAY = str(Path(sys.executable).parent / "assay")
ROOT = Path(__file__).resolve().parents[1]
USERS_PASSWORD = "the-users-own-password"

pytestmark = [pytest.mark.postgres]


async def fetch(dsn: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def role_row(server: Service, role: str) -> list[asyncpg.Record]:
    """Everything the server keeps about a role: a password reset or an ALTER shows here."""
    return await fetch(
        server.address,
        "SELECT a.*, s.setconfig FROM pg_authid a"
        " LEFT JOIN pg_db_role_setting s ON s.setrole = a.oid WHERE a.rolname = $1",
        role,
    )


async def users_rows(server: Service) -> list[int]:
    """The user's table, read by the user's role logging in with its password."""
    dsn = role_dsn(with_database(server.address, "assay"), "assay_execute", USERS_PASSWORD)
    return [r[0] for r in await fetch(dsn, "SELECT x FROM mine ORDER BY x")]


@dataclass
class Users:
    """What the user had on the server before any stack."""

    server: Service
    role: list[asyncpg.Record]


@pytest.fixture(scope="module")
def users(own_postgres: Service) -> Users:
    """The module's server, holding a user's own database `assay` (a table with rows) and
    role `assay_execute` with a password that it must give (names an `assay up` used to
    drop and alter)."""
    server = own_postgres.address

    async def seed() -> Path:
        conn = await asyncpg.connect(server)
        try:
            await conn.execute("CREATE DATABASE assay")
            await conn.execute(f"CREATE ROLE assay_execute LOGIN PASSWORD '{USERS_PASSWORD}'")
            hba = Path(await conn.fetchval("SHOW hba_file"))
        finally:
            await conn.close()
        db = await asyncpg.connect(with_database(server, "assay"))
        try:
            await db.execute("CREATE TABLE mine (x int); INSERT INTO mine VALUES (1), (2), (3)")
            await db.execute("GRANT SELECT ON mine TO assay_execute")
        finally:
            await db.close()
        return hba

    async def check() -> Users:
        await fetch(server, "SELECT pg_reload_conf()")
        wrong = role_dsn(with_database(server, "assay"), "assay_execute", "not-the-password")
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(wrong)  # the password is really asked for
        assert await users_rows(own_postgres) == [1, 2, 3]
        return Users(own_postgres, await role_row(own_postgres, "assay_execute"))

    hba = asyncio.run(seed())
    # The cluster trusts every login; this role must give its password.
    hba.write_text("host all assay_execute 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
    return asyncio.run(check())


async def assert_users_objects_untouched(users: Users) -> None:
    assert await users_rows(users.server) == [1, 2, 3]
    assert await role_row(users.server, "assay_execute") == users.role


def assay(
    *args: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ASSAY, *args], env=env, capture_output=True, text=True, timeout=timeout)


@dataclass
class Stack:
    workdir: Path
    env: dict[str, str]
    state: dict[str, Any]

    @property
    def database(self) -> str:
        return str(self.state["postgres"]["database"])


@pytest.fixture(scope="module")
def stack(users: Users, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`assay up` on the module's server (borrowed: `ASSAY_TEST_DATABASE_URL`)."""
    workdir = tmp_path_factory.mktemp("stack")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSAY_")}
    env.update({"ASSAY_TEST_DATABASE_URL": users.server.address, "ASSAY_PARTITIONS": "2"})
    up = assay("up", "--dir", str(workdir), env=env, timeout=240)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield Stack(workdir, env, json.loads((workdir / "stack.json").read_text()))
    finally:
        assay("down", "--purge", "--dir", str(workdir), env=env)


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.s3
@pytest.mark.timeout(300)
async def test_up_on_a_server_it_did_not_start_leaves_the_users_database_and_role_alone(
    users: Users, stack: Stack
) -> None:
    stack_id = stack.state["stack"]
    assert stack.database == f"assay_{stack_id}"
    assert stack.state["postgres"]["roles"] == {s: f"assay_{stack_id}_{s}" for s in STAGE_ROLES}
    await assert_users_objects_untouched(users)
    owners = await fetch(
        with_database(users.server.address, stack.database),
        "SELECT nspname, pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = ANY($1)",
        list(STAGE_ROLES),
    )
    assert dict((r[0], r[1]) for r in owners) == stack.state["postgres"]["roles"]
    owned = load_objects(stack.workdir)
    assert (owned.stack, owned.database) == (stack_id, stack.database)
    assert sorted(owned.roles) == sorted(stack.state["postgres"]["roles"].values())


async def wait_for_allocation(dsn: str, tenant: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not await fetch(
        dsn,
        "SELECT 1 FROM ingest.state WHERE tenant = $1 AND kind = 'allocation'",
        uuid.UUID(tenant),
    ):
        assert time.monotonic() < deadline, "the workflow never reached ingest"
        await asyncio.sleep(0.1)


def run_tasks(stack: Stack, tenant: str, count: int, timeout_s: float = 90) -> None:
    """Register the arithmetic workflow for `tenant`, submit `count` tasks, and return
    once each has its result."""
    env = {**stack.env, "ASSAY_KAFKA_BOOTSTRAP": stack.state["settings"]["ASSAY_KAFKA_BOOTSTRAP"]}
    workflow = str(ROOT / "examples/workflows/arith-v1.yaml")
    registered = assay("register", workflow, "--tenant", tenant, env=env)
    assert registered.returncode == 0, registered.stderr
    admin = with_database(stack.env["ASSAY_TEST_DATABASE_URL"], stack.database)
    asyncio.run(wait_for_allocation(admin, tenant))
    tasks = stack.workdir / f"tasks-{tenant}.jsonl"
    tasks.write_text(
        "".join(
            json.dumps(
                {
                    "idempotency_key": f"k{i}",
                    "input": {"question": f"{i} + 1", "answer": str(i + 1)},
                }
            )
            + "\n"
            for i in range(count)
        )
    )
    submitted = assay("submit", str(tasks), "--tenant", tenant, "--workflow", "arith", env=env)
    assert submitted.returncode == 0, submitted.stderr
    deadline = time.monotonic() + timeout_s
    while True:  # each `assay results` reads the topic to its end: it paces the loop
        results = assay("results", "--tenant", tenant, env=env)
        assert results.returncode == 0, results.stderr
        if len(results.stdout.splitlines()) >= count:
            return
        assert time.monotonic() < deadline, f"results: {results.stdout}"


def rebuild_check(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return assay("rebuild", "--check", *args, env=env)


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.s3
@pytest.mark.timeout(300)
def test_rebuild_check_passes_after_a_run_and_names_a_tampered_document(stack: Stack) -> None:
    tenant = str(uuid.uuid4())
    run_tasks(stack, tenant, 3)
    admin = with_database(stack.env["ASSAY_TEST_DATABASE_URL"], stack.database)

    check = rebuild_check("--database-url", admin, env=stack.env)

    assert check.returncode == 0, check.stdout + check.stderr
    lines = check.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(STAGES)
    assert all(line.endswith("identical") for line in lines), check.stdout

    (t, kind, key, value) = asyncio.run(
        fetch(
            admin,
            "SELECT tenant, kind, key, value FROM verify.state"
            " WHERE tenant = $1 AND value IS NOT NULL ORDER BY kind, key LIMIT 1",
            uuid.UUID(tenant),
        )
    )[0]
    tampered = value + b" "
    update = "UPDATE verify.state SET value = $4 WHERE tenant = $1 AND kind = $2 AND key = $3"
    asyncio.run(fetch(admin, update, t, kind, key, tampered))
    try:
        check = rebuild_check("--database-url", admin, env=stack.env)

        assert check.returncode == 1, check.stdout + check.stderr
        assert f"    {tenant}/{kind}/{key}: differs" in check.stdout.splitlines()
        verify = next(line for line in check.stdout.splitlines() if line.startswith("verify"))
        assert verify.endswith("1 difference(s)")
        others = [line for line in check.stdout.splitlines() if line.split()[0] in STAGES]
        assert sum(line.endswith("identical") for line in others) == len(STAGES) - 1
        stored = asyncio.run(
            fetch(
                admin,
                "SELECT value FROM verify.state WHERE tenant = $1 AND kind = $2 AND key = $3",
                t,
                kind,
                key,
            )
        )
        assert stored[0][0] == tampered, "the check changed the state it checked"
    finally:
        asyncio.run(fetch(admin, update, t, kind, key, value))


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.s3
@pytest.mark.timeout(300)
def test_rebuild_check_with_a_role_that_reads_one_stage_checks_it_alone(
    users: Users, stack: Stack
) -> None:
    """A role that may only read the verify schema (no write, so no lock either) checks
    verify from `ASSAY_DATABASE_URL` and names every other stage as skipped."""
    reader = f"reader_{uuid.uuid4().hex[:8]}"
    admin = with_database(users.server.address, stack.database)
    for sql in (
        f"CREATE ROLE {reader} LOGIN",
        f"GRANT USAGE ON SCHEMA verify TO {reader}",
        f"GRANT SELECT ON verify.log, verify.state TO {reader}",
    ):
        asyncio.run(fetch(admin, sql))
    env = {**stack.env, "ASSAY_DATABASE_URL": role_dsn(admin, reader, "")}

    check = rebuild_check(env=env)

    assert check.returncode == 0, check.stdout + check.stderr
    lines = dict(line.split(None, 1) for line in check.stdout.splitlines())
    assert set(lines) == set(STAGES)
    assert lines["verify"].endswith("identical")
    assert all(lines[s].startswith(f"skipped: role {reader}") for s in STAGES if s != "verify")

    named = rebuild_check("--stage", "ingest", env=env)

    assert named.returncode == 2
    assert f"role {reader} may not read the ingest schema" in named.stderr


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.s3
@pytest.mark.timeout(300)
async def test_down_purge_stops_the_stack_and_drops_only_what_it_created(
    users: Users, stack: Stack
) -> None:
    recorded = [
        ProcessIdentity.from_json(info["process"])
        for group in ("stages", "infra")
        for info in stack.state[group].values()
        if info["pid"] is not None
    ]
    assert len(recorded) >= len(STAGES) + 2  # the stages, the broker, the S3 server
    roles = sorted(stack.state["postgres"]["roles"].values())
    server = users.server.address
    granted = f"granted_{uuid.uuid4().hex[:8]}"  # a role of the user's, with a grant there
    await fetch(server, f"CREATE ROLE {granted}")
    await fetch(with_database(server, stack.database), f"GRANT USAGE ON SCHEMA verify TO {granted}")

    down = await asyncio.to_thread(
        assay, "down", "--purge", "--dir", str(stack.workdir), env=stack.env
    )

    assert down.returncode == 0, down.stdout + down.stderr
    assert f"dropped database {stack.database}" in down.stdout
    assert all(f"dropped role {role}" in down.stdout for role in roles)
    assert [p for p in recorded if identify(p.pid) == p] == [], "down left processes running"
    assert not (stack.workdir / "stack.json").exists()
    assert not (stack.workdir / OWNED).exists()
    assert not await fetch(server, "SELECT 1 FROM pg_database WHERE datname = $1", stack.database)
    left = await fetch(server, "SELECT rolname FROM pg_roles WHERE rolname = ANY($1)", roles)
    assert left == []
    await assert_users_objects_untouched(users)
    assert await fetch(server, "SELECT 1 FROM pg_roles WHERE rolname = $1", granted), (
        "a role the stack did not create was dropped"
    )


# -- claiming names, without a deployment ------------------------------------------


async def test_claim_refuses_a_database_or_role_it_did_not_create(
    users: Users, tmp_path: Path
) -> None:
    server = users.server.address
    objects = StackObjects(new_stack_id())
    name = objects.database_name
    theirs = objects.role("verify")
    await fetch(server, f"CREATE DATABASE {name}")
    with pytest.raises(StackConflict, match=f"database {name} already exists.*another --dir"):
        await claim(server, tmp_path, objects, STAGES)
    assert await fetch(server, "SELECT 1 FROM pg_database WHERE datname = $1", name)
    assert load_objects(tmp_path).is_empty()

    await fetch(server, f"DROP DATABASE {name}")
    await fetch(server, f"CREATE ROLE {theirs} LOGIN PASSWORD 'theirs'")
    before = await role_row(users.server, theirs)
    try:
        with pytest.raises(StackConflict, match=f"role {theirs} already exists"):
            await claim(server, tmp_path, objects, STAGES)
        assert await role_row(users.server, theirs) == before
        made = load_objects(tmp_path)
        assert made.database == name
        assert made.roles == [objects.role("ingest"), objects.role("execute")]

        report = await purge(tmp_path)

        assert report.dropped == [f"database {name}", *(f"role {r}" for r in made.roles)]
        assert report.kept == []
        assert await role_row(users.server, theirs) == before
        assert not (tmp_path / OWNED).exists()
    finally:
        await fetch(server, f"DROP ROLE IF EXISTS {theirs}")


async def test_claim_refuses_when_the_stacks_objects_are_on_another_server(
    users: Users, tmp_path: Path
) -> None:
    objects = StackObjects(new_stack_id())
    elsewhere = StackObjects(
        objects.stack, "postgresql://postgres@192.0.2.1:5433/postgres", objects.database_name
    )
    (tmp_path / OWNED).write_text(json.dumps(elsewhere.__dict__))
    with pytest.raises(StackConflict, match=r"192\.0\.2\.1:5433.*assay down --purge"):
        await claim(users.server.address, tmp_path, load_objects(tmp_path), STAGES)
    assert not await fetch(
        users.server.address, "SELECT 1 FROM pg_database WHERE datname = $1", objects.database_name
    )
