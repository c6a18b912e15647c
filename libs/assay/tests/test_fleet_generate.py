"""Synthetic traces: the same seed gives the same bytes, here and on any machine."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from assay.cli import main
from assay.fleet import FleetError, parse_trace
from assay.fleet.generate import generate
from assay.kernel.canonical import digest

SEED_0 = "4abc80a4cc73ddfc2efb586887b85bc4393281eee2489d4887bc0d74f6309634"
"""blake3 of seed 0's three traces per class: a changed sampler changes it."""


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exit_:
            return int(exit_.code or 0), out.getvalue(), err.getvalue()
    raise AssertionError("main() returned without exiting")


def test_seed_zero_is_pinned_and_every_trace_validates() -> None:
    made = generate(0, 3)
    assert digest("".join(t.to_jsonl() for t in made).encode()) == SEED_0
    assert [t.header.workload_class for t in made] == ["coding-agent@synthetic"] * 3 + [
        "review-agent@synthetic"
    ] * 3
    for t in made:
        assert parse_trace(t.to_jsonl(), t.header.run) == t
    assert generate(1, 3) != made


def test_the_command_writes_the_same_bytes_twice_and_never_over_a_file(tmp_path: Path) -> None:
    for where in ("a", "b"):
        code, _, err = cli(
            "fleet",
            "generate",
            "--output",
            str(tmp_path / where),
            "--seed",
            "5",
            "--traces-per-class",
            "4",
        )
        assert code == 0, err
    a = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()}
    assert len(a) == 8
    assert a == {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}
    code, out, err = cli("fleet", "generate", "--output", str(tmp_path / "a"), "--seed", "6")
    assert (code, out) == (2, "")
    assert "refusing to overwrite" in err
    assert a == {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()}


def test_unknown_classes_are_refused() -> None:
    with pytest.raises(FleetError, match="unknown class 'nap'"):
        generate(0, 1, ["nap"])
    with pytest.raises(FleetError, match="at least 1"):
        generate(0, 0)
