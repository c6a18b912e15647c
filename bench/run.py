"""Assay benchmarks: each figure beside its baseline, measured in the same run.

Prints a table and writes `bench/results/latest.json` (flat: figure name -> number;
names are stable across commits). A run of named sections replaces only their figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import asyncpg
from console import console_figures
from engine import engine_figures
from fleet import fleet_figures
from pipeline import pipeline_figures
from soak import soak_figures, soak_pg_figures

from assay.devstack import InfraUnavailable
from assay.devstack.postgres import create_database, drop_database, resolve_postgres
from assay.kernel import TenantId
from assay.record import BranchKey, Event, EventRegistry, LogRecord, Put, StateDelta, StateKey
from assay.store import CommitBatch, SqliteEventLog, connect
from assay.store.postgres import PostgresEventLog

ROOT = Path(__file__).resolve().parents[1]
WARM_UP = 3000
N_TOTAL = WARM_UP + 5000
PAYLOAD = "x" * 160


class Tick(Event):
    """A small event, about the size of an attempt record."""

    type: ClassVar[str] = "Tick"
    version: ClassVar[int] = 1
    n: int
    note: str


def _fold(record: LogRecord) -> list[StateDelta]:
    assert isinstance(record.event, Tick)
    return [Put(StateKey(record.key.tenant, "tick", record.key.stream), {"n": record.event.n})]


async def eventlog_vs_raw(tmp: Path) -> tuple[float, float]:
    """`EventLog.commit` (one event per commit, awaited one after another) and a raw
    sqlite3 loop writing one row of the log's own shape per transaction, the same
    pragmas, the same disk. The two alternate commit by commit, so both see the same
    fsync latency (it drifts on shared disks); both first write past the first WAL
    checkpoint, since steady state reuses the WAL file."""
    log = await SqliteEventLog(tmp / "log.sqlite", EventRegistry([Tick]), _fold).open()
    key = BranchKey.main(TenantId(uuid.uuid4()), "bench")
    raw = connect(tmp / "raw.sqlite")
    raw.execute(
        "CREATE TABLE log (seq INTEGER PRIMARY KEY, tenant TEXT NOT NULL, stream TEXT NOT NULL,"
        " branch INTEGER NOT NULL, lsn INTEGER NOT NULL, type TEXT NOT NULL,"
        " schema_version INTEGER NOT NULL, at_ms INTEGER NOT NULL, payload BLOB NOT NULL,"
        " UNIQUE (tenant, stream, branch, lsn))"
    )
    row = json.dumps({"n": 0, "note": PAYLOAD}).encode()
    tenant = str(uuid.uuid4())
    sql = "INSERT INTO log VALUES (NULL, ?, 'bench', 0, ?, 'Tick', 1, ?, ?)"
    batches = [CommitBatch(records=[(key, Tick(n=i, note=PAYLOAD))]) for i in range(N_TOTAL)]
    ours_s = raw_s = 0.0
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        raw.execute("BEGIN")
        raw.execute(sql, (tenant, i, int(time.time() * 1000), row))
        raw.execute("COMMIT")
        t1 = time.perf_counter()
        await log.commit(batch)
        t2 = time.perf_counter()
        if i >= WARM_UP:
            raw_s += t1 - t0
            ours_s += t2 - t1
    await log.close()
    raw.close()
    n = N_TOTAL - WARM_UP
    return n / ours_s, n / raw_s


PG_WARM_UP = 1000
PG_N_TOTAL = PG_WARM_UP + 4000


async def postgres_eventlog_vs_raw(admin_dsn: str) -> tuple[float, float]:
    """`PostgresEventLog.commit` (one event per commit, awaited one after another) and
    a raw asyncpg loop inserting one row of the log's own shape per transaction (one
    autocommit INSERT: one round trip, one WAL flush), in one fresh database. The two
    alternate commit by commit, so both see the same server and disk."""
    name = f"assay_bench_{uuid.uuid4().hex[:10]}"
    dsn = await create_database(admin_dsn, name)
    try:
        log = await PostgresEventLog(dsn, "bench", EventRegistry([Tick]), _fold).open()
        raw = await asyncpg.connect(dsn)
        await raw.execute(
            "CREATE TABLE raw_log (seq bigserial, tenant uuid NOT NULL, stream text NOT NULL,"
            " branch integer NOT NULL, lsn bigint NOT NULL, type text NOT NULL,"
            " schema_version integer NOT NULL, at_ms bigint NOT NULL, payload bytea NOT NULL,"
            " PRIMARY KEY (tenant, stream, branch, lsn))"
        )
        insert = (
            "INSERT INTO raw_log (tenant, stream, branch, lsn, type, schema_version, at_ms,"
            " payload) VALUES ($1, 'bench', 0, $2, 'Tick', 1, $3, $4)"
        )
        key = BranchKey.main(TenantId(uuid.uuid4()), "bench")
        row = json.dumps({"n": 0, "note": PAYLOAD}).encode()
        tenant = uuid.uuid4()
        batches = [CommitBatch(records=[(key, Tick(n=i, note=PAYLOAD))]) for i in range(PG_N_TOTAL)]
        ours_s = raw_s = 0.0
        try:
            for i, batch in enumerate(batches):
                t0 = time.perf_counter()
                await raw.execute(insert, tenant, i, int(time.time() * 1000), row)
                t1 = time.perf_counter()
                await log.commit(batch)
                t2 = time.perf_counter()
                if i >= PG_WARM_UP:
                    raw_s += t1 - t0
                    ours_s += t2 - t1
        finally:
            await raw.close()
            await log.close()
    finally:
        await drop_database(admin_dsn, name)
    n = PG_N_TOTAL - PG_WARM_UP
    return n / ours_s, n / raw_s


def paired(name: str, unit: str, ours: float, raw: float) -> dict[str, float]:
    """A figure beside its baseline: `<name>.<unit>`, `<name>.raw_per_s`, `<name>.ratio`."""
    return {
        f"{name}.{unit}": round(ours, 1),
        f"{name}.raw_per_s": round(raw, 1),
        f"{name}.ratio": round(ours / raw, 3),
    }


def postgres_figures(workdir: Path) -> dict[str, float]:
    """The Postgres event-log figures, or none when no Postgres can be had here."""
    try:
        server = resolve_postgres(workdir)
    except InfraUnavailable as exc:
        print(f"no Postgres figures: {exc}")
        return {}
    try:
        ours, raw = asyncio.run(postgres_eventlog_vs_raw(server.address))
    finally:
        server.stop()
    return paired("eventlog.postgres", "events_per_s", ours, raw)


RELAY_N = 20_000
RELAY_BATCH = 500  # the relay's default batch
RELAY_WARM_UP = 4  # batches of each side left out of the figures


async def relay_vs_raw(bootstrap: str, tmp: Path) -> tuple[float, float]:
    """`OutboxRelay` shipping committed outbox rows of a `SqliteEventLog` through
    `KafkaTransport`, and a raw aiokafka producer (acks=all, no idempotence: the
    transport's settings) sending the same messages in batches of the relay's size,
    each batch awaited before the next. The two alternate batch by batch, so both
    see the same broker and disk."""
    from aiokafka import AIOKafkaProducer

    from assay.bus import FileLock, KafkaTransport, OutboxRelay, ensure_topics
    from assay.store import OutboxEntry

    ours_topic, raw_topic = (f"bench.relay-{side}.{uuid.uuid4().hex[:8]}" for side in "or")
    await ensure_topics(bootstrap, [ours_topic, raw_topic], partitions=12)

    def rows(topic: str) -> list[OutboxEntry]:
        return [
            OutboxEntry(topic, f"tenant:run-{i % 1000}", PAYLOAD.encode(), (("n", b"%d" % i),))
            for i in range(RELAY_N)
        ]

    def no_fold(record: LogRecord) -> list[StateDelta]:
        return []

    log = await SqliteEventLog(tmp / "relay.sqlite", EventRegistry([]), no_fold).open()
    ours_rows, raw_rows = rows(ours_topic), rows(raw_topic)
    for i in range(0, RELAY_N, RELAY_BATCH):
        await log.commit(CommitBatch(outbox=ours_rows[i : i + RELAY_BATCH]))
    transport = await KafkaTransport(bootstrap, client_id="bench-relay").open()
    relay = OutboxRelay("bench", log, transport, FileLock(tmp / "relay.lock"), RELAY_BATCH)
    raw = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=False)
    await raw.start()
    ours_s = raw_s = 0.0
    try:
        for b, i in enumerate(range(0, RELAY_N, RELAY_BATCH)):
            t0 = time.perf_counter()
            sent = [
                await raw.send(e.topic, e.value, key=e.key.encode(), headers=list(e.headers))
                for e in raw_rows[i : i + RELAY_BATCH]
            ]
            await asyncio.gather(*sent)
            t1 = time.perf_counter()
            shipped = await relay.ship_once()
            t2 = time.perf_counter()
            assert shipped == RELAY_BATCH, shipped
            if b >= RELAY_WARM_UP:
                raw_s += t1 - t0
                ours_s += t2 - t1
        assert await relay.ship_once() == 0
    finally:
        await raw.stop()
        await transport.close()
        await log.close()
    n = RELAY_N - RELAY_WARM_UP * RELAY_BATCH
    return n / ours_s, n / raw_s


def relay_figures(workdir: Path) -> dict[str, float]:
    """The outbox relay over Kafka beside raw aiokafka, or none when no broker can be had."""
    from assay.devstack.kafka import resolve_kafka

    try:
        broker = resolve_kafka(workdir)
    except InfraUnavailable as exc:
        print(f"no relay figures: {exc}")
        return {}
    try:
        ours, raw = asyncio.run(relay_vs_raw(broker.address, workdir))
    finally:
        broker.stop()
    return paired("relay", "msgs_per_s", ours, raw)


def demo_figures(data: Path) -> tuple[float, float]:
    """Runs per second of the embedded demo, and its peak RSS in MB (a child process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "assay"),
            "--data-dir",
            str(data),
            "demo",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    elapsed = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with sqlite3.connect(data / "execute.sqlite") as db:
        runs = db.execute("SELECT COUNT(*) FROM log WHERE type = 'RunFinished'").fetchone()[0]
    assert "PROMOTED v2" in done.stdout, done.stdout
    del before
    return runs / elapsed, peak_kb / 1024


SPRT_WIN_RATES = (0.5, 0.55, 0.6, 0.7)
SPRT_REPS = 20_000
BT_PLAYERS = 100
BT_COMPARISONS = 20_000
BT_REPEATS = 5


# The grading figures import numpy, scipy and choix when they run, after the demo: the
# demo's peak RSS is read from the children's rusage, which a fork of a bigger parent
# would inflate.


def sprt_figures() -> dict[str, float]:
    """The default sequential test's cost at true win rates from p0 to p1, as a share of
    the exact fixed-n binomial test with the same alpha and beta: the exact mean number
    of comparisons to a decision (`sprt.ratio.p<p>`) and a simulation of it
    (`sprt.sim_ratio.p<p>`)."""
    from assay.grading import SprtPolicy, fixed_n, operating_characteristics, simulate

    policy = SprtPolicy()
    baseline = fixed_n(policy.p0, policy.p1, policy.alpha, policy.beta)
    figures: dict[str, float] = {"sprt.fixed_n": baseline}
    for p in SPRT_WIN_RATES:
        exact = operating_characteristics(policy, p)
        sim = simulate(policy, p, SPRT_REPS, seed=int(p * 1000))
        figures[f"sprt.ratio.p{p:g}"] = round(exact.mean_n / baseline, 3)
        figures[f"sprt.sim_ratio.p{p:g}"] = round(sim.mean_n / baseline, 3)
    return figures


def bt_figures() -> dict[str, float]:
    """Bradley-Terry maximum likelihood (prior_precision=0, ties=NONE) beside choix's
    fastest maximum-likelihood routine (`ilsr_pairwise`, alpha=0) on one data set:
    100 players with known strengths, 20,000 simulated comparisons without draws. Each
    side starts from the same list of (winner, loser) comparisons, so ours includes
    aggregating it into pair counts. Median seconds of five runs each, and the largest
    difference between the two fits with both anchored at player 0."""
    import choix
    import numpy as np

    from assay.grading.bt import Ties, count_rows, fit

    rng = np.random.default_rng(20_240_801)
    theta = rng.normal(0.0, 1.0, BT_PLAYERS)
    a = rng.integers(0, BT_PLAYERS, BT_COMPARISONS)
    b = (a + rng.integers(1, BT_PLAYERS, BT_COMPARISONS)) % BT_PLAYERS
    a_won = rng.random(BT_COMPARISONS) < 1 / (1 + np.exp(theta[b] - theta[a]))
    data = list(zip(np.where(a_won, a, b).tolist(), np.where(a_won, b, a).tolist(), strict=True))
    names = [str(i) for i in range(BT_PLAYERS)]

    def ours() -> list[float]:
        rows = ((names[w], names[x], "a") for w, x in data)
        result = fit(count_rows(rows), prior_precision=0, ties=Ties.NONE, players=names)
        return [result.strengths[name].strength for name in names]

    def theirs() -> list[float]:
        params = choix.ilsr_pairwise(BT_PLAYERS, data, alpha=0.0)
        return [float(v - params[0]) for v in params]

    def median_s(run: Callable[[], list[float]]) -> tuple[float, list[float]]:
        times, out = [], []
        for _ in range(BT_REPEATS):
            t0 = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), out

    fit_s, mine = median_s(ours)
    choix_s, reference = median_s(theirs)
    diff = max(abs(x - y) for x, y in zip(mine, reference, strict=True))
    return {
        "bt.fit_s": round(fit_s, 4),
        "bt.choix_s": round(choix_s, 4),
        "bt.max_abs_diff": float(f"{diff:.2e}"),
    }


