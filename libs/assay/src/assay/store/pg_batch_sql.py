"""One batch as one SQL statement: the commit's fast path (§8.3).

A batch committed alone needs no savepoint, so it goes as one statement of
data-modifying CTEs with plain scalar parameters — no arrays, no composite
types, no PL/pgSQL loop — which the server runs noticeably faster than the
general `assay_commit` function. The statement text depends only on the batch's
shape (how many rows of each kind), so each shape is prepared once per
connection and reused. The closing `assay_check` call raises what the function
would raise: `AS001` for a duplicate message, `AS002` for a patch whose base
changed; and it notifies the outbox channel when rows were added.

Every row of one batch touches a distinct document (the client collapsed the
batch's deltas per document), so the CTEs, which all see one snapshot, never
write the same row twice. The log rows are inserted only once the document rows
are written (the insert reads the state CTEs' results): their `seq` must come
after the document locks (`pg_schema`, the commit protocol).
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

PUT, DELETE, PATCH = 0, 1, 2
"""State row ops, as `assay_commit` takes them (`pg_schema`): a delete is a put of NULL."""

_MAX_ROWS = 64
"""A batch with more rows of any kind takes the general function instead."""


class Shape(NamedTuple):
    """How many rows of each kind a batch writes: it decides the statement's text."""

    inbox: bool
    puts: int  # documents put or deleted, whatever was there
    creates: int  # patches of a document that was absent
    updates: int  # patches of a document that held a known value
    logs: int
    position: bool
    outs: int
    fenced: bool = False


def one_batch(
    inbox: tuple[Any, Any] | None,
    logs: list[tuple[Any, ...]],
    states: list[tuple[Any, ...]],
    position: tuple[Any, Any, Any] | None,
    outs: list[tuple[Any, ...]],
    fence: tuple[Any, Any, Any] | None = None,
) -> tuple[Shape, list[Any]] | None:
    """The shape of a batch and its parameters in statement order; None when it is
    too big for the fast path. `fence` is (tenant, stream, fence) of a fenced batch."""
    if len(logs) > _MAX_ROWS or len(states) > _MAX_ROWS or len(outs) > _MAX_ROWS:
        return None
    args: list[Any] = [*fence] if fence is not None else []
    if inbox is not None:
        args += inbox
    creates: list[tuple[Any, ...]] = []
    updates: list[tuple[Any, ...]] = []
    puts = 0
    for op, t, kind, key, value, expected in states:
        if op != PATCH:  # the common case: straight into place
            args += (t, kind, key, value)
            puts += 1
        elif expected is None:
            creates.append((t, kind, key, value))
        else:
            updates.append((t, kind, key, value, expected))
    for row in creates:
        args += row
    for row in updates:
        args += row
    for row in logs:
        args += row
    if position is not None:
        args += position
    for row in outs:
        args += row
    shape = Shape(
        inbox is not None,
        puts,
        len(creates),
        len(updates),
        len(logs),
        position is not None,
        len(outs),
        fence is not None,
    )
    return shape, args


def statement(s: str, shape: Shape) -> str:
    """The SQL text of one batch of `shape` in the quoted schema `s`."""
    n = itertools.count(1)

    def row(*casts: str) -> str:
        return "(" + ", ".join(f"${next(n)}::{c}" for c in casts) + ")"

    def rows(count: int, *casts: str) -> str:
        return ", ".join(row(*casts) for _ in range(count))

    ctes: list[str] = []
    written: list[str] = []  # the state CTEs, which the log insert waits for
    inbox_ok = patches_ok = "true"
    if shape.fenced:
        ctes.append(fence_cte(s, next(n), next(n), next(n)))
    if shape.inbox:
        ctes.append(
            f"ib AS (INSERT INTO {s}.inbox VALUES {row('uuid', 'text')}"
            " ON CONFLICT DO NOTHING RETURNING 1)"
        )
        inbox_ok = "EXISTS (SELECT FROM ib)"
    if shape.puts:
        values = rows(shape.puts, "uuid", "text", "text", "bytea")
        ctes.append(
            f"sp AS (INSERT INTO {s}.state VALUES {values}"
            " ON CONFLICT (tenant, kind, key) DO UPDATE SET value = excluded.value RETURNING 1)"
        )
        written.append("sp")
    if shape.creates:
        values = rows(shape.creates, "uuid", "text", "text", "bytea")
        ctes.append(
            f"sn AS (INSERT INTO {s}.state VALUES {values}"
            " ON CONFLICT (tenant, kind, key) DO UPDATE SET value = excluded.value"
            f" WHERE {s}.state.value IS NULL RETURNING 1)"
        )
        written.append("sn")
    if shape.updates:
        values = rows(shape.updates, "uuid", "text", "text", "bytea", "bytea")
        ctes.append(
            f"su AS (UPDATE {s}.state d SET value = v.value"
            f" FROM (VALUES {values}) AS v(tenant, kind, key, value, expected)"
            " WHERE d.tenant = v.tenant AND d.kind = v.kind AND d.key = v.key"
            " AND d.value = v.expected RETURNING 1)"
        )
        written.append("su")
    if shape.creates or shape.updates:
        counted = " + ".join(f"(SELECT count(*) FROM {cte})" for cte in written if cte != "sp")
        patches_ok = f"{counted} = {shape.creates + shape.updates}"
    if shape.logs:
        values = rows(
            shape.logs, "uuid", "text", "integer", "bigint", "text", "integer", "bigint", "bytea"
        )
        # Joined with the state CTEs' row counts: the rows (and their seq) come after.
        after = "".join(f", (SELECT count(*) FROM {cte}) AS {cte}_n" for cte in written)
        ctes.append(
            f"lg AS (INSERT INTO {s}.log"
            " (tenant, stream, branch, lsn, type, schema_version, at_ms, payload)"
            f" SELECT v.* FROM (VALUES {values}) AS v{after})"
        )
    if shape.position:
        ctes.append(
            f"ps AS (INSERT INTO {s}.positions VALUES {row('text', 'integer', 'bigint')}"
            " ON CONFLICT (topic, partition) DO UPDATE SET next_offset = excluded.next_offset)"
        )
    if shape.outs:
        ctes.append(
            f"ob AS (INSERT INTO {s}.outbox (topic, key, value, headers)"
            f" VALUES {rows(shape.outs, 'text', 'text', 'bytea', 'bytea')})"
        )
    if inbox_ok == patches_ok == "true" and not shape.outs:
        check = "1"  # nothing to check, nobody to wake
    else:
        notify = "true" if shape.outs else "false"
        check = f"{s}.assay_check({inbox_ok}, {patches_ok}, {notify})"
    if shape.fenced:
        check = f"{FENCE_CHECK.format(s=s)}, {check}"
    return f"WITH {', '.join(ctes)} SELECT {check}" if ctes else f"SELECT {check}"


FENCE_CHECK = "{s}.assay_fenced(EXISTS (SELECT FROM fc))"
"""Raises `AS003` unless the `fc` CTE found the batch's lease at its fence."""


def fence_cte(s: str, tenant: int, stream: int, fence: int) -> str:
    """The CTE that share-locks a fenced batch's lease row, if its fence still holds."""
    return (
        f"fc AS (SELECT 1 FROM {s}.leases WHERE tenant = ${tenant}::uuid"
        f" AND stream = ${stream}::text AND fence = ${fence}::bigint FOR SHARE)"
    )
