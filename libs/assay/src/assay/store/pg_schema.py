"""The Postgres event log's schema: versioned, idempotent migrations (§7, §8.3).

A stage owns one schema. Its tables mirror the SQLite adapter's; the commit of
§8.3 is one statement (`pg_batch_sql`) or, for a group of commits, one call of
the server-side function `assay_commit`: one round trip either way. Migrations
are an ordered list of SQL texts with `{s}` (the quoted schema) and `{channel}`
(the outbox notification channel) to fill in; version n is the n-th text. Each
applied version is recorded in `<schema>.assay_migrations` in the same
transaction that applies it, under a transaction-scoped advisory lock, so
replicas starting together apply each version exactly once.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from assay.record.state import DocumentTable
from assay.store.pg_spend import SPEND_MIGRATION

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,47}$")

DUPLICATE_MESSAGE = "AS001"
"""SQLSTATE `assay_commit` raises when a batch's inbox id was committed before."""
STALE_GUESS = "AS002"
"""SQLSTATE for a patch whose base document changed since the writer read it."""
STALE_FENCE = "AS003"
"""SQLSTATE for a fenced commit whose lease was taken over."""


class Outcome:
    """Per-batch outcomes `assay_commit` returns for a group of batches."""

    COMMITTED = 0
    DUPLICATE = 1
    STALE = 2
    FAILED = 3
    SKIPPED = 4  # an earlier batch it built on failed; it was not attempted
    STALE_FENCE = 5  # its lease was taken over: it wrote nothing, and is not tried again


_TABLES = """
CREATE TABLE {s}.log (
    seq bigserial NOT NULL,
    tenant uuid NOT NULL,
    stream text COLLATE "C" NOT NULL,
    branch integer NOT NULL,
    lsn bigint NOT NULL,
    type text NOT NULL,
    schema_version integer NOT NULL,
    at_ms bigint NOT NULL,
    payload bytea NOT NULL,
    PRIMARY KEY (tenant, stream, branch, lsn)
);
CREATE TABLE {s}.state (
    tenant uuid NOT NULL,
    kind text COLLATE "C" NOT NULL,
    key text COLLATE "C" NOT NULL,
    value bytea,  -- NULL: deleted (a tombstone; see the commit protocol below)
    PRIMARY KEY (tenant, kind, key)
);
CREATE TABLE {s}.positions (
    topic text COLLATE "C" NOT NULL,
    partition integer NOT NULL,
    next_offset bigint NOT NULL,
    PRIMARY KEY (topic, partition)
);
CREATE TABLE {s}.inbox (
    tenant uuid NOT NULL,
    message_id text COLLATE "C" NOT NULL,
    PRIMARY KEY (tenant, message_id)
);
CREATE TABLE {s}.outbox (
    seq bigserial PRIMARY KEY,
    topic text NOT NULL,
    key text NOT NULL,
    value bytea NOT NULL,
    headers bytea NOT NULL
);
CREATE TABLE {s}.checkpoints (
    tenant uuid NOT NULL,
    stream text COLLATE "C" NOT NULL,
    branch integer NOT NULL,
    upto bigint NOT NULL,
    state bytea NOT NULL,
    PRIMARY KEY (tenant, stream, branch, upto)
);
"""

