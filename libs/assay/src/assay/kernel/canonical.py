"""Canonical JSON and content hashing.

Canonical form: UTF-8 JSON, keys sorted, no insignificant whitespace, no NaN.
Two documents that differ only in key order or formatting have the same bytes
and so the same blake3 digest.
"""

from __future__ import annotations

import json
from typing import Any

import blake3


def canonical_bytes(value: Any) -> bytes:
    """Encode a JSON-compatible value canonically. Raises `ValueError` on NaN/inf."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def digest(data: bytes) -> str:
    """blake3 of `data`, as 64 lowercase hex characters."""
    return str(blake3.blake3(data).hexdigest())


def content_hash(value: Any) -> str:
    """blake3 of the canonical JSON of `value`."""
    return digest(canonical_bytes(value))
