"""The recorder's metrics files, read strictly and summarised (best-effort evidence).

A metrics file is JSON lines: a header (`format` `assay.fleet.metrics`, version 1),
then samples of the recorded process tree — `t_ms` on the trace's clock, cumulative
`cpu_seconds` of the processes alive at the sample, `rss_bytes`, `processes`. These are
local observations of a process tree, not proof that a remote sandbox released anything:
they support a trace, they do not replace it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from assay.fleet.validate import Issue, TraceInvalid

METRICS_FORMAT = "assay.fleet.metrics"


class MetricsHeader(BaseModel):
    """The first line of a metrics file."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["header"] = Field(description="Line kind.")
    format: Literal["assay.fleet.metrics"] = Field(description="Always `assay.fleet.metrics`.")
    version: Literal[1] = Field(description="Metrics format version.")


class MetricsSample(BaseModel):
    """The recorded process tree at one moment."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["sample"] = Field(description="Line kind.")
    t_ms: int = Field(ge=0, description="Milliseconds since the recording's origin.")
    cpu_seconds: float = Field(ge=0, description="CPU seconds of the processes alive now.")
    rss_bytes: int = Field(ge=0, description="Their resident memory.")
    processes: int = Field(ge=0, description="How many there are.")


@dataclass(frozen=True)
class MetricsSummary:
    """What one recording's samples show."""

    samples: int
    last_t_ms: int
    peak_cpu_seconds: float
    peak_rss_bytes: int
    peak_processes: int


def parse_metrics(text: str, source: str) -> MetricsSummary:
    """The summary of a metrics file, checked line by line.

    Raises:
        TraceInvalid: a rule is broken (`json`, `header`, `version`, `schema`, `order`).
    """
    issues: list[Issue] = []
    samples: list[MetricsSample] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        try:
            doc: Any = json.loads(raw)
        except json.JSONDecodeError as exc:
            issues.append(Issue(source, n, "json", f"not JSON: {exc.msg}"))
            continue
        if n == 1:
            ours = isinstance(doc, dict) and doc.get("format") == METRICS_FORMAT
            if ours and doc.get("version") != 1:
                version = doc.get("version")
                issues.append(Issue(source, 1, "version", f"unknown version {version!r}"))
                continue
            try:
                MetricsHeader.model_validate(doc)
            except ValidationError:
                issues.append(Issue(source, 1, "header", f"not a {METRICS_FORMAT} header"))
            continue
        try:
            sample = MetricsSample.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(line)"
            issues.append(Issue(source, n, "schema", f"{where}: {first['msg']}"))
            continue
        if samples and sample.t_ms < samples[-1].t_ms:
            issues.append(Issue(source, n, "order", f"t_ms {sample.t_ms} goes back"))
            continue
        samples.append(sample)
    if not text.strip():
        issues.append(Issue(source, 1, "header", "the file is empty"))
    if issues:
        raise TraceInvalid(issues)
    return summarise(samples)


def summarise(samples: Sequence[MetricsSample]) -> MetricsSummary:
    """Peaks and extent of a recording's samples."""
    return MetricsSummary(
        samples=len(samples),
        last_t_ms=max((s.t_ms for s in samples), default=0),
        peak_cpu_seconds=max((s.cpu_seconds for s in samples), default=0.0),
        peak_rss_bytes=max((s.rss_bytes for s in samples), default=0),
        peak_processes=max((s.processes for s in samples), default=0),
    )


def observed(summaries: Sequence[MetricsSummary], durations_ms: Sequence[int]) -> dict[str, Any]:
    """A class's recordings, together: how many, what they consumed at most, and coverage.

    `coverage` is the share of the traces' time the samples span (last sample over
    duration, capped at 1, averaged): low coverage means the peaks saw little of the runs.
    """
    if not summaries:
        return {"recordings": 0}
    cover = [
        min(1.0, s.last_t_ms / d) if d else 1.0
        for s, d in zip(summaries, durations_ms, strict=True)
    ]
    return {
        "recordings": len(summaries),
        "samples": sum(s.samples for s in summaries),
        "peak_cpu_seconds": round(max(s.peak_cpu_seconds for s in summaries), 3),
        "peak_rss_bytes": max(s.peak_rss_bytes for s in summaries),
        "peak_processes": max(s.peak_processes for s in summaries),
        "mean_coverage": round(sum(cover) / len(cover), 6),
    }
