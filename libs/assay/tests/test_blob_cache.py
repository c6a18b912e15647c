"""The in-process blob cache: bounded by bytes, by age, and scoped by tenant."""

from __future__ import annotations

import uuid

from assay.kernel.canonical import digest
from assay.kernel.ids import TenantId, tenant_id
from assay.store.blob_cache import BlobCache


def new_tenant() -> TenantId:
    return tenant_id(uuid.uuid4())


def test_one_tenants_entry_never_answers_another() -> None:
    cache = BlobCache()
    a, b = new_tenant(), new_tenant()
    ref = digest(b"same bytes")
    cache.put(a, ref, b"same bytes")
    assert cache.get(a, ref) == b"same bytes"
    assert cache.get(b, ref) is None


def test_the_least_recently_used_go_first_once_the_bytes_are_over() -> None:
    cache = BlobCache(max_bytes=40)
    t = new_tenant()
    blobs = {name: name.encode() * 10 for name in "abcd"}  # 10 bytes each
    for name, content in blobs.items():
        cache.put(t, name, content)
    assert cache.get(t, "a") == blobs["a"]  # "a" is now the most recently used
    cache.put(t, "e", b"e" * 10)  # 50 bytes: the least recently used, "b", goes
    assert cache.get(t, "b") is None
    assert [cache.get(t, n) for n in "acde"] == [blobs["a"], blobs["c"], blobs["d"], b"e" * 10]
    assert cache.size_bytes == 40


def test_a_blob_over_a_quarter_of_the_cache_is_not_kept() -> None:
    cache = BlobCache(max_bytes=40)
    t = new_tenant()
    cache.put(t, "big", b"x" * 11)
    assert cache.get(t, "big") is None
    assert cache.size_bytes == 0


def test_an_entry_older_than_its_ttl_is_gone() -> None:
    now = [0.0]
    cache = BlobCache(ttl_s=5.0, clock=lambda: now[0])
    t = new_tenant()
    cache.put(t, "r", b"bytes")
    now[0] = 5.0
    assert cache.get(t, "r") == b"bytes"
    now[0] = 5.1
    assert cache.get(t, "r") is None
    assert cache.size_bytes == 0


def test_putting_a_ref_again_does_not_count_it_twice() -> None:
    cache = BlobCache()
    t = new_tenant()
    cache.put(t, "r", b"bytes")
    cache.put(t, "r", b"bytes")
    assert cache.size_bytes == 5
    cache.evict(t, "r")
    cache.evict(t, "r")  # harmless when not cached
    assert cache.size_bytes == 0
