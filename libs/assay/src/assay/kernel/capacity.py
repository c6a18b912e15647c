"""Model capacity as a hard limit (§14.2): declared VRAM, model profiles, the residency
invariant and the context ceiling derived from KV cost. Pure: no I/O.

The invariant, checked at start-up, at workflow registration and before every admission:

    sum(weights of resident models) + peak concurrent KV <= vram_bytes_per_device * devices
    resident model count <= max_resident_models

and, device by device, a model spanning `devices_required` devices under tensor
parallelism counts on each of them: it puts `1/devices_required` of its weights and of
its KV on every device it spans, and that share must fit there beside the others'.

The context ceiling is worked backwards from it (§14.2):

    max_context_tokens = (vram_bytes_per_device * devices - resident weights) / kv_bytes_per_token
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from assay.kernel.errors import AssayError

__all__ = [
    "EXAMPLE_PROFILES",
    "Capacity",
    "CapacityExceeded",
    "CapacityInvalid",
    "CapacityLedger",
    "CapacityLimits",
    "Demand",
    "ModelProfile",
    "kv_bytes_per_token",
]


class CapacityInvalid(AssayError):
    """The declared capacity contradicts itself: a pinned model without a profile, a
    model needing more devices than there are, or a model no profile describes."""


class CapacityExceeded(AssayError):
    """The residency invariant would break. `limit` names the limit; the message the numbers."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class ModelProfile(BaseModel):
    """What one model costs in VRAM (§14.2). Sizes are bytes (`16.06GB`, `80GiB` also read)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1, description="Model id, as the endpoint knows it.")
    weights_bytes: ByteSize = Field(gt=0, description="Bytes of weights at the deployed dtype.")
    kv_bytes_per_token: ByteSize = Field(
        gt=0,
        description=(
            "KV cache bytes one token of context costs at the deployed dtype: "
            "2 (K and V) x layers x KV heads x head dim x bytes per element."
        ),
    )
    devices_required: int = Field(
        1, ge=1, description="Devices the model spans under tensor parallelism."
    )


class CapacityLimits(BaseModel):
    """What the deployment may use (§14.2)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vram_bytes_per_device: ByteSize = Field(
        gt=0,
        description="VRAM per device Assay's models may use: not the card's total, leave headroom.",
    )
    devices: int = Field(1, ge=1, description="Devices.")
    max_resident_models: int = Field(
        1, ge=1, description="Models resident at once, across all devices."
    )
    pinned: tuple[str, ...] = Field(
        (), description="Models always resident, never evicted (the agent's model belongs here)."
    )

    @property
    def total_vram_bytes(self) -> int:
        """VRAM of every device together."""
        return int(self.vram_bytes_per_device) * self.devices


@dataclass(frozen=True)
class Demand:
    """What one admitted run may hold at its peak: `concurrent_calls` calls of `model`,
    each with up to `context_tokens` tokens of context."""

    model: str
    context_tokens: int
    concurrent_calls: int = 1

    def kv_bytes(self, profile: ModelProfile) -> int:
        """KV bytes the run holds at its peak on `profile`'s model."""
        return self.context_tokens * self.concurrent_calls * int(profile.kv_bytes_per_token)


