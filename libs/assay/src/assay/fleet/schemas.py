"""JSON Schemas of the fleet files, published in `schemas/` beside the messages'."""

from __future__ import annotations

from typing import Any

from assay.fleet.experiment import ExperimentManifest
from assay.fleet.metrics import MetricsHeader, MetricsSample
from assay.fleet.trace import EVENT, TRACE_VERSION, TraceHeader


def fleet_schemas() -> dict[str, dict[str, Any]]:
    """File name -> JSON Schema of each fleet file format's lines."""
    v = TRACE_VERSION
    return {
        f"FleetTraceHeader.v{v}.schema.json": TraceHeader.model_json_schema(),
        f"FleetTraceEvent.v{v}.schema.json": EVENT.json_schema(),
        "FleetExperiment.v1.schema.json": ExperimentManifest.model_json_schema(),
        "FleetMetricsHeader.v1.schema.json": MetricsHeader.model_json_schema(),
        "FleetMetricsSample.v1.schema.json": MetricsSample.model_json_schema(),
    }
