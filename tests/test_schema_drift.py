"""The committed wire contracts in `schemas/` match the code (`make schemas` regenerates)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from assay.cli.schemas import examples, render
from assay.messages import MESSAGES

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"


def test_committed_schemas_match_the_models() -> None:
    expected = render()
    committed = {
        str(p.relative_to(SCHEMAS)): p.read_text() for p in SCHEMAS.rglob("*") if p.is_file()
    }
    missing = sorted(expected.keys() - committed.keys())
    stale = sorted(committed.keys() - expected.keys())
    changed = sorted(k for k in expected.keys() & committed.keys() if expected[k] != committed[k])
    hint = "schemas/ drifted from the models; run `make schemas`"
    assert not missing, f"{hint}: missing {missing}"
    assert not stale, f"{hint}: stale {stale}"
    assert not changed, f"{hint}: changed {changed}"


def test_every_example_validates_against_its_json_schema() -> None:
    for name, example in examples().items():
        model = MESSAGES.types()[name]
        schema = json.loads((SCHEMAS / f"{name}.v{model.version}.schema.json").read_text())
        jsonschema.Draft202012Validator(schema).validate(example)
        assert MESSAGES.decode(name, model.version, example).type == name