class Capacity(BaseModel):
    """The declared deployment: its limits and the profile of every model it may serve."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    limits: CapacityLimits
    models: tuple[ModelProfile, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> Capacity:
        ids = [m.id for m in self.models]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ValueError(f"models: {', '.join(twice)} described more than once")
        for pinned in self.limits.pinned:
            if pinned not in ids:
                raise ValueError(f"pinned: model {pinned!r} has no profile in models")
        if len(set(self.limits.pinned)) > self.limits.max_resident_models:
            raise ValueError(
                f"pinned: {len(set(self.limits.pinned))} models pinned; "
                f"max_resident_models is {self.limits.max_resident_models}"
            )
        return self

    def profile(self, model: str) -> ModelProfile:
        """The profile of `model`.

        Raises:
            CapacityInvalid: no profile describes it.
        """
        for m in self.models:
            if m.id == model:
                return m
        known = ", ".join(m.id for m in self.models) or "none"
        raise CapacityInvalid(f"model {model!r} has no capacity profile (profiles: {known})")

    def resident_with(self, *models: str) -> tuple[str, ...]:
        """The pinned models and `models`, each once, in that order."""
        return tuple(dict.fromkeys((*self.limits.pinned, *models)))

    def weights_bytes(self, resident: Iterable[str]) -> int:
        """Bytes of weights of the `resident` models together."""
        return sum(int(self.profile(m).weights_bytes) for m in dict.fromkeys(resident))

    def max_context_tokens(self, model: str, resident: Iterable[str] = ()) -> int:
        """The longest context one call of `model` can have with nothing else in flight:
        `(vram_bytes_per_device * devices - resident weights) / kv_bytes_per_token`
        (0 when the weights alone do not fit). `model` counts as resident."""
        models = self.resident_with(*resident, model)
        free = self.limits.total_vram_bytes - self.weights_bytes(models)
        return max(0, free // int(self.profile(model).kv_bytes_per_token))

    def check(self, resident: Iterable[str], kv_bytes: Mapping[str, int] | None = None) -> None:
        """Check the residency invariant with `resident` models (the pinned ones are
        added) and `kv_bytes` of KV in flight per model.

        Raises:
            CapacityInvalid: a model has no profile.
            CapacityExceeded: a limit is broken; the message names it and the numbers.
        """
        models = self.resident_with(*resident, *(kv_bytes or {}))
        kv = {m: int((kv_bytes or {}).get(m, 0)) for m in models}
        for m in models:
            self.profile(m)  # an unknown model is named before any limit
        limits = self.limits
        if len(models) > limits.max_resident_models:
            raise CapacityExceeded(
                "max_resident_models",
                f"{len(models)} resident models ({', '.join(models)}) exceed "
                f"max_resident_models={limits.max_resident_models}; a second model is never "
                "swapped in per call",
            )
        for m in models:
            span = self.profile(m).devices_required
            if span > limits.devices:
                raise CapacityExceeded(
                    "devices",
                    f"model {m!r} needs devices_required={span} devices; devices is "
                    f"{limits.devices}",
                )
        weights = self.weights_bytes(models)
        total_kv = sum(kv.values())
        if weights + total_kv > limits.total_vram_bytes:
            raise CapacityExceeded(
                "vram_bytes_per_device",
                f"resident weights {_gb(weights)} + concurrent KV {_gb(total_kv)} = "
                f"{_gb(weights + total_kv)} exceed vram_bytes_per_device x devices = "
                f"{_gb(limits.vram_bytes_per_device)} x {limits.devices} = "
                f"{_gb(limits.total_vram_bytes)}",
            )
        self._place(models, kv)

    def _place(self, models: tuple[str, ...], kv: Mapping[str, int]) -> None:
        """Put each model on the least-loaded devices it spans, largest share first; a
        model spanning several devices puts its share of weights and KV on each."""
        loads = [0] * self.limits.devices
        shares = sorted(
            (
                (-(int(p.weights_bytes) + kv[m]) // -p.devices_required, p.devices_required, m)
                for m in models
                for p in (self.profile(m),)
            ),
            reverse=True,
        )
        per_device = int(self.limits.vram_bytes_per_device)
        for share, span, model in shares:
            chosen = sorted(range(len(loads)), key=lambda d: (loads[d], d))[:span]
            for d in chosen:
                loads[d] += share
                if loads[d] > per_device:
                    raise CapacityExceeded(
                        "vram_bytes_per_device",
                        f"device {d} would hold {_gb(loads[d])} (model {model!r} puts "
                        f"{_gb(share)} of weights and KV on each of its {span} device(s)); "
                        f"vram_bytes_per_device is {_gb(per_device)}",
                    )


class CapacityLedger:
    """The KV that admitted runs may hold, against the declared capacity (§14.2).

    `admit` checks a run's demand against the invariant with every run already
    admitted and, if it fits, holds it until `release` — one decision at a time
    (thread-safe), so concurrent admissions never break the invariant together. A
    model becomes resident when the first thing naming it fits, and then stays: it is
    never swapped out for another.
    """

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.resident: tuple[str, ...] = capacity.resident_with()
        self._held: dict[str, Demand] = {}
        self._lock = threading.Lock()
        self.refusals: Counter[str] = Counter()
        """Refused admissions since start, by the limit they would have broken."""

    def kv_in_flight(self) -> dict[str, int]:
        """KV bytes the admitted runs may hold, per model."""
        kv: Counter[str] = Counter()
        for d in self._held.values():
            kv[d.model] += d.kv_bytes(self.capacity.profile(d.model))
        return dict(kv)

    def make_resident(self, *models: str) -> None:
        """Add `models` to the resident set if the invariant holds with them and with
        what is in flight.

        Raises:
            CapacityInvalid, CapacityExceeded: as `Capacity.check`.
        """
        with self._lock:
            wanted = (*self.resident, *models)
            self.capacity.check(wanted, self.kv_in_flight())
            self.resident = self.capacity.resident_with(*wanted)

    def admit(self, key: str, demand: Demand) -> CapacityExceeded | None:
        """Hold `demand` under `key` if it fits; the refusal (counted) if it does not.
        A key already held is admitted again without holding twice.

        Raises:
            CapacityInvalid: the demand's model has no profile.
        """
        with self._lock:
            if key in self._held:
                return None
            profile = self.capacity.profile(demand.model)
            kv = Counter(self.kv_in_flight())
            kv[demand.model] += demand.kv_bytes(profile)
            try:
                self.capacity.check((*self.resident, demand.model), kv)
            except CapacityExceeded as exc:
                self.refusals[exc.limit] += 1
                return exc
            self.resident = self.capacity.resident_with(*self.resident, demand.model)
            self._held[key] = demand
            return None

    def release(self, key: str) -> None:
        """Stop holding what `key` was admitted with (nothing if it holds nothing)."""
        with self._lock:
            self._held.pop(key, None)

    @property
    def held(self) -> int:
        """Runs admitted and not released."""
        return len(self._held)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """KV bytes per token: 2 (K and V) x layers x KV heads x head dim x bytes per element."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


