"""The committed configuration reference matches the settings (`make config-docs`
regenerates it), and every setting is described."""

from __future__ import annotations

from pathlib import Path

from assay.runtime.config_reference import REFERENCE_PATH, entries, render

ROOT = Path(__file__).resolve().parents[1]


def test_committed_reference_matches_the_settings() -> None:
    committed = (ROOT / REFERENCE_PATH).read_text()
    assert committed == render(), (
        "docs/reference/configuration.md drifted from the settings; run `make config-docs`"
    )


def test_every_setting_has_a_description() -> None:
    missing = [e.variable for e in entries() if not (e.info.description or "").strip()]
    assert not missing, f"settings without a description: {missing}"
