"""The envelope every bus message travels in (DESIGN §5).

The JSON body holds the envelope and the payload; Kafka headers repeat the
envelope fields so a consumer can route without parsing the body.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from assay.kernel.canonical import canonical_bytes, digest
from assay.kernel.errors import Refused
from assay.kernel.ids import MessageId, TenantId
from assay.kernel.schema import Versioned, one_line

MAX_MESSAGE_BYTES = 1_000_000
"""Larger payloads are refused; large content travels as blobs."""


class Envelope(BaseModel):
    """Metadata of one message plus its payload at `schema_version`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: MessageId = Field(description="Deterministic id; consumers dedupe on it.")
    type: str = Field(description="Stable message type name.")
    schema_version: int = Field(ge=1, description="Version of the payload's schema.")
    tenant: TenantId = Field(description="Tenant the message belongs to.")
    key: str = Field(description="Partition key, `tenant:...` as the topic defines.")
    occurred_at: datetime = Field(description="When the producing fact was committed.")
    causation_id: MessageId | None = Field(None, description="The message that caused this one.")
    correlation_id: str = Field(description="Shared by every message of one submitted task.")
    traceparent: str = Field(description="W3C trace context.")
    payload: dict[str, Any] = Field(description="The message, as its schema version defines it.")

    def encode(self, *, payload: bytes | None = None) -> bytes:
        """The wire body (canonical JSON).

        Args:
            payload: the canonical bytes of `self.payload` when the caller has them
                already (it hashed them for the message id): they are used as they are,
                not encoded again. The body is the same bytes either way.
        """
        if payload is None:
            return canonical_bytes(self.model_dump(mode="json"))
        # Canonical JSON sorts keys: the payload sits between the fields that sort before
        # and after its name, each half encoded as the whole would encode it.
        fields = self.model_dump(mode="json", exclude={"payload"})
        before = canonical_bytes({k: v for k, v in fields.items() if k < "payload"})
        after = canonical_bytes({k: v for k, v in fields.items() if k > "payload"})
        return b"".join(
            (
                before[:-1],
                b"," if len(before) > 2 else b"",
                b'"payload":',
                payload,
                b"," if len(after) > 2 else b"",
                after[1:],
            )
        )

    def headers(self) -> list[tuple[str, bytes]]:
        """Kafka headers mirroring the envelope (everything but the payload)."""
        fields = self.model_dump(mode="json", exclude={"payload"})
        return [(k, str(v).encode()) for k, v in fields.items() if v is not None]


def message_id(*parts: str) -> MessageId:
    """A deterministic message id from the parts that identify the fact."""
    return MessageId(digest("\x1f".join(parts).encode())[:32])


def traceparent_for(correlation_id: str, span_seed: str) -> str:
    """A W3C traceparent whose trace id follows the correlation id."""
    trace = digest(correlation_id.encode())[:32]
    span = digest(span_seed.encode())[:16]
    return f"00-{trace}-{span}-01"


_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def valid_traceparent(value: str | None) -> bool:
    """Whether `value` is a W3C `traceparent` of version 00 with non-zero ids."""
    found = _TRACEPARENT.fullmatch(value or "")
    return found is not None and set(found[1]) != {"0"} and set(found[2]) != {"0"}


def continue_trace(traceparent: str, span_seed: str) -> str | None:
    """A child of `traceparent`: the same trace and flags, a span id derived from
    `span_seed`; None if `traceparent` is not valid."""
    if not valid_traceparent(traceparent):
        return None
    _, trace, _, flags = traceparent.split("-")
    return f"00-{trace}-{digest(span_seed.encode())[:16]}-{flags}"


def seal(
    msg: Versioned,
    *,
    tenant: TenantId,
    key: str,
    id: MessageId,
    causation: Envelope | None,
    correlation_id: str | None = None,
    occurred_at: datetime | None = None,
    traceparent: str | None = None,
    payload: dict[str, Any] | None = None,
) -> Envelope:
    """Wrap a message in an envelope; correlation and trace follow the cause.

    The trace is `traceparent` where that is valid (the span that produced the
    message), else a child of the cause's trace, else a new one whose trace id
    follows the correlation id. `payload` is `msg.model_dump(mode="json")` when the
    caller has made it already (it is not made again).
    """
    corr = correlation_id or (causation.correlation_id if causation else id)
    if not valid_traceparent(traceparent):
        traceparent = (
            continue_trace(causation.traceparent, id) if causation is not None else None
        ) or traceparent_for(corr, id)
    return Envelope(
        id=id,
        type=msg.type,
        schema_version=msg.version,
        tenant=tenant,
        key=key,
        occurred_at=occurred_at or (causation.occurred_at if causation else datetime.now(UTC)),
        causation_id=causation.id if causation else None,
        correlation_id=corr,
        traceparent=traceparent,
        payload=msg.model_dump(mode="json") if payload is None else payload,
    )


def open_envelope(value: bytes) -> Envelope:
    """Decode a wire body.

    Raises:
        Refused: oversized, not JSON, or not an envelope.
    """
    if len(value) > MAX_MESSAGE_BYTES:
        raise Refused(f"message of {len(value)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:  # parsed and validated in one pass; what it refuses is read again below
        return Envelope.model_validate_json(value)
    except ValidationError:
        # pydantic's parser refuses some bodies `json.loads` reads (a UTF-8 byte order
        # mark, a lone surrogate escape): the way below decides those, and words the
        # reason of a refusal, exactly as before.
        pass
    try:
        doc = json.loads(value)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise Refused(f"not JSON: {exc}") from exc
    try:
        return Envelope.model_validate(doc)
    except ValidationError as exc:
        raise Refused(f"not an envelope: {one_line(exc)}") from exc
