"""Small blobs travel inline beside their ref (a claim check); readers check the copy."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from assay.kernel import Refused, TenantId
from assay.kernel.canonical import canonical_bytes, digest
from assay.messages import MESSAGES, RunExecuted, RunVerified
from assay.store import FsBlobStore, S3BlobStore
from assay.store.inline_blobs import (
    DEFAULT_INLINE_MAX_BYTES,
    InlineCopyMismatch,
    claimed_blob,
    inline_copy,
)

TENANT = TenantId(uuid.UUID(int=7))
MESSAGES_DIR = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "messages"
DOC: dict[str, Any] = {"b": [1, 2.5, None], "a": "é", "c": {"z": True}}
BLOB = canonical_bytes(DOC)


class CountingBlobs(FsBlobStore):
    """A filesystem blob store that counts its reads."""

    gets = 0

    async def get(self, tenant: TenantId, ref: str) -> bytes | None:
        self.gets += 1
        return await super().get(tenant, ref)


def test_a_blob_travels_inline_up_to_the_threshold_and_no_further() -> None:
    assert inline_copy(BLOB, len(BLOB)) == DOC
    assert inline_copy(BLOB, len(BLOB) - 1) is None
    assert inline_copy(BLOB, 0) is None  # 0: never inline
    assert DEFAULT_INLINE_MAX_BYTES == 64 * 1024


async def test_an_inline_copy_is_read_instead_of_the_blob(tmp_path: Path) -> None:
    blobs = CountingBlobs(tmp_path)
    ref = await blobs.put(TENANT, BLOB)
    assert await claimed_blob(blobs, TENANT, ref, inline_copy(BLOB, 1024)) == BLOB
    assert blobs.gets == 0
    assert await claimed_blob(blobs, TENANT, ref, None) == BLOB  # none: the blob is read
    assert blobs.gets == 1


async def test_an_inline_copy_that_is_not_the_blob_is_refused(tmp_path: Path) -> None:
    blobs = CountingBlobs(tmp_path)
    ref = digest(BLOB)
    with pytest.raises(InlineCopyMismatch) as refused:
        await claimed_blob(blobs, TENANT, ref, {**DOC, "a": "e"})
    assert isinstance(refused.value, Refused)  # so the stage dead-letters the message
    assert ref in refused.value.reason
    with pytest.raises(InlineCopyMismatch):
        await claimed_blob(blobs, TENANT, ref, {**DOC, "b": [float("nan")]})
    assert blobs.gets == 0


async def test_a_checked_inline_copy_is_cached_so_a_later_read_makes_no_request() -> None:
    # Never opened: a read that reached the bucket would raise "is not open".
    s3 = S3BlobStore(None, "bucket", access_key_id=None, secret_access_key=None)
    ref = digest(BLOB)
    assert await claimed_blob(s3, TENANT, ref, DOC) == BLOB
    assert await s3.get(TENANT, ref) == BLOB
    with pytest.raises(RuntimeError, match="not open"):
        await s3.get(TenantId(uuid.UUID(int=8)), ref)  # another tenant's read is its own


@pytest.mark.parametrize("type_", ["RunExecuted", "RunVerified"])
def test_a_v4_run_reads_with_no_inline_copy_and_serialises_as_before(type_: str) -> None:
    v4 = json.loads((MESSAGES_DIR / f"{type_}.v4.json").read_text())
    msg = MESSAGES.decode(type_, 4, v4)
    assert isinstance(msg, RunExecuted | RunVerified)
    assert msg.episode_inline is None
    assert "episode_inline" not in msg.model_dump(mode="json")  # kept copies are unchanged


@pytest.mark.parametrize("type_", ["RunExecuted", "RunVerified"])
def test_the_v5_fixtures_inline_copy_is_the_blob_it_names(type_: str) -> None:
    v5 = json.loads((MESSAGES_DIR / f"{type_}.v5.json").read_text())
    msg = MESSAGES.decode(type_, 5, v5)
    assert isinstance(msg, RunExecuted | RunVerified)
    assert msg.episode_inline is not None
    assert digest(canonical_bytes(msg.episode_inline)) == msg.episode
