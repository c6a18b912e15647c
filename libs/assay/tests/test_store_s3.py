"""What the S3 blob store does beyond the `BlobStore` contract (§3, §7).

The contract suite (`test_store_contract.py`) runs against this adapter too; the
tests here look inside the bucket with a plain S3 client: the bucket is made at
open, every key carries its tenant, and a prefixed store never leaves its prefix.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aioboto3
import pytest
from aiobotocore.config import AioConfig
from botocore.exceptions import ClientError
from types_aiobotocore_s3 import S3Client

from assay.devstack import InfraUnavailable, Service
from assay.devstack.s3 import resolve_s3
from assay.kernel.canonical import digest
from assay.kernel.ids import TenantId, tenant_id
from assay.store import BadBlobRef, BlobStore, S3BlobStore
from assay.store.blob_cache import BlobCache
from assay.store.s3_blobs import UNREFERENCED_ENDPOINT_PARAMS, resolve_endpoints_per_bucket
from assay.store.s3_put import SignedPut

pytestmark = pytest.mark.s3

PATH_STYLE = AioConfig(s3={"addressing_style": "path"})


def new_tenant() -> TenantId:
    return tenant_id(uuid.uuid4())


def session(s3: Service) -> aioboto3.Session:
    return aioboto3.Session(
        aws_access_key_id=s3.details["access_key_id"],
        aws_secret_access_key=s3.details["secret_access_key"],
        region_name=s3.details["region"],
    )


@pytest.fixture
async def client(s3: Service) -> AsyncIterator[S3Client]:
    """A plain S3 client, to look at the bucket from outside the store."""
    async with session(s3).client("s3", endpoint_url=s3.address, config=PATH_STYLE) as c:
        yield c


@pytest.fixture
def bucket() -> str:
    """A bucket name no other test uses; the bucket does not exist yet."""
    return f"assay-s3-{uuid.uuid4().hex}"


@pytest.fixture
async def stores(s3: Service, client: S3Client, bucket: str) -> AsyncIterator[list[S3BlobStore]]:
    """Stores a test opens on `bucket`; closed, and the bucket removed, afterwards."""
    opened: list[S3BlobStore] = []
    yield opened
    for store in opened:
        await store.close()
    if await bucket_exists(client, bucket):
        keys = await list_keys(client, bucket)
        if keys:
            await client.delete_objects(
                Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]}
            )
        await client.delete_bucket(Bucket=bucket)


def make_store(
    s3: Service,
    bucket: str,
    opened: list[S3BlobStore],
    *,
    prefix: str = "",
    region: str = "",
    cache: BlobCache | None = None,
) -> S3BlobStore:
    store = S3BlobStore(
        s3.address,
        bucket,
        access_key_id=s3.details["access_key_id"],
        secret_access_key=s3.details["secret_access_key"],
        region=region or s3.details["region"],
        prefix=prefix,
        cache=cache,
    )
    opened.append(store)
    return store


async def bucket_exists(client: S3Client, bucket: str) -> bool:
    try:
        await client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket"):
            return False
        raise
    return True


async def list_keys(client: S3Client, bucket: str, prefix: str = "") -> list[str]:
    keys: list[str] = []
    async for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix
    ):
        keys.extend(o["Key"] for o in page.get("Contents", []))
    return sorted(keys)


def key_of(tenant: TenantId, content: bytes, prefix: str = "") -> str:
    ref = digest(content)
    return f"{prefix}tenants/{tenant}/blobs/{ref[:2]}/{ref}"


# -- the bucket ------------------------------------------------------------------


async def test_open_creates_a_missing_bucket_and_is_idempotent(
    s3: Service, client: S3Client, bucket: str, stores: list[S3BlobStore]
) -> None:
    assert not await bucket_exists(client, bucket)
    first = make_store(s3, bucket, stores)
    assert all(s is first for s in await asyncio.gather(first.open(), first.open()))
    assert await bucket_exists(client, bucket)
    assert await first.open() is first  # opening an open store changes nothing

    tenant = new_tenant()
    ref = await first.put(tenant, b"kept")
    # Stores opened later, and several at once, find the bucket and keep its contents.
    later = [make_store(s3, bucket, stores) for _ in range(2)]
    await asyncio.gather(*(store.open() for store in later))
    keys = await list_keys(client, bucket)
    assert len(keys) == 1
    assert keys[0].endswith(ref)
    assert await later[0].get(tenant, ref) == b"kept"


async def test_concurrent_opens_of_a_missing_bucket_all_succeed(
    s3: Service, client: S3Client, bucket: str, stores: list[S3BlobStore]
) -> None:
    several = [make_store(s3, bucket, stores) for _ in range(3)]
    await asyncio.gather(*(store.open() for store in several))
    assert await bucket_exists(client, bucket)
    tenant = new_tenant()
    refs = await asyncio.gather(*(store.put(tenant, b"same bytes") for store in several))
    assert len(set(refs)) == 1
    assert await list_keys(client, bucket) == [key_of(tenant, b"same bytes")]


async def test_a_bucket_outside_us_east_1_is_created_in_the_stores_region(
    s3: Service, client: S3Client, bucket: str, stores: list[S3BlobStore]
) -> None:
    if s3.process is None:
        pytest.skip("needs the local moto server: other S3 APIs tie buckets to their own region")
    store = make_store(s3, bucket, stores, region="eu-west-1")
    await store.open()
    await make_store(s3, bucket, stores, region="eu-west-1").open()
    location = await client.get_bucket_location(Bucket=bucket)
    assert location.get("LocationConstraint") == "eu-west-1"


async def test_a_bucket_removed_under_an_open_store_is_an_error_not_absence(
    s3: Service, client: S3Client, bucket: str, stores: list[S3BlobStore]
) -> None:
    store = await make_store(s3, bucket, stores).open()
    await client.delete_bucket(Bucket=bucket)
    with pytest.raises(ClientError, match="NoSuchBucket"):
        await store.get(new_tenant(), digest(b"anything"))


# -- keys and tenants ------------------------------------------------------------


async def test_every_key_in_the_bucket_starts_with_its_tenant(
    s3: Service, client: S3Client, bucket: str, stores: list[S3BlobStore]
) -> None:
    store = await make_store(s3, bucket, stores).open()
    a, b = new_tenant(), new_tenant()
    await store.put(a, b"one")
    await store.put(a, b"two")
    await store.put(a, b"two")  # idempotent: still one object
    await store.put(b, b"one")  # the same bytes under another tenant: another object

    keys = await list_keys(client, bucket)
    assert keys == sorted([key_of(a, b"one"), key_of(a, b"two"), key_of(b, b"one")])
    shape = re.compile(r"tenants/([0-9a-f-]{36})/blobs/([0-9a-f]{2})/(\2[0-9a-f]{62})")
    for key in keys:
        found = shape.fullmatch(key)
        assert found is not None, key
        assert found.group(1) in (str(a), str(b))
        assert store.key(tenant_id(found.group(1)), found.group(3)) == key


async def test_an_object_under_one_tenants_prefix_is_invisible_to_another(
    s3: Service, client: S3Client, bucket: str, stores: list[S3BlobStore]
) -> None:
    store = await make_store(s3, bucket, stores).open()
    a, b = new_tenant(), new_tenant()
    content = b"tenant a's episode"
    ref = digest(content)
    # Written straight into the bucket, as another replica of the stage would have.
    await client.put_object(Bucket=bucket, Key=key_of(a, content), Body=content)

    assert await store.get(a, ref) == content
    assert await store.get(b, ref) is None
    await store.delete(b, ref)
    assert await list_keys(client, bucket) == [key_of(a, content)]
    assert await store.get(a, ref) == content


async def test_refs_are_checked_before_any_request(
    s3: Service, client: S3Client, bucket: str, stores: list[S3BlobStore]
) -> None:
    store = make_store(s3, bucket, stores)
    tenant = new_tenant()
    bad = "../" + digest(b"x")[3:]
    with pytest.raises(BadBlobRef):
        store.key(tenant, bad)
    with pytest.raises(BadBlobRef):
        await store.get(tenant, bad)
    with pytest.raises(BadBlobRef):
        await store.delete(tenant, bad)
    with pytest.raises(RuntimeError, match="not open"):
        await store.get(tenant, digest(b"x"))
    assert not await bucket_exists(client, bucket)


# -- prefix ----------------------------------------------------------------------


async def test_a_prefixed_store_stays_inside_its_prefix(
    s3: Service, client: S3Client, bucket: str, stores: list[S3BlobStore]
) -> None:
    prefix = "deploy/blue/"
    boxed = await make_store(s3, bucket, stores, prefix="deploy/blue").open()
    assert boxed.prefix == prefix  # the separator is added, so "deploy/blue-green/" is apart
    plain = await make_store(s3, bucket, stores).open()
    sibling = await make_store(s3, bucket, stores, prefix="deploy/blue-green/").open()
    tenant = new_tenant()

    ref = await boxed.put(tenant, b"inside")
    await boxed.put(tenant, b"also inside")
    await plain.put(tenant, b"outside")
    await sibling.put(tenant, b"next door")

    assert await list_keys(client, bucket, prefix) == sorted(
        [key_of(tenant, b"inside", prefix), key_of(tenant, b"also inside", prefix)]
    )
    # Neither the unprefixed store nor a store whose prefix merely starts the same sees it.
    assert await plain.get(tenant, ref) is None
    assert await sibling.get(tenant, ref) is None
    assert await boxed.get(tenant, digest(b"outside")) is None
    assert await boxed.get(tenant, digest(b"next door")) is None
    await plain.delete(tenant, ref)
    await sibling.delete(tenant, ref)
    assert await boxed.get(tenant, ref) == b"inside"

    await boxed.delete(tenant, ref)
    assert await list_keys(client, bucket, prefix) == [key_of(tenant, b"also inside", prefix)]
    assert len(await list_keys(client, bucket)) == 3


# -- the in-process cache ----------------------------------------------------------


async def test_a_blob_read_is_read_again_from_memory_until_its_ttl(
    s3: Service, client: S3Client, bucket: str, stores: list[S3BlobStore]
) -> None:
    now = [0.0]
    cache = BlobCache(ttl_s=60.0, clock=lambda: now[0])
    store = await make_store(s3, bucket, stores, cache=cache).open()
    a, b = new_tenant(), new_tenant()
    content = b"an episode read by two comparisons"
    ref = digest(content)
    await client.put_object(Bucket=bucket, Key=key_of(a, content), Body=content)
    assert await store.get(a, ref) == content

    # Gone from the bucket (another process deleted it): the read is served from memory,
    # which proves it made no request, and never for another tenant.
    await client.delete_object(Bucket=bucket, Key=key_of(a, content))
    assert await store.get(a, ref) == content
    assert await store.get(b, ref) is None
    now[0] = 61.0  # past the entry's ttl: the bucket is asked again
    assert await store.get(a, ref) is None


async def test_a_delete_through_the_store_forgets_the_blob_at_once(
    s3: Service, bucket: str, stores: list[S3BlobStore]
) -> None:
    store = await make_store(s3, bucket, stores).open()
    tenant = new_tenant()
    ref = await store.put(tenant, b"to be deleted")
    assert await store.get(tenant, ref) == b"to be deleted"
    await store.delete(tenant, ref)
    assert await store.get(tenant, ref) is None


async def test_a_write_is_not_cached_so_reading_it_back_asks_the_bucket(
    s3: Service, client: S3Client, bucket: str, stores: list[S3BlobStore]
) -> None:
    # A run's archive is read back before its records are deleted: that read must
    # see what the bucket holds, not what this process wrote.
    store = await make_store(s3, bucket, stores).open()
    tenant = new_tenant()
    ref = await store.put(tenant, b"an archive")
    await client.delete_object(Bucket=bucket, Key=key_of(tenant, b"an archive"))
    assert await store.get(tenant, ref) is None


# -- the store's own PutObject (assay.store.s3_put) ----------------------------------


async def test_blobs_are_written_without_the_sdk_and_read_back_through_it(
    s3: Service, client: S3Client, bucket: str, stores: list[S3BlobStore]
) -> None:
    store = await make_store(s3, bucket, stores, prefix="odd prefix+%/").open()
    assert writer_of(store) is not None  # an endpoint and static credentials: it signs alone
    tenant = new_tenant()
    content = bytes(range(256)) * 40
    ref = await store.put(tenant, content)
    assert await list_keys(client, bucket) == [key_of(tenant, content, "odd prefix+%/")]
    got = await client.get_object(Bucket=bucket, Key=key_of(tenant, content, "odd prefix+%/"))
    async with got["Body"] as body:
        assert await body.read() == content
    assert await store.put(tenant, content) == ref  # again: the same object


async def test_a_write_the_store_cannot_make_itself_is_made_through_the_sdk(
    s3: Service, client: S3Client, bucket: str, stores: list[S3BlobStore]
) -> None:
    store = await make_store(s3, bucket, stores).open()
    tenant = new_tenant()
    details = s3.details
    unreachable = SignedPut(
        "http://127.0.0.1:9",  # discard port: nothing listens
        bucket,
        access_key_id=details["access_key_id"],
        secret=details["secret_access_key"],
        region=details["region"],
    ).open()
    store._writer = unreachable
    ref = await store.put(tenant, b"first")
    assert await store.get(tenant, ref) == b"first"
    assert writer_of(store) is unreachable  # no answer is no verdict: it is tried again
    await unreachable.close()

    refused = SignedPut(  # S3 answers 404 NoSuchBucket: a refusal, every time
        s3.address,
        f"{bucket}-missing",
        access_key_id=details["access_key_id"],
        secret=details["secret_access_key"],
        region=details["region"],
    ).open()
    store._writer = refused
    ref = await store.put(tenant, b"second")
    assert await list_keys(client, bucket) == sorted(
        [key_of(tenant, b"first"), key_of(tenant, b"second")]
    )
    assert writer_of(store) is None  # from now on the SDK writes
    await refused.close()


def test_without_static_credentials_or_an_endpoint_the_sdk_writes() -> None:
    for endpoint, key_id in ((None, "id"), ("http://127.0.0.1:9", None)):
        store = S3BlobStore(endpoint, "b", access_key_id=key_id, secret_access_key=key_id)
        assert writer_of(store) is None


def writer_of(store: S3BlobStore) -> SignedPut | None:
    """The store's own writer (None: the SDK writes)."""
    return store._writer


