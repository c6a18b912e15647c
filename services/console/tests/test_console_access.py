"""Console access (tokens, loopback) and the committed OpenAPI document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from assay_console.access import Access, AccessInvalid
from assay_console.openapi import rendered
from services.console.tests.console_seed import TENANT_A

ROOT = Path(__file__).resolve().parents[3]


def test_a_console_on_another_address_needs_a_token() -> None:
    with pytest.raises(AccessInvalid, match="without a token"):
        Access.parse(None, None, "0.0.0.0")
    assert Access.parse(None, None, "127.0.0.1").open
    assert not Access.parse(None, "secret", "0.0.0.0").open


def test_tokens_are_kept_as_digests_and_may_be_given_as_one() -> None:
    from assay.kernel.canonical import digest

    access = Access.parse(f"{TENANT_A}=blake3:{digest(b'token-a')}", None, "::1")
    assert "token-a" not in repr(access)
    who = access.identify("Bearer token-a")
    assert who is not None
    assert who.tenant == TENANT_A
    with pytest.raises(AccessInvalid, match="not a UUID"):
        Access.parse("someone=token", None, "127.0.0.1")


def test_the_committed_openapi_document_is_the_generated_one() -> None:
    committed = (ROOT / "schemas" / "console-openapi.json").read_text()
    assert committed == rendered(), "run: .venv/bin/assay-console-openapi"
    paths = json.loads(committed)["paths"]
    assert {
        "/api/runs",
        "/api/runs/{run_id}",
        "/api/overview",
        "/api/workflows",
        "/api/workflows/{workflow_id}",
    } <= set(paths)