# The commit protocol. The fold ran in the client, which also assigned the LSNs
# and computed each document's canonical bytes; the server only checks and writes.
# State rows: op 0 puts (a NULL value deletes), op 2 puts only if the document
# still holds `expected` (NULL: absent) — the base a patch was merged onto.
#
# Replicas may write the same document at once; `rebuild` re-folds in `seq`
# order, so a transaction must take its log rows' `seq` only after it holds the
# rows of the documents it writes. Hence: state before log, and a delete is an
# upsert to NULL (a tombstone), so that even deleting an absent document waits for
# a concurrent insert of it. Whoever writes a document second takes a higher seq.
#
# `assay_commit` takes a group of batches, each under a savepoint; a batch
# committed alone takes the faster single statement of `pg_batch_sql`, which
# ends with `assay_check`.
_COMMIT = """
CREATE TYPE {s}.commit_batch AS (
    inbox_tenant uuid, inbox_id text, pos_topic text, pos_partition integer, pos_offset bigint,
    n_log integer, n_state integer, n_out integer, deps integer[], follows integer[]
);
CREATE TYPE {s}.log_row AS (
    tenant uuid, stream text, branch integer, lsn bigint, type text, schema_version integer,
    at_ms bigint, payload bytea
);
CREATE TYPE {s}.state_row AS (
    op smallint, tenant uuid, kind text, key text, value bytea, expected bytea
);
CREATE TYPE {s}.outbox_row AS (topic text, key text, value bytea, headers bytea);

CREATE FUNCTION {s}.assay_check(inbox_ok boolean, patches_ok boolean, notify boolean)
RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
    IF NOT inbox_ok THEN
        RAISE EXCEPTION 'the message was already handled' USING ERRCODE = 'AS001';
    END IF;
    IF NOT patches_ok THEN
        RAISE EXCEPTION 'a patched document changed' USING ERRCODE = 'AS002';
    END IF;
    IF notify THEN
        PERFORM pg_notify('{channel}', '');
    END IF;
END
$fn$;

CREATE FUNCTION {s}.assay_apply(
    b {s}.commit_batch, logs {s}.log_row[], states {s}.state_row[], outs {s}.outbox_row[]
) RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
    r {s}.state_row;
BEGIN
    IF b.inbox_id IS NOT NULL THEN
        INSERT INTO {s}.inbox VALUES (b.inbox_tenant, b.inbox_id) ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'message % was already handled', b.inbox_id USING ERRCODE = 'AS001';
        END IF;
    END IF;
    FOREACH r IN ARRAY states LOOP
        IF r.op <> 2 THEN
            INSERT INTO {s}.state VALUES (r.tenant, r.kind, r.key, r.value)
            ON CONFLICT (tenant, kind, key) DO UPDATE SET value = excluded.value;
        ELSIF r.expected IS NULL THEN
            INSERT INTO {s}.state VALUES (r.tenant, r.kind, r.key, r.value)
            ON CONFLICT (tenant, kind, key) DO UPDATE SET value = excluded.value
            WHERE {s}.state.value IS NULL;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'document %/% appeared', r.kind, r.key USING ERRCODE = 'AS002';
            END IF;
        ELSE
            UPDATE {s}.state SET value = r.value
            WHERE tenant = r.tenant AND kind = r.kind AND key = r.key AND value = r.expected;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'document %/% changed', r.kind, r.key USING ERRCODE = 'AS002';
            END IF;
        END IF;
    END LOOP;
    IF cardinality(logs) > 0 THEN
        INSERT INTO {s}.log (tenant, stream, branch, lsn, type, schema_version, at_ms, payload)
        SELECT * FROM unnest(logs);
    END IF;
    IF b.pos_topic IS NOT NULL THEN
        INSERT INTO {s}.positions VALUES (b.pos_topic, b.pos_partition, b.pos_offset)
        ON CONFLICT (topic, partition) DO UPDATE SET next_offset = excluded.next_offset;
    END IF;
    IF cardinality(outs) > 0 THEN
        INSERT INTO {s}.outbox (topic, key, value, headers) SELECT * FROM unnest(outs);
    END IF;
END
$fn$;

CREATE FUNCTION {s}.assay_commit(
    batches {s}.commit_batch[], logs {s}.log_row[], states {s}.state_row[], outs {s}.outbox_row[]
) RETURNS smallint[] LANGUAGE plpgsql AS $fn$
DECLARE
    b {s}.commit_batch;
    i integer := 0;
    li integer := 1;
    si integer := 1;
    oi integer := 1;
    outcome smallint[] := '{{}}';
    failed integer[] := '{{}}';   -- batches that wrote nothing
    again integer[] := '{{}}';    -- batches that will be tried again
    notify boolean := false;
BEGIN
    IF cardinality(batches) = 1 THEN
        -- One batch: no savepoint; any error aborts the whole statement.
        PERFORM {s}.assay_apply(batches[1], logs, states, outs);
        IF cardinality(outs) > 0 THEN
            PERFORM pg_notify('{channel}', '');
        END IF;
        RETURN NULL;
    END IF;
    FOREACH b IN ARRAY batches LOOP
        i := i + 1;
        -- Not attempted: it was computed on what a failed batch would have written,
        -- or it must land after a batch that will be tried again.
        IF b.deps && failed OR b.follows && again THEN
            outcome := outcome || 4::smallint;
            failed := failed || i;
            again := again || i;
        ELSE
            BEGIN  -- a savepoint per batch: a failing batch never takes the others down
                PERFORM {s}.assay_apply(
                    b, logs[li:li + b.n_log - 1], states[si:si + b.n_state - 1],
                    outs[oi:oi + b.n_out - 1]);
                outcome := outcome || 0::smallint;
                notify := notify OR b.n_out > 0;
            EXCEPTION
                WHEN SQLSTATE 'AS001' THEN
                    outcome := outcome || 1::smallint;
                    failed := failed || i;
                WHEN unique_violation OR SQLSTATE 'AS002' THEN
                    outcome := outcome || 2::smallint;
                    failed := failed || i;
                    again := again || i;
                WHEN OTHERS THEN
                    outcome := outcome || 3::smallint;
                    failed := failed || i;
                    again := again || i;
            END;
        END IF;
        li := li + b.n_log;
        si := si + b.n_state;
        oi := oi + b.n_out;
    END LOOP;
    IF notify THEN
        PERFORM pg_notify('{channel}', '');
    END IF;
    RETURN outcome;
END
$fn$;
"""

