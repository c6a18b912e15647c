"""Derived state as a pure fold of the log (§2 principle 4).

A stage's derived state is a set of JSON documents keyed `(tenant, kind, key)`.
It changes only through `StateDelta`s that the stage's fold computes from log
records alone, so dropping it and re-folding the log reproduces it byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

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


class ReadModel(BaseModel):
    """A derived document, typed: what a fold puts and a handler gets back.

    `kind` names the documents of one model in the store. A model's dump is the
    stored document, so its fields are the stored keys: rename or reshape one and
    stored state stops folding identically (tests/test_stored_state.py). A model
    built by `Patch`es gives every patched-in field a default.
    """

    model_config = ConfigDict(frozen=True)
    kind: ClassVar[str]

    def put(self, tenant: TenantId, key: str) -> Put:
        """Replace this model's document at `key` of `tenant` with this one."""
        return Put(StateKey(tenant, self.kind, key), self.model_dump(mode="json"))

    @classmethod
    def at(cls, tenant: TenantId, key: str) -> StateKey:
        """The address of this model's document at `key` of `tenant`."""
        return StateKey(tenant, cls.kind, key)


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
