"""`assay rebuild`: drop derived state, re-fold it from each stage's log, compare.

Embedded, the stage stores are the data directory's SQLite files. Distributed (a
`--database-url`, else `ASSAY_DATABASE_URL`), only `--check` is offered: each stage's
schema in that database is re-folded in one read-only snapshot — never migrated,
locked or written — and compared with its stored state, exactly as embedded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from assay.engine.models import StubModel
from assay.engine.tools import BUILTIN_TOOLS
from assay.grading.judges import StubJudge
from assay.kernel.errors import AssayError
from assay.runtime.embedded import STAGES, StageMissing, discover_stages, stage_log
from assay.runtime.stage import StageDeps, StageSpec
from assay.store.fs_blobs import FsBlobStore
from assay.store.ports import RebuildReport


class RebuildRefused(AssayError):
    """A rebuild that would change a live deployment's state, or names no known stage."""


def _specs(blobs: Path, names: Sequence[str]) -> dict[str, StageSpec]:
    """The installed stages' specs (their events and folds); nothing is opened."""
    factories = discover_stages()
    missing = [n for n in names if n not in factories]
    if missing:
        raise StageMissing(f"not installed: {', '.join(missing)}")
    deps = StageDeps(
        blobs=FsBlobStore(blobs),  # folds read no blobs: the store is never used
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
    )
    return {name: factories[name](deps) for name in names}


def _wanted(stages: Sequence[str] | None) -> list[str]:
    if stages is None:
        return list(STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise RebuildRefused(f"no such stage: {', '.join(unknown)} (have: {', '.join(STAGES)})")
    return [s for s in STAGES if s in stages]


def _print(name: str, report: RebuildReport) -> bool:
    """One line per stage, then its first differences; whether it was identical."""
    verdict = "identical" if report.identical else f"{len(report.differences)} difference(s)"
    print(
        f"{name:<11} {report.records:>7} records  {report.documents_after:>6} documents  {verdict}"
    )
    for line in report.differences[:10]:
        print(f"    {line}")
    return report.identical


async def rebuild(data_dir: Path, *, check: bool, stages: Sequence[str] | None = None) -> int:
    """Rebuild (or, with `check`, verify) every stage store in `data_dir` (or those of
    `stages`); 1 on a difference.

    Raises:
        AssayError: no stage store in `data_dir`, a named stage has none, or a stage
            is not installed.
    """
    wanted = _wanted(stages)
    found = [s for s in wanted if (data_dir / f"{s}.sqlite").exists()]
    if not found:
        raise AssayError(f"no stage stores in {data_dir}")
    if stages is not None and len(found) < len(wanted):
        absent = ", ".join(s for s in wanted if s not in found)
        raise AssayError(f"no store of {absent} in {data_dir}")
    specs = _specs(data_dir / "blobs", found)
    bad = 0
    for name in found:
        log = await stage_log(data_dir, specs[name]).open()
        try:
            report = await log.rebuild(keep=not check)
        finally:
            await log.close()
        bad += not _print(name, report)
    return 1 if bad else 0


async def check_postgres(
    database_url: str,
    *,
    check: bool,
    stages: Sequence[str] | None = None,
    source: str = "--database-url",
    blobs: Path = Path("blobs"),
) -> int:
    """Verify each stage's schema in the database at `database_url`: re-fold its log
    read-only and compare with its stored state; 1 on a difference.

    Every stage whose schema holds a log is checked; one the URL's role may not read
    (a stage's own role reads its schema alone) is named as skipped. With `stages`,
    exactly those are checked, and one that is missing or unreadable is an error.

    Args:
        check: must be True: rewriting a live deployment's state is refused.
        source: where the URL came from, for messages (its password is never shown).
        blobs: a blob directory the stage specs are built with; never read or written.

    Raises:
        RebuildRefused: `check` is False, or a named stage is unknown.
        AssayError: the database cannot be reached or read, holds no stage log, or a
            named stage's log is missing or unreadable.
    """
    import asyncpg

    from assay.store.postgres import PostgresEventLog

    if not check:
        raise RebuildRefused(
            "a distributed deployment's state is only checked, never rebuilt in place:"
            " run `assay rebuild --check`"
        )
    wanted = _wanted(stages)
    try:
        readable, unreadable, role = await _stage_schemas(database_url, wanted)
    except (OSError, asyncpg.PostgresError) as exc:
        raise AssayError(f"cannot connect to the database of {source}: {exc}") from exc
    if stages is not None:
        absent = [s for s in wanted if s not in readable and s not in unreadable]
        if absent:
            raise AssayError(f"no {', '.join(absent)} log in the database of {source}")
        if unreadable:
            raise AssayError(f"role {role} may not read the {', '.join(unreadable)} schema")
    if not readable:
        raise AssayError(f"no stage log {role} may read in the database of {source}")
    specs = _specs(blobs, readable)
    bad = 0
    for name in wanted:
        if name in unreadable:
            print(f"{name:<11} skipped: role {role} may not read it (an admin URL checks it)")
            continue
        if name not in readable:
            continue
        spec = specs[name]
        log = PostgresEventLog(database_url, name, spec.events, spec.fold, pool_size=1)
        try:
            await log.open(migrate_schema=False)
            try:
                report = await log.rebuild(keep=False)
            finally:
                await log.close()
        except (OSError, asyncpg.PostgresError) as exc:
            raise AssayError(f"cannot check the {name} log: {exc}") from exc
        bad += not _print(name, report)
    return 1 if bad else 0


async def _stage_schemas(dsn: str, wanted: Sequence[str]) -> tuple[list[str], list[str], str]:
    """Stages of `wanted` whose schema holds a log table: those the connecting role may
    read, those it may not, and the role's name. Reads the catalogs only."""
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        role = str(await conn.fetchval("SELECT current_user"))
        rows = await conn.fetch(
            "SELECT n.nspname,"
            " has_schema_privilege(n.oid, 'USAGE') AND has_table_privilege(c.oid, 'SELECT')"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relname = 'log' AND c.relkind IN ('r', 'p') AND n.nspname = ANY($1::text[])",
            list(wanted),
        )
    finally:
        await conn.close()
    may = {str(name): bool(ok) for name, ok in rows}
    readable = [s for s in wanted if may.get(s) is True]
    unreadable = [s for s in wanted if may.get(s) is False]
    return readable, unreadable, role