# Leases (§9.4): one row per leased stream; `fence` only ever grows. A fenced
# commit reads its lease row FOR SHARE in the commit's own statement, so a claim
# that bumps the fence either commits first (the write is refused) or waits for
# the write to land (the new holder reads it).
_LEASES = """
CREATE TABLE {s}.leases (
    tenant uuid NOT NULL, stream text NOT NULL, holder text, fence bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (tenant, stream)
);

CREATE FUNCTION {s}.assay_fenced(ok boolean) RETURNS boolean LANGUAGE plpgsql AS $fn$
BEGIN
    IF NOT ok THEN
        RAISE EXCEPTION 'stale fence: the run was taken over' USING ERRCODE = 'AS003';
    END IF;
    RETURN true;
END
$fn$;
"""

# Fenced batches in a group (§9.4): `assay_commit_fenced` is `assay_commit` with one
# fence per batch (a NULL tenant: none). Inside its batch's savepoint, before any
# write, a fenced batch reads its lease row FOR SHARE at its fence (the lock is kept
# to the end of the transaction, as the single statement keeps it); a stale fence
# refuses that batch alone (`5`), and the batches built on it are not attempted.
_FENCED_GROUPS = """
CREATE TYPE {s}.fence_row AS (tenant uuid, stream text, fence bigint);

CREATE FUNCTION {s}.assay_commit_fenced(
    batches {s}.commit_batch[], logs {s}.log_row[], states {s}.state_row[],
    outs {s}.outbox_row[], fences {s}.fence_row[]
) RETURNS smallint[] LANGUAGE plpgsql AS $fn$
DECLARE
    b {s}.commit_batch;
    f {s}.fence_row;
    i integer := 0;
    li integer := 1;
    si integer := 1;
    oi integer := 1;
    outcome smallint[] := '{{}}';
    failed integer[] := '{{}}';   -- batches that wrote nothing
    again integer[] := '{{}}';    -- batches that will be tried again
    notify boolean := false;
BEGIN
    FOREACH b IN ARRAY batches LOOP
        i := i + 1;
        f := fences[i];
        IF b.deps && failed OR b.follows && again THEN
            outcome := outcome || 4::smallint;
            failed := failed || i;
            again := again || i;
        ELSE
            BEGIN  -- a savepoint per batch: a failing batch never takes the others down
                IF f.tenant IS NOT NULL THEN
                    PERFORM FROM {s}.leases
                    WHERE tenant = f.tenant AND stream = f.stream AND fence = f.fence
                    FOR SHARE;
                    IF NOT FOUND THEN
                        RAISE EXCEPTION 'stale fence: the run was taken over'
                            USING ERRCODE = 'AS003';
                    END IF;
                END IF;
                PERFORM {s}.assay_apply(
                    b, logs[li:li + b.n_log - 1], states[si:si + b.n_state - 1],
                    outs[oi:oi + b.n_out - 1]);
                outcome := outcome || 0::smallint;
                notify := notify OR b.n_out > 0;
            EXCEPTION
                WHEN SQLSTATE 'AS001' THEN
                    outcome := outcome || 1::smallint;
                    failed := failed || i;
                WHEN SQLSTATE 'AS003' THEN
                    outcome := outcome || 5::smallint;
                    failed := failed || i;
                WHEN unique_violation OR SQLSTATE 'AS002' THEN
                    outcome := outcome || 2::smallint;
                    failed := failed || i;
                    again := again || i;
                WHEN OTHERS THEN
                    outcome := outcome || 3::smallint;
                    failed := failed || i;
                    again := again || i;
            END;
        END IF;
        li := li + b.n_log;
        si := si + b.n_state;
        oi := oi + b.n_out;
    END LOOP;
    IF notify THEN
        PERFORM pg_notify('{channel}', '');
    END IF;
    RETURN outcome;
END
$fn$;
"""

