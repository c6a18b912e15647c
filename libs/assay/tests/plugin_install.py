"""Installing a throwaway plugin distribution for a test.

A `*.dist-info` directory with an `entry_points.txt`, beside the module it points at, on
`sys.path`: `importlib.metadata` finds it exactly as it finds a pip-installed package.
"""

from __future__ import annotations

import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

Install = Callable[[str, dict[str, list[str]]], str]
"""install(module source, {group: ["name = {module}:attr", ...]}) -> the module's name."""


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Install:
    """Install a throwaway distribution whose module holds `source`."""

    def do(source: str, groups: dict[str, list[str]]) -> str:
        module = f"assay_plugin_{uuid.uuid4().hex[:12]}"
        site = tmp_path / module
        site.mkdir()
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        dist = site / f"{module}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
        lines = []
        for group, entries in groups.items():
            lines.append(f"[{group}]")
            lines.extend(e.format(module=module) for e in entries)
        (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
        monkeypatch.syspath_prepend(str(site))
        return module

    return do
