"""Derived state as a pure fold of the log (§2 principle 4).

A stage's derived state is a set of JSON documents keyed `(tenant, kind, key)`.
It changes only through `StateDelta`s that the stage's fold computes from log
records alone, so dropping it and re-folding the log reproduces it byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from assay.kernel.ids import TenantId
from assay.record.events import LogRecord


@dataclass(frozen=True, order=True)
class StateKey:
    """Address of one derived document. The tenant comes first, always."""

    tenant: TenantId
    kind: str
    key: str


@dataclass(frozen=True)
class Put:
    """Replace the document at `at` with `value`."""

    at: StateKey
    value: dict[str, Any]


@dataclass(frozen=True)
class Patch:
    """Shallow-merge `fields` into the document at `at` (created if absent)."""

    at: StateKey
    fields: dict[str, Any]


@dataclass(frozen=True)
class Delete:
    """Remove the document at `at` (no-op if absent)."""

    at: StateKey


StateDelta = Put | Patch | Delete
Fold = Callable[[LogRecord], list[StateDelta]]
"""A stage's fold: a pure function of one record. It reads no other state."""


def apply_delta(current: dict[str, Any] | None, delta: StateDelta) -> dict[str, Any] | None:
    """The document after `delta`, given the document before it."""
    match delta:
        case Put(value=value):
            return dict(value)
        case Patch(fields=fields):
            return {**(current or {}), **fields}
        case Delete():
            return None