# Retention (`assay.runtime.retention`): when each inbox entry was committed, so that
# entries older than any redelivery can be pruned. Rows of before take the migration's
# time; a commit's insert names two values and takes the server clock for the third.
_INBOX_TIME = """
ALTER TABLE {s}.inbox ADD COLUMN at_ms bigint NOT NULL
    DEFAULT (extract(epoch FROM clock_timestamp()) * 1000)::bigint;
"""

# Retention: the tombstones a deleting commit leaves in `state` (see the commit protocol
# above) are pruned by `reclaim_space`; this index finds them without a scan of `state`.
_TOMBSTONES = """
CREATE INDEX state_tombstones ON {s}.state (tenant) WHERE value IS NULL;
"""

MIGRATIONS: tuple[str, ...] = (
    _TABLES,
    _COMMIT,
    _LEASES,
    _FENCED_GROUPS,
    _INBOX_TIME,
    _TOMBSTONES,
    SPEND_MIGRATION,
)
"""The event log's migrations, in order: version n is `MIGRATIONS[n - 1]`."""


def checked_schema(schema: str) -> str:
    """`schema` if it is a plain lower-case identifier of at most 48 characters that
    does not start with `pg_` (reserved by Postgres).

    Raises:
        ValueError: anything else (it is spliced into SQL and a channel name).
    """
    if not _SCHEMA_NAME.match(schema) or schema.startswith("pg_"):
        raise ValueError(f"not a plain schema name (a-z, 0-9, _; at most 48): {schema!r}")
    return schema


def quoted(schema: str) -> str:
    """The schema as a quoted SQL identifier."""
    return f'"{checked_schema(schema)}"'


def outbox_channel(schema: str) -> str:
    """The channel `assay_commit` notifies after a commit that added outbox rows."""
    return f"{checked_schema(schema)}_outbox"


