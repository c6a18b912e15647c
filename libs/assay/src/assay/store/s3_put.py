"""A PutObject signed here and sent on one aiohttp session: the S3 store's write path.

botocore spends about 2 ms of CPU on every request it makes (building its user agent
string twice, resolving the endpoint, emitting a dozen events through awaitables,
signing through generic machinery), several times what sending the bytes costs; a
stage that writes a blob for every run (execute, its episodes) spent a quarter of its
CPU there. A PutObject is one signed request with a fixed shape, so the store makes
it itself: AWS Signature Version 4 (https://docs.aws.amazon.com/IAM/latest/UserGuide/
reference_sigv-create-signed-request.html) over the host, the date and the body's
SHA-256 (S3 refuses a body whose hash differs: the upload is as checked as botocore's),
sent path-style like the store's client.

Only for what it can sign alone: an explicit endpoint and static credentials. Anything
else (the SDK's credential chain, AWS's own endpoints) goes through botocore, and so
does every request this one does not complete: the store then makes the same write
through its client, with botocore's retries and errors (`S3BlobStore.put`).
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, datetime
from urllib.parse import quote

import aiohttp
from yarl import URL

_ALGORITHM = "AWS4-HMAC-SHA256"
_SIGNED_HEADERS = "host;x-amz-content-sha256;x-amz-date"
TIMEOUT = aiohttp.ClientTimeout(sock_connect=60, sock_read=60)
"""botocore's defaults (60 s to connect, 60 s between bytes read)."""


class PutFailed(Exception):
    """S3 did not store the object (its status and body, or why the request failed)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status S3 answered, None if the request got no answer."""


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


class SignedPut:
    """PutObject on `endpoint_url` path-style, signed with one access key.

    Use `open()` first; `close()` releases the connections.
    """

    def __init__(
        self, endpoint_url: str, bucket: str, *, access_key_id: str, secret: str, region: str
    ) -> None:
        """Describe the writer; nothing is contacted until a `put`."""
        base = URL(endpoint_url.rstrip("/"))
        host = base.host_port_subcomponent  # the port only if not the scheme's own
        if not host:
            raise ValueError(f"not an endpoint URL: {endpoint_url!r}")
        self._base = base
        self._host = host
        self._bucket_path = f"{base.raw_path.rstrip('/')}/{quote(bucket, safe='-_.~')}"
        self._access_key_id = access_key_id
        self._secret = secret
        self._region = region
        self._keys: tuple[str, bytes] = ("", b"")  # (date, signing key of that date)
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

    def headers(self, key: str, body: bytes, now: datetime) -> tuple[str, dict[str, str]]:
        """The request's path and signed headers for writing `body` at `key` at `now`."""
        path = f"{self._bucket_path}/{quote(key, safe='/-_.~')}"
        stamp = now.strftime("%Y%m%dT%H%M%SZ")
        date = stamp[:8]
        payload = hashlib.sha256(body).hexdigest()
        canonical = "\n".join(
            (
                "PUT",
                path,
                "",
                f"host:{self._host}",
                f"x-amz-content-sha256:{payload}",
                f"x-amz-date:{stamp}",
                "",
                _SIGNED_HEADERS,
                payload,
            )
        )
        scope = f"{date}/{self._region}/s3/aws4_request"
        to_sign = "\n".join(
            (_ALGORITHM, stamp, scope, hashlib.sha256(canonical.encode()).hexdigest())
        )
        signature = hmac.new(self._signing_key(date), to_sign.encode(), hashlib.sha256)
        authorization = (
            f"{_ALGORITHM} Credential={self._access_key_id}/{scope}, "
            f"SignedHeaders={_SIGNED_HEADERS}, Signature={signature.hexdigest()}"
        )
        return path, {
            "Host": self._host,
            "X-Amz-Content-SHA256": payload,
            "X-Amz-Date": stamp,
            "Authorization": authorization,
        }

    def _signing_key(self, date: str) -> bytes:
        if self._keys[0] != date:  # derived once a day, not for every request
            key = _hmac(f"AWS4{self._secret}".encode(), date)
            for part in (self._region, "s3", "aws4_request"):
                key = _hmac(key, part)
            self._keys = (date, key)
        return self._keys[1]

    async def put(self, key: str, body: bytes) -> None:
        """Store `body` at `key`; returns once S3 has acknowledged it.

        Raises:
            PutFailed: S3 answered other than 200, or the request failed.
            RuntimeError: not open.
        """
        if self._session is None:
            raise RuntimeError("the S3 writer is not open")
        path, headers = self.headers(key, body, datetime.now(UTC))
        url = self._base.with_path(path, encoded=True)
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
