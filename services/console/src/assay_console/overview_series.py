"""The overview over time: per tenant, bucket by bucket, tasks in, results out, pass
rate, throughput and end-to-end latency (p50, p95), and their charts.

Each figure is read from the `console_runs` table (`RUNS_TABLE`) in two queries, each
one index range of the tenant: runs by creation (their ids are ULIDs, so a key range
is a time range) for tasks in and the pass rate; runs by result time (the
`result_ms, created_ms` index) for results out, throughput and latency, whose
percentiles are ranked inside the database, so only two rows a bucket come back.

A bucket's pass rate is of the runs created in it (passed over verified); its results,
throughput and latency are of the results received in it. Latency is result time minus
creation time, nearest-rank percentiles. A result recorded before the console noted its
time (`ResultSeen` v1) counts in the totals but in no bucket.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from assay.kernel.ids import TenantId, new_run_id
from assay_console.charts import TimeChart, time_chart
from assay_console.reads import BadQuery, RunsTable

MINUTE, HOUR, DAY = 60_000, 3_600_000, 86_400_000
WINDOWS = {"1h": HOUR, "6h": 6 * HOUR, "24h": DAY, "7d": 7 * DAY, "30d": 30 * DAY}
"""The spans the overview shows, by name."""
BUCKETS = {"1m": MINUTE, "5m": 5 * MINUTE, "15m": 15 * MINUTE, "1h": HOUR, "1d": DAY}
"""The bucket sizes, by name."""
DEFAULT_BUCKET = {"1h": "1m", "6h": "5m", "24h": "1h", "7d": "1h", "30d": "1d"}
"""Each window's bucket when none is asked for."""
DEFAULT_WINDOW = "24h"
MAX_BUCKETS = 500
PARAMETERS = frozenset({"tenant", "window", "bucket", "end"})


class SeriesBucket(BaseModel):
    """One bucket of a tenant's overview over time."""

    start: datetime = Field(description="Start of the bucket (UTC).")
    tasks_in: int = Field(description="Runs created in the bucket.")
    results_out: int = Field(description="Results received in the bucket.")
    passed: int = Field(description="Runs created in the bucket that passed verification.")
    verified: int = Field(description="Runs created in the bucket that were verified.")
    pass_rate: float | None = Field(description="`passed` over `verified`; None: none verified.")
    throughput_per_s: float = Field(
        description="Results per second over the bucket (the part of it before `end`)."
    )
    latency_p50_ms: int | None = Field(
        description="Median of result time minus creation time of the bucket's results, ms "
        "(nearest rank); None: no result."
    )
    latency_p95_ms: int | None = Field(
        description="95th percentile of the same (nearest rank); None: no result."
    )


class OverviewSeries(BaseModel):
    """A tenant's overview over time: every bucket of the window, oldest first."""

    tenant: TenantId = Field(description="The tenant.")
    window: str = Field(description="The span shown: 1h, 6h, 24h, 7d or 30d.")
    bucket: str = Field(description="Bucket size: 1m, 5m, 15m, 1h or 1d (UTC-aligned).")
    since: datetime = Field(description="Start of the first bucket.")
    end: datetime = Field(description="End of the span (now unless asked); exclusive.")
    buckets: list[SeriesBucket] = Field(description="Every bucket, empty ones included.")


