"""S3 adapter of `BlobStore`: content-addressed, one key prefix per tenant (§3, §7)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, cast

from botocore.exceptions import ClientError

from assay.kernel.canonical import digest
from assay.kernel.ids import TenantId
from assay.store.blob_cache import BlobCache
from assay.store.fs_blobs import check_ref
from assay.store.s3_put import PutFailed, SignedPut

if TYPE_CHECKING:
    from types_aiobotocore_s3 import S3Client
    from types_aiobotocore_s3.literals import BucketLocationConstraintType

log = logging.getLogger(__name__)

# GetObject on a missing key answers NoSuchKey; a bodiless 404 carries only the status.
_MISSING_KEY = frozenset({"NoSuchKey", "404"})

UNREFERENCED_ENDPOINT_PARAMS = frozenset({"Key", "Prefix", "CopySource"})
"""Parameters of S3's endpoint rule set that none of its rules reads."""


def resolve_endpoints_per_bucket(client: Any) -> None:
    """Make `client` resolve its endpoint once per bucket, not once per object.

    botocore resolves a request's endpoint by evaluating S3's rule set, caching the
    result by the rule set's parameters; those include the object's `Key` (and
    `Prefix`, `CopySource`), which no rule reads, so the cache missed for every
    object and the evaluation was a quarter of each request's CPU
    (boto/botocore#3528). Fixed upstream by dropping them before the lookup
    (boto/botocore#3692), later than the botocore aiobotocore pins here; this does
    the same. `test_store_s3` fails should a rule come to read one of them.
    """
    provider = getattr(getattr(client, "_ruleset_resolver", None), "_provider", None)
    if provider is None:  # another botocore: leave it as it is
        return
    resolve = provider.resolve_endpoint

    def per_bucket(**params: Any) -> Any:
        kept = {k: v for k, v in params.items() if k not in UNREFERENCED_ENDPOINT_PARAMS}
        return resolve(**kept)

    provider.resolve_endpoint = per_bucket


