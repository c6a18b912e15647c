"""Per-class analysis: percentiles by hand, and a weak class fails the whole."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from assay.cli import main
from assay.fleet import Gates, Policy, Trace
from assay.fleet.analyze import Minimums, analyze, percentile
from libs.assay.tests.fleet_traces import run


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exit_:
            return int(exit_.code or 0), out.getvalue(), err.getvalue()
    raise AssertionError("main() returned without exiting")


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


def test_recorder_metrics_are_summarised_beside_the_class_and_checked(tmp_path: Path) -> None:
    trace = run(10_000, ("model", 1_000, 9_000), workflow_id="rec", run="r1")
    (tmp_path / "r1.jsonl").write_text(trace.to_jsonl())
    samples = [
        {"type": "header", "format": "assay.fleet.metrics", "version": 1},
        {"type": "sample", "t_ms": 0, "cpu_seconds": 0.0, "rss_bytes": 100, "processes": 1},
        {"type": "sample", "t_ms": 5_000, "cpu_seconds": 1.5, "rss_bytes": 900, "processes": 3},
        {"type": "sample", "t_ms": 8_000, "cpu_seconds": 1.75, "rss_bytes": 400, "processes": 2},
    ]
    metrics = tmp_path / "r1.metrics.jsonl"
    metrics.write_text("".join(json.dumps(s) + "\n" for s in samples))
    flags = ["--minimum-traces-per-class", "1", "--minimum-workload-classes", "1"]
    code, out, err = cli("fleet", "analyze", str(tmp_path), *flags)
    assert code == 1, err  # a 10 s run with an 8 s wait, idle_after 30 s: nothing saved
    assert json.loads(out)["classes"]["rec@v1"]["observed"] == {
        "recordings": 1,
        "samples": 3,
        "peak_cpu_seconds": 1.75,
        "peak_rss_bytes": 900,
        "peak_processes": 3,
        "mean_coverage": 0.8,
    }
    samples[2] = {**samples[2], "t_ms": 9_000}  # now the third goes back
    metrics.write_text("".join(json.dumps(s) + "\n" for s in samples))
    code, out, err = cli("fleet", "analyze", str(tmp_path), *flags)
    assert (code, out) == (2, "")
    assert f"{metrics}:4: order: t_ms 8000 goes back" in err
