"""Experiment manifests: strict, pinned to their traces, and byte-identical reports."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from assay.cli import main
from assay.fleet.generate import generate

SCHEMAS = Path(__file__).resolve().parents[3] / "schemas"


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exit_:
            return int(exit_.code or 0), out.getvalue(), err.getvalue()
    raise AssertionError("main() returned without exiting")


def manifest(content_hash: str, **over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": "assay.fleet.experiment",
        "version": 1,
        "name": "synthetic-idle-suspension",
        "traces": {"directory": "traces", "content_hash": content_hash},
        "baseline": "always_on",
        "policy": {
            "idle_after_s": 5,
            "checkpoint_s": 1,
            "resume_s": 0.5,
            "kinds": ["model", "human"],
        },
        "gates": {
            "min_cpu_saving": 0.2,
            "min_memory_saving": 0.2,
            "max_overhead": 0.05,
            "minimum_traces_per_class": 4,
            "minimum_workload_classes": 2,
        },
        "evaluator": "assay.fleet.analyze/1",
    }
    doc.update(over)
    return doc


@pytest.fixture
def pinned(tmp_path: Path) -> tuple[Path, str]:
    traces = tmp_path / "traces"
    traces.mkdir()
    for t in generate(3, 4):
        (traces / f"{t.header.run}.jsonl").write_text(t.to_jsonl())
    code, out, _ = cli("fleet", "hash", str(traces))
    assert code == 0
    return tmp_path, out.strip()


def test_the_same_manifest_gives_the_same_report_byte_for_byte(pinned: tuple[Path, str]) -> None:
    root, digest = pinned
    doc = manifest(digest)
    schema = json.loads((SCHEMAS / "FleetExperiment.v1.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)
    path = root / "experiment.json"
    path.write_text(json.dumps(doc))
    first = cli("fleet", "experiment", str(path))
    # the same manifest, its keys reordered: the same report
    path.write_text(json.dumps(dict(reversed(list(doc.items()))), indent=4))
    second = cli("fleet", "experiment", str(path))
    assert first == second
    code, out, _ = first
    report = json.loads(out)
    assert code == (0 if report["analysis"]["passed"] else 1)
    assert report["traces"] == {"content_hash": digest, "count": 8}
    assert report["evaluator"] == "assay.fleet.analyze/1"
    assert sorted(report["analysis"]["classes"]) == [
        "coding-agent@synthetic",
        "review-agent@synthetic",
    ]
    assert report["analysis"]["policy"]["kinds"] == ["human", "model"]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"version": 2}, "experiment.json: version: "),
        ({"evaluator": "assay.fleet.analyze/0"}, "experiment.json: evaluator: "),
        ({"baseline": "never"}, "experiment.json: baseline: "),
        ({"extra": 1}, "experiment.json: extra: Extra inputs are not permitted"),
        (
            {"policy": {"idle_after_s": -1, "checkpoint_s": 0, "resume_s": 0, "kinds": ["model"]}},
            "experiment.json: policy.idle_after_s: ",
        ),
        (
            {"traces": {"directory": "traces", "content_hash": "blake3:" + "0" * 64}},
            "hash to blake3:",
        ),
    ],
)
def test_a_manifest_that_does_not_hold_is_refused(
    pinned: tuple[Path, str], change: dict[str, Any], needle: str
) -> None:
    root, digest = pinned
    path = root / "experiment.json"
    path.write_text(json.dumps(manifest(digest, **change)))
    code, out, err = cli("fleet", "experiment", str(path))
    assert (code, out) == (2, ""), err
    assert needle in err


def test_a_changed_trace_no_longer_matches(pinned: tuple[Path, str]) -> None:
    root, digest = pinned
    path = root / "experiment.json"
    path.write_text(json.dumps(manifest(digest)))
    victim = sorted((root / "traces").iterdir())[0]
    victim.write_text(victim.read_text().replace('"succeeded"', '"failed"'))
    code, _, err = cli("fleet", "experiment", str(path))
    assert code == 2
    assert "not the manifest's " + digest in err
    path.write_text("{\n  nope")
    code, _, err = cli("fleet", "experiment", str(path))
    assert code == 2
    assert "experiment.json:2: json:" in err
