"""Stage provisioning on Postgres (DESIGN §3): one login role and one schema per stage.

A stage's role owns its schema and nothing else: it cannot read or write another
stage's schema, and nobody may create objects in `public`. The stage's event log,
opened with the role's DSN, migrates its own schema (`pg_schema.migrate`).
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg

from assay.store.pg_schema import checked_schema, lock_key

ROLE_PREFIX = "assay_"
"""Stage roles start with `assay_`; provisioning isolates each from the others."""

_GRANTABLE = (
    "SCHEMA",
    "ALL TABLES IN SCHEMA",
    "ALL SEQUENCES IN SCHEMA",
    "ALL FUNCTIONS IN SCHEMA",
)


def stage_role(stage: str, stack: str | None = None) -> str:
    """The login role of a stage: `assay_<stage>`, or `assay_<stack>_<stage>` for a stage
    of the stack `stack` (roles are the server's, shared by all its databases, so two
    stacks on one server need roles of their own).

    Raises:
        ValueError: `stage` or `stack` is not a plain lower-case identifier.
    """
    if stack is None:
        return f"{ROLE_PREFIX}{checked_schema(stage)}"
    return f"{ROLE_PREFIX}{checked_schema(stack)}_{checked_schema(stage)}"


async def provision_stage(
    admin_dsn: str, stage: str, password: str, *, role: str | None = None
) -> str:
    """Create or update the stage's login role and the schema `<stage>` it owns.

    Idempotent: a second call sets the password again and re-applies the grants.
    Revokes every privilege this role and `PUBLIC` hold on the schemas of other
    stages (those owned by other `assay_*` roles), every privilege other stages'
    roles hold on this one, and `CREATE` on `public` from everyone.

    Args:
        admin_dsn: a superuser (or CREATEROLE and schema-owning) DSN of the database.
        stage: the stage's name, also its schema's (a plain lower-case identifier).
        password: the role's login password.
        role: the login role (default `stage_role(stage)`, `assay_<stage>`); an existing
            role of that name is altered, so a caller that must not touch roles it did
            not make creates the role first (`assay up` does).

    Returns:
        A DSN of the same server and database that logs in as the stage's role.

    Raises:
        ValueError: `stage` is not a plain lower-case identifier, or `role` is not one
            that starts with `assay_` (the prefix stage isolation looks for).
        asyncpg.PostgresError: the admin DSN lacks the privileges to do this.
    """
    schema = checked_schema(stage)
    if role is None:
        role = stage_role(stage)
    elif not role.startswith(ROLE_PREFIX):
        raise ValueError(f"a stage role starts with {ROLE_PREFIX!r}: {role!r}")
    else:
        checked_schema(role)  # a plain identifier, as the stage's own name is
    conn = await asyncpg.connect(admin_dsn)
    try:
        async with conn.transaction():
            # Provisioners running together would race on CREATE ROLE / SCHEMA.
            await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key("provision", "*"))
            exists = await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role)
            await _run(
                conn,
                "%s ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD %L",
                "ALTER" if exists else "CREATE",
                role,
                password,
            )
            owner = await conn.fetchval(
                "SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = $1", schema
            )
            if owner is None:
                await _run(conn, "CREATE SCHEMA %I AUTHORIZATION %I", schema, role)
            elif owner != role:
                await _run(conn, "ALTER SCHEMA %I OWNER TO %I", schema, role)
            await _adopt(conn, schema, role)
            await _run(conn, "REVOKE ALL ON SCHEMA %I FROM PUBLIC", schema)
            database = await conn.fetchval("SELECT current_database()")
            await _run(conn, "GRANT CONNECT ON DATABASE %I TO %I", database, role)
            await _run(conn, "REVOKE CREATE ON SCHEMA public FROM PUBLIC, %I", role)
            others = await conn.fetch(
                "SELECT n.nspname, r.rolname FROM pg_namespace n"
                " JOIN pg_roles r ON r.oid = n.nspowner"
                " WHERE starts_with(r.rolname, $1) AND r.rolname <> $2",
                ROLE_PREFIX,
                role,
            )
            for other_schema, other_role in others:
                for what in _GRANTABLE:
                    await _run(conn, f"REVOKE ALL ON {what} %I FROM PUBLIC, %I", other_schema, role)
                    await _run(conn, f"REVOKE ALL ON {what} %I FROM %I", schema, other_role)
            await _run(conn, "ALTER ROLE %I SET search_path = %I", role, schema)
    finally:
        await conn.close()
    return role_dsn(admin_dsn, role, password)


async def _adopt(conn: asyncpg.Connection, schema: str, role: str) -> None:
    """Hand the role what others made in its schema (say, a log migrated by the admin
    before the stage had a role): tables with their sequences, types, functions."""
    tables = await conn.fetch(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = $1 AND c.relkind IN ('r', 'p', 'v', 'm')"
        " AND pg_get_userbyid(c.relowner) <> $2",
        schema,
        role,
    )
    for (table,) in tables:
        await _run(conn, "ALTER TABLE %I.%I OWNER TO %I", schema, table, role)
    types = await conn.fetch(
        "SELECT t.typname FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace"
        " LEFT JOIN pg_class c ON c.oid = t.typrelid"
        " WHERE n.nspname = $1 AND t.typtype = 'c' AND c.relkind = 'c'"
        " AND pg_get_userbyid(t.typowner) <> $2",
        schema,
        role,
    )
    for (name,) in types:
        await _run(conn, "ALTER TYPE %I.%I OWNER TO %I", schema, name, role)
    functions = await conn.fetch(
        "SELECT p.oid::regprocedure::text FROM pg_proc p"
        " JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = $1 AND pg_get_userbyid(p.proowner) <> $2",
        schema,
        role,
    )
    for (signature,) in functions:  # already quoted and qualified by regprocedure
        await conn.execute(
            await conn.fetchval(
                "SELECT format('ALTER FUNCTION %s OWNER TO %I', $1::text, $2::text)",
                signature,
                role,
            )
        )


def role_dsn(admin_dsn: str, role: str, password: str) -> str:
    """`admin_dsn` with its user and password replaced by `role` and `password`."""
    parts = urlsplit(admin_dsn)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    netloc = f"{quote(role, safe='')}:{quote(password, safe='')}@{host}{port}"
    return urlunsplit(parts._replace(netloc=netloc))


async def _run(conn: asyncpg.Connection, template: str, *args: str) -> None:
    """Execute a utility statement built by the server's `format()`: identifiers with
    `%I` and literals with `%L` are quoted by Postgres itself, never by hand."""
    placeholders = ", ".join(f"${i}::text" for i in range(1, len(args) + 2))
    await conn.execute(await conn.fetchval(f"SELECT format({placeholders})", template, *args))
