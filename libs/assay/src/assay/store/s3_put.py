"""A PutObject signed by botocore's S3 signer and sent on one aiohttp session: the S3
store's write path.

botocore's client spends about 2 ms of CPU on every request it makes (building its
user agent string twice, resolving the endpoint, emitting a dozen events through
awaitables), several times what sending the bytes costs; a stage that writes a blob
for every run (execute, its episodes) spent a quarter of its CPU there. A PutObject is
one signed request with a fixed shape, so the store builds it itself and has botocore's
`S3SigV4Auth` sign it (about 80 µs): AWS Signature Version 4 over the host, the date
and the body's SHA-256 (S3 refuses a body whose hash differs: the upload is as checked
as the client's), sent path-style like the store's client.

Only for what it can sign alone: an explicit endpoint and static credentials. Anything
else (the SDK's credential chain, AWS's own endpoints) goes through the client, and so
does every request this one does not complete: the store then makes the same write
through its client, with botocore's retries and errors (`S3BlobStore.put`).
"""

from __future__ import annotations

import hashlib
from urllib.parse import quote

import aiohttp
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from yarl import URL

TIMEOUT = aiohttp.ClientTimeout(sock_connect=60, sock_read=60)
"""botocore's defaults (60 s to connect, 60 s between bytes read)."""


class PutFailed(Exception):
    """S3 did not store the object (its status and body, or why the request failed)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status S3 answered, None if the request got no answer."""


class SignedPut:
    """PutObject on `endpoint_url` path-style, signed with one access key.

    Use `open()` first; `close()` releases the connections.
    """

    def __init__(
        self, endpoint_url: str, bucket: str, *, access_key_id: str, secret: str, region: str
    ) -> None:
        """Describe the writer; nothing is contacted until a `put`."""
        base = URL(endpoint_url.rstrip("/"))
        if not base.host:
            raise ValueError(f"not an endpoint URL: {endpoint_url!r}")
        self._base = base
        self._bucket_path = f"{base.raw_path.rstrip('/')}/{quote(bucket, safe='-_.~')}"
        self._signer = S3SigV4Auth(Credentials(access_key_id, secret), "s3", region)
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> SignedPut:
        """Make the session (its connections open on the first `put`)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=TIMEOUT, auto_decompress=False)
        return self

    async def close(self) -> None:
        """Release the session. Safe to call more than once."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def request(self, key: str, body: bytes) -> tuple[URL, dict[str, str]]:
        """The URL and signed headers for writing `body` at `key` now."""
        url = self._base.with_path(f"{self._bucket_path}/{quote(key, safe='/-_.~')}", encoded=True)
        request = AWSRequest(
            method="PUT",
            url=str(url),
            data=body,
            headers={"X-Amz-Content-SHA256": hashlib.sha256(body).hexdigest()},
        )
        self._signer.add_auth(request)
        return url, dict(request.headers.items())

    async def put(self, key: str, body: bytes) -> None:
        """Store `body` at `key`; returns once S3 has acknowledged it.

        Raises:
            PutFailed: S3 answered other than 200, or the request failed.
            RuntimeError: not open.
        """
        if self._session is None:
            raise RuntimeError("the S3 writer is not open")
        url, headers = self.request(key, body)
        try:
            async with self._session.put(url, data=body, headers=headers) as response:
                if response.status != 200:
                    text = await response.text(errors="replace")
                    raise PutFailed(
                        f"PutObject {key}: HTTP {response.status}: {text[:500]}", response.status
                    )
                await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise PutFailed(f"PutObject {key}: {exc!r}") from exc