def engine_section(workdir: Path) -> dict[str, float]:
    """The engine beside DBOS Transact and LangGraph, on SQLite and (with a server) on
    Postgres; commits per step by effect class."""
    try:
        server = resolve_postgres(workdir)
    except InfraUnavailable as exc:
        print(f"no Postgres engine figures: {exc}")
        return engine_figures(workdir, None)
    try:
        return engine_figures(workdir, server.address)
    finally:
        server.stop()


SECTIONS = (
    "eventlog",
    "demo",
    "postgres",
    "relay",
    "engine",
    "pipeline",
    "grading",
    "fleet",
    "soak",
    "soak-pg",
    "console",
)
FIGURES_OF = {
    "eventlog": ("eventlog.sqlite.",),
    "demo": ("demo.",),
    "postgres": ("eventlog.postgres.",),
    "relay": ("relay.",),
    "engine": ("engine.",),
    "pipeline": ("pipeline.",),
    "grading": ("sprt.", "bt."),
    "fleet": ("fleet.",),
    "soak": ("soak.",),
    "soak-pg": ("soak.pg.",),
    "console": ("console.",),
}
"""The names each section's figures start with: `--write` replaces exactly those (a
figure is its longest prefix's: `soak.pg.*` is `soak-pg`'s, not `soak`'s)."""


