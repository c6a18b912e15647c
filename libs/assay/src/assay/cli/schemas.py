"""`assay schemas DIR`: the wire contracts as JSON Schema files plus an AsyncAPI document.

Generated from the pydantic models, so field descriptions are the documentation;
the AsyncAPI document is FastStream's, from one application per installed stage
(`assay.bus.asyncapi`). A test regenerates them and fails on any drift from the
committed copies.
"""

from __future__ import annotations

import json
import tempfile
from importlib.metadata import entry_points
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from assay.bus.asyncapi import document
from assay.fleet.schemas import fleet_schemas
from assay.kernel.errors import AssayError
from assay.messages import (
    MESSAGES,
    BranchChildResult,
    BranchTree,
    Envelope,
    Episode,
    ReducedEpisode,
)
from assay.runtime.bootstrap import stage_deps
from assay.runtime.embedded import STAGES, discover_stages
from assay.runtime.settings import AssaySettings
from assay.store.fs_blobs import FsBlobStore


def render() -> dict[str, str]:
    """File name -> content of every generated contract file."""
    files: dict[str, str] = {}

    def put(name: str, schema: dict[str, Any]) -> None:
        files[name] = json.dumps(schema, indent=2, sort_keys=True) + "\n"

    put("Envelope.schema.json", Envelope.model_json_schema())
    put(f"Episode.v{Episode.version}.schema.json", Episode.model_json_schema())
    put(
        f"ReducedEpisode.v{ReducedEpisode.version}.schema.json",
        ReducedEpisode.model_json_schema(),
    )
    for artifact in (BranchTree, BranchChildResult):  # branch lineage blobs (DESIGN §13)
        put(f"{artifact.type}.v{artifact.version}.schema.json", artifact.model_json_schema())
    for name, model in sorted(MESSAGES.types().items()):
        put(f"{name}.v{model.version}.schema.json", model.model_json_schema())
    for name, schema in fleet_schemas().items():  # files, not messages (DESIGN §16)
        put(name, schema)
    doc = document(stage_handlers())
    files["asyncapi.yaml"] = yaml.safe_dump(doc, sort_keys=True, width=100)
    for name, example in examples().items():
        files[f"examples/{name}.json"] = json.dumps(example, indent=2, sort_keys=True) + "\n"
    # Documents installed components contribute (the console's OpenAPI), by file name.
    for ep in entry_points(group="assay.schemas"):
        files[ep.name] = ep.load()()
    return files


def stage_handlers() -> dict[str, dict[str, dict[str, object]]]:
    """Each installed stage's `StageSpec.handlers`, in pipeline order (built with the
    default dependencies; nothing is opened or run)."""
    factories = discover_stages()
    with tempfile.TemporaryDirectory() as tmp:
        deps = stage_deps(AssaySettings(), FsBlobStore(tmp)).deps
        return {
            s: {t: dict(h) for t, h in factories[s](deps).handlers.items()}
            for s in STAGES
            if s in factories
        }


def examples() -> dict[str, dict[str, Any]]:
    """One valid example payload per message type (shipped with the library).

    Raises:
        AssayError: a message type has no example, or its example does not validate.
    """
    root = files("assay.messages") / "examples"
    out: dict[str, dict[str, Any]] = {}
    for name, model in sorted(MESSAGES.types().items()):
        source = root / f"{name}.json"
        if not source.is_file():
            raise AssayError(f"message type {name} has no example in assay/messages/examples")
        doc = json.loads(source.read_text())
        model.model_validate(doc)  # an example that does not validate is a bug here
        out[name] = doc
    return out


def write(directory: Path) -> list[Path]:
    """Write every contract file into `directory`; return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name, content in render().items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        out.append(path)
    return out
