"""The embedded pipeline under a judge that fails at random: every count agrees.

`assay demo` runs against a loopback OpenAI-compatible gateway that serves both the
agent and the judge (the judge on the agent's endpoint, as the default strategy
runs it). The gateway answers the agent's arithmetic and the judge's questions,
and fails judge calls at random — refusals, malformed answers, timeouts, server
errors — and may stop altogether part-way, after which every call (the agent's
too) finds the port closed. Whatever happened, the demo's summary, `assay grade
health`, the `RunGraded` messages and the `UsageRecorded` messages report the
same judge calls, answered and failed, by purpose; no score or attempt rank
exists without an answered comparison behind it; and every stage re-folds
identically (`rebuild --check`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import sqlite3
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from assay.cli.demo import demo
from assay.cli.health import health_command
from assay.cli.rebuild import rebuild
from assay.engine import solve
from assay.kernel.scores import DecidedBy, Ranked, Relative
from assay.messages import MESSAGES, JudgePurpose, Purpose, RunGraded, UsageRecorded, open_envelope
from libs.assay.tests.chat_endpoint import ChatServer, Reply, Seen, completion, json_reply

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "workflows"

MODES = ("ok", "refusal", "malformed", "timeout", "server_error")
"""How the gateway treats one judge call."""
JUDGE_TIMEOUT_S = 0.3


@dataclass
class Gateway:
    """Answers the agent and the judge; fails judge calls as drawn; stops when told."""

    modes: list[str]
    stop_after: int | None
    seed: int
    served: int = 0
    chat: ChatServer = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.chat = ChatServer(self.respond)

    def respond(self, seen: Seen) -> Reply:
        with self._lock:
            self.served += 1
            if self.stop_after is not None and self.served > self.stop_after:
                self.chat.stop_soon()  # the gateway goes away, this request with it
                return Reply(hang_up=True)
            mode = self.rng.choice(self.modes)
            verdict = self.rng.choice(("A", "B", "draw"))
        messages = seen.body["messages"]
        if messages[0]["role"] != "system":  # the agent: the arithmetic, answered
            value = solve(messages[-1]["content"])
            return json_reply(completion(str(value), model="gateway-model"))
        screen = "screen" in messages[0]["content"].split(".")[0]
        match mode:
            case "ok":
                answer = '{"violations": []}' if screen else f'{{"verdict": "{verdict}"}}'
                return json_reply(completion(answer, model="gateway-model"))
            case "refusal":
                body = completion("", model="gateway-model")
                body["choices"][0]["message"] = {
                    "role": "assistant",
                    "content": None,
                    "refusal": "I can't help with that.",
                }
                return json_reply(body)
            case "malformed":
                return json_reply(completion("A is better, I think.", model="gateway-model"))
            case "timeout":
                return Reply(delay_s=2 * JUDGE_TIMEOUT_S, hang_up=True)
            case _:
                return json_reply({"error": "upstream unavailable"}, 503)


def ranked_workflows(into: Path) -> list[Path]:
    """The tournament-graded arithmetic workflows, with groups that close quickly."""
    paths = []
    for n in (1, 2):
        text = (EXAMPLES / f"arith-ranked-v{n}.yaml").read_text()
        path = into / f"ranked-v{n}.yaml"
        path.write_text(text.replace("group_timeout_s: 10", "group_timeout_s: 0.5"))
        paths.append(path)
    return paths


SUMMARY_LINE = re.compile(
    r"judge calls\s+(?P<answered>\d+) answered(?: \((?P<by>[^)]*)\))?"
    r"(?:; (?P<failed>\d+) failed \((?P<failed_by>[^)]*)\))?"
)


def by_purpose(text: str | None) -> dict[str, int]:
    pairs = (part.rsplit(" ", 1) for part in (text or "").split(", ") if part)
    return {purpose: int(n) for purpose, n in pairs}


def bus_messages(data: Path) -> list[Any]:
    """Every message on the bus, decoded once each (by envelope id)."""
    with sqlite3.connect(data / "bus.sqlite") as db:
        values = [v for (v,) in db.execute("SELECT value FROM records").fetchall()]
    seen: dict[str, Any] = {}
    for value in values:
        env = open_envelope(value)
        if env.type in ("RunGraded", "UsageRecorded"):
            seen[env.id] = MESSAGES.decode(env.type, env.schema_version, env.payload)
    return list(seen.values())


def tally(counts: dict[JudgePurpose, int]) -> Counter[str]:
    return Counter({p.value: n for p, n in counts.items()})


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """Exactly these `ASSAY_*` variables while inside; the environment as it was after."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: v for k, v in saved.items() if not k.startswith("ASSAY_")})
    os.environ.update(variables)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


