"""Identifiers (§3, DESIGN §7).

Each identifier is a distinct type with no default value, so a placeholder
cannot type-check. `NewType` keeps them zero-cost at runtime and lets pydantic
validate them as their underlying types.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import NewType

from assay.kernel.canonical import digest

TenantId = NewType("TenantId", uuid.UUID)
"""A tenant. Every key and every blob path starts with one."""

WorkflowId = NewType("WorkflowId", str)
"""A logical workflow, stable across versions."""

WorkflowVersion = NewType("WorkflowVersion", str)
"""blake3 (hex) of the canonical workflow IR — never of the source text."""

StepId = NewType("StepId", str)
"""Author-assigned, opaque, stable across versions (§4.3)."""

TaskId = NewType("TaskId", str)
"""blake3 (hex) of the canonical task input before any workflow touches it (§11.5)."""

RunId = NewType("RunId", str)
"""A ULID: lexicographically sortable by creation time."""

BranchId = NewType("BranchId", int)
"""A rewind fork of a run (§8.5). The first branch is 0."""

AttemptNo = NewType("AttemptNo", int)
"""1-based attempt number of one step on one branch."""

Lsn = NewType("Lsn", int)
"""Per-branch log sequence number, from 0."""

GroupEpoch = NewType("GroupEpoch", int)
"""Comparison-group generation (§11.6)."""

MessageId = NewType("MessageId", str)
"""Deterministic id of one bus message; the inbox dedupes on it."""

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def tenant_id(value: str | uuid.UUID) -> TenantId:
    """Parse a tenant id; raises `ValueError` on anything that is not a UUID."""
    return TenantId(value if isinstance(value, uuid.UUID) else uuid.UUID(str(value)))


def new_run_id(at_ms: int | None = None, entropy: bytes | None = None) -> RunId:
    """A ULID. Pass both arguments to derive it deterministically from an input.

    Args:
        at_ms: creation time in Unix milliseconds (now if omitted).
        entropy: at least 10 bytes of randomness (os.urandom if omitted).
    """
    ms = int(time.time() * 1000) if at_ms is None else at_ms
    rnd = os.urandom(10) if entropy is None else entropy[:10]
    if len(rnd) < 10:
        raise ValueError("a ULID needs 10 bytes of entropy")
    value = (ms & ((1 << 48) - 1)) << 80 | int.from_bytes(rnd, "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return RunId("".join(reversed(chars)))


def run_id_from(at_ms: int, seed: str) -> RunId:
    """A ULID derived from a time and a seed: the same input gives the same run."""
    return new_run_id(at_ms, bytes.fromhex(digest(seed.encode()))[:10])


def is_run_id(value: str) -> bool:
    """True if `value` is a well-formed ULID."""
    return len(value) == 26 and all(c in _CROCKFORD for c in value) and value[0] <= "7"
