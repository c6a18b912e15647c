"""The `capacity` section of the settings tree: the VRAM a deployment declares and the
profiles of the models it serves (§14.2; `assay.kernel.capacity`).

Set it with `ASSAY_CAPACITY_*` variables, or in a YAML file named by
`ASSAY_CAPACITY_FILE` (the only way to give model profiles); a variable beats the
file's value of the same field. Without `vram_bytes_per_device` nothing is declared
and no capacity check applies (a hosted API, say).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, field_validator
from pydantic import model_validator as _model_validator

from assay.kernel.capacity import Capacity, CapacityLimits, ModelProfile

FILE_FIELDS = ("vram_bytes_per_device", "devices", "max_resident_models", "pinned", "models")
"""Fields a capacity file may set."""


class _CapacityFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    vram_bytes_per_device: ByteSize | None = Field(None, gt=0)
    devices: int | None = Field(None, ge=1)
    max_resident_models: int | None = Field(None, ge=1)
    pinned: tuple[str, ...] | None = None
    models: tuple[ModelProfile, ...] = ()


class CapacitySettings(BaseModel):
    """Declared GPU capacity and model profiles (`ASSAY_CAPACITY_*`, §14.2)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    file: Path | None = Field(
        None,
        description=(
            "A YAML file declaring the fields below and `models:`, the profile of each model "
            "(id, weights_bytes, kv_bytes_per_token, devices_required)."
        ),
    )
    vram_bytes_per_device: ByteSize | None = Field(
        None,
        gt=0,
        description=(
            "VRAM per device Assay's models may use, in bytes (or `72GB`, `80GiB`); leave "
            "headroom. Unset: no capacity declared, nothing checked."
        ),
    )
    devices: int = Field(1, ge=1, description="Devices the models are served on.")
    max_resident_models: int = Field(
        1, ge=1, description="Models resident at once across all devices; none is swapped per call."
    )
    pinned: tuple[str, ...] | None = Field(
        None,
        description=(
            "Models always resident, comma-separated (default: the agent's model, "
            "`ASSAY_MODEL_NAME`). Each needs a profile."
        ),
    )
    models: tuple[ModelProfile, ...] = Field(
        (),
        description=(
            "Model profiles, usually given in the capacity file; as a variable, a JSON list "
            'of `{"id", "weights_bytes", "kv_bytes_per_token", "devices_required"}`.'
        ),
    )
    default_context_tokens: int = Field(
        8192,
        ge=1,
        description=(
            "Context tokens one model call of a run may hold when its workflow declares none "
            "(`resources.max_context_tokens`); admission reserves KV for it."
        ),
    )
    endpoint_concurrency: int = Field(
        8,
        ge=1,
        description=(
            "Model calls in flight at once on one endpoint (the agent's, the judge's and "
            "the proposer's share it when they share a URL); more wait, agent calls first."
        ),
    )
    agent_reserved_calls: int = Field(
        1,
        ge=0,
        description=(
            "Of those, calls only agent work may take, so that grading and proposer calls "
            "never hold every slot when an agent step arrives."
        ),
    )

    @field_validator("models", mode="before")
    @classmethod
    def _json_list(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON list of model profiles ({exc})") from exc
        return value

    @field_validator("pinned", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return value

    @_model_validator(mode="before")
    @classmethod
    def _with_the_file(cls, data: Any) -> Any:
        """The file's fields under the ones given directly (variables beat the file)."""
        if not isinstance(data, dict) or not data.get("file"):
            return data
        return {**read_capacity_file(Path(data["file"])), **data}

    @_model_validator(mode="after")
    def _reserve_below_concurrency(self) -> CapacitySettings:
        if self.agent_reserved_calls >= self.endpoint_concurrency:
            raise ValueError(
                f"agent_reserved_calls ({self.agent_reserved_calls}) must be below "
                f"endpoint_concurrency ({self.endpoint_concurrency}), or grading never runs"
            )
        return self

    def declared(self, agent_model: str | None) -> Capacity | None:
        """The declared capacity, the agent's model pinned unless `pinned` says otherwise;
        None when `vram_bytes_per_device` is unset.

        Raises:
            ValueError: the declaration contradicts itself (a pinned model without a
                profile, more pinned models than may be resident); the message names it.
        """
        if self.vram_bytes_per_device is None:
            return None
        pinned = self.pinned if self.pinned is not None else (agent_model,) if agent_model else ()
        try:
            return Capacity(
                limits=CapacityLimits(
                    vram_bytes_per_device=self.vram_bytes_per_device,
                    devices=self.devices,
                    max_resident_models=self.max_resident_models,
                    pinned=pinned,
                ),
                models=self.models,
            )
        except ValidationError as exc:
            raise ValueError(_first(exc)) from exc


def read_capacity_file(path: Path) -> dict[str, Any]:
    """The fields a capacity file sets, checked.

    Raises:
        ValueError: the file cannot be read, is not YAML, is not a mapping, or a field
            is unknown or invalid; the message names the file and the field.
    """
    import yaml  # here: settings that name no capacity file do not load it

    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"capacity file {path}: cannot read it ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"capacity file {path}: not YAML ({exc})") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"capacity file {path}: must be a mapping of {', '.join(FILE_FIELDS)}")
    try:
        checked = _CapacityFile.model_validate(doc)
    except ValidationError as exc:
        raise ValueError(f"capacity file {path}: {_first(exc)}") from exc
    return checked.model_dump(exclude_unset=True)


def _first(exc: ValidationError) -> str:
    """The first error as `field.path: reason`."""
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"])
    ctx = error.get("ctx") or {}
    reason = str(ctx["error"]) if "error" in ctx else error["msg"]
    return f"{where}: {reason}" if where else reason