async def run_demo(data: Path, workflows: list[Path] | None, limit: int) -> tuple[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = await demo(data, tasks=None, workflows=workflows, limit=limit, progress=False)
    assert code == 0, out.getvalue()
    summary = out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert await health_command(data, None) == 0
    (health,) = json.loads(out.getvalue())
    return summary, health


def check_agreement(summary: str, health: dict[str, Any], messages: list[Any]) -> None:
    graded = [m for m in messages if isinstance(m, RunGraded)]
    usage = [m for m in messages if isinstance(m, UsageRecorded) and m.purpose is Purpose.GRADING]
    line = SUMMARY_LINE.search(summary)
    assert line is not None, summary
    answered, failed = Counter[str](), Counter[str]()
    for g in graded:
        answered.update(tally(g.judge_calls_by_purpose))
        failed.update(tally(g.judge_failures_by_purpose))
    used = Counter(u.judge_purpose.value for u in usage if u.judge_purpose and not u.failed)
    # answered calls: one figure in all four places, by purpose too
    assert int(line["answered"]) == health["judge_calls_total"] == sum(answered.values())
    assert sum(answered.values()) == sum(g.judge_calls for g in graded) == sum(used.values())
    assert by_purpose(line["by"]) == health["judge_calls_by_purpose"] == dict(answered)
    assert dict(used) == dict(answered)
    # failed calls: counted as failed, never as answers
    assert int(line["failed"] or 0) == health["judge_failures"] == sum(failed.values())
    assert sum(failed.values()) == sum(g.judge_failures for g in graded)
    assert by_purpose(line["failed_by"]) == health["judge_failures_by_purpose"] == dict(failed)
    billed_failures = sum(u.failed for u in usage)
    assert billed_failures == health["judge_failures_billed"] <= health["judge_failures"]
    assert all(u.judge_purpose is not None for u in usage)


def check_grounded(messages: list[Any]) -> None:
    """No score or attempt rank without an answered comparison behind it."""
    for g in (m for m in messages if isinstance(m, RunGraded)):
        calls = g.judge_calls_by_purpose
        match g.score:
            case Ranked() as score:
                assert score.comparisons is not None  # >= 1 by its type
            case Relative(decided_by=DecidedBy.JUDGE):
                assert calls.get(JudgePurpose.COMPARE, 0) >= 1
        for rank in g.attempt_ranks:
            assert rank.rank.comparisons is not None
        if g.attempt_ranks:
            assert calls.get(JudgePurpose.ATTEMPTS, 0) >= 1


@settings(max_examples=3, deadline=None)
@given(
    ranked=st.booleans(),
    modes=st.lists(st.sampled_from(MODES), min_size=1, max_size=6),
    stop_after=st.one_of(st.none(), st.integers(0, 40)),
    limit=st.integers(3, 6),
    seed=st.integers(0, 2**16),
)
# The scenario: the gateway stops part-way through the demo.
@example(ranked=False, modes=["ok"], stop_after=10, limit=6, seed=0)
@example(ranked=True, modes=["ok", "malformed", "refusal"], stop_after=None, limit=4, seed=1)
@pytest.mark.timeout(600)
async def test_every_count_of_judge_calls_agrees_whatever_the_judge_does(
    ranked: bool, modes: list[str], stop_after: int | None, limit: int, seed: int
) -> None:
    gateway = Gateway(modes, stop_after, seed)
    env = {
        "ASSAY_MODEL_URL": gateway.chat.base_url,
        "ASSAY_MODEL_NAME": "gateway-model",
        "ASSAY_MODEL_MAX_RETRIES": "0",
        "ASSAY_MODEL_TIMEOUT_S": "5",
        "ASSAY_JUDGE_MAX_RETRIES": "0",
        "ASSAY_JUDGE_TIMEOUT_S": str(JUDGE_TIMEOUT_S),
    }
    with tempfile.TemporaryDirectory() as tmp, environment(env), gateway.chat:
        data = Path(tmp) / "data"
        workflows = ranked_workflows(Path(tmp)) if ranked else None
        summary, health = await run_demo(data, workflows, limit)
        messages = bus_messages(data)
        check_agreement(summary, health, messages)
        check_grounded(messages)
        with contextlib.redirect_stdout(io.StringIO()):
            assert await rebuild(data, check=True) == 0
