"""Each stage's health and lag, for the overview: the figures of the §15 signals that the
stages already serve, read rather than recomputed.

Distributed, every stage process answers `/readyz` (its readiness document) and
`/metrics` (Prometheus text) on its status port; the console reads both from each
address `ASSAY_CONSOLE_STAGE_URLS` names, concurrently and with a short timeout, and a
stage that does not answer is shown as unreachable, with the error. Embedded, one
process runs every stage: the console reads the same metrics from that process's
registry (`Embedded.metrics`, whose lag is each reader's stored position against the
embedded bus's end), and each stage is running while the process consumes.

Lag and health are operational figures of the shared topics, without a tenant id:
every caller the console admits may read them (`GET /api/stages`).
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import httpx
from prometheus_client import Metric
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from assay.runtime.embedded import Embedded

TIMEOUT_S = 2.0
"""How long the console waits for one stage's answer before calling it unreachable."""
LAG = "assay_stage_lag"
HANDLED = "assay_messages_handled"
HANDLER_SECONDS = "assay_handler_seconds"


class Health(enum.Enum):
    """What a stage's status port said of it."""

    READY = "ready"
    """Its `/readyz` answered ready."""
    NOT_READY = "not_ready"
    """Its `/readyz` answered, not ready: `reasons` say why."""
    UNREACHABLE = "unreachable"
    """It did not answer within the timeout: `reasons` hold the error."""
    RUNNING = "running"
    """Embedded: the process runs it (there is no readiness of one stage apart)."""


class PartitionLag(BaseModel):
    """Records of one partition a stage has yet to handle."""

    topic: str = Field(description="The topic.")
    partition: int = Field(description="The partition.")
    lag: int = Field(description="End offset minus the position the stage stored.")


class StageView(BaseModel):
    """One stage (distributed: one status port; a replica has its own name)."""

    name: str = Field(description="The stage, as the console's settings name it.")
    health: Health = Field(description="ready, not_ready, unreachable or running.")
    reasons: list[str] = Field(
        default_factory=list, description="Why not ready, or the error of an unreachable one."
    )
    lag: list[PartitionLag] = Field(
        default_factory=list, description="Lag per topic and partition the stage holds."
    )
    lag_total: int | None = Field(
        None, description="Lag over every partition; null: the stage's metrics were not read."
    )
    handled: int | None = Field(
        None, description="Messages the stage handled and committed since it started."
    )
    p50_s: float | None = Field(
        None, description="Median time to handle a message, from the histogram's buckets."
    )
    p95_s: float | None = Field(None, description="95th percentile of the same.")


class StagesView(BaseModel):
    """Every stage the console knows of, in the order its settings name them."""

    mode: str = Field(description="`distributed`, `embedded`, or `none` (no stages known).")
    stages: list[StageView] = Field(description="The stages.")


class StageStatus(Protocol):
    """Where the console reads the stages' health and lag."""

    async def read(self) -> StagesView:
        """Every stage's view; a stage that cannot be read is shown so, never raised."""
        ...


@dataclass
class Figures:
    """What one stage's metrics say, summed over its message types."""

    lag: dict[tuple[str, int], int] = field(default_factory=dict)
    handled: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)
    """Cumulative count of handlings at or under each upper bound (seconds)."""

    def add(self, other: Figures) -> None:
        """Add another process's (or label's) figures to these."""
        for tp, n in other.lag.items():
            self.lag[tp] = self.lag.get(tp, 0) + n
        self.handled += other.handled
        for le, count in other.buckets.items():
            self.buckets[le] = self.buckets.get(le, 0.0) + count

    def quantile(self, q: float) -> float | None:
        """The `q` quantile of handling time, interpolated within its bucket as
        Prometheus's `histogram_quantile` does; None before anything was handled."""
        bounds = sorted(self.buckets)
        total = self.buckets.get(math.inf, 0.0)
        if not bounds or total <= 0:
            return None
        rank, lower, below = q * total, 0.0, 0.0
        for le in bounds:
            count = self.buckets[le]
            if count >= rank:
                if math.isinf(le):  # past the last bound: the last bound is all one knows
                    return lower
                return lower + (le - lower) * ((rank - below) / (count - below or 1.0))
            lower, below = le, count
        return lower


def figures(families: Iterable[Metric]) -> dict[str, Figures]:
    """Each stage's figures among a process's metric families, by their `stage` label."""
    found: dict[str, Figures] = {}
    for family in families:
        if family.name not in (LAG, HANDLED, HANDLER_SECONDS):
            continue
        for sample in family.samples:
            stage = sample.labels.get("stage")
            if stage is None:
                continue
            fig = found.setdefault(stage, Figures())
            if family.name == LAG:
                tp = (sample.labels["topic"], int(sample.labels["partition"]))
                fig.lag[tp] = fig.lag.get(tp, 0) + int(sample.value)
            elif family.name == HANDLED and sample.name == f"{HANDLED}_total":
                fig.handled += sample.value
            elif sample.name == f"{HANDLER_SECONDS}_bucket":
                le = float(sample.labels["le"])
                fig.buckets[le] = fig.buckets.get(le, 0.0) + sample.value
    return found


