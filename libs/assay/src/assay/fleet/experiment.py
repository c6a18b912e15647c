"""Experiment manifests: one file pins the inputs, baseline, policy, gates and evaluator.

The trace set is pinned by a content hash over its files (`trace_set_hash`), so a
manifest names exactly the evidence it was run on; the evaluator by a version
string this code must match. The same manifest over the same files gives a
byte-identical report: nothing in it depends on the clock, the machine or the
order files are listed in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from assay.fleet.analyze import Minimums, analyze
from assay.fleet.errors import FleetError
from assay.fleet.simulate import Gates, Policy
from assay.fleet.trace import Trace, WaitKind
from assay.kernel.canonical import content_hash, digest

EVALUATOR = "assay.fleet.analyze/1"
"""The evaluator this code is: its model of suspension and its gates, version 1."""


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TraceSet(_Strict):
    """The evidence: a directory of traces and the hash of its contents."""

    directory: str = Field(
        min_length=1, description="Directory of traces, relative to the manifest's own."
    )
    content_hash: str = Field(
        pattern=r"^blake3:[0-9a-f]{64}$",
        description="`blake3:` and the trace set's hash (`assay fleet hash DIR` prints it).",
    )


class PolicySpec(_Strict):
    """The suspension policy under test."""

    idle_after_s: float = Field(ge=0, description="Idle seconds before a checkpoint starts.")
    checkpoint_s: float = Field(ge=0, description="Seconds a checkpoint holds the sandbox.")
    resume_s: float = Field(ge=0, description="Seconds a resume adds to the critical path.")
    kinds: list[WaitKind] = Field(min_length=1, description="Wait kinds that are suspended.")


class GateSpec(_Strict):
    """The acceptance gates and how much evidence they need."""

    min_cpu_saving: float = Field(description="Least CPU resource-time saved (fraction).")
    min_memory_saving: float = Field(description="Least memory resource-time saved (fraction).")
    max_overhead: float = Field(ge=0, description="Most completion time added (fraction).")
    minimum_traces_per_class: int = Field(ge=1, description="Traces each class needs.")
    minimum_workload_classes: int = Field(ge=1, description="Classes the set needs.")


class ExperimentManifest(_Strict):
    """An experiment, pinned (`format` `assay.fleet.experiment`, version 1)."""

    format: Literal["assay.fleet.experiment"] = Field(description="The file's format.")
    version: Literal[1] = Field(description="The manifest format's version.")
    name: str = Field(min_length=1, max_length=200, description="What the experiment is called.")
    traces: TraceSet = Field(description="The trace set, pinned.")
    baseline: Literal["always_on"] = Field(description="What the policy is compared with.")
    policy: PolicySpec = Field(description="The policy under test.")
    gates: GateSpec = Field(description="The gates and the evidence they need.")
    evaluator: Literal["assay.fleet.analyze/1"] = Field(
        description="The evaluator version the results were (and must be) computed by."
    )


def parse_manifest(text: str, source: str) -> ExperimentManifest:
    """The manifest in `text`, validated strictly.

    Raises:
        FleetError: not JSON, or it breaks the schema; the error names the place.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FleetError(f"{source}:{exc.lineno}: json: {exc.msg}") from exc
    if isinstance(doc, dict) and "evaluator" in doc and doc["evaluator"] != EVALUATOR:
        raise FleetError(
            f"{source}: evaluator: {doc['evaluator']!r} is not this evaluator ({EVALUATOR})"
        )
    try:
        return ExperimentManifest.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top)"
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise FleetError(f"{source}: {where}: {first['msg']}{more}") from exc


def trace_set_hash(files: Mapping[str, bytes]) -> str:
    """`blake3:` + the hash of a set of files by relative path and content."""
    pairs = sorted((name, digest(content)) for name, content in files.items())
    return f"blake3:{content_hash([list(p) for p in pairs])}"


def run_experiment(
    manifest: ExperimentManifest, traces: Sequence[Trace], files_hash: str
) -> dict[str, Any]:
    """The report of `manifest` over `traces`, whose files hash to `files_hash`.

    Raises:
        FleetError: the files are not the ones the manifest pins.
    """
    if files_hash != manifest.traces.content_hash:
        raise FleetError(
            f"the traces in {manifest.traces.directory} hash to {files_hash}, "
            f"not the manifest's {manifest.traces.content_hash}"
        )
    p, g = manifest.policy, manifest.gates
    policy = Policy.from_seconds(p.idle_after_s, p.checkpoint_s, p.resume_s, p.kinds)
    gates = Gates(g.min_cpu_saving, g.min_memory_saving, g.max_overhead)
    minimums = Minimums(g.minimum_traces_per_class, g.minimum_workload_classes)
    return {
        "experiment": manifest.name,
        "manifest_hash": f"blake3:{content_hash(manifest.model_dump(mode='json'))}",
        "traces": {"content_hash": files_hash, "count": len(traces)},
        "baseline": manifest.baseline,
        "evaluator": EVALUATOR,
        "analysis": analyze(traces, policy, gates, minimums),
    }