def lock_key(purpose: str, schema: str) -> int:
    """A stable 64-bit advisory-lock key for one purpose on one schema."""
    digest = hashlib.blake2b(f"assay:{purpose}:{schema}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


Connection = asyncpg.Connection | PoolConnectionProxy
"""A connection of its own or one borrowed from a pool: either runs queries."""


async def migrate(
    conn: Connection, schema: str, migrations: Sequence[str] = MIGRATIONS
) -> list[int]:
    """Bring `schema` up to `len(migrations)`; return the versions applied now.

    Creates the schema if it is missing (a provisioned stage role finds its own
    schema already there). Applying the same list again is a no-op. Versions the
    database holds beyond the list are left alone (a newer replica migrated). A
    migration's text is filled in with `str.format` (`{s}`, `{channel}`), so its
    own braces are doubled. Applied versions are never edited: a change is a new
    version.

    Raises:
        asyncpg.PostgresError: a migration failed; none of this call's versions stick.
    """
    s = quoted(schema)
    applied_now: list[int] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key("migrate", schema))
        exists = await conn.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = $1", schema)
        if not exists:
            await conn.execute(f"CREATE SCHEMA {s}")
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.assay_migrations ("
            " version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r[0] for r in await conn.fetch(f"SELECT version FROM {s}.assay_migrations")}
        for version, text in enumerate(migrations, start=1):
            if version in done:
                continue
            await conn.execute(text.format(s=s, channel=outbox_channel(schema)))
            await conn.execute(f"INSERT INTO {s}.assay_migrations (version) VALUES ($1)", version)
            applied_now.append(version)
    return applied_now


_PG_TYPES = {"text": 'text COLLATE "C"', "integer": "bigint", "boolean": "boolean"}
_PG_CAST = {"text": "", "integer": "::bigint", "boolean": "::boolean"}


async def _add_table_columns(conn: Connection, schema: str, t: DocumentTable) -> None:
    """Bring a table a schema of an earlier version made up to `t`: add the columns it
    lacks, filled from the documents (the trigger function, replaced after, writes them
    from then on)."""
    have = {
        r["column_name"]
        for r in await conn.fetch(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = $1 AND table_name = $2",
            schema,
            t.table,
        )
    }
    missing = [c for c in t.columns if c.name not in have]
    if not missing:
        return
    s = quoted(schema)
    adds = ", ".join(f"ADD COLUMN {c.name} {_PG_TYPES[c.sql_type]}" for c in missing)
    await conn.execute(f"ALTER TABLE {s}.{t.table} {adds}")
    sets = ", ".join(
        f"{c.name} = (convert_from(st.value, 'UTF8')::jsonb ->> '{c.name}'){_PG_CAST[c.sql_type]}"
        for c in missing
    )
    await conn.execute(
        f"UPDATE {s}.{t.table} AS t SET {sets} FROM {s}.state AS st"
        f" WHERE st.tenant = t.tenant AND st.kind = '{t.kind}' AND st.key = t.key"
        " AND st.value IS NOT NULL"
    )


async def create_document_tables(
    conn: Connection, schema: str, tables: Sequence[DocumentTable]
) -> None:
    """Create each `DocumentTable` of a stage (idempotent): its table, indexes and the row
    trigger on `state` that keeps it in step inside the writing transaction. A document
    written as a tombstone (`value` NULL) or deleted loses its row.

    Raises:
        asyncpg.PostgresError: the server refused.
    """
    s = quoted(schema)
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key("tables", schema))
        for t in tables:
            cols = ", ".join(f"{c.name} {_PG_TYPES[c.sql_type]}" for c in t.columns)
            names = ", ".join(c.name for c in t.columns)
            values = ", ".join(f"(d ->> '{c.name}'){_PG_CAST[c.sql_type]}" for c in t.columns)
            sets = ", ".join(f"{c.name} = EXCLUDED.{c.name}" for c in t.columns)
            await conn.execute(
                f"CREATE TABLE IF NOT EXISTS {s}.{t.table} (tenant uuid NOT NULL,"
                f' key text COLLATE "C" NOT NULL, {cols}, PRIMARY KEY (tenant, key))'
            )
            await _add_table_columns(conn, schema, t)
            for index in t.indexes:
                await conn.execute(
                    f"CREATE INDEX IF NOT EXISTS {t.table}_by_{'_'.join(index)}"
                    f" ON {s}.{t.table} (tenant, {', '.join(index)}, key)"
                )
            await conn.execute(
                f"""CREATE OR REPLACE FUNCTION {s}.{t.table}_sync() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE d jsonb;
BEGIN
    IF TG_OP <> 'INSERT' THEN
        DELETE FROM {s}.{t.table} WHERE tenant = OLD.tenant AND key = OLD.key;
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.value IS NOT NULL THEN
        d := convert_from(NEW.value, 'UTF8')::jsonb;
        INSERT INTO {s}.{t.table} (tenant, key, {names}) VALUES (NEW.tenant, NEW.key, {values})
        ON CONFLICT (tenant, key) DO UPDATE SET {sets};
    END IF;
    RETURN NULL;
END
$fn$"""
            )
            for name, ops, row in (("put", "INSERT OR UPDATE", "NEW"), ("del", "DELETE", "OLD")):
                await conn.execute(
                    f"CREATE OR REPLACE TRIGGER {t.table}_{name} AFTER {ops} ON {s}.state"
                    f" FOR EACH ROW WHEN ({row}.kind = '{t.kind}')"
                    f" EXECUTE FUNCTION {s}.{t.table}_sync()"
                )