def parse(text: str) -> dict[str, Figures]:
    """`figures` of Prometheus text (a `/metrics` answer).

    Raises:
        ValueError: the text is not Prometheus's exposition format.
    """
    return figures(text_string_to_metric_families(text))


def stage_view(
    name: str, health: Health, reasons: list[str], fig: Figures | None = None
) -> StageView:
    """The view of a stage: its health, and what its metrics said (None: not read)."""
    if fig is None:
        return StageView(name=name, health=health, reasons=reasons)
    lag = [PartitionLag(topic=t, partition=p, lag=n) for (t, p), n in sorted(fig.lag.items())]
    return StageView(
        name=name,
        health=health,
        reasons=reasons,
        lag=lag,
        lag_total=sum(x.lag for x in lag),
        handled=int(fig.handled),
        p50_s=fig.quantile(0.5),
        p95_s=fig.quantile(0.95),
    )


class NoStages:
    """A console that knows of no stage (distributed without `ASSAY_CONSOLE_STAGE_URLS`)."""

    async def read(self) -> StagesView:
        return StagesView(mode="none", stages=[])


class HttpStages:
    """Distributed: each stage's status port."""

    def __init__(self, urls: dict[str, str], timeout_s: float = TIMEOUT_S) -> None:
        self.urls = dict(urls)
        self.timeout_s = timeout_s

    async def read(self) -> StagesView:
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            views = await asyncio.gather(
                *(self._one(client, name, url) for name, url in self.urls.items())
            )
        return StagesView(mode="distributed", stages=list(views))

    async def _one(self, client: httpx.AsyncClient, name: str, url: str) -> StageView:
        ready, metrics = await asyncio.gather(
            client.get(f"{url}/readyz"), client.get(f"{url}/metrics"), return_exceptions=True
        )
        if isinstance(ready, BaseException):
            if not isinstance(ready, httpx.HTTPError):
                raise ready
            return stage_view(name, Health.UNREACHABLE, [f"{url}: {_error(ready)}"])
        health, reasons = _readiness(ready)
        if isinstance(metrics, BaseException):
            if not isinstance(metrics, httpx.HTTPError):
                raise metrics
            return stage_view(name, health, [*reasons, f"{url}/metrics: {_error(metrics)}"])
        if metrics.status_code != 200:
            return stage_view(name, health, [*reasons, f"/metrics answered {metrics.status_code}"])
        try:
            found = parse(metrics.text)
        except ValueError as exc:
            return stage_view(name, health, [*reasons, f"/metrics did not parse: {exc}"])
        merged = Figures()
        for fig in found.values():  # one stage per process: its label is its stage's
            merged.add(fig)
        return stage_view(name, health, reasons, merged)


def _error(exc: httpx.HTTPError) -> str:
    """An HTTP error, for people: its kind, and what it said (a timeout says nothing)."""
    return f"{type(exc).__name__} {exc}".strip()


def _readiness(answer: httpx.Response) -> tuple[Health, list[str]]:
    """A `/readyz` answer: 200 is ready; otherwise its document's reasons."""
    if answer.status_code == 200:
        return Health.READY, []
    try:
        doc = answer.json()
        reasons = [str(r) for r in doc.get("reasons", [])] if isinstance(doc, dict) else []
    except ValueError:
        reasons = []
    return Health.NOT_READY, reasons or [f"/readyz answered {answer.status_code}"]


class ProcessStages:
    """Embedded: the stages of this process, read from its metrics registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        refresh: Callable[[], Awaitable[None]],
        stages: list[str],
        running: Callable[[], bool],
    ) -> None:
        self.registry = registry
        self.refresh = refresh
        self.stages = stages
        self.running = running

    @classmethod
    def of(cls, rt: Embedded) -> ProcessStages:
        """The stages `rt` runs, from its registry (`Embedded.metrics`)."""
        registry, refresh = rt.metrics()
        return cls(registry, refresh, list(rt.runners), lambda: bool(rt.health()["ready"]))

    async def read(self) -> StagesView:
        await self.refresh()
        found = figures(self.registry.collect())
        running = self.running()
        health = Health.RUNNING if running else Health.NOT_READY
        reasons = [] if running else ["the process has not started its stages"]
        views = [stage_view(s, health, reasons, found.get(s, Figures())) for s in self.stages]
        return StagesView(mode="embedded", stages=views)


def lag_bars(view: StagesView, width: float = 160.0) -> dict[str, float]:
    """Each stage's bar on the overview: its lag against the largest (0 to `width`)."""
    most = max((s.lag_total or 0 for s in view.stages), default=0)
    return {s.name: (width * (s.lag_total or 0) / most if most else 0.0) for s in view.stages}
