"""`assay up` starts a complete local deployment without Docker; `assay down` stops it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import asyncpg
import pytest

from assay.devstack.postgres import with_database

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


def _held_once_joined(port: int, timeout_s: float = 60.0) -> set[str]:
    """The partitions a stage's consumer holds (its `/readyz`), once it has joined."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz") as r:
                doc = json.loads(r.read())
        except urllib.error.HTTPError as exc:  # 503 while not ready: the body says why
            doc = json.loads(exc.read())
        consumer = doc.get("checks", {}).get("consumer", {})
        if consumer.get("joined"):
            return set(consumer.get("held", ()))
        assert time.monotonic() < deadline, f"stage on {port} never joined: {doc}"
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_up_serves_every_stage_and_down_stops_everything_it_started(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSAY_")}
    env["ASSAY_PARTITIONS"] = "2"
    env["ASSAY_CONTROL_PARTITIONS"] = "3"  # not the default: `up` passes it on
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
            "console",
        }
        # `up` says where the console is, and it answers there (open, on loopback).
        console = state["console"]
        assert f"console on {console} (open" in up.stdout
        _wait_for_console(console)
        with urllib.request.urlopen(f"{console}workflows?tenant={uuid.uuid4()}") as r:
            assert b"Workflows" in r.read()
        for info in state["stages"].values():
            with urllib.request.urlopen(f"http://127.0.0.1:{info['port']}/healthz") as r:
                assert json.loads(r.read())["ok"] is True
            with urllib.request.urlopen(f"http://127.0.0.1:{info['port']}/metrics") as r:
                assert b"assay_messages_handled_total" in r.read()
        held = _held_once_joined(state["stages"]["ingest"]["port"])
        assert {"assay.tenants/2", "assay.tasks/1"} <= held
        assert "assay.tasks/2" not in held
        again = subprocess.run(
            [ASSAY, "up", "--dir", str(tmp_path)], env=env, capture_output=True, text=True
        )
        assert again.returncode == 2, "a second up over a recorded stack must refuse"
    finally:
        down = subprocess.run(
            [ASSAY, "down", "--purge", "--dir", str(tmp_path)],
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


def _wait_for_console(url: str, timeout_s: float = 60) -> None:
    """The console binds its port once its process has its store open."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}healthz", timeout=2) as r:
                if json.loads(r.read())["ok"]:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"no console at {url}"
        time.sleep(0.2)  # nothing to wait on but the port: try again


async def _wait_for_allocation(dsn: str, tenant: str, timeout_s: float = 60) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + timeout_s
        while not await conn.fetchval(
            "SELECT 1 FROM ingest.state WHERE tenant = $1 AND kind = 'allocation'",
            uuid.UUID(tenant),
        ):
            assert time.monotonic() < deadline, "the workflow never reached ingest"
            await asyncio.sleep(0.1)
    finally:
        await conn.close()


def _results(env: dict[str, str], tenant: str) -> list[dict[str, object]]:
    out = subprocess.run(
        [ASSAY, "results", "--tenant", tenant],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.timeout(420)
def test_a_second_up_starts_clean_and_loses_nothing(tmp_path: Path) -> None:
    """The local broker forgets everything at down; positions kept from an earlier
    stack would point past the new topics' ends and skip their first records."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSAY_")}
    env["ASSAY_PARTITIONS"] = "2"
    tenant = "6f1c2b9e-8d0a-4c4e-9a57-0e1d2c3b4a59"
    root = Path(__file__).resolve().parents[1]
    stacks: list[str] = []
    try:
        for round_ in range(2):
            up = subprocess.run(
                [ASSAY, "up", "--dir", str(tmp_path)],
                env=env,
                capture_output=True,
                text=True,
                timeout=240,
            )
            try:
                assert up.returncode == 0, up.stdout + up.stderr
                state = json.loads((tmp_path / "stack.json").read_text())
                stacks.append(state["stack"])
                run_env = {
                    **env,
                    "ASSAY_KAFKA_BOOTSTRAP": state["settings"]["ASSAY_KAFKA_BOOTSTRAP"],
                }
                subprocess.run(
                    [
                        ASSAY,
                        "register",
                        str(root / "examples/workflows/arith-v1.yaml"),
                        "--tenant",
                        tenant,
                    ],
                    env=run_env,
                    check=True,
                    capture_output=True,
                    timeout=60,
                )
                admin = with_database(
                    state["infra"]["postgres"]["address"], state["postgres"]["database"]
                )
                asyncio.run(_wait_for_allocation(admin, tenant))
                tasks = tmp_path / f"tasks-{round_}.jsonl"
                tasks.write_text(
                    "".join(
                        json.dumps(
                            {
                                "idempotency_key": f"r{round_}-{i}",
                                "input": {"question": f"{i} + 1", "answer": str(i + 1)},
                            }
                        )
                        + "\n"
                        for i in range(6)
                    )
                )
                subprocess.run(
                    [ASSAY, "submit", str(tasks), "--tenant", tenant, "--workflow", "arith"],
                    env=run_env,
                    check=True,
                    capture_output=True,
                    timeout=60,
                )
                deadline = time.monotonic() + 60
                while len(_results(run_env, tenant)) < 6 and time.monotonic() < deadline:
                    time.sleep(1)
                keys = sorted(str(r["idempotency_key"]) for r in _results(run_env, tenant))
                assert keys == [f"r{round_}-{i}" for i in range(6)]
            finally:
                subprocess.run([ASSAY, "down", "--dir", str(tmp_path)], env=env, timeout=120)
        # Each up in a directory is the same stack, emptying the database it made.
        assert len(set(stacks)) == 1
    finally:
        subprocess.run([ASSAY, "down", "--purge", "--dir", str(tmp_path)], env=env, timeout=120)
