"""The S3 store's own PutObject (`assay.store.s3_put`) asks for the object the store's
botocore client would: the same URL for every key, signed by botocore's S3 signer.

moto does not check signatures, so the request is checked here against what botocore's
client builds for the same key; the writes themselves run against the S3 double in
`test_store_s3.py` and the contract suite.
"""

from __future__ import annotations

import hashlib

import botocore.session
import pytest
from botocore.config import Config
from yarl import URL

from assay.store.s3_put import SignedPut

KEYS = [
    pytest.param("tenants/0b1c/blobs/ab/abcdef", id="blob"),
    pytest.param("p r+e%fix/é~/x", id="escapes"),
    pytest.param("a//b/./c", id="dot-segments"),
]


@pytest.mark.parametrize(
    "endpoint",
    [
        pytest.param("http://127.0.0.1:9000", id="loopback"),
        pytest.param("https://s3.example.test:8443", id="https-port"),
        pytest.param("http://[::1]:9000", id="ipv6"),
        pytest.param("https://s3.example.test", id="default-port"),
    ],
)
@pytest.mark.parametrize("key", KEYS)
def test_a_put_goes_where_the_client_would_put_it(endpoint: str, key: str) -> None:
    writer = SignedPut(
        endpoint, "my-bucket", access_key_id="AKIDEXAMPLE", secret="wJal/K+EY", region="eu-west-3"
    )
    body = b"an episode" * 100
    url, headers = writer.request(key, body)

    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        region_name="eu-west-3",
        aws_access_key_id="AKIDEXAMPLE",
        aws_secret_access_key="wJal/K+EY",
        config=Config(s3={"addressing_style": "path"}),
    )
    theirs = URL(
        client.generate_presigned_url(  # type: ignore[attr-defined]  # added at client creation
            "put_object", {"Bucket": "my-bucket", "Key": key}
        ),
        encoded=True,
    )
    assert url.origin() == theirs.origin()
    assert url.raw_path == theirs.raw_path
    assert headers["X-Amz-Content-SHA256"] == hashlib.sha256(body).hexdigest()
    credential = "Credential=AKIDEXAMPLE/" + headers["X-Amz-Date"][:8] + "/eu-west-3/s3/"
    assert headers["Authorization"].startswith("AWS4-HMAC-SHA256 " + credential)
    assert "SignedHeaders=host;x-amz-content-sha256;x-amz-date," in headers["Authorization"]


def test_the_body_is_signed() -> None:
    writer = SignedPut("http://s3.test", "b", access_key_id="id", secret="s", region="r")
    signed = [writer.request("k", body)[1]["Authorization"] for body in (b"x", b"y")]
    assert signed[0] != signed[1]
