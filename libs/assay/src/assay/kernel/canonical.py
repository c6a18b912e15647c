"""Canonical JSON and content hashing.

Canonical form: UTF-8 JSON, keys sorted, no insignificant whitespace, no NaN.
Two documents that differ only in key order or formatting have the same bytes
and so the same blake3 digest.
"""

from __future__ import annotations

import json
from typing import Any

import blake3
import orjson

_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)
"""What `json.dumps` with these options builds on every call; one, built once (an
encoder keeps no state between calls)."""


def canonical_bytes(value: Any) -> bytes:
    """Encode a JSON-compatible value canonically. Raises `ValueError` on NaN/inf."""
    return _CANONICAL.encode(value).encode()


def document_bytes(value: dict[str, Any]) -> bytes:
    """Canonical bytes of a derived-state document, fast (the commit path writes many).

    Same canonical form as `canonical_bytes` (sorted keys, compact, UTF-8), but a
    non-finite float is refused rather than silently written as null.
    """
    out = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    if b"null" in out and _has_non_finite(value):
        raise ValueError("a derived document holds NaN or infinity")
    return out


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return value != value or value in (float("inf"), float("-inf"))
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_non_finite(v) for v in value)
    return False


def digest(data: bytes) -> str:
    """blake3 of `data`, as 64 lowercase hex characters."""
    return str(blake3.blake3(data).hexdigest())


def content_hash(value: Any) -> str:
    """blake3 of the canonical JSON of `value`."""
    return digest(canonical_bytes(value))
