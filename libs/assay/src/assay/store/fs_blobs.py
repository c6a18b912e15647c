"""Filesystem adapter of `BlobStore`: content-addressed, one directory per tenant."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
from pathlib import Path

from assay.kernel.canonical import digest
from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId

_REF = re.compile(r"[0-9a-f]{64}")


class BadBlobRef(AssayError):
    """A blob ref that is not a blake3 hex digest (it could escape the tenant's directory)."""


def check_ref(ref: str) -> str:
    """Return `ref` if it is a well-formed blob ref, else raise `BadBlobRef`."""
    if not _REF.fullmatch(ref):
        raise BadBlobRef(f"not a blob ref: {ref[:80]!r}")
    return ref


class FsBlobStore:
    """Blobs under `root/<tenant>/<ref[:2]>/<ref>`, written durably (fsync + rename)."""

    def __init__(self, root: str | Path) -> None:
        self._root = Path(root)

    def _path(self, tenant: TenantId, ref: str) -> Path:
        check_ref(ref)
        return self._root / str(tenant) / ref[:2] / ref

    async def put(self, tenant: TenantId, content: bytes) -> str:
        ref = digest(content)
        await asyncio.to_thread(self._write, self._path(tenant, ref), content)
        return ref

    @staticmethod
    def _write(path: Path, content: bytes) -> None:
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        # Unique per write, not per process: two handlers of one process may put the same
        # content at once (siblings of a rollout group writing one workspace snapshot).
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
        with open(tmp, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dirfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)

    async def get(self, tenant: TenantId, ref: str) -> bytes | None:
        path = self._path(tenant, ref)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            return None

    async def delete(self, tenant: TenantId, ref: str) -> None:
        path = self._path(tenant, ref)
        await asyncio.to_thread(path.unlink, missing_ok=True)

    async def delete_tenant(self, tenant: TenantId) -> int:
        """Remove the tenant's directory; how many blobs it held."""
        return await asyncio.to_thread(self._delete_tree, self._root / str(tenant))

    @staticmethod
    def _delete_tree(path: Path) -> int:
        if not path.is_dir():
            return 0
        count = sum(1 for p in path.rglob("*") if p.is_file())
        shutil.rmtree(path, ignore_errors=False)
        return count

    async def close(self) -> None:
        """Nothing to release; present for symmetry with networked stores."""
