"""Only the winner's effects leave the sandbox, end to end in embedded mode: two siblings
of a rollout group POST to a real loopback endpoint through the `Unsafe` built-in
`http_request`; exactly one request arrives, the selected sibling's, published after
the selection; the other sibling's staged request is discarded and recorded as such."""

from __future__ import annotations

from pathlib import Path

import pytest

from assay.engine.staging import (
    EffectDiscarded,
    EffectPublished,
    EffectPublishing,
    Publication,
    staged_output,
)
from assay.kernel import IntentState
from assay.runtime import Embedded
from tests.winner_effects import (
    Ledger,
    episode_of,
    settled,
    settlement,
    staged_effects,
    staged_records,
    submit,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(autouse=True)
def network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASSAY_SANDBOX_NETWORK", "allow")  # http_request may reach loopback


async def test_two_siblings_stage_a_request_and_only_the_winners_is_made(tmp_path: Path) -> None:
    with Ledger() as ledger:
        async with Embedded(tmp_path / "data") as rt:
            rt.start()
            await submit(rt, ledger.url)
            result = await wait_for(lambda: settled(rt), 120, "the group to settle")
            assert result.winner is not None
            (loser,) = [s.run_id for s in result.siblings if s.run_id != result.winner]
            won = await settlement(rt, result.winner)
            lost = await settlement(rt, loser)
            (winner_staged,) = await staged_records(rt, result.winner)
            (loser_staged,) = await staged_records(rt, loser)
            effects = await staged_effects(rt)
            episode = await episode_of(rt, result.winner)
        states = sorted((e.state, e.detail or "") for e in effects.values())
        assert [state for state, _ in states] == ["discarded", "published"], states
        (entry,) = ledger.entries  # exactly one effect reached the outside world
    assert [s.ended for s in result.siblings] == ["verified", "verified"]
    assert all(s.passed for s in result.siblings)  # each verified its staged marker
    assert [type(e).__name__ for e in won] == [
        "EffectPublishing",
        "EffectPublishing",
        "EffectPublished",
    ]
    assert [e.state for e in won if isinstance(e, EffectPublishing)] == [
        IntentState.PENDING,
        IntentState.DISPATCHED,
    ]
    published = won[-1]
    assert isinstance(published, EffectPublished)
    assert published.state is Publication.PUBLISHED
    assert published.output == entry.receipt  # the one request is the winner's publication
    assert published.effect_key == winner_staged.effect_key
    (discarded,) = lost
    assert isinstance(discarded, EffectDiscarded)
    assert discarded.effect_key == loser_staged.effect_key
    index = {s.run_id: s.index for s in result.siblings}
    assert (
        discarded.reason
        == f"sibling #{index[loser]} was not selected (#{index[result.winner]} was)"
    )
    outputs = {str(a.step): a.output for a in episode.attempts}
    assert outputs["notify"] == staged_output("http_request", winner_staged.effect_key)
    assert entry.body == outputs["solve"]  # what the winner's agent decided to send