# -- endpoint resolution ------------------------------------------------------------


def test_no_rule_of_s3s_endpoint_rule_set_reads_the_parameters_left_out() -> None:
    # What makes resolving once per bucket right: should a botocore upgrade bring a
    # rule that reads the key, this fails, and the parameters must be passed again.
    import botocore.loaders

    rules = botocore.loaders.Loader().load_service_model("s3", "endpoint-rule-set-1")
    read: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("ref"), str):
                read.add(node["ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str):
            read.update(re.findall(r"\{([A-Za-z]+)", node))

    walk(rules["rules"])
    assert set(rules["parameters"]) >= UNREFERENCED_ENDPOINT_PARAMS
    assert not UNREFERENCED_ENDPOINT_PARAMS & read


async def test_the_endpoint_is_resolved_once_per_bucket_not_per_object() -> None:
    session = aioboto3.Session(
        aws_access_key_id="id", aws_secret_access_key="secret", region_name="us-east-1"
    )
    endpoint = "http://127.0.0.1:9"  # never contacted: only endpoints are resolved here
    async with session.client("s3", endpoint_url=endpoint, config=PATH_STYLE) as client:
        resolve_endpoints_per_bucket(client)
        untyped: Any = client  # the stubs do not show botocore's resolver
        provider = untyped._ruleset_resolver._provider
        common = {"Bucket": "b", "Region": "us-east-1", "Endpoint": endpoint}
        found = [
            provider.resolve_endpoint(**common, ForcePathStyle=True, Key=f"k{i}") for i in range(5)
        ]
    assert {f.url for f in found} == {f"{endpoint}/b"}
    assert all(f is found[0] for f in found)  # one evaluation, then the cached result


def test_building_a_store_contacts_nothing() -> None:
    def build(prefix: str) -> S3BlobStore:
        return S3BlobStore(None, "any", access_key_id=None, secret_access_key=None, prefix=prefix)

    store: BlobStore = build("")  # typed as the port: mypy checks the adapter satisfies it
    assert isinstance(store, S3BlobStore)
    assert (store.bucket, store.prefix) == ("any", "")
    assert build("a/b/").prefix == build("a/b").prefix == "a/b/"


# -- where the endpoint comes from -----------------------------------------------


def test_an_endpoint_from_the_environment_is_borrowed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ASSAY_TEST_S3_ENDPOINT", "http://s3.example.test:9000")
    monkeypatch.setenv("ASSAY_TEST_S3_ACCESS_KEY_ID", "key-id")
    monkeypatch.setenv("ASSAY_TEST_S3_SECRET_ACCESS_KEY", "secret")
    monkeypatch.delenv("ASSAY_TEST_S3_REGION", raising=False)
    service = resolve_s3(tmp_path)
    assert service.address == "http://s3.example.test:9000"
    assert service.details == {
        "access_key_id": "key-id",
        "secret_access_key": "secret",
        "region": "us-east-1",
    }
    assert service.process is None
    service.stop()  # a borrowed service is left alone


def test_an_endpoint_without_credentials_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ASSAY_TEST_S3_ENDPOINT", "http://s3.example.test:9000")
    monkeypatch.delenv("ASSAY_TEST_S3_ACCESS_KEY_ID", raising=False)
    with pytest.raises(InfraUnavailable, match="ASSAY_TEST_S3_ACCESS_KEY_ID"):
        resolve_s3(tmp_path)
