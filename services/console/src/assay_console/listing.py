"""`assay runs list`: the console's runs list over a data directory's console store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from assay.kernel.ids import tenant_id
from assay.kernel.schema import one_line
from assay.store.sqlite import SqliteEventLog
from assay_console.reads import BadQuery, ConsoleReads, RunFilters, SqliteRunsTable
from assay_console.stage import CONSOLE_EVENTS, CONSOLE_TABLES, fold_console


async def runs_page(store: Path, tenant: str | None, query: dict[str, str]) -> dict[str, Any]:
    """One page of a tenant's runs (the only tenant's when `tenant` is None), as the API's
    JSON.

    Raises:
        BadQuery: a filter or cursor does not parse, or the tenant is ambiguous.
    """
    log = await SqliteEventLog(store, CONSOLE_EVENTS, fold_console, tables=CONSOLE_TABLES).open()
    reads = ConsoleReads(log, SqliteRunsTable(store))
    try:
        if tenant is None:
            known = await reads.tenants()
            if len(known) != 1:
                raise BadQuery(f"{len(known)} tenants have runs here: name one with --tenant")
            who = known[0]
        else:
            try:
                who = tenant_id(tenant)
            except ValueError as exc:
                raise BadQuery(f"--tenant {tenant!r} is not a UUID") from exc
        paging = {k: query.pop(k) for k in ("cursor", "limit") if k in query}
        try:
            filters = RunFilters.model_validate(query)
        except ValidationError as exc:
            raise BadQuery(one_line(exc)) from exc
        limit = int(paging.get("limit") or 50)
        page = await reads.runs(who, filters, paging.get("cursor"), limit)
        return page.model_dump(mode="json")
    finally:
        await reads.close()
        await log.close()
