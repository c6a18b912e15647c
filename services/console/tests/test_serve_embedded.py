"""`assay serve-embedded` as a real process: a workflow registered and tasks submitted
over HTTP run to results read from the API, `/metrics` on the same port shows the
signals move, SIGTERM stops it cleanly and `assay rebuild --check` passes after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from assay.runtime.embedded import STAGES
from services.console.tests.console_seed import HOSTILE, TENANT_A, TENANT_B
from services.console.tests.embedded_process import ASSAY, serve_embedded, until

ROOT = Path(__file__).resolve().parents[3]
A = {"authorization": "Bearer token-a"}
B = {"authorization": "Bearer token-b"}
TASKS = 6


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def served(data_dir: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    with serve_embedded(data_dir, f"{TENANT_A}=token-a,{TENANT_B}=token-b") as found:
        yield found


def metric(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def results(client: httpx.Client, headers: dict[str, str]) -> list[dict[str, object]]:
    runs = client.get("/api/runs", headers=headers, params={"limit": "200"}).json()["runs"]
    return [r for r in runs if r["status"] is not None]


def test_one_port_feeds_runs_and_reports_the_pipeline(
    served: tuple[str, subprocess.Popen[str]], data_dir: Path
) -> None:
    url, proc = served
    definition = yaml.safe_load((ROOT / "examples" / "workflows" / "arith-v1.yaml").read_text())
    lines = (ROOT / "examples" / "tasks" / "arith.jsonl").read_text().splitlines()[:TASKS]
    tasks = [{**json.loads(line), "workflow_id": "arith"} for line in lines]
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.get("/healthz").json()["ok"]
        before = client.get("/metrics").text
        registered = client.post("/api/workflows", json={"definition": definition}, headers=A)
        assert registered.status_code == 200, registered.text
        assert registered.json()["workflow_id"] == "arith"
        # another tenant cannot submit in A's name, nor see A's runs
        stolen = client.post("/api/tasks", json={**tasks[0], "tenant": str(TENANT_A)}, headers=B)
        assert stolen.status_code == 404
        bad = client.post("/api/tasks", json=[{"input": {"q": HOSTILE}}], headers=A)
        assert bad.status_code == 400
        assert bad.json()["detail"].startswith("task 0: workflow_id: Field required")
        unauthenticated = client.post("/api/tasks", json=tasks, headers={})
        assert unauthenticated.status_code == 401
        submitted = client.post("/api/tasks", json=tasks, headers=A)
        assert submitted.status_code == 202, submitted.text
        assert submitted.json()["submitted"] == TASKS
        until(lambda: len(results(client, A)) >= TASKS or None, proc, 180)
        assert client.get("/api/runs", headers=B).json()["runs"] == []
        after = client.get("/metrics").text
        assert client.get("/readyz").status_code == 200
        # The overview's stages: every stage of the process, read from the same metrics.
        stages = client.get("/api/stages", headers=B).json()
        assert stages["mode"] == "embedded"
        by = {s["name"]: s for s in stages["stages"]}
        assert set(by) == {*STAGES, "console"}
        assert {s["health"] for s in by.values()} == {"running"}
        for stage in STAGES:
            handled = metric(after, "assay_messages_handled_total", stage=stage)
            assert by[stage]["handled"] >= handled > 0, stage
            assert by[stage]["p95_s"] is not None, stage
    for name in ("assay_run_transitions_total", "assay_messages_handled_total"):
        assert metric(after, name) > metric(before, name), name
    assert metric(after, "assay_task_to_result_seconds_count") >= TASKS
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    env = {**os.environ, "ASSAY_DATA_DIR": str(data_dir)}
    check = subprocess.run(
        [ASSAY, "rebuild", "--check"], env=env, capture_output=True, text=True, timeout=300
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_public_address_without_a_token_refuses_to_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSAY_CONSOLE_")}
    env["ASSAY_DATA_DIR"] = str(tmp_path / "data")
    out = subprocess.run(
        [ASSAY, "serve-embedded", "--host", "0.0.0.0", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "refusing to serve the console on 0.0.0.0 without a token" in out.stderr
