"""The S3 store's own PutObject signature (`assay.store.s3_put`) is botocore's.

moto does not check signatures, so the writer's requests are checked here against
botocore's S3 signer for the same request at the same instant; the writes themselves
run against the S3 double in `test_store_s3.py` and the contract suite.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from yarl import URL

from assay.store.s3_put import SignedPut

NOW = datetime(2026, 12, 6, 23, 59, 59, tzinfo=UTC)


@pytest.mark.parametrize(
    ("endpoint", "key"),
    [
        pytest.param("http://127.0.0.1:9000", "tenants/0b1c/blobs/ab/abcdef", id="loopback"),
        pytest.param("https://s3.example.test:443/base/", "p r+e%fix/é~/x", id="path-and-escapes"),
        pytest.param("http://[::1]:9000", "k", id="ipv6"),
        pytest.param("https://s3.example.test", "a//b/./c", id="default-port"),
    ],
)
def test_a_put_is_signed_as_botocore_signs_it(
    endpoint: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = SignedPut(
        endpoint, "my-bucket", access_key_id="AKIDEXAMPLE", secret="wJal/K+EY", region="eu-west-3"
    )
    body = b"an episode" * 100
    path, headers = writer.headers(key, body, NOW)

    monkeypatch.setattr("botocore.auth.get_current_datetime", lambda: NOW.replace(tzinfo=None))
    request = AWSRequest(
        method="PUT",
        url=str(URL(endpoint).origin()) + path,
        data=body,
        headers={"X-Amz-Content-SHA256": headers["X-Amz-Content-SHA256"]},
    )
    signer = S3SigV4Auth(Credentials("AKIDEXAMPLE", "wJal/K+EY"), "s3", "eu-west-3")
    signer.add_auth(request)

    assert headers["Authorization"] == request.headers["Authorization"]
    assert headers["X-Amz-Date"] == request.headers["X-Amz-Date"]
    assert headers["Host"] == endpoint.split("://")[1].split("/")[0].removesuffix(":443")


def test_a_new_day_signs_with_that_days_key() -> None:
    writer = SignedPut("http://s3.test", "b", access_key_id="id", secret="s", region="r")
    first = writer.headers("k", b"x", NOW)[1]["Authorization"]
    next_day = writer.headers("k", b"x", NOW.replace(day=7))[1]["Authorization"]
    assert "/20261206/" in first
    assert "/20261207/" in next_day
    assert writer.headers("k", b"x", NOW)[1]["Authorization"] == first
