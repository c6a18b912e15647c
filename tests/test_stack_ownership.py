"""`assay up` on a Postgres server it did not start touches only what it created, and
`assay down --purge` removes only that.

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
    assert stack.state["postgres"]["roles"] == {s: f"assay_{stack_id}_{s}" for s in STAGES}
    await assert_users_objects_untouched(users)
    owners = await fetch(
        with_database(users.server.address, stack.database),
        "SELECT nspname, pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = ANY($1)",
        list(STAGES),
    )
    assert dict((r[0], r[1]) for r in owners) == stack.state["postgres"]["roles"]
    owned = load_objects(stack.workdir)
    assert (owned.stack, owned.database) == (stack_id, stack.database)
    assert sorted(owned.roles) == sorted(stack.state["postgres"]["roles"].values())


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
