"""SIGKILL the embedded pipeline between a rollout group's selection and the publication of
its winner's staged effect, and at each commit of that publication; restart on the same
data directory and check that the outside world saw the effect exactly once.

The workload is `tests.winner_effects`: two siblings each stage a POST to a loopback
ledger that lives in this test's process, so it outlives the killed pipeline. The
process dies at the named crash point (`ASSAY_CRASH_AT=<point>:1`, its arrival proven
by `ASSAY_CRASH_TRACE`), is started again without it, and must settle the group. A
crash between `Dispatched` and the outcome's commit leaves the outcome unknown: the
effect is then `Indeterminate` and never dispatched again — whether it happened is
what the ledger says (it did after the call, it did not before it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from assay.crash import CRASH_AT_ENV, CRASH_TRACE_ENV
from assay.engine.staging import EffectDiscarded, EffectPublished, Publication
from assay.runtime import Embedded
from tests.winner_effects import Ledger, rollout_result, settlement

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

PUBLISHED, UNKNOWN = Publication.PUBLISHED, Publication.INDETERMINATE
POINTS: dict[str, tuple[int, Publication]] = {
    # point: (requests the ledger received, how the winner's publication is recorded)
    "execute.after_commit.EffectStaged.unsafe+AttemptFinished.succeeded": (1, PUBLISHED),
    # selected, nothing of the publication committed: the result is redelivered
    "execute.before_commit.EffectPublishing.pending.unsafe": (1, PUBLISHED),
    "execute.after_commit.EffectPublishing.pending.unsafe": (1, PUBLISHED),
    # dispatched, the call not made: unknown to Assay, and it never happened
    "execute.after_commit.EffectPublishing.dispatched.unsafe": (0, UNKNOWN),
    # the call landed, its outcome not committed: unknown to Assay, it happened once
    "execute.before_commit.EffectPublished.published": (1, UNKNOWN),
    "execute.after_commit.EffectPublished.published": (1, PUBLISHED),
    "execute.after_commit.EffectDiscarded": (1, PUBLISHED),
}


def _env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSAY_")}
    return env | {"ASSAY_SANDBOX_NETWORK": "allow", "ASSAY_LEASE_TTL_S": "0.5", **more}


def _run(data: Path, url: str, env: dict[str, str], output: Path) -> int:
    """`python -m tests.winner_effects` until the group settles (or the process dies)."""
    with output.open("ab") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.winner_effects", str(data), url],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=150,
            check=False,
        )
    return proc.returncode


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.mark.timeout(330)
@pytest.mark.parametrize("point", list(POINTS))
def test_a_crash_between_selection_and_publication_publishes_once(
    point: str, tmp_path: Path
) -> None:
    data, trace, output = tmp_path / "data", tmp_path / "trace", tmp_path / "output"
    requests, recorded = POINTS[point]
    with Ledger() as ledger:
        crash = _env(**{CRASH_AT_ENV: f"{point}:1", CRASH_TRACE_ENV: str(trace)})
        rc = _run(data, ledger.url, crash, output)
        reached = trace.read_text() if trace.exists() else ""
        assert point in reached, f"{point} was never reached:\n{_tail(output)}"
        assert rc == -signal.SIGKILL, f"exit {rc}, not SIGKILL, at {point}:\n{_tail(output)}"
        assert _run(data, ledger.url, _env(), output) == 0, _tail(output)
        entries = list(ledger.entries)
    assert len(entries) == requests, f"{len(entries)} requests reached the ledger at {point}"
    winner_end, loser_end = asyncio.run(_ends(data))
    assert isinstance(winner_end, EffectPublished)
    assert winner_end.state is recorded
    if recorded is PUBLISHED:
        assert winner_end.output == entries[0].receipt
    assert isinstance(loser_end, EffectDiscarded)


async def _ends(data: Path) -> tuple[object, object]:
    """The last publication record of the winner and of the other sibling."""
    async with Embedded(data, stages=("execute",)) as rt:  # read, never started
        result = await rollout_result(rt)
        assert result is not None
        assert result.winner is not None
        (loser,) = [s.run_id for s in result.siblings if s.run_id != result.winner]
        won, lost = await settlement(rt, result.winner), await settlement(rt, loser)
    assert sum(isinstance(e, EffectPublished) for e in won) == 1  # recorded once
    assert len(lost) == 1
    return won[-1], lost[-1]
