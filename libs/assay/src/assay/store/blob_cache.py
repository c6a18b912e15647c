"""An in-process cache of blobs recently read (§3, §7).

A blob's ref is the digest of its bytes, so a cached blob can never be stale: the
only change a blob sees is its deletion. A delete through the same store evicts
it at once; one made by another process (retention, a tenant's deletion) is seen
here once the entry's `ttl_s` has passed, which bounds how long a process may
still serve bytes that are gone from the bucket.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from assay.kernel.ids import TenantId

DEFAULT_MAX_BYTES = 32 * 1024 * 1024
DEFAULT_TTL_S = 60.0


@dataclass
class BlobCache:
    """Least recently used blobs up to `max_bytes` in all, each kept at most `ttl_s`.

    Keyed by tenant and ref: one tenant's entry never answers another's read,
    even for the same bytes. A blob larger than a quarter of `max_bytes` is not kept.
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    ttl_s: float = DEFAULT_TTL_S
    clock: Callable[[], float] = time.monotonic
    _entries: OrderedDict[tuple[TenantId, str], tuple[float, bytes]] = field(
        default_factory=OrderedDict, init=False, repr=False
    )
    _bytes: int = field(default=0, init=False, repr=False)

    def get(self, tenant: TenantId, ref: str) -> bytes | None:
        """The cached bytes, or None when not cached (or kept too long)."""
        key = (tenant, ref)
        entry = self._entries.get(key)
        if entry is None or self.clock() - entry[0] > self.ttl_s:
            if entry is not None:
                self.evict(tenant, ref)
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, tenant: TenantId, ref: str, content: bytes) -> None:
        """Keep `content` (stored under `ref`), evicting the least recently used."""
        if len(content) * 4 > self.max_bytes:
            return
        self.evict(tenant, ref)
        self._entries[(tenant, ref)] = (self.clock(), content)
        self._bytes += len(content)
        while self._bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= len(dropped)

    def evict(self, tenant: TenantId, ref: str) -> None:
        """Forget one blob (harmless when not cached)."""
        entry = self._entries.pop((tenant, ref), None)
        if entry is not None:
            self._bytes -= len(entry[1])

    @property
    def size_bytes(self) -> int:
        """The bytes held."""
        return self._bytes
