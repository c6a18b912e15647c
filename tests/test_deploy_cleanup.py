"""A deployment that never comes up leaves nothing running: no stage, no broker, no
database — however far it got."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest

from assay.devstack import Service
from assay.devstack.deployment import Deployment, deploy
from assay.devstack.kafka import start_tansu


async def _databases(server: str) -> set[str]:
    conn = await asyncpg.connect(server)
    try:
        return {r["datname"] for r in await conn.fetch("SELECT datname FROM pg_database")}
    finally:
        await conn.close()


pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.postgres, pytest.mark.timeout(180)]


def test_stages_that_cannot_start_are_stopped_with_their_broker(
    postgres: Service, s3: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stopped: list[Deployment] = []
    real_stop = Deployment.stop

    def stop(self: Deployment) -> None:
        stopped.append(self)
        real_stop(self)

    monkeypatch.setattr(Deployment, "stop", stop)
    broken = tmp_path / "broken"  # every stage process dies as its interpreter starts
    broken.mkdir()
    (broken / "sitecustomize.py").write_text("raise SystemExit('broken on purpose')\n")
    with pytest.raises(AssertionError, match="exited"):
        asyncio.run(deploy(tmp_path / "d", postgres, s3, extra_env={"PYTHONPATH": str(broken)}))
    (d,) = stopped
    assert all(proc.poll() is not None for proc in d.procs.values())
    assert d.broker.process is not None
    assert d.broker.process.poll() is not None, "the broker was stopped too"
    assert d.owned_database is not None
    server, name = d.owned_database
    assert name not in asyncio.run(_databases(server))


def test_settings_that_do_not_validate_leave_no_broker_and_no_database(
    postgres: Service, s3: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    brokers: list[Service] = []

    def started(path: Path) -> Service:
        brokers.append(start_tansu(path))
        return brokers[-1]

    monkeypatch.setattr("assay.devstack.deployment.start_tansu", started)
    bad = {"ASSAY_SHADOW_RATE": "not a rate"}
    before = asyncio.run(_databases(postgres.address))
    with pytest.raises(Exception, match="ASSAY_SHADOW_RATE"):
        asyncio.run(deploy(tmp_path / "d", postgres, s3, extra_env=bad))
    assert asyncio.run(_databases(postgres.address)) <= before
    (broker,) = brokers
    assert broker.process is not None
    assert broker.process.poll() is not None
