"""The committed wire contracts in `schemas/` match the code (`make schemas` regenerates)."""

from __future__ import annotations

from pathlib import Path

from assay.cli.schemas import render

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"


def test_committed_schemas_match_the_models() -> None:
    expected = render()
    committed = {p.name: p.read_text() for p in SCHEMAS.iterdir() if p.is_file()}
    missing = sorted(expected.keys() - committed.keys())
    stale = sorted(committed.keys() - expected.keys())
    changed = sorted(k for k in expected.keys() & committed.keys() if expected[k] != committed[k])
    hint = "schemas/ drifted from the models; run `make schemas`"
    assert not missing, f"{hint}: missing {missing}"
    assert not stale, f"{hint}: stale {stale}"
    assert not changed, f"{hint}: changed {changed}"
