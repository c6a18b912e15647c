"""Several live challengers end to end, embedded (§12.1, §12.3): `assay demo
--challengers 2` registers two tournament-graded challengers at once; they climb side
by side on Bradley-Terry strengths across groups, the better one is promoted, and the
other's time ends with it — one promotion, and every stage re-folds byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from assay.bus import DECISIONS
from assay.cli.demo import DEMO_TENANT, contest, demo
from assay.cli.ladder import read_reports
from assay.cli.rebuild import rebuild
from assay.kernel.errors import AssayError
from assay.messages import MESSAGES, AllocationChanged, Promoted, open_envelope
from assay.record import StateKey
from assay.runtime import Embedded

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_number_of_challengers_is_checked_before_anything_runs() -> None:
    with pytest.raises(AssayError, match="--challengers takes 1 to 4"):
        contest(0, 4, EXAMPLES)
    with pytest.raises(AssayError, match=r"ASSAY_LADDER_MAX_CHALLENGERS is 2\), not 3"):
        contest(3, 2, EXAMPLES)
    current, *rest = contest(2, 4, EXAMPLES)
    assert current.grading.live_challengers == 2
    assert current.grading.group_quorum == 3  # a group closes with every live version
    assert len({wf.version for wf in (current, *rest)}) == 3


@pytest.mark.slow
@pytest.mark.timeout(360)  # the whole demo, two challengers climbing: ≈ 90–150 s on two busy cores
async def test_two_challengers_climb_at_once_and_the_better_one_is_promoted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    assert (
        await demo(data, tasks=None, workflows=None, challengers=2, limit=None, progress=False) == 0
    )
    out = capsys.readouterr().out
    current, weaker, better = contest(2, 4, EXAMPLES)
    async with Embedded(data) as rt:
        decide = rt.logs["decide"]
        alloc = await decide.get(StateKey(DEMO_TENANT, "allocation", current.id))
        won = await decide.get(StateKey(DEMO_TENANT, "decision", better.version))
        lost = await decide.get(StateKey(DEMO_TENANT, "decision", weaker.version))
        decisions = [
            MESSAGES.decode(env.type, env.schema_version, env.payload)
            for p in range(rt.partitions)
            for m in await rt.bus.fetch(DECISIONS, p, 0, 10_000, 0.0)
            if (env := open_envelope(m.value)).tenant == DEMO_TENANT
        ]
    assert alloc is not None
    assert alloc["current"] == better.version, out
    assert won is not None
    assert won["outcome"] == "promoted"
    assert lost is not None
    assert lost["outcome"] == "rejected"
    promoted = [d for d in decisions if isinstance(d, Promoted)]
    assert [p.workflow_version for p in promoted] == [better.version]  # one promotion
    allocations = [d for d in decisions if isinstance(d, AllocationChanged)]
    assert any(len(a.challengers) == 2 for a in allocations)  # the two were live together
    assert all(abs(sum(a.shares.values()) - 1) < 1e-9 for a in allocations)
    (report,) = await read_reports(data, DEMO_TENANT)
    paths = {v["version"]: v["path"] for v in report["versions"]}
    assert paths[better.version] == ["shadow", "canary", "ramp", "current"]
    assert paths[weaker.version][-1] == "rejected"
    assert await rebuild(data, check=True) == 0
