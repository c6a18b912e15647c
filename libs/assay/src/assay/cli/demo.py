"""`assay demo`: the whole loop in one process, resumable after a crash.

Registers v1 (becomes current) and v2 (becomes the challenger and climbs the
promotion ladder: shadow, trial, current), submits the example tasks at a
producer's pace, and once v2's time ends registers v3 — a challenger that leaks a
debug trace a `Core` rubric criterion forbids, and is rolled back. It follows
`assay.results` with a progress bar that shows the ladder until every task has
its result and every run is graded, then prints a summary read from the stages'
own state (`summary.py`).

With `challengers=N` (`assay demo --challengers N`), the resourced mode (§12.1,
§12.3): the tournament-graded example workflow allows N live challengers, and N
versions of it — the best prompt among them, though not first — are registered
at once and climb the resourced ladder side by side; every group ranks them all
beside the current version, and the strongest one that qualifies is promoted,
ending the others' time.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from assay.bus.topics import RESULTS, TASKS, WORKFLOWS
from assay.cli.console import CONSOLE_STAGE, announce, console_installed, start_console
from assay.cli.summary import print_summary, summarise
from assay.cli.tasks import read_tasks
from assay.grading.sprt import SprtPolicy
from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId
from assay.kernel.schema import Versioned, one_line
from assay.messages import MESSAGES, RunResult, TaskSubmitted, WorkflowRegistered, open_envelope
from assay.messages.loop import complete_allocation
from assay.record import StateKey
from assay.runtime.embedded import STAGES, Embedded
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.workflow import WorkflowDef, load_workflow

DEMO_TENANT = TenantId(uuid.uuid5(uuid.NAMESPACE_URL, "assay:demo"))
IN_FLIGHT = 32
"""Tasks the demo keeps awaiting a result at once."""
DEFAULT_WORKFLOWS = ("arith-v1.yaml", "arith-v2.yaml", "arith-v3.yaml")
DEMO_LADDER = {"trial_share": 0.1, "min_trial_runs": 3}
"""A ladder sized for 240 tasks (the defaults trial a challenger on 5% of live tasks and
want 5 clean trial episodes: about a hundred tasks). `ASSAY_LADDER_*` still override it."""


CONTEST_PROMPTS = (
    "Think step by step. What is {{ task.question }}?",
    "Think step by step, then reply with only the number. What is {{ task.question }}?",
    "Reply with only the number. What is {{ task.question }}?",
    "Please work out {{ task.question }}.",
)
"""The challengers' prompts in `--challengers` mode, in the order they are registered. The
stub model slips less when asked to think step by step and answers the bare number when
asked for only the number; the stub judge prefers the shorter of two episodes in one
outcome class. So the first passes more often than the current version but the judge
sees no difference (the same sentence), and the second — both — is the best."""


def contest(n: int, ceiling: int, examples: Path | None = None) -> list[WorkflowDef]:
    """The `--challengers n` mode's versions: the tournament-graded example workflow as
    current, allowing `n` live challengers (each group closes at all `n + 1` versions),
    then `n` challengers that differ only in their prompt.

    Raises:
        AssayError: `n` is below one, above `ceiling`, or above the prompts there are.
    """
    most = min(ceiling, len(CONTEST_PROMPTS))
    if not 1 <= n <= most:
        raise AssayError(
            f"--challengers takes 1 to {most} (ASSAY_LADDER_MAX_CHALLENGERS is {ceiling}), not {n}"
        )
    path = (examples or _examples()) / "workflows" / "arith-ranked-v1.yaml"
    doc = load_workflow(path).model_dump(mode="json", by_alias=True)
    grading = {**doc["grading"], "quorum": n + 1, "challengers": n}
    current = WorkflowDef.model_validate({**doc, "grading": grading})

    def challenger(prompt: str) -> WorkflowDef:
        steps = [{**doc["steps"][0], "prompt": prompt}, *doc["steps"][1:]]
        return WorkflowDef.model_validate({**doc, "steps": steps, "grading": grading})

    return [current, *(challenger(p) for p in CONTEST_PROMPTS[:n])]


def _examples() -> Path:
    """The repository's `examples/` directory (the demo's default inputs)."""
    here = Path(__file__).resolve()  # `assay` is a namespace package: no files("assay") path
    for parent in here.parents:
        if (parent / "examples" / "workflows").is_dir():
            return parent / "examples"
    raise AssayError("cannot find the examples directory; pass --tasks and --workflows")


class _Bar:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.t0 = total, enabled, time.monotonic()

    def show(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        width = 32
        fill = int(width * done / max(self.total, 1))
        rate = done / max(time.monotonic() - self.t0, 1e-9)
        sys.stderr.write(
            f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} results "
            f"{rate:5.1f}/s {note:<34}"
        )
        sys.stderr.flush()

    def end(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def _wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        if time.monotonic() > deadline:
            raise AssayError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class _Ladder:
    """The demo's versions in order: the first is current, each later one challenges once
    the one before it is decided (at most one challenger at a time) — or, `at_once`,
    every challenger is registered together."""

    def __init__(self, rt: Embedded, versions: list[WorkflowDef], at_once: bool = False) -> None:
        self.rt, self.versions, self.at_once = rt, versions, at_once
        self.labels: dict[str, str] = {wf.version: f"v{n}" for n, wf in enumerate(versions, 1)}
        self.registered = 0
        self.workflow = versions[0].id

    async def start(self) -> None:
        """Register the current version and the first challenger (every one, at once)."""
        await self.register_next()
        while self.registered < (len(self.versions) if self.at_once else 2):
            await self.register_next()

    async def allocation(self) -> dict[str, Any] | None:
        return await self.rt.logs["ingest"].get(StateKey(DEMO_TENANT, "allocation", self.workflow))

    async def decided(self, wf: WorkflowDef) -> bool:
        doc = StateKey(DEMO_TENANT, "decision", wf.version)
        return await self.rt.logs["decide"].get(doc) is not None

    async def register_next(self) -> None:
        """Register the next version; wait until decide knows it (held, or turned away at
        shadow's door) and ingest routes by decide's latest allocation. After a restart
        the version may long be known, or even replaced: that is as good."""
        wf = self.versions[self.registered]
        msg = WorkflowRegistered(
            tenant=DEMO_TENANT, definition=wf.model_dump(mode="json", by_alias=True)
        )
        await self.rt.publish(WORKFLOWS, msg, DEMO_TENANT, idem=wf.version)
        self.registered += 1
        decide = self.rt.logs["decide"]

        async def routed() -> bool:
            if await decide.get(StateKey(DEMO_TENANT, "known", wf.version)) is None:
                return False
            held = await decide.get(StateKey(DEMO_TENANT, "allocation", self.workflow))
            routing = await self.allocation()
            if held is None or routing is None:
                return False
            return bool(routing["generation"] >= held["generation"])

        await _wait_for(routed, 30, f"registration of {wf.version[:12]}")

    async def advance(self) -> None:
        """Register the next challenger once the last one's time has ended."""
        waiting = 2 <= self.registered < len(self.versions)
        if waiting and await self.decided(self.versions[self.registered - 1]):
            await self.register_next()

    async def note(self) -> str:
        a = await self.allocation()
        if a is None:
            return ""
        a = complete_allocation(a)
        now = f"{self.labels.get(a['current'], '?')} current"
        for c in a["challengers"]:
            rung = getattr(c["rung"], "value", c["rung"]) or "shadow"
            share = a["shares"][c["version"]]
            now += (
                f", {self.labels.get(c['version'], '?')} {rung}{f' {share:.0%}' if share else ''}"
            )
        return now


async def demo(
    data_dir: Path,
    *,
    tasks: Path | None,
    workflows: list[Path] | None,
    limit: int | None,
    challengers: int | None = None,
    progress: bool,
    sprt: dict[str, float] | None = None,
    metrics_port: int | None = None,
    console: bool = False,
    console_port: int | None = None,
) -> int:
    """Run the demo; return 0 when every task has exactly one result.

    With `metrics_port`, the process serves `/metrics` (every stage's signals), `/healthz`
    and `/readyz` on 127.0.0.1 at that port while the demo runs. With `console` (and
    `assay-console` installed), the console stage folds alongside and the console is
    served while the demo runs, on `console_port` (else `ASSAY_CONSOLE_PORT`, or any
    free port if that one is taken).

    `workflows` are the current version, then the challengers in turn (one or two).
    `challengers` (instead) runs the several-challengers mode (`contest`).
    `sprt` overrides fields of the sequential test's policy (else `ASSAY_SPRT_*`).
    """
    settings = AssaySettings.from_env()
    try:
        policy = SprtPolicy.model_validate({**settings.sprt.model_dump(), **(sprt or {})})
    except ValidationError as exc:
        raise AssayError(f"invalid SPRT policy: {one_line(exc)}") from exc
    if challengers is not None:
        if workflows is not None:
            raise AssayError("--challengers builds its own workflows; drop --workflows")
        versions = contest(challengers, settings.ladder.max_challengers)
    else:
        if workflows is None:
            workflows = [_examples() / "workflows" / name for name in DEFAULT_WORKFLOWS]
        if not 2 <= len(workflows) <= 3:
            raise AssayError("--workflows takes the current version and one or two challengers")
        versions = [load_workflow(p) for p in workflows]
    if len({wf.id for wf in versions}) != 1:
        ids = ", ".join(repr(str(wf.id)) for wf in versions)
        raise AssayError(f"the workflows must share an id ({ids})")
    todo = read_tasks(tasks or _examples() / "tasks" / "arith.jsonl", DEMO_TENANT, versions[0].id)
    todo = todo[:limit] if limit else todo
    keys = {t.idempotency_key for t in todo}
    t0 = time.monotonic()
    try:
        ladder_policy = settings.ladder.over(DEMO_LADDER)
    except ValidationError as exc:
        raise SettingsInvalid(f"invalid ASSAY_LADDER_* settings: {one_line(exc)}") from exc
    serve_console = console and console_installed()
    stages = (*STAGES, CONSOLE_STAGE) if serve_console else STAGES
    async with (
        Embedded(
            data_dir, sprt=policy, ladder=ladder_policy, settings=settings, stages=stages
        ) as rt,
        contextlib.AsyncExitStack() as stack,
    ):
        if metrics_port is not None:
            status = await rt.serve_status(metrics_port)
            stack.push_async_callback(status.close)
            print(f"metrics on http://127.0.0.1:{status.port}/metrics", flush=True)
        rt.start()
        if serve_console:
            await _serve_console(rt, settings, console_port, stack)
        ladder = _Ladder(rt, versions, at_once=challengers is not None)
        await ladder.start()
        bar = _Bar(len(keys), progress)
        results = await _follow_results(rt, todo, bar, ladder)
        await _wait_for(lambda: _settled(rt), 120, "every run to be graded")
        if ladder.registered == len(versions):  # the last challengers' episodes decide them
            await _wait_for(lambda: _decided_or_idle(ladder), 30, "the last challenger")
        bar.show(len(results), await ladder.note())
        bar.end()
        summary = await summarise(rt, DEMO_TENANT, ladder.labels, results, time.monotonic() - t0)
        summary["ladder"] = (
            f"trial on {ladder_policy.trial_share:.0%} of tasks after "
            f"{ladder_policy.min_shadow_runs} clean shadow episodes; current after "
            f"{ladder_policy.min_trial_runs} clean trial ones; "
            f"{ladder_policy.held_out_fraction:.0%} of tasks held out"
        )
    print_summary(summary)
    dupes = summary["duplicate_results"]
    return 0 if len(results) == len(keys) and not dupes else 1


async def _serve_console(
    rt: Embedded, settings: AssaySettings, port: int | None, stack: contextlib.AsyncExitStack
) -> None:
    """Serve the console on loopback while the demo runs (on another port than metrics).
    A busy default port falls back to any free one; a port asked for must be free."""
    try:
        running = await start_console(
            rt.logs[CONSOLE_STAGE], rt.data_dir, settings, None, port, rt.bus, rt
        )
    except OSError:
        if port is not None:
            raise
        running = await start_console(
            rt.logs[CONSOLE_STAGE], rt.data_dir, settings, None, 0, rt.bus, rt
        )
    stack.push_async_callback(running.aclose)
    announce(running)


async def _decided_or_idle(ladder: _Ladder) -> bool:
    """The last challenger (every one, at once) was decided, or the pipeline is quiet and
    did not decide it (its episodes were too few, or all on held-out tasks)."""
    last = ladder.versions[1:] if ladder.at_once else ladder.versions[-1:]
    decided = [await ladder.decided(wf) for wf in last]
    return all(decided) or await _quiet(ladder.rt)


async def _quiet(rt: Embedded) -> bool:
    """Every stage has read every message on its topics and shipped its outbox."""
    for name, runner in rt.runners.items():
        if await rt.logs[name].drain_outbox(1):
            return False
        if any((await runner.lag()).values()):  # a deleted tenant's holes are not lag
            return False
    return True


async def _follow_results(
    rt: Embedded, todo: list[TaskSubmitted], bar: _Bar, ladder: _Ladder
) -> dict[str, list[RunResult]]:
    """Submit tasks with at most `IN_FLIGHT` awaiting a result, like a producer that
    paces itself, and collect every result. Routing follows the allocation as it
    changes, so each rung's share of live tasks takes effect as the ladder moves."""
    keys = {t.idempotency_key for t in todo}
    results: dict[str, list[RunResult]] = {}
    offsets = dict.fromkeys(range(rt.partitions), 0)
    seen_ids: set[str] = set()
    queue = list(todo)
    in_flight: set[str] = set()
    note, noted = "", 0.0
    while len(results) < len(keys):
        got = 0
        for p in range(rt.partitions):
            for m in await rt.bus.fetch(RESULTS, p, offsets[p], 500, 0.0 if got else 0.01):
                offsets[p] = m.offset + 1
                env = open_envelope(m.value)
                if env.tenant != DEMO_TENANT or env.id in seen_ids:
                    continue  # a relay re-publish after a crash: same id, same fact
                seen_ids.add(env.id)
                res = MESSAGES.decode(env.type, env.schema_version, env.payload)
                assert isinstance(res, RunResult)
                if res.idempotency_key in keys:
                    results.setdefault(res.idempotency_key, []).append(res)
                    in_flight.discard(res.idempotency_key)
                    got += 1
        if time.monotonic() - noted > 0.2:
            await ladder.advance()
            note, noted = await ladder.note(), time.monotonic()
        batch: list[tuple[str, Versioned, TenantId, str]] = []
        while queue and len(in_flight) < IN_FLIGHT:
            task = queue.pop(0)
            if task.idempotency_key not in results:  # done before a restart: not resent
                in_flight.add(task.idempotency_key)
                batch.append((TASKS, task, DEMO_TENANT, task.idempotency_key))
        if batch:
            await rt.publish_many(batch)
        bar.show(len(results), note)
        if not got and not batch:
            await asyncio.sleep(0.02)
    return results


async def _settled(rt: Embedded) -> bool:
    spawned = sum(len(doc["runs"]) for _, doc in await rt.logs["ingest"].scan(DEMO_TENANT, "task"))
    scored = len(await rt.logs["tournament"].scan(DEMO_TENANT, "scored"))
    return scored >= spawned
