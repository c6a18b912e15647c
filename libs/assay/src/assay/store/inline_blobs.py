"""Small blobs that travel inline in a message beside their ref (a claim check, §7).

The writer stores the blob as always — it stays the durable copy that retention,
tiering, the console and `assay runs show` read — and, when it is small, also puts
its JSON document in the message that names it. A reader takes the inline copy
when there is one, after checking that its canonical bytes are the blob the ref
names (a ref is the blake3 digest of its blob's bytes), and reads the blob
otherwise: one S3 write per blob, and no read for most of them.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from assay.kernel.canonical import canonical_bytes, digest
from assay.kernel.errors import Refused
from assay.kernel.ids import TenantId
from assay.store.ports import BlobStore

DEFAULT_INLINE_MAX_BYTES = 64 * 1024
"""Blobs of at most this many bytes travel inline by default: well under the 1 MiB a
Kafka broker accepts in one message by default, with room for the rest of it."""

MAX_INLINE_MAX_BYTES = 512 * 1024
"""The most a setting may allow inline: half of a broker's default largest message."""


class InlineCopyMismatch(Refused):
    """A message's inline copy of a blob is not the blob its ref names: the message is
    corrupt, and goes to the stage's dead-letter topic with this reason."""


@runtime_checkable
class RemembersBlobs(Protocol):
    """A blob store that keeps blobs it is handed (an in-process cache)."""

    def remember(self, tenant: TenantId, ref: str, content: bytes) -> None:
        """Keep `content`, known to be the blob `ref`, for later reads."""
        ...


def inline_copy(content: bytes, max_bytes: int) -> dict[str, Any] | None:
    """The JSON document a blob's canonical bytes encode, to carry inline; None when the
    blob is larger than `max_bytes` (0: never inline).

    `content` must be canonical JSON of an object (what `Episode.encode` writes), so the
    reader's `canonical_bytes` of the document gives back the same bytes.
    """
    if len(content) > max_bytes:
        return None
    document = json.loads(content)
    if not isinstance(document, dict):
        raise TypeError("only a JSON object travels inline")
    return document


async def claimed_blob(
    blobs: BlobStore, tenant: TenantId, ref: str, inline: dict[str, Any] | None
) -> bytes | None:
    """The bytes of the blob `ref` of `tenant`: its inline copy when the message carried
    one (checked against `ref`, then handed to the store's cache if it keeps one, so a
    later read of the blob here makes no request), else the stored blob (None: gone).

    Raises:
        InlineCopyMismatch: the inline copy's canonical bytes do not hash to `ref`.
        BadBlobRef: `ref` is malformed (only when the blob is read).
    """
    if inline is None:
        return await blobs.get(tenant, ref)
    try:
        content = canonical_bytes(inline)
    except ValueError:  # NaN or infinity: no blob ever held them
        content = b""
    if digest(content) != ref:
        raise InlineCopyMismatch(f"the inline copy of blob {ref} does not match its digest")
    if isinstance(blobs, RemembersBlobs):
        blobs.remember(tenant, ref, content)
    return content
