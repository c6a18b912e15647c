"""The residency invariant and the derived context ceiling (§14.2), against numbers
worked by hand; admission never lets the invariant break, however admissions interleave."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from assay.kernel.capacity import (
    EXAMPLE_PROFILES,
    Capacity,
    CapacityExceeded,
    CapacityInvalid,
    CapacityLedger,
    CapacityLimits,
    Demand,
    ModelProfile,
    kv_bytes_per_token,
)

GB = 10**9
L8B = "meta-llama/Llama-3.1-8B-Instruct"
L70B = "meta-llama/Llama-3.1-70B-Instruct"
QWEN7B = "Qwen/Qwen2.5-7B-Instruct"


def deployment(
    vram: int = 80 * GB, devices: int = 1, max_resident: int = 1, pinned: tuple[str, ...] = (L8B,)
) -> Capacity:
    return Capacity(
        limits=CapacityLimits(
            vram_bytes_per_device=vram,
            devices=devices,
            max_resident_models=max_resident,
            pinned=pinned,
        ),
        models=EXAMPLE_PROFILES,
    )


def test_kv_per_token_is_the_gqa_arithmetic() -> None:
    # 8B-class: 2 (K, V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes = 131,072 B
    assert kv_bytes_per_token(32, 8, 128) == 2 * 32 * 8 * 128 * 2 == 131_072
    # 70B-class: 2 x 80 x 8 x 128 x 2 = 327,680 B, the seed's "0.33 MB"
    assert kv_bytes_per_token(80, 8, 128) == 327_680


def test_the_seeds_two_full_ceiling_episodes() -> None:
    """§14.2: two episodes at the 200k retention ceiling are 400k tokens in one judge call."""
    cap = deployment()
    judge_call = Demand(L8B, context_tokens=2 * 200_000)
    kv = judge_call.kv_bytes(cap.profile(L8B))
    assert kv == 400_000 * 131_072 == 52_428_800_000  # the seed's 52 GB, before weights
    # With the agent pinned on the same model and one agent call of its own at the
    # retention ceiling in flight, the judge's call does not fit the 80 GB device:
    # 16.06 + 52.43 + 26.21 = 94.70 GB > 80 GB.
    agent_call = Demand(L8B, context_tokens=200_000).kv_bytes(cap.profile(L8B))
    with pytest.raises(CapacityExceeded) as exc:
        cap.check([L8B], {L8B: kv + agent_call})
    assert exc.value.limit == "vram_bytes_per_device"
    assert "94.70 GB exceed vram_bytes_per_device x devices = 80.00 GB x 1 = 80.00 GB" in str(
        exc.value
    )
    # Alone on an idle device it is 68.49 GB and fits; at 70B it is 131 GB of KV alone.
    cap.check([L8B], {L8B: kv})
    assert Demand(L70B, 400_000).kv_bytes(cap.profile(L70B)) == 131_072_000_000 > 80 * GB


def test_derived_context_ceiling() -> None:
    cap = deployment()
    # (80e9 - 16.06e9) / 131,072 = 487,823.48 -> 487,823 tokens
    assert cap.max_context_tokens(L8B) == (80 * GB - 16_060_000_000) // 131_072 == 487_823
    # 70B over 4 x 80 GB: (320e9 - 141.2e9) / 327,680 = 545,654.29
    big = deployment(devices=4, pinned=(L70B,))
    assert big.max_context_tokens(L70B) == 545_654
    # A second resident model's weights come off the ceiling: Qwen 7B beside Llama 8B
    two = deployment(max_resident=2)
    assert two.max_context_tokens(L8B, [QWEN7B]) == (80 * GB - 16_060_000_000 - 15_230_000_000) // (
        131_072
    )
    # Weights that do not fit leave no context at all
    assert deployment(vram=10 * GB).max_context_tokens(L8B) == 0


def test_a_second_model_needs_room_and_a_slot() -> None:
    with pytest.raises(CapacityExceeded, match=r"2 resident models .* max_resident_models=1"):
        deployment().check([QWEN7B])
    deployment(max_resident=2).check([QWEN7B])  # 31.29 GB of weights fit 80 GB
    with pytest.raises(CapacityExceeded, match="vram_bytes_per_device"):
        deployment(vram=24 * GB, max_resident=2).check([QWEN7B])


def test_a_model_spanning_devices_counts_on_each() -> None:
    """70B over 4 x 40 GB: 35.3 GB on each device; an 8B beside it needs 16.06 GB on one
    of them — 51.36 GB > 40 GB — although 157.26 GB of 160 GB fit in aggregate."""
    cap = deployment(vram=40 * GB, devices=4, max_resident=2, pinned=(L70B,))
    cap.check([])
    with pytest.raises(CapacityExceeded, match=r"device \d would hold 51.36 GB"):
        cap.check([L8B])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"pinned": ("nobody/unknown",)}, "pinned: model 'nobody/unknown' has no profile"),
        ({"max_resident_models": 1, "pinned": (L8B, QWEN7B)}, "2 models pinned"),
    ],
)
def test_contradictions_are_refused_naming_the_field(change: dict[str, object], field: str) -> None:
    limits = {"vram_bytes_per_device": 80 * GB, "devices": 1, "pinned": (L8B,), **change}
    with pytest.raises(ValidationError, match=field):
        Capacity(limits=CapacityLimits.model_validate(limits), models=EXAMPLE_PROFILES)


@pytest.mark.parametrize("size", [0, -1, "-5GB", "lots"])
def test_sizes_must_be_positive(size: object) -> None:
    with pytest.raises(ValidationError, match="weights_bytes"):
        ModelProfile.model_validate({"id": "m", "weights_bytes": size, "kv_bytes_per_token": 1})


def test_a_model_needs_its_devices() -> None:
    with pytest.raises(CapacityExceeded, match="needs devices_required=4 devices; devices is 2"):
        deployment(devices=2, pinned=(L70B,)).check([])


def test_unknown_model_is_named() -> None:
    with pytest.raises(CapacityInvalid, match="'gpt-x' has no capacity profile"):
        CapacityLedger(deployment()).admit("run", Demand("gpt-x", 1000))


def test_ledger_admits_until_full_and_releases() -> None:
    ledger = CapacityLedger(deployment())
    # room for 487,823 tokens of KV: three runs of 150k fit, a fourth does not
    for i in range(3):
        assert ledger.admit(f"r{i}", Demand(L8B, 150_000)) is None
    refused = ledger.admit("r3", Demand(L8B, 150_000))
    assert refused is not None
    assert refused.limit == "vram_bytes_per_device"
    assert ledger.refusals == {"vram_bytes_per_device": 1}
    assert ledger.admit("r0", Demand(L8B, 150_000)) is None  # already held: not twice
    assert ledger.held == 3
    ledger.release("r1")
    assert ledger.admit("r3", Demand(L8B, 150_000)) is None


def _holds_invariant(ledger: CapacityLedger) -> None:
    ledger.capacity.check(ledger.resident, ledger.kv_in_flight())


demands = st.lists(
    st.tuples(
        st.sampled_from([L8B, QWEN7B]),
        st.integers(1, 400_000),
        st.integers(1, 4),
        st.booleans(),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(demands)
def test_concurrent_admissions_never_break_the_invariant(
    script: list[tuple[str, int, int, bool]],
) -> None:
    """Admissions and releases on many threads at once: whatever was admitted, the
    invariant holds with all of it in flight, after every step and at the end."""
    ledger = CapacityLedger(deployment(max_resident=2))
    broken: list[Exception] = []
    start = threading.Barrier(len(script))

    def one(i: int, model: str, tokens: int, calls: int, release: bool) -> None:
        start.wait()
        if ledger.admit(f"r{i}", Demand(model, tokens, calls)) is None and release:
            ledger.release(f"r{i}")
        try:
            with ledger._lock:
                _holds_invariant(ledger)
        except CapacityExceeded as exc:
            broken.append(exc)

    threads = [threading.Thread(target=one, args=(i, *s)) for i, s in enumerate(script)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert broken == []
    _holds_invariant(ledger)
    assert ledger.held + sum(ledger.refusals.values()) + sum(s[3] for s in script) >= len(script)


@settings(max_examples=30, deadline=None)
@given(demands)
async def test_interleaved_async_admissions_keep_the_invariant(
    script: list[tuple[str, int, int, bool]],
) -> None:
    ledger = CapacityLedger(deployment(max_resident=2))
    admitted: list[str] = []

    async def one(i: int, model: str, tokens: int, calls: int, release: bool) -> None:
        await asyncio.sleep(0)
        if ledger.admit(f"r{i}", Demand(model, tokens, calls)) is None:
            admitted.append(f"r{i}")
            await asyncio.sleep(0)
            if release:
                ledger.release(f"r{i}")
        _holds_invariant(ledger)

    await asyncio.gather(*(one(i, *s) for i, s in enumerate(script)))
    assert ledger.held == sum(1 for i, s in enumerate(script) if f"r{i}" in admitted and not s[3])
