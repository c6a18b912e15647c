"""The README shows real things: its workflow loads as `assay run` loads it, its
handler table names handlers that exist, and its links point at files that exist."""

from __future__ import annotations

import re
from pathlib import Path

from assay.runtime.plugins import load_tools, load_verifiers
from assay.workflow import load_workflow
from assay.workflow.ir import BUILTIN_VERIFIER_KINDS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _text() -> str:
    return README.read_text(encoding="utf-8")


def _yaml_block() -> str:
    blocks = re.findall(r"^```yaml\n(.*?)^```$", _text(), flags=re.M | re.S)
    assert len(blocks) == 1, f"README should show one YAML workflow, found {len(blocks)}"
    return str(blocks[0])


def test_readme_opens_with_the_two_commands() -> None:
    lines = _text().splitlines()
    assert lines[:6] == [
        "# Assay",
        "",
        "```sh",
        "make run    # the embedded demo: zero infrastructure, one process, SQLite",
        "make test   # sets up everything on a fresh machine and runs the whole suite",
        "```",
    ]


def test_readme_workflow_is_valid_and_is_the_example_it_names(tmp_path: Path) -> None:
    path = tmp_path / "readme.yaml"
    path.write_text(_yaml_block(), encoding="utf-8")
    # The same checks `assay run` makes: known tools and verifier kinds included.
    tools = frozenset(load_tools())
    verifiers = BUILTIN_VERIFIER_KINDS | frozenset(load_verifiers())
    shown = load_workflow(path, tools, verifiers)
    assert shown.verifiers, "the README's workflow should have a verifier"
    example = load_workflow(ROOT / "examples/workflows/arith-v1.yaml", tools, verifiers)
    assert shown.version == example.version


def test_readme_handler_table_names_handlers_that_exist() -> None:
    rows = re.findall(r"^\| (\w+) \| `(\w+)` in \[`([^`]+)`\]\(([^)]+)\)", _text(), flags=re.M)
    assert {stage for stage, *_ in rows} == {
        "ingest",
        "execute",
        "verify",
        "tournament",
        "aggregate",
        "decide",
    }
    for stage, handler, shown, target in rows:
        assert shown == target
        assert target.startswith(f"services/{stage}/src/assay_{stage}/")
        source = (ROOT / target).read_text(encoding="utf-8")
        assert re.search(rf"async def {handler}\(", source), f"{handler} is not in {target}"


def test_readme_links_point_at_files_that_exist() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _text())
    assert targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing
