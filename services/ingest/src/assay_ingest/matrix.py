"""A rollout group's candidate matrix at ingest (§11.1 `ReplayTournament`, DESIGN §13).

A task whose rollout spec carries `candidates` runs N variants of its workflow
on the same input — stored versions, a model, prompts — each as `samples`
consecutive siblings (default one), with purpose `replay`. Ingest admits the
matrix whole or refuses it whole, at submission:

- **Resolution.** Each candidate becomes the definition its sibling runs: a
  stored version of the workflow (its hash, a prefix naming one, or `current`),
  or the current version with every model step calling another model, or with
  new prompts (a derived definition, content-addressed like any version). The
  control is the candidate named `control`, else the one that is the current
  version, else the current version added as an implicit last candidate running
  as many siblings as the most any candidate runs.
- **Cost, declared.** Every sibling's per-run maxima (model calls, tokens, US
  dollars) add up to the group's `MatrixEstimate`. The group's caps must cover
  every sibling at the largest per-run maximum (what spawning holds each start
  to), every sibling's run must fit the declared capacity (§14.2), and every
  sibling's model calls are reserved against the tenant's replay ceiling (§12.4)
  — all in the commit that admits the group.
- **Refusal.** The first candidate that does not fit refuses the task: `Refused`
  names it and why, the message goes to `assay.dlq.ingest`, and nothing is
  recorded — no group, no reservation, no capacity held.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from decimal import Decimal
from typing import Any, ClassVar

from pydantic import Field

from assay.engine import StepNotExecutable, check_executable
from assay.grading.replay import METER_STREAM, admit, meter_of, reserved_today
from assay.kernel import Lsn, Refused, RunId, WorkflowVersion, run_id_from
from assay.kernel.spend import Spend, micro_usd
from assay.messages import Purpose, Role, RolloutSpec, TaskSubmitted
from assay.messages.candidates import (
    CURRENT,
    MAX_SIBLINGS,
    Candidate,
    MatrixEstimate,
    PlannedCandidate,
    sibling_owner,
)
from assay.record import BranchKey, Event, LogRecord, ReadModel, StateDelta
from assay.workflow import ModelStep, ResourceSpec, WorkflowDef, WorkflowInvalid, validate
from assay_ingest.ingesting import IngestUnitOfWork
from assay_ingest.replay import METER_KEY, ReplayMeter, ReplayMetered, no_room, worst_run
from assay_ingest.routing import Allocation
from assay_ingest.versions import StoredDefinition, resolve


class MatrixAdmitted(Event):
    """A rollout group's candidate matrix was admitted whole: each candidate's plan and
    the definition its siblings run, and the cost declared.

    Version 2: a candidate may run several siblings (`PlannedCandidate.samples`).
    """

    type: ClassVar[str] = "MatrixAdmitted"
    version: ClassVar[int] = 2
    group: str = Field(description="The task's idempotency key.")
    candidates: list[PlannedCandidate] = Field(
        description="Every candidate, in the order of its siblings' indexes."
    )
    definitions: dict[str, dict[str, Any]] = Field(
        description="The IR each candidate runs, by version (derived variants included)."
    )
    estimate: MatrixEstimate = Field(description="The group's cost, declared at submission.")


MATRIX_EVENTS: list[type[Event]] = [MatrixAdmitted]


class RolloutMatrix(ReadModel):
    """A group's admitted candidate matrix. Keyed like the group."""

    kind: ClassVar[str] = "rollout-matrix"
    candidates: list[PlannedCandidate]
    definitions: dict[str, dict[str, Any]]
    estimate: MatrixEstimate


def fold_matrix(record: LogRecord) -> list[StateDelta]:
    """The group's matrix."""
    match record.event:
        case MatrixAdmitted() as e:
            matrix = RolloutMatrix(
                candidates=e.candidates, definitions=e.definitions, estimate=e.estimate
            )
            return [matrix.put(record.key.tenant, e.group)]
    return []


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A candidate and the workflow its sibling runs."""

    name: str
    candidate: Candidate | None
    """None: the implicit control (the current version)."""
    workflow: WorkflowDef

    @property
    def variant(self) -> str:
        """The variant, for people."""
        c = self.candidate
        if c is None or c.workflow_version is not None:
            return f"version {self.workflow.version}"
        if c.model is not None:
            return f"model {c.model}"
        steps = [s.id for s in _model_steps(self.workflow)] if isinstance(c.prompt, str) else []
        return f"prompt of {', '.join(steps or sorted(c.prompt or {}))}"


@dataclasses.dataclass(frozen=True)
class SiblingPlan:
    """What one sibling of a group runs, and as what."""

    workflow: WorkflowDef
    definition: dict[str, Any]
    children: dict[str, dict[str, Any]]
    role: Role
    purpose: Purpose
    max_model_calls: int
    baseline: WorkflowVersion | None = None


@dataclasses.dataclass(frozen=True)
class AdmittedMatrix:
    """A matrix admitted whole: its candidates, the cost declared, the largest per-run
    model-call maximum (what the group's spawning counts each start at)."""

    matrix: RolloutMatrix
    """As recorded (read from here until the admitting commit lands)."""
    per_run: int

    @property
    def candidates(self) -> list[PlannedCandidate]:
        """Every candidate, in the order of its siblings' indexes."""
        return self.matrix.candidates

    @property
    def siblings(self) -> int:
        """The siblings the matrix runs: every candidate's `samples` added up."""
        return sum(p.samples for p in self.candidates)

    @property
    def estimate(self) -> MatrixEstimate:
        """The cost declared."""
        return self.matrix.estimate


async def admit_matrix(
    uow: IngestUnitOfWork,
    msg: TaskSubmitted,
    alloc: Allocation,
    run_id_of: Callable[[int], RunId],
) -> AdmittedMatrix:
    """Resolve, cost, hold and reserve every sibling of every candidate of `msg`'s matrix,
    and record it.

    Raises:
        Refused: a candidate names no stored version of the workflow, cannot be derived,
            or does not fit the group's budget, the declared capacity or the tenant's
            replay ceiling, or the implicit control would take the group past its most
            siblings; the reason names it. Nothing is recorded or held.
    """
    spec = msg.rollout
    assert spec is not None
    assert spec.candidates is not None
    resolved, control = await _resolve(uow, msg, alloc, spec)
    plans = _plans(resolved, spec, control)
    per_run = max(p.max_model_calls for p in plans)
    _check_budget(spec, plans, per_run)
    _hold_capacity(uow, resolved, plans, run_id_of)
    estimate = await _reserve_replay(uow, spec, plans, resolved)
    definitions = {
        r.workflow.version: r.workflow.model_dump(mode="json", by_alias=True) for r in resolved
    }
    admitted = MatrixAdmitted(
        group=msg.idempotency_key, candidates=plans, definitions=definitions, estimate=estimate
    )
    uow.record(BranchKey.main(uow.tenant, f"rollout:{msg.idempotency_key}"), admitted)
    matrix = RolloutMatrix(candidates=plans, definitions=definitions, estimate=estimate)
    return AdmittedMatrix(matrix, per_run)


async def sibling_plan(
    uow: IngestUnitOfWork,
    key: str,
    version: WorkflowVersion,
    index: int,
    matrix: bool,
    admitted: RolloutMatrix | None = None,
) -> SiblingPlan:
    """What the group's sibling `index` runs: for a matrix (`admitted` in the commit that
    admits it, else as recorded), the definition of the candidate it is a sibling of
    (purpose `replay`; the control as current, the others as challengers of it); else the
    group's version."""
    if not matrix:
        stored = await uow.get(StoredDefinition, version)
        assert stored is not None, "a routed version is always stored"
        wf = stored.workflow
        children = await resolve(uow, wf)
        calls = wf.budget.max_model_calls
        return SiblingPlan(wf, stored.definition, children, Role.CURRENT, Purpose.WORK, calls)
    doc = admitted or await uow.get(RolloutMatrix, key)
    assert doc is not None, "a matrix group's matrix is recorded when it is admitted"
    plan = doc.candidates[sibling_owner([c.samples for c in doc.candidates], index)]
    definition = doc.definitions[plan.workflow_version]
    wf = WorkflowDef.model_validate(definition)
    control = next(c for c in doc.candidates if c.control)
    return SiblingPlan(
        wf,
        definition,
        await resolve(uow, wf),
        Role.CURRENT if plan.control else Role.CHALLENGER,
        Purpose.REPLAY,
        plan.max_model_calls,
        baseline=None if plan.control else control.workflow_version,
    )


async def _resolve(
    uow: IngestUnitOfWork, msg: TaskSubmitted, alloc: Allocation, spec: RolloutSpec
) -> tuple[list[Resolved], str]:
    """Every candidate's workflow, the implicit control last if needed, and the control."""
    assert spec.candidates is not None
    current = WorkflowDef.model_validate(alloc.definitions[alloc.current])
    resolved: list[Resolved] = []
    for i, c in enumerate(spec.candidates):
        name = c.label(i)
        try:
            wf = await _variant(uow, msg, alloc, current, c)
            wf = validate(wf, uow.deps.known_tools, uow.deps.known_verifiers)
            check_executable(wf)
        except (WorkflowInvalid, StepNotExecutable) as exc:
            raise Refused(f"candidate {name!r} cannot run: {exc}") from exc
        resolved.append(Resolved(name, c, wf))
    if spec.control is not None:
        return resolved, spec.control
    for r in resolved:
        if r.candidate and r.candidate.workflow_version and r.workflow.version == alloc.current:
            return resolved, r.name
    name = "current" if "current" not in {r.name for r in resolved} else "control:current"
    return [*resolved, Resolved(name, None, current)], name


async def _variant(
    uow: IngestUnitOfWork,
    msg: TaskSubmitted,
    alloc: Allocation,
    current: WorkflowDef,
    c: Candidate,
) -> WorkflowDef:
    """The workflow candidate `c` runs.

    Raises:
        WorkflowInvalid: it names no stored version of the workflow, or a variant that the
            current version has nothing to vary for.
    """
    if c.workflow_version is not None:
        return await _stored_version(uow, msg, alloc, c.workflow_version)
    steps = _model_steps(current)
    if not steps:
        raise WorkflowInvalid(f"workflow {current.id!r} has no model step to vary")
    doc = current.model_dump(mode="json", by_alias=True)
    if c.model is not None:
        for step in doc["steps"]:
            if step["kind"] == "model":
                step["model"] = c.model
        resources = current.resources or ResourceSpec()
        doc["resources"] = resources.model_copy(update={"model": c.model}).model_dump(mode="json")
        return WorkflowDef.model_validate(doc)
    prompts = c.prompt
    if isinstance(prompts, str):
        if len(steps) != 1:
            names = ", ".join(s.id for s in steps)
            raise WorkflowInvalid(f"the workflow has several model steps ({names}): name each one")
        prompts = {steps[0].id: prompts}
    assert prompts is not None
    unknown = sorted(set(prompts) - {s.id for s in steps})
    if unknown:
        raise WorkflowInvalid(f"no model step {', '.join(unknown)} in workflow {current.id!r}")
    for step in doc["steps"]:
        if step["id"] in prompts:
            step["prompt"] = prompts[step["id"]]
    return WorkflowDef.model_validate(doc)


async def _stored_version(
    uow: IngestUnitOfWork, msg: TaskSubmitted, alloc: Allocation, named: str
) -> WorkflowDef:
    """The stored version of the task's workflow that `named` names (`current`, the hash,
    or a prefix of exactly one)."""
    if named == CURRENT:
        return WorkflowDef.model_validate(alloc.definitions[alloc.current])
    exact = await uow.get(StoredDefinition, named)
    if exact is not None and exact.workflow_id == msg.workflow_id:
        return exact.workflow
    found = [
        d.workflow
        for v, d in await uow.scan(StoredDefinition)
        if d.workflow_id == msg.workflow_id and v.startswith(named)
    ]
    if len(found) != 1:
        how = "names no" if not found else f"names {len(found)} versions, not one"
        raise WorkflowInvalid(f"version {named!r} {how} stored version of {msg.workflow_id!r}")
    return found[0]


def _model_steps(wf: WorkflowDef) -> list[ModelStep]:
    return [s for s in wf.steps if isinstance(s, ModelStep)]


def _plans(resolved: list[Resolved], spec: RolloutSpec, control: str) -> list[PlannedCandidate]:
    """Every candidate's plan, its siblings numbered on from the previous candidate's; the
    implicit control runs as many siblings as the most any candidate runs.

    Raises:
        Refused: the implicit control takes the group past its most siblings.
    """
    most = max((r.candidate.samples for r in resolved if r.candidate is not None), default=1)
    plans: list[PlannedCandidate] = []
    index = 0
    for r in resolved:
        samples = most if r.candidate is None else r.candidate.samples
        if index + samples > MAX_SIBLINGS:
            raise Refused(
                f"candidate {r.name!r} cannot be admitted: its {samples} sibling(s) take the "
                f"group to {index + samples} siblings, more than a group's {MAX_SIBLINGS}"
            )
        plans.append(_plan(index, samples, r, spec, control))
        index += samples
    return plans


def _plan(
    index: int, samples: int, r: Resolved, spec: RolloutSpec, control: str
) -> PlannedCandidate:
    budget = spec.budget
    calls = r.workflow.budget.max_model_calls
    if budget.run_max_model_calls is not None:
        calls = min(calls, budget.run_max_model_calls)
    return PlannedCandidate(
        name=r.name,
        index=index,
        samples=samples,
        kind="version" if r.candidate is None else r.candidate.kind,
        variant=r.variant,
        workflow_version=r.workflow.version,
        control=r.name == control,
        implicit=r.candidate is None,
        max_model_calls=calls,
        max_tokens=budget.run_max_tokens,
        max_cost_usd=budget.run_max_cost_usd,
    )


def _check_budget(spec: RolloutSpec, plans: list[PlannedCandidate], per_run: int) -> None:
    """Refuse a matrix whose group caps do not cover every sibling at the largest per-run
    maximum (so no start is ever held back), naming the candidate of the first left out."""
    budget = spec.budget
    limits: list[tuple[str, int]] = []
    if budget.group_max_model_calls is not None:
        limits.append(("group_max_model_calls", budget.group_max_model_calls // per_run))
    if budget.group_max_tokens is not None and budget.run_max_tokens is not None:
        limits.append(("group_max_tokens", budget.group_max_tokens // budget.run_max_tokens))
    if budget.group_max_cost_usd is not None and budget.run_max_cost_usd is not None:
        held = Decimal(repr(budget.group_max_cost_usd)) // Decimal(repr(budget.run_max_cost_usd))
        limits.append(("group_max_cost_usd", int(held)))
    siblings = sum(p.samples for p in plans)
    for cap, fits in limits:
        if fits < siblings:
            left_out = plans[sibling_owner([p.samples for p in plans], fits)].name
            what = "candidates" if siblings == len(plans) else "siblings"
            raise Refused(
                f"candidate {left_out!r} cannot be admitted: the group's {cap} covers "
                f"{fits} of the {siblings} {what} at the per-run maximum"
            )


def _hold_capacity(
    uow: IngestUnitOfWork,
    resolved: list[Resolved],
    plans: list[PlannedCandidate],
    run_id_of: Callable[[int], RunId],
) -> None:
    """Hold every sibling's run against the declared capacity (§14.2), or none."""
    admission = uow.deps.admission
    held: list[str] = []
    for r, plan in zip(resolved, plans, strict=True):
        for i in plan.indexes:
            run = str(run_id_of(i))
            why = admission.admit(run, r.workflow, uow)
            if why is not None:
                for other in held:
                    admission.release(other)
                raise Refused(f"candidate {r.name!r} cannot be admitted: {why}")
            held.append(run)
    for run in held:  # spawned, each lets go when its run stops executing
        uow.on_discard(functools.partial(admission.release, run))


def sibling_run_id(at_ms: int, origin: str, index: int) -> RunId:
    """The run id of a group's sibling `index` (`RolloutGroup.next_run_id` when it starts)."""
    return run_id_from(at_ms, f"{origin}:rollout:{index}")


def release_unstarted(
    uow: IngestUnitOfWork, at_ms: int, origin: str, started: int, admitted: int
) -> None:
    """Let go, once the closing commit lands, of the capacity held since submission for
    the candidates that never started (the group was cancelled, or its deadline passed)."""
    for index in range(started, admitted):
        run = str(sibling_run_id(at_ms, origin, index))
        uow.on_landed(functools.partial(uow.deps.admission.release, run))


def _worst(uow: IngestUnitOfWork, plan: PlannedCandidate, r: Resolved) -> Spend:
    """A candidate's run at its worst (`replay.worst_run`), within the per-run token and
    dollar caps its group declares."""
    worst = worst_run(r.workflow, plan.max_model_calls, uow.deps.admission, uow.deps.prices)
    tokens, micro = worst.tokens, worst.micro_usd
    if plan.max_tokens is not None:
        tokens = min(tokens, plan.max_tokens)
    if plan.max_cost_usd is not None:
        micro = min(micro, micro_usd(plan.max_cost_usd))
    return Spend(worst.calls, tokens, micro)


async def _reserve_replay(
    uow: IngestUnitOfWork,
    spec: RolloutSpec,
    plans: list[PlannedCandidate],
    resolved: list[Resolved],
) -> MatrixEstimate:
    """Reserve every sibling's worst case against the tenant's replay ceiling, or none
    (the meter is compare-and-swapped like a shadow run's reservation)."""
    doc = await uow.get(ReplayMeter, METER_KEY)
    head = Lsn(0) if doc is None else doc.next
    today = uow.envelope.occurred_at.date().isoformat()
    meter = meter_of(today, None if doc is None else doc.counts())
    limit = uow.deps.replay.limit_for(str(uow.tenant))
    for plan, r in zip(plans, resolved, strict=True):
        worst = _worst(uow, plan, r)
        if not limit.admits(reserved_today(meter) + worst * plan.samples):
            whose = "its" if plan.samples == 1 else f"its {plan.samples} siblings'"
            why = no_room(worst * plan.samples, meter, limit, whose=whose)
            raise Refused(f"candidate {plan.name!r} cannot be admitted: {why}")
        for _ in plan.indexes:  # each sibling a replay run of its own on the meter
            reserved = admit(meter, worst, limit)
            assert reserved, "its siblings together were found to fit"
    key = BranchKey.main(uow.tenant, METER_STREAM)
    uow.expect(key, head)  # another task of the tenant reserved first: read it again
    uow.record(key, ReplayMetered(meter=meter))
    budget = spec.budget
    siblings = sum(p.samples for p in plans)
    calls = sum(p.max_model_calls * p.samples for p in plans)
    return MatrixEstimate(
        model_calls=calls,
        tokens=None if budget.run_max_tokens is None else budget.run_max_tokens * siblings,
        cost_usd=None
        if budget.run_max_cost_usd is None
        else float(Decimal(repr(budget.run_max_cost_usd)) * siblings),
        replay_calls=calls,
    )