EXAMPLE_PROFILES: tuple[ModelProfile, ...] = (
    ModelProfile(
        id="meta-llama/Llama-3.1-8B-Instruct",  # 8.03B params, bf16; GQA 32 layers, 8 KV heads
        weights_bytes=ByteSize(16_060_000_000),
        kv_bytes_per_token=ByteSize(kv_bytes_per_token(32, 8, 128)),
    ),
    ModelProfile(
        id="Qwen/Qwen2.5-7B-Instruct",  # 7.62B params, bf16; GQA 28 layers, 4 KV heads
        weights_bytes=ByteSize(15_230_000_000),
        kv_bytes_per_token=ByteSize(kv_bytes_per_token(28, 4, 128)),
    ),
    ModelProfile(
        id="mistralai/Mistral-7B-Instruct-v0.3",  # 7.25B params, bf16; GQA 32 layers, 8 KV heads
        weights_bytes=ByteSize(14_500_000_000),
        kv_bytes_per_token=ByteSize(kv_bytes_per_token(32, 8, 128)),
    ),
    ModelProfile(
        id="meta-llama/Llama-3.1-70B-Instruct",  # 70.6B params, bf16; GQA 80 layers, 8 KV heads
        weights_bytes=ByteSize(141_200_000_000),
        kv_bytes_per_token=ByteSize(kv_bytes_per_token(80, 8, 128)),
        devices_required=4,
    ),
    ModelProfile(
        id="Qwen/Qwen2.5-72B-Instruct",  # 72.7B params, bf16; GQA 80 layers, 8 KV heads
        weights_bytes=ByteSize(145_400_000_000),
        kv_bytes_per_token=ByteSize(kv_bytes_per_token(80, 8, 128)),
        devices_required=4,
    ),
)
"""Profiles of common open models at bf16 with fp16 KV (`examples/capacity/` has them as
YAML). The weights are parameters x 2 bytes; the KV cost is `kv_bytes_per_token`."""
