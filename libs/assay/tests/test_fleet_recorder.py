"""The recorder on a real child process tree: output passed through, marks, /proc samples."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from assay.cli import main
from assay.fleet import WaitKind, parse_trace
from assay.fleet.markers import MARKS_ENV, mark, wait

AGENT = """
import subprocess, sys
from assay.fleet.markers import wait
print("hello from the agent", flush=True)
with wait("model"):
    # a grandchild that lives a while: the tree has two processes meanwhile
    subprocess.run([sys.executable, "-c", "import time; time.sleep(1.0)"], check=True)
with wait("tool"):
    pass
print("bye", file=sys.stderr, flush=True)
sys.exit(3)
"""


def run(*args: str) -> int:
    try:
        main(list(args))
    except SystemExit as exit_:
        return int(exit_.code or 0)
    raise AssertionError("main() returned without exiting")


def record(out: Path, *cmd: str) -> int:
    return run(
        "fleet",
        "record",
        "--output",
        str(out),
        "--name",
        "py-agent",
        "--cpu-cores",
        "2",
        "--memory-gib",
        "1.5",
        "--sample-interval",
        "0.1",
        "--",
        *cmd,
    )


@pytest.mark.slow
def test_a_recorded_process_tree(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "agent.jsonl"
    assert record(out, sys.executable, "-c", AGENT) == 3  # the command's own status
    seen = capfd.readouterr()
    assert "hello from the agent" in seen.out
    assert "bye" in seen.err
    trace = parse_trace(out.read_text(), str(out))
    assert trace.header.workload_class == "py-agent@unversioned"
    assert (trace.header.cpu_cores, trace.header.memory_gib, trace.header.source) == (
        2.0,
        1.5,
        "record",
    )
    waits = trace.waits()
    assert [w.kind for w in waits] == [WaitKind.MODEL, WaitKind.TOOL]
    assert waits[0].duration_ms >= 1000
    assert "hello" not in out.read_text()
    metrics = tmp_path / "agent.metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert lines[0] == {"type": "header", "format": "assay.fleet.metrics", "version": 1}
    samples = lines[1:]
    assert max(s["processes"] for s in samples) >= 2
    assert all(s["rss_bytes"] >= 0 and s["cpu_seconds"] >= 0 for s in samples)
    assert [s["t_ms"] for s in samples] == sorted(s["t_ms"] for s in samples)
    for f in (out, metrics):
        assert f.stat().st_mode & 0o777 == 0o600


def test_a_wait_that_never_ends_writes_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "open.jsonl"
    code = record(
        out,
        sys.executable,
        "-c",
        "from assay.fleet.markers import mark; mark('human', 'started')",
    )
    assert code == 2
    assert "open.jsonl (from its marks):4: unfinished: run_finished while a human wait is open" in (
        capfd.readouterr().err
    )
    assert list(tmp_path.iterdir()) == []


def test_nothing_is_overwritten(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.jsonl"
    metrics = tmp_path / "x.metrics.jsonl"
    metrics.write_text("mine\n")
    ran = tmp_path / "ran"
    code = record(out, sys.executable, "-c", f"open({str(ran)!r}, 'w').close()")
    assert code == 2
    assert "x.metrics.jsonl exists: refusing to overwrite it" in capfd.readouterr().err
    assert not out.exists()
    assert not ran.exists()
    assert metrics.read_text() == "mine\n"
    assert (
        run(
            "fleet",
            "record",
            "--output",
            str(tmp_path / "y.txt"),
            "--name",
            "n",
            "--cpu-cores",
            "1",
            "--memory-gib",
            "1",
            "--",
            "true",
        )
        == 2
    )


def test_markers_outside_a_recording_do_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MARKS_ENV, raising=False)
    assert mark("model", "started") is False
    with wait("tool"):
        pass
    assert run("fleet", "mark", "model-wait-started") == 0
    marks = tmp_path / "marks.jsonl"
    marks.touch()
    monkeypatch.setenv(MARKS_ENV, str(marks))
    assert run("fleet", "mark", "human-wait-finished") == 0
    line = json.loads(marks.read_text())
    assert (line["kind"], line["edge"]) == ("human", "finished")
    assert set(line) == {"t_ns", "kind", "edge"}
    with pytest.raises(ValueError, match="nap"):
        mark("nap", "started")


def test_a_command_killed_by_a_signal_exits_as_a_shell_says(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "killed.jsonl"
    code = record(out, sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 15)")
    assert code == 128 + 15
    assert parse_trace(out.read_text(), str(out)).waits() == []