@dataclass(frozen=True)
class SeriesQuery:
    """What to show: the window and bucket names, and the span's end (ms)."""

    window: str
    bucket: str
    end_ms: int

    @property
    def width(self) -> int:
        """The bucket's width in ms."""
        return BUCKETS[self.bucket]

    @property
    def count(self) -> int:
        """How many buckets the window holds."""
        return WINDOWS[self.window] // self.width

    @property
    def since_ms(self) -> int:
        """Start of the first bucket: buckets are aligned on the epoch, the last holds `end`."""
        return (self.end_ms // self.width - self.count + 1) * self.width


def series_query(params: Mapping[str, str], now: datetime) -> SeriesQuery:
    """The window, bucket and end asked for (`window`, `bucket`, `end`; defaults: the last
    24 hours by hour, up to `now`).

    Raises:
        BadQuery: an unknown parameter or value, or a bucket that does not fit the window.
    """
    unknown = sorted(set(params) - PARAMETERS)
    if unknown:
        raise BadQuery(f"unknown parameter: {', '.join(unknown)}")
    window = params.get("window") or DEFAULT_WINDOW
    if window not in WINDOWS:
        raise BadQuery(f"window: {window!r} is not one of {', '.join(WINDOWS)}")
    bucket = params.get("bucket") or DEFAULT_BUCKET[window]
    if bucket not in BUCKETS:
        raise BadQuery(f"bucket: {bucket!r} is not one of {', '.join(BUCKETS)}")
    count = WINDOWS[window] // BUCKETS[bucket]
    if count < 1:
        raise BadQuery(f"bucket: {bucket} is longer than the window {window}")
    if count > MAX_BUCKETS:
        raise BadQuery(
            f"bucket: {bucket} makes {count} buckets of the window {window}; at most {MAX_BUCKETS}"
        )
    end = now
    raw = params.get("end")
    if raw:
        try:
            end = datetime.fromisoformat(raw)
        except ValueError as exc:
            raise BadQuery(f"end: {raw!r} is not an ISO 8601 time") from exc
        end = end if end.tzinfo else end.replace(tzinfo=UTC)
    end_ms = int(end.timestamp() * 1000)
    if end_ms < WINDOWS[window]:
        raise BadQuery(f"end: {raw!r} is before the epoch's first window")
    return SeriesQuery(window, bucket, end_ms)


CREATED_SQL = (
    "SELECT (created_ms - ?) / ?, count(*), CAST(sum(CASE WHEN passed THEN 1 ELSE 0 END)"
    " AS BIGINT), count(passed) FROM console_runs WHERE tenant = ? AND key >= ? AND key < ?"
    " GROUP BY 1"
)
"""Tasks in, passed and verified by creation bucket: one range of the primary key."""
RESULTS_SQL = (
    "SELECT b, n, latency, r = (n * 50 + 99) / 100, r = (n * 95 + 99) / 100 FROM ("
    " SELECT b, latency, row_number() OVER (PARTITION BY b ORDER BY latency) AS r,"
    " count(*) OVER (PARTITION BY b) AS n FROM ("
    "  SELECT (result_ms - ?) / ? AS b, result_ms - created_ms AS latency FROM console_runs"
    "  WHERE tenant = ? AND result_ms >= ? AND result_ms < ?) AS x) AS y"
    " WHERE r = (n * 50 + 99) / 100 OR r = (n * 95 + 99) / 100"
)
"""Per result bucket, its count and the latencies at the 50th and 95th nearest ranks (each
row says which of the two it is): one range of the `result_ms, created_ms` index."""


def _first_id(ms: int) -> str:
    """The lowest run id created at `ms`."""
    return new_run_id(ms, bytes(10))


async def overview_series(table: RunsTable, tenant: TenantId, q: SeriesQuery) -> OverviewSeries:
    """The tenant's buckets of the window `q` asks for."""
    since, width, end = q.since_ms, q.width, q.end_ms
    created = await table.fetch(
        CREATED_SQL, (since, width, str(tenant), _first_id(since), _first_id(end))
    )
    results = await table.fetch(RESULTS_SQL, (since, width, str(tenant), since, end))
    rows: list[dict[str, Any]] = [
        {"tasks_in": 0, "passed": 0, "verified": 0, "results_out": 0, "p50": None, "p95": None}
        for _ in range(q.count)
    ]
    for b, n, passed, verified in created:
        if 0 <= int(b) < q.count:
            rows[int(b)] |= {"tasks_in": int(n), "passed": int(passed), "verified": int(verified)}
    for b, n, latency, is_p50, is_p95 in results:
        if not 0 <= int(b) < q.count:
            continue
        row = rows[int(b)]
        row["results_out"] = int(n)
        if is_p50:
            row["p50"] = max(int(latency), 0)  # a creation clock ahead of the console's
        if is_p95:
            row["p95"] = max(int(latency), 0)
    buckets = []
    for i, row in enumerate(rows):
        start = since + i * width
        covered = min(start + width, end) - start
        buckets.append(
            SeriesBucket(
                start=datetime.fromtimestamp(start / 1000, UTC),
                tasks_in=row["tasks_in"],
                results_out=row["results_out"],
                passed=row["passed"],
                verified=row["verified"],
                pass_rate=row["passed"] / row["verified"] if row["verified"] else None,
                throughput_per_s=round(row["results_out"] * 1000 / covered, 6) if covered else 0.0,
                latency_p50_ms=row["p50"],
                latency_p95_ms=row["p95"],
            )
        )
    return OverviewSeries(
        tenant=tenant,
        window=q.window,
        bucket=q.bucket,
        since=datetime.fromtimestamp(since / 1000, UTC),
        end=datetime.fromtimestamp(end / 1000, UTC),
        buckets=buckets,
    )


@dataclass(frozen=True)
class SeriesCharts:
    """A tenant's overview series and its four charts."""

    series: OverviewSeries
    query: str
    """The query string that asks for the same window again (for the live refresh)."""
    live: bool
    """The window ends now: the page refreshes it."""
    volume: TimeChart
    pass_rate: TimeChart
    throughput: TimeChart
    latency: TimeChart


def _label(at: datetime, bucket: str) -> str:
    if bucket == "1d":
        return at.strftime("%m-%d")
    return at.strftime("%m-%d %H:00" if bucket == "1h" else "%H:%M")


def series_charts(s: OverviewSeries, live: bool) -> SeriesCharts:
    """The charts of a tenant's series: tasks in against results out, pass rate (0 to 1),
    throughput, and latency p50 and p95 in seconds. A bucket without a value (no run
    verified, no result) has no point; the line joins its neighbours."""
    xs = [_label(b.start, s.bucket) for b in s.buckets]
    bs = s.buckets

    def seconds(ms: int | None) -> float | None:
        return None if ms is None else ms / 1000

    query = f"tenant={s.tenant}&window={s.window}&bucket={s.bucket}"
    return SeriesCharts(
        series=s,
        query=query,
        live=live,
        volume=time_chart(
            xs,
            {"tasks in": [b.tasks_in for b in bs], "results out": [b.results_out for b in bs]},
            {},
        ),
        pass_rate=time_chart(xs, {"pass rate": [b.pass_rate for b in bs]}, {}, y_max=1.0),
        throughput=time_chart(xs, {"results/s": [b.throughput_per_s for b in bs]}, {}),
        latency=time_chart(
            xs,
            {
                "p50 s": [seconds(b.latency_p50_ms) for b in bs],
                "p95 s": [seconds(b.latency_p95_ms) for b in bs],
            },
            {},
        ),
    )


Endpoint = Callable[[Request], Awaitable[Response]]


def series_routes(
    table: RunsTable,
    tenant_of: Callable[[Request], TenantId],
    guarded: Callable[..., Endpoint],
    render: Callable[..., Response],
) -> list[Route]:
    """`/api/overview/series` (JSON) and `/overview/series` (the page's fragment of one
    tenant's charts, which the overview refreshes), each scoped like the rest."""

    async def read(request: Request) -> OverviewSeries:
        q = series_query(request.query_params, datetime.now(UTC))
        return await overview_series(table, tenant_of(request), q)

    async def api_series(request: Request) -> Response:
        s = await read(request)
        return Response(s.model_dump_json(), media_type="application/json")

    async def fragment(request: Request) -> Response:
        s = await read(request)
        live = "end" not in request.query_params
        return render("_overview_series.html", c=series_charts(s, live))

    return [
        Route("/api/overview/series", guarded(api_series), methods=["GET"]),
        Route("/overview/series", guarded(fragment, html=True), methods=["GET"]),
    ]


async def tenants_series(
    table: RunsTable, tenants: list[TenantId], params: Mapping[str, str]
) -> dict[TenantId, SeriesCharts]:
    """The overview page's charts of each tenant it shows, for the window its query
    string asks for."""
    q = series_query(params, datetime.now(UTC))
    live = "end" not in params
    return {t: series_charts(await overview_series(table, t, q), live) for t in tenants}
