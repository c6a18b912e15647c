"""`assay up` starts a complete local deployment without Docker; `assay down` stops it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.postgres, pytest.mark.s3]

ASSAY = str(Path(sys.executable).parent / "assay")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}/status").exists()
        and "zombie" not in Path(f"/proc/{pid}/status").read_text()
    )


@pytest.mark.timeout(300)
def test_up_serves_every_stage_and_down_stops_everything_it_started(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSAY_")}
    env["ASSAY_PARTITIONS"] = "2"
    up = subprocess.run(
        [ASSAY, "up", "--dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    state = json.loads((tmp_path / "stack.json").read_text()) if up.returncode == 0 else {}
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "kafka bootstrap" in up.stdout
        assert set(state["stages"]) == {
            "ingest",
            "execute",
            "verify",
            "tournament",
            "aggregate",
            "decide",
        }
        for info in state["stages"].values():
            with urllib.request.urlopen(f"http://127.0.0.1:{info['port']}/healthz") as r:
                assert json.loads(r.read())["ok"] is True
            with urllib.request.urlopen(f"http://127.0.0.1:{info['port']}/metrics") as r:
                assert b"assay_messages_handled_total" in r.read()
        again = subprocess.run(
            [ASSAY, "up", "--dir", str(tmp_path)], env=env, capture_output=True, text=True
        )
        assert again.returncode == 2, "a second up over a recorded stack must refuse"
    finally:
        down = subprocess.run(
            [ASSAY, "down", "--dir", str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert down.returncode == 0, down.stderr
    pids = [i["pid"] for i in state["stages"].values()]
    pids += [i["pid"] for i in state["infra"].values() if i["pid"] is not None]
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "down left processes running"
    assert not (tmp_path / "stack.json").exists()
