"""Kafka record headers through a transport that takes one text value per name.

A Kafka record's headers are a list of (name, bytes) pairs: a name may repeat
and a value may be any bytes. FastStream's `KafkaBroker.publish` takes
`dict[str, str]` and encodes each value as UTF-8. Assay's own headers fit that
(ASCII, one per name), but a dead letter copies the headers of a record some
other producer wrote. When a list does not fit a dict exactly, the dict keeps
each name's last value (undecodable bytes replaced) and the complete list goes
along in one more header, `assay-dlq-original-headers`: a JSON array of
`[name, base64(value)]` pairs, in order. Nothing a producer sent is lost.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence

from assay.kernel.errors import AssayError

ORIGINAL_HEADERS = "assay-dlq-original-headers"
"""The header carrying a record's complete header list when a dict could not."""

DLQ_REASON = "assay-dlq-reason"
"""The header on a dead letter saying why the stage refused the record."""

Headers = tuple[tuple[str, bytes], ...]


class BadOriginalHeaders(AssayError):
    """An `assay-dlq-original-headers` value that is not the encoding this module writes."""


def _text(value: bytes) -> str | None:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return None


def as_text(headers: Sequence[tuple[str, bytes]]) -> dict[str, str]:
    """`headers` as one text value per name, plus `ORIGINAL_HEADERS` when that loses anything.

    Exact (the same list comes out of the dict, values encoded as UTF-8) when
    every name is given once and every value is UTF-8.
    """
    out: dict[str, str] = {}
    exact = True
    for name, value in headers:
        text = _text(value)
        exact = exact and text is not None and name not in out
        out[name] = text if text is not None else value.decode("utf-8", errors="replace")
    if not exact:
        out[ORIGINAL_HEADERS] = encode(headers)
    return out


def encode(headers: Sequence[tuple[str, bytes]]) -> str:
    """The `ORIGINAL_HEADERS` value of `headers`: JSON `[[name, base64(value)], ...]` (ASCII)."""
    pairs = [[name, base64.b64encode(value).decode("ascii")] for name, value in headers]
    return json.dumps(pairs, separators=(",", ":"))


def original_headers(received: Sequence[tuple[str, bytes | None]]) -> Headers:
    """The headers a record was published with, from the headers it was read with.

    When `ORIGINAL_HEADERS` is there, its list exactly; otherwise the received
    headers as they are (a value-less header as empty bytes).

    Raises:
        BadOriginalHeaders: `ORIGINAL_HEADERS` is there but is not a list of
            `[name, base64]` pairs.
    """
    carried = [v for k, v in received if k == ORIGINAL_HEADERS]
    if not carried:
        return tuple((k, v if v is not None else b"") for k, v in received)
    try:
        pairs = json.loads(carried[-1] or b"")
        if not isinstance(pairs, list):
            raise TypeError("not a list")
        out = []
        for name, value in pairs:
            if not isinstance(name, str) or not isinstance(value, str):
                raise TypeError(f"not a [name, base64] pair: {[name, value]!r}")
            out.append((name, base64.b64decode(value, validate=True)))
    except (ValueError, TypeError, binascii.Error) as exc:
        raise BadOriginalHeaders(f"{ORIGINAL_HEADERS} is not a header list: {exc}") from exc
    return tuple(out)
