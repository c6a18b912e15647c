"""The idle_after sweep: a dominated setting is off the frontier; the plot is well-formed SVG."""

from __future__ import annotations

import contextlib
import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from assay.cli import main
from assay.fleet import FleetError, Gates, Policy
from assay.fleet.sweep import idle_values, render_svg, render_table, sweep
from libs.assay.tests.fleet_traces import run

# 100 s, one 60 s model wait; checkpoint 2 s, resume 3 s.
#   idle 0:  released 58, added 3 -> saving 55%, overhead 3%   (frontier)
#   idle 10: released 48, added 3 -> saving 45%, overhead 3%   (dominated by idle 0)
#   idle 70: not suspended        -> saving 0%,  overhead 0%   (frontier: least overhead)
TRACE = run(100_000, ("model", 20_000, 80_000))
BASE = Policy.from_seconds(0, checkpoint_s=2, resume_s=3)


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exit_:
            return int(exit_.code or 0), out.getvalue(), err.getvalue()
    raise AssertionError("main() returned without exiting")


def test_the_frontier_by_hand() -> None:
    points = sweep([TRACE], BASE, [0, 10, 70], Gates())["coder@v1"]
    assert [p.to_json() for p in points] == [
        {
            "idle_after_s": 0.0,
            "cpu_saving": 0.55,
            "memory_saving": 0.55,
            "overhead": 0.03,
            "gate_passed": True,
            "frontier": True,
        },
        {
            "idle_after_s": 10.0,
            "cpu_saving": 0.45,
            "memory_saving": 0.45,
            "overhead": 0.03,
            "gate_passed": True,
            "frontier": False,
        },
        {
            "idle_after_s": 70.0,
            "cpu_saving": 0.0,
            "memory_saving": 0.0,
            "overhead": 0.0,
            "gate_passed": False,
            "frontier": True,
        },
    ]
    table = render_table({"coder@v1": points})
    assert table.splitlines()[2] == ("         0.000      55.00%         55.00%     3.00%  pass  *")
    svg = render_svg({"coder@v1": points}, Gates())
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    circles = root.findall("{http://www.w3.org/2000/svg}circle")
    assert [c.get("fill") for c in circles] == ["#1f77b4", "white", "#1f77b4"]


def test_ranges() -> None:
    assert idle_values(0, 30, 10) == [0, 10, 20, 30]
    assert idle_values(0.5, 0.5, 1) == [0.5]
    for bad in ((5, 1, 1), (0, 10, 0), (0, 10_000, 1)):
        with pytest.raises(FleetError):
            idle_values(*bad)


def test_the_command_writes_the_plot_once(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text(TRACE.to_jsonl())
    svg = tmp_path / "frontier.svg"
    flags = ["--from", "0", "--to", "70", "--step", "10", "--checkpoint-s", "2", "--resume-s", "3"]
    code, out, err = cli("fleet", "sweep", str(tmp_path / "t.jsonl"), *flags, "--svg", str(svg))
    assert code == 0, err
    assert out.startswith("class coder@v1\n")
    first = svg.read_text()
    ET.fromstring(first)
    code, out, err = cli("fleet", "sweep", str(tmp_path / "t.jsonl"), *flags, "--svg", str(svg))
    assert (code, out) == (2, "")
    assert "refusing to overwrite" in err
    assert svg.read_text() == first
    code, out, _ = cli("fleet", "sweep", str(tmp_path / "t.jsonl"), *flags, "--json")
    doc = json.loads(out)
    # 60 s and 70 s suspend nothing: equal points, neither dominates the other
    assert [p["frontier"] for p in doc["classes"]["coder@v1"]] == [True] + [False] * 5 + [True] * 2