class S3BlobStore:
    """Blobs in one bucket under `<prefix>tenants/<tenant>/blobs/<ref[:2]>/<ref>`.

    Same contract as `FsBlobStore`: a blob's ref is the blake3 hex digest of its
    bytes, and every key carries the tenant, so one tenant never reads, overwrites
    or deletes another's blob even when both stored the same bytes. Refs are
    checked before any request is made (`BadBlobRef`).

    Works against AWS S3 and S3-compatible servers (MinIO, moto): requests use
    path-style addressing. One client is held from `open()` to `close()`.

    Blobs read are kept in `cache` (`assay.store.blob_cache`): a stage that reads
    an episode again (the tournament, for the reference of every challenger of a
    task) reads it from memory, not from the bucket; so are blobs that came inline with
    a message, checked against their ref (`remember`). Blobs written are not: a read
    right after a write (a run's archive, read back before its records are
    deleted) must come from the bucket.
    """

    def __init__(
        self,
        endpoint_url: str | None,
        bucket: str,
        *,
        access_key_id: str | None,
        secret_access_key: str | None,
        region: str = "us-east-1",
        prefix: str = "",
        cache: BlobCache | None = None,
    ) -> None:
        """Describe the store; nothing is contacted until `open()`.

        Args:
            endpoint_url: the S3 API's URL, or None for AWS S3's own endpoint.
            bucket: the bucket holding every tenant's blobs.
            access_key_id: the key id requests are signed with; None (with a None
                secret) takes credentials from the SDK's default chain (environment,
                shared config, instance or pod role).
            secret_access_key: the secret half of those credentials, or None.
            region: the bucket's region (the region a new bucket is created in).
            prefix: a key prefix the store never leaves, e.g. `"assay/prod/"`; a
                missing trailing `/` is added so one prefix never overlaps another.
            cache: the in-process cache of blobs (a default-sized one when None).
        """
        self._endpoint_url = endpoint_url
        self._bucket = bucket
        self._region = region
        self._prefix = prefix if not prefix or prefix.endswith("/") else f"{prefix}/"
        self._credentials = (access_key_id, secret_access_key)
        self._stack: AsyncExitStack | None = None
        self._client: S3Client | None = None
        self._writer: SignedPut | None = None
        """Writes blobs without botocore when it can sign them alone (`assay.store.s3_put`)."""
        self._opening = asyncio.Lock()
        self.cache = cache if cache is not None else BlobCache()

    @property
    def bucket(self) -> str:
        """The bucket the store writes to."""
        return self._bucket

    @property
    def prefix(self) -> str:
        """The key prefix every object of this store starts with ("" for none)."""
        return self._prefix

    def key(self, tenant: TenantId, ref: str) -> str:
        """The object key of `ref` for `tenant`.

        Raises:
            BadBlobRef: `ref` is not a blake3 hex digest.
        """
        check_ref(ref)
        return f"{self._prefix}tenants/{tenant}/blobs/{ref[:2]}/{ref}"

    async def open(self) -> S3BlobStore:
        """Connect, and create the bucket if it does not exist (idempotent).

        Raises:
            botocore.exceptions.ClientError: the bucket cannot be reached or created
                (for example, it exists but belongs to someone else).
        """
        async with self._opening:  # concurrent opens of one store make one client
            if self._client is None:
                self._stack, self._client = await self._connect()
        return self

    async def _connect(self) -> tuple[AsyncExitStack, S3Client]:
        # Imported here: the SDK takes about a second to import, and embedded mode never needs it.
        import aioboto3
        from aiobotocore.config import AioConfig

        session = aioboto3.Session(
            aws_access_key_id=self._credentials[0],
            aws_secret_access_key=self._credentials[1],
            region_name=self._region,
        )
        stack = AsyncExitStack()
        try:
            client = await stack.enter_async_context(
                session.client(
                    "s3",
                    endpoint_url=self._endpoint_url,
                    config=AioConfig(s3={"addressing_style": "path"}),
                )
            )
            resolve_endpoints_per_bucket(client)
            await self._ensure_bucket(client)
            key_id, secret = self._credentials
            if self._endpoint_url and key_id and secret:
                writer = SignedPut(
                    self._endpoint_url,
                    self._bucket,
                    access_key_id=key_id,
                    secret=secret,
                    region=self._region,
                )
                self._writer = writer.open()
                stack.push_async_callback(writer.close)
        except BaseException:
            await stack.aclose()
            raise
        return stack, client

    async def _ensure_bucket(self, client: S3Client) -> None:
        try:
            await client.head_bucket(Bucket=self._bucket)
            return
        except ClientError as exc:
            if _code(exc) not in ("404", "NoSuchBucket", "NotFound"):
                raise
        try:
            if self._region == "us-east-1":  # the one region that refuses a LocationConstraint
                await client.create_bucket(Bucket=self._bucket)
            else:
                # The stubs list AWS's regions; an S3-compatible server may name its own.
                where = cast("BucketLocationConstraintType", self._region)
                await client.create_bucket(
                    Bucket=self._bucket, CreateBucketConfiguration={"LocationConstraint": where}
                )
        except ClientError as exc:
            # Another opener created it between our HEAD and our CREATE.
            if _code(exc) != "BucketAlreadyOwnedByYou":
                raise

    async def close(self) -> None:
        """Release the client. Safe to call more than once."""
        stack, self._stack, self._client = self._stack, None, None
        self._writer = None
        if stack is not None:
            await stack.aclose()

    @property
    def _s3(self) -> S3Client:
        if self._client is None:
            raise RuntimeError(f"blob store s3://{self._bucket}/{self._prefix} is not open")
        return self._client

    async def put(self, tenant: TenantId, content: bytes) -> str:
        """Store `content` for `tenant`; return its ref. Idempotent.

        The key is derived from the bytes, so writing a ref again writes the same
        bytes again: a repeated or concurrent put can never change a stored blob.
        The blob is durable when this returns (S3 acknowledges a PUT once stored).
        """
        ref = digest(content)
        key = self.key(tenant, ref)
        writer = self._writer
        if writer is None:
            await self._s3.put_object(Bucket=self._bucket, Key=key, Body=content)
            return ref
        try:
            await writer.put(key, content)
            return ref
        except PutFailed as exc:  # the client writes it, with its retries and its errors
            await self._s3.put_object(Bucket=self._bucket, Key=key, Body=content)
            refused = exc.status is not None and 400 <= exc.status < 500
            if refused and self._writer is writer:  # S3 refuses what the client's signer passes
                log.warning("S3 writes go through the SDK from now on: %s", exc)
                self._writer = None
        return ref

    async def get(self, tenant: TenantId, ref: str) -> bytes | None:
        """The blob's bytes, or None when this tenant has no blob `ref`.

        Raises:
            BadBlobRef: `ref` is malformed.
            botocore.exceptions.ClientError: any failure other than a missing key
                (a missing bucket included: that is misconfiguration, not absence).
        """
        key = self.key(tenant, ref)
        cached = self.cache.get(tenant, ref)
        if cached is not None:
            return cached
        try:
            response = await self._s3.get_object(Bucket=self._bucket, Key=key)
        except ClientError as exc:
            if _code(exc) in _MISSING_KEY:
                return None
            raise
        async with response["Body"] as body:
            content = await body.read()
        self.cache.put(tenant, ref, content)
        return content

    def remember(self, tenant: TenantId, ref: str, content: bytes) -> None:
        """Keep `content` in the cache as the blob `ref` of `tenant`, so the next read of
        it here makes no request. The caller has checked that `ref` is its digest (an
        inline copy that came with a message: `assay.store.inline_blobs`)."""
        self.cache.put(tenant, ref, content)

    async def delete(self, tenant: TenantId, ref: str) -> None:
        """Remove this tenant's blob `ref`; a no-op when there is none.

        Raises:
            BadBlobRef: `ref` is malformed.
        """
        key = self.key(tenant, ref)
        self.cache.evict(tenant, ref)
        await self._s3.delete_object(Bucket=self._bucket, Key=key)

    def tenant_prefix(self, tenant: TenantId) -> str:
        """The key prefix of every object of `tenant`."""
        return f"{self._prefix}tenants/{tenant}/"

    async def delete_tenant(self, tenant: TenantId) -> int:
        """Remove every object under the tenant's prefix, a page (at most 1000) at a time;
        how many went."""
        prefix = self.tenant_prefix(tenant)
        gone = 0
        while True:
            page = await self._s3.list_objects_v2(Bucket=self._bucket, Prefix=prefix)
            keys = [o["Key"] for o in page.get("Contents", []) if "Key" in o]
            if not keys:
                return gone
            await self._s3.delete_objects(
                Bucket=self._bucket,
                Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True},
            )
            gone += len(keys)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
