"""Per-class analysis: percentiles by hand, and a weak class fails the whole."""

from __future__ import annotations

from assay.fleet import Gates, Policy, Trace
from assay.fleet.analyze import Minimums, analyze, percentile
from libs.assay.tests.fleet_traces import run


def test_nearest_rank_percentiles() -> None:
    values = list(range(1, 101))  # 1..100
    assert [percentile(values, p) for p in (50, 95, 99)] == [50, 95, 99]
    assert [percentile([7], p) for p in (50, 95, 99)] == [7, 7, 7]
    assert [percentile([1, 2, 3], p) for p in (50, 95, 99)] == [2, 3, 3]


def strong(i: int) -> Trace:
    # 100 s runs waiting 80 s on a model: suspended after 10 s, saving 70%
    return run(100_000, ("model", 10_000, 90_000 + i * 1_000), workflow_id="strong", run=f"s{i}")


def weak(i: int) -> Trace:
    # 100 s runs waiting 5 s on a tool: never suspended
    return run(100_000, ("tool", 10_000, 15_000), workflow_id="weak", run=f"w{i}")


def test_a_strong_class_cannot_hide_a_weak_one() -> None:
    traces = [strong(i) for i in range(3)] + [weak(i) for i in range(3)]
    pooled_policy = Policy.from_seconds(10)
    report = analyze(traces, pooled_policy, Gates(), Minimums(3, 2))
    s, w = report["classes"]["strong@v1"], report["classes"]["weak@v1"]
    assert s["gate"] == {"passed": True, "reasons": []}
    assert s["waits"]["model"] == {
        "count": 3,
        "total_seconds": 243.0,  # 80 + 81 + 82
        "p50_seconds": 81.0,
        "p95_seconds": 82.0,
        "p99_seconds": 82.0,
    }
    assert s["waits"]["human"]["p50_seconds"] is None
    assert w["gate"]["passed"] is False
    assert w["gate"]["reasons"][0] == "CPU saving 0.00% < 20.00%"
    assert report["passed"] is False
    assert report["reasons"] == ["class weak@v1 fails its gate"]


def test_too_little_evidence_fails() -> None:
    report = analyze([strong(0), strong(1)], Policy.from_seconds(10), Gates(), Minimums(3, 2))
    assert report["classes"]["strong@v1"]["gate"]["reasons"] == ["2 traces < 3 per class"]
    assert report["reasons"] == [
        "1 workload classes < 2",
        "class strong@v1 fails its gate",
    ]