def section_of(figure: str) -> str | None:
    """The section whose prefix of `figure` is the longest (None: no section's)."""
    owners = [(len(p), s) for s, ps in FIGURES_OF.items() for p in ps if figure.startswith(p)]
    return max(owners)[1] if owners else None


def measure(sections: set[str]) -> dict[str, float]:
    """The figures of the named sections, in the order of `SECTIONS`."""
    figures: dict[str, float] = {}
    tmp = Path(tempfile.mkdtemp(prefix="assay-bench-", dir=ROOT / "bench"))
    try:
        if "eventlog" in sections:
            ours, raw = asyncio.run(eventlog_vs_raw(tmp))
            figures.update(paired("eventlog.sqlite", "events_per_s", ours, raw))
        if "demo" in sections:
            runs_per_s, rss = demo_figures(tmp / "demo")
            figures["demo.runs_per_s"] = round(runs_per_s, 1)
            figures["demo.peak_rss_mb"] = round(rss, 1)
        if "postgres" in sections:
            figures.update(postgres_figures(tmp / "postgres"))
        if "relay" in sections:
            figures.update(relay_figures(tmp / "kafka"))
        if "engine" in sections:
            figures.update(engine_section(tmp / "engine"))
        if "pipeline" in sections:
            figures.update(pipeline_figures(tmp / "pipeline"))
        if "grading" in sections:
            figures.update({**sprt_figures(), **bt_figures()})
        if "fleet" in sections:
            figures.update(fleet_figures(tmp / "fleet"))
        if "soak" in sections:
            figures.update(soak_figures(tmp / "soak"))
        if "soak-pg" in sections:
            figures.update(soak_pg_figures(tmp / "soak-pg"))
        if "console" in sections:
            figures.update(console_figures(tmp / "console"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return figures


def main() -> None:
    """`run.py` measures every section and writes `latest.json`; `run.py pipeline relay`
    measures only those sections and only prints them; `run.py engine --write` measures
    only the engine section and writes its figures into `latest.json`, every other
    section's figures left as the file has them."""
    parser = argparse.ArgumentParser(description="Assay's figures beside their baselines.")
    parser.add_argument("sections", nargs="*", metavar="section", help=", ".join(SECTIONS))
    parser.add_argument(
        "--write",
        action="store_true",
        help="write the named sections' figures into latest.json (the rest stay as they are)",
    )
    args = parser.parse_args()
    chosen = set(args.sections) or set(SECTIONS)
    if unknown := chosen - set(SECTIONS):
        sys.exit(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    figures = measure(chosen)
    targets = {
        "eventlog.sqlite.ratio": ">= 0.8",
        "demo.peak_rss_mb": "<= 300",
        "eventlog.postgres.ratio": ">= 0.7",
        "relay.ratio": ">= 0.8",
        "engine.commits_per_step.pure": "<= 1 (consecutive Pure steps share a commit)",
        "engine.commits_per_step.unsafe": "== 4 (2 + the intent's 2)",
        "engine.peer_ratio.sqlite": ">= 2.0",
        "engine.peer_ratio.postgres": ">= 2.0",
        "pipeline.runs_per_s": ">= 100",
        "pipeline.latency_p50_ms": "<= 50 (paced at half of runs_per_s)",
        "pipeline.latency_p99_ms": "<= 150 (paced at half of runs_per_s)",
        "pipeline.cpu_ms_per_run": "<= 20 (six stages, broker, S3, Postgres backends)",
        "pipeline.stage_cpu_ms_per_run": "<= 8 (six stages)",
        "pipeline.records_per_run": "broker records produced, every topic",
        "pipeline.pg_xacts_per_run": "pg_stat_database (pg_stat_statements not loaded)",
        "pipeline.pg_statements_per_run": "pg_stat_statements",
        "pipeline.s3_requests_per_run": "moto's request log",
        "pipeline.max_stage_rss_mb": "<= 200",
        "sprt.ratio.p0.5": "<= 0.55",
        "sprt.ratio.p0.7": "<= 0.55",
        "bt.fit_s": "<= bt.choix_s",
        "bt.max_abs_diff": "<= 1e-3",
        "fleet.saving_ratio": "~ 1",
        "fleet.overhead_ratio": "~ 1",
        "fleet.wall_s": "<= 90",
        "soak.bytes_growth_last_half": "~ 0, << soak.bytes_growth_first_half",
        "soak.results_missing": "== 0",
        "soak.rebuild_check_ok": "== 1",
        "soak.pg.bytes_growth_last_half": "~ 0, << soak.pg.bytes_growth_first_half",
        "soak.pg.results_missing": "== 0",
        "soak.pg.rebuild_check_ok": "== 1",
        "console.runs_page_p95_ms.sqlite": "<= 100",
        "console.runs_page_p95_ms.postgres": "<= 100",
    }
    width = max(len(k) for k in figures)
    print(f"{'figure':<{width}}  {'value':>10}  target")
    for k, v in figures.items():
        print(f"{k:<{width}}  {v:>10}  {targets.get(k, '')}")
    out = ROOT / "bench" / "results" / "latest.json"
    if chosen == set(SECTIONS):
        written = figures
    elif args.write:
        kept = json.loads(out.read_text()) if out.exists() else {}
        written = {**{k: v for k, v in kept.items() if section_of(k) not in chosen}, **figures}
    else:
        return
    out.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
