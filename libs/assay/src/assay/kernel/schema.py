"""Versioned contracts: a stable type name, an integer version, upcasters (§8.7).

Used by log events and bus messages alike. The stored type name is a literal,
never a Python import path, so moving a class never breaks stored data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from assay.kernel.errors import AssayError


def one_line(exc: ValidationError) -> str:
    """A pydantic validation error as one line: where, what, and how many more."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top)"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"


class UnknownSchema(AssayError):
    """A record or message of a type or version this code cannot decode."""


class Versioned(BaseModel):
    """A frozen model with a stable `type` name and a schema `version`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    type: ClassVar[str]
    version: ClassVar[int]


V = TypeVar("V", bound=Versioned)
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


class SchemaRegistry(Generic[V]):
    """Maps `(type, version)` to models at their current version, plus upcasters."""

    def __init__(self, models: Iterable[type[V]] = ()) -> None:
        self._latest: dict[str, type[V]] = {}
        self._upcasters: dict[tuple[str, int], Upcaster] = {}
        for m in models:
            self.register(m)

    def register(self, model: type[V]) -> type[V]:
        """Register the current version of a type (usable as a decorator)."""
        prior = self._latest.get(model.type)
        if prior is not None and prior is not model:
            raise ValueError(f"type {model.type!r} registered twice")
        self._latest[model.type] = model
        return model

    def upcaster(self, type_: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        """Register `fn(payload at from_version) -> payload at from_version + 1`."""

        def deco(fn: Upcaster) -> Upcaster:
            self._upcasters[(type_, from_version)] = fn
            return fn

        return deco

    def types(self) -> dict[str, type[V]]:
        """Every registered type at its current version."""
        return dict(self._latest)

    def versions(self, type_: str) -> list[int]:
        """Every version of `type_` that still decodes, oldest first."""
        latest = self._latest[type_].version
        return [*sorted(v for (t, v) in self._upcasters if t == type_), latest]

    def decode(self, type_: str, version: int, payload: dict[str, Any]) -> V:
        """Decode a payload, upcasting it to the current version.

        Raises:
            UnknownSchema: unknown type, a version newer than this code, a gap
                in the upcaster chain, or a payload that does not validate.
        """
        model = self._latest.get(type_)
        if model is None:
            raise UnknownSchema(f"unknown type {type_!r}")
        if version > model.version or version < 1:
            raise UnknownSchema(
                f"{type_!r} has schema version {version}; this code reads 1..{model.version}"
            )
        while version < model.version:
            step = self._upcasters.get((type_, version))
            if step is None:
                raise UnknownSchema(f"no upcaster for {type_!r} from version {version}")
            payload = step(payload)
            version += 1
        try:
            return model.model_validate(payload)
        except ValidationError as exc:
            raise UnknownSchema(f"{type_!r} v{version}: {one_line(exc)}") from exc
