"""The workflow IR (§4.1): what every format parses into, and what gets hashed."""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated, Any, Final, Literal, TypeAlias

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    model_serializer,
    model_validator,
)

from assay.kernel.canonical import canonical_bytes, digest
from assay.kernel.errors import AssayError
from assay.kernel.ids import StepId, WorkflowId, WorkflowVersion
from assay.workflow.drift import DriftSpec


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class RetryPolicy(_Frozen):
    """How many attempts a step gets. Attempt N+1 never mutates attempt N."""

    max_attempts: int = Field(1, ge=1, le=20, description="Attempts in total, the first included.")
    backoff_s: float = Field(0.0, ge=0, le=60, description="Pause before each retry, in seconds.")


class ModelStep(_Frozen):
    """Call the run's model with a rendered prompt."""

    id: StepId = Field(description="Author-assigned, stable across versions (§4.3).")
    kind: Literal["model"] = Field(description="Step kind.")
    prompt: str = Field(description="Template over `task.*` and `steps.<id>.output`.")
    max_tokens: int = Field(256, ge=1, le=1_000_000, description="Completion token cap.")
    retry: RetryPolicy = Field(default_factory=RetryPolicy, description="Retry policy.")
    timeout_s: float = Field(30.0, gt=0, le=3600, description="Per-attempt wall-clock limit.")
    model: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description=(
            "The model this step calls, by the name its endpoint knows (default: the agent's "
            "model); a replay candidate's model variant sets it. Left out while unset."
        ),
    )
    tools: list[str] | None = Field(
        None,
        min_length=1,
        description=(
            "Registered tools offered to the model with the prompt (OpenAI-style `tools`); "
            "the engine does not run a tool call the model answers with. Left out while unset."
        ),
    )
    context_budget_chars: int | None = Field(
        None,
        ge=1,
        le=100_000_000,
        description=(
            "Most characters the prompt may have; whole references are dropped to fit "
            "(earlier-step outputs first, then task fields). Left out while unset."
        ),
    )

    @model_serializer(mode="wrap")
    def _omit_unset_model(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Left out while unset, so versions written before them hash as they always did."""
        data: dict[str, Any] = handler(self)
        for name in ("model", "tools", "context_budget_chars"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class ToolStep(_Frozen):
    """Call a registered tool with rendered arguments."""

    id: StepId = Field(description="Author-assigned, stable across versions (§4.3).")
    kind: Literal["tool"] = Field(description="Step kind.")
    tool: str = Field(description="Name of a registered tool.")
    args: dict[str, str] = Field(default_factory=dict, description="Argument templates.")
    retry: RetryPolicy = Field(default_factory=RetryPolicy, description="Retry policy.")
    timeout_s: float = Field(30.0, gt=0, le=3600, description="Per-attempt wall-clock limit.")


class ConditionalBranch(_Frozen):
    """One guarded way out of a conditional step."""

    when: str = Field(
        description="Condition in the workflow expression language; must be true or false."
    )
    to: StepId = Field(description="Step entered when the condition holds.")


class ConditionalStep(_Frozen):
    """Route the run: the first branch whose condition holds is taken.

    When none holds, the run enters `otherwise`; when `otherwise` is null, it follows
    the conditional's own forward transition, or ends if there is none. A condition
    may refer only to steps that can have run before the conditional.
    """

    id: StepId = Field(description="Author-assigned, stable across versions (§4.3).")
    kind: Literal["conditional"] = Field(description="Step kind.")
    branches: list[ConditionalBranch] = Field(
        min_length=1, description="Guarded targets, tried in order; the first true one wins."
    )
    otherwise: StepId | None = Field(
        None, description="Step entered when no condition holds; null: the forward transition."
    )


class ParallelStep(_Frozen):
    """Fan out to branch steps that run at the same time, then join.

    Each branch is a self-contained model, tool or subworkflow step, entered only
    from this step and leading nowhere else. The output is a JSON object mapping
    each succeeded branch's id to its output.
    """

    id: StepId = Field(description="Author-assigned, stable across versions (§4.3).")
    kind: Literal["parallel"] = Field(description="Step kind.")
    branches: list[StepId] = Field(min_length=1, description="Steps fanned out, run at once.")
    join: Literal["all", "any", "quorum"] = Field(
        "all", description="Succeed when all branches, any one, or `quorum` of them succeed."
    )
    quorum: int | None = Field(
        None, description="join=quorum only: how many branches must succeed."
    )


PinnedVersion = Annotated[WorkflowVersion, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
LATEST: Final = "latest"


class SubworkflowStep(_Frozen):
    """Run another workflow as a child run; its output is the child's output (§4.4).

    `latest` resolves once, when the parent run is spawned, and the resolved hash
    is recorded: a run's sub-workflow version never changes mid-execution.
    """

    id: StepId = Field(description="Author-assigned, stable across versions (§4.3).")
    kind: Literal["subworkflow"] = Field(description="Step kind.")
    workflow: WorkflowId = Field(description="Logical id of the child workflow.")
    version: PinnedVersion | Literal["latest"] = Field(
        description="An exact version (blake3 hex), or `latest`, resolved at run spawn."
    )
    input: dict[str, str] = Field(
        default_factory=dict, description="The child's task fields, as templates."
    )


class AwaitStep(_Frozen):
    """Wait for a human approval or a named external signal. Its output is the signal's payload.

    On timeout the run fails (`fail`) or moves on with the step marked not succeeded
    (`continue`), which a later conditional can test with `steps.<id>.succeeded`.
    """

    id: StepId = Field(description="Author-assigned, stable across versions (§4.3).")
    kind: Literal["await"] = Field(description="Step kind.")
    signal: str = Field(
        "approval",
        pattern=r"^[A-Za-z0-9_.:-]{1,64}$",
        description="`approval` for a human approval, else the name of an external signal.",
    )
    timeout_s: float = Field(86_400.0, gt=0, description="How long to wait, in seconds.")
    on_timeout: Literal["fail", "continue"] = Field(
        "fail", description="What a timeout does: fail the run, or continue past the step."
    )


WorkStep: TypeAlias = ModelStep | ToolStep
"""A step that does work itself: calls the model or a tool."""

AnyStep: TypeAlias = (
    ModelStep | ToolStep | ConditionalStep | ParallelStep | SubworkflowStep | AwaitStep
)
"""A step of any kind."""

Step = Annotated[AnyStep, Field(discriminator="kind")]


class NotAWorkStep(AssayError):
    """A model or tool step was asked for, and the id names a step of another kind."""


class Transition(_Frozen):
    """An edge between steps. A back edge must declare its loop bound."""

    source: StepId = Field(alias="from", description="Step the edge leaves.")
    target: StepId = Field(alias="to", description="Step the edge enters.")
    max_iterations: int | None = Field(
        None, ge=1, le=1000, description="Loop bound: how many times this edge may be taken."
    )


BUILTIN_VERIFIER_KINDS = frozenset({"exact", "regex", "json_schema", "command", "context"})
"""Verifier kinds Assay ships; others come from the `assay.verifiers` entry-point group."""

_OMITTED_WHEN_UNSET = ("argv", "timeout_s", "params", "expect")


class ContextExpectation(_Frozen):
    """What a `context` verifier expects a model call to have had (§10.1)."""

    packed: list[str] = Field(
        default_factory=list,
        description="References that must be packed: `task.<field>`, `steps.<id>.output`, `plan`.",
    )
    tools_offered: list[str] = Field(
        default_factory=list, description="Tools the model must have been offered."
    )
    dropped: list[str] | None = Field(
        None,
        description=(
            "References the context budget must have dropped (the budget really bit). "
            "Left out while unset."
        ),
    )
    max_dropped: int | None = Field(
        None,
        ge=0,
        description=(
            "Most references the budget may have dropped (0: nothing may be dropped). "
            "Left out while unset."
        ),
    )

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Left out while unset, so versions written before them hash as they always did."""
        data: dict[str, Any] = handler(self)
        for name in ("dropped", "max_dropped"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class VerifierSpec(_Frozen):
    """A fail-closed check on the frozen episode (§10).

    The fields added after the first release (`argv`, `timeout_s`, `params`)
    are left out of the serialised form while unset, so the canonical bytes —
    and so the version — of every workflow that does not use them are what
    they always were.
    """

    id: str = Field(description="Verifier id, unique within the workflow.")
    kind: str = Field(
        pattern=r"^[a-z][a-z0-9_.-]{0,63}$",
        description=(
            "Verifier kind: a built-in one (exact, regex, json_schema, command) or one "
            "registered under the `assay.verifiers` entry-point group."
        ),
    )
    step: StepId | None = Field(None, description="Whose output is checked; default the run's.")
    expected: str | None = Field(None, description="exact: template of the expected output.")
    pattern: str | None = Field(None, description="regex: a full-match pattern.")
    json_schema: dict[str, Any] | None = Field(None, description="json_schema: the schema.")
    strip: bool = Field(True, description="Strip surrounding whitespace before checking.")
    argv: list[str] | None = Field(
        None,
        description=(
            "command: the command to run in a sandbox workspace, each item a template; "
            "exit code 0 passes."
        ),
    )
    timeout_s: float | None = Field(
        None, gt=0, le=3600, description="command: wall-clock limit in seconds (default 60)."
    )
    params: dict[str, Any] | None = Field(
        None, description="Parameters of a verifier kind registered by an installed package."
    )
    expect: ContextExpectation | None = Field(
        None,
        description=(
            "context: what the step's last model call (every model call, without `step`) "
            "must have had in its context and been offered."
        ),
    )

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in _OMITTED_WHEN_UNSET:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class RubricItem(_Frozen):
    """One rubric line (§11.7). A `core` violation caps the episode."""

    id: str = Field(description="Criterion id.")
    layer: Literal["core", "prescriptive", "contextual"] = Field(description="Rubric layer.")
    text: str = Field(description="What the judge looks for.")


_GRADING_OMITTED_WHEN_UNSET = (
    "quorum",
    "group_timeout_s",
    "prior_precision",
    "metric",
    "higher_is_better",
    "attempt_tournaments",
    "challengers",
    "params",
)

UNGROUPED_BUILTINS = ("pairwise_sequential", "deterministic")
"""The built-in strategies whose episodes do not gather in groups."""

DEFAULT_QUORUM = 8
DEFAULT_GROUP_TIMEOUT_S = 3600.0
DEFAULT_PRIOR_PRECISION = 1.0

METRIC_PATTERN = (
    r"^(duration_ms|attempts|usage\.(model_calls|prompt_tokens|completion_tokens)"
    r"|output(\.[A-Za-z0-9_-]+)*)$"
)


class GradingSpec(_Frozen):
    """Which grading strategy applies, and its parameters (§11.1, §11.4-§11.6).

    - `pairwise_sequential` (default): each challenger episode against the current
      version's episode on the same task; a sequential test decides.
    - `tournament`: episodes of one task and outcome class gather into a group that
      closes at `quorum` or after `group_timeout_s`; Swiss pairing, both orderings,
      a Bradley-Terry-Davidson fit with a Gaussian prior of `prior_precision`.
    - `deterministic`: a number the episode already holds (`metric`), no judge.
    - any other name: a strategy an installed package registers; the stages look it up
      when the workflow is registered and refuse a name that none registers. Its own
      parameters go in `params`, validated by the strategy's `params_model` then.

    `attempt_tournaments` (default on) ranks same-outcome attempts of a step and
    attributes each fail-then-pass retry to its step. `challengers` (default one) lets a
    tournament-graded workflow carry several live challengers at once (§12.1, §12.3).
    The fields added after the first
    release are left out of the serialised form while unset, so existing versions hash
    as they always did.
    """

    strategy: str = Field(
        "pairwise_sequential",
        pattern=r"^[a-z][a-z0-9_.-]{0,63}$",
        description=(
            "Grading strategy: `pairwise_sequential`, `tournament`, `deterministic`, or one "
            "an installed package registers (`assay.grading_strategies`); a name no package "
            "registers is refused at registration."
        ),
    )
    quorum: int | None = Field(
        None,
        ge=2,
        le=64,
        description=f"grouped strategies: group size that closes a group ({DEFAULT_QUORUM}).",
    )
    group_timeout_s: float | None = Field(
        None,
        gt=0,
        le=30 * 86400,
        description=(
            "grouped strategies: a group closes this long after its first episode, with whatever "
            f"arrived ({DEFAULT_GROUP_TIMEOUT_S:.0f})."
        ),
    )
    prior_precision: float | None = Field(
        None,
        gt=0,
        le=1e6,
        description=(
            "tournament: precision of the Gaussian prior on strengths; required > 0, it keeps "
            f"a clean sweep finite ({DEFAULT_PRIOR_PRECISION})."
        ),
    )
    metric: str | None = Field(
        None,
        pattern=METRIC_PATTERN,
        description=(
            "deterministic: the number graded — `duration_ms`, `attempts`, "
            "`usage.model_calls|prompt_tokens|completion_tokens`, `output` (the output is "
            "a number) or `output.<key>...` (a number inside the output's JSON)."
        ),
    )
    higher_is_better: bool | None = Field(
        None, description="deterministic: a larger number is better (default true)."
    )
    attempt_tournaments: bool | None = Field(
        None, description="Rank same-outcome attempts of a step; credit fail-then-pass retries."
    )
    challengers: int | None = Field(
        None,
        ge=1,
        description=(
            "Live challengers the workflow allows at once (1). More than one needs a grouped "
            "strategy (`tournament`) and at most the deployment's `ASSAY_LADDER_MAX_CHALLENGERS`; "
            "both are checked at registration."
        ),
    )

    params: dict[str, Any] | None = Field(
        None,
        description=(
            "An installed strategy's own parameters, validated by its `params_model` when "
            "the workflow is registered (a built-in strategy takes none)."
        ),
    )

    @model_validator(mode="after")
    def _fits_strategy(self) -> GradingSpec:
        # Group fields fit the tournament or an installed strategy (registration checks
        # that one is grouped); never the two built-in ungrouped ones.
        grouped_only = ("quorum", "group_timeout_s", "prior_precision")
        deterministic_only = ("metric", "higher_is_better")
        for name in grouped_only:
            if getattr(self, name) is not None and self.strategy in UNGROUPED_BUILTINS:
                raise ValueError(f"grading.{name} applies to a grouped strategy only")
        for name in deterministic_only:
            if getattr(self, name) is not None and self.strategy != "deterministic":
                raise ValueError(f"grading.{name} applies to the deterministic strategy only")
        if self.strategy == "deterministic" and self.metric is None:
            raise ValueError("the deterministic strategy needs grading.metric")
        return self

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in _GRADING_OMITTED_WHEN_UNSET:
            if data.get(name) is None:
                data.pop(name, None)
        return data

    @property
    def group_quorum(self) -> int:
        """The quorum in effect."""
        return self.quorum if self.quorum is not None else DEFAULT_QUORUM

    @property
    def timeout_s(self) -> float:
        """The group timeout in effect."""
        return self.group_timeout_s if self.group_timeout_s is not None else DEFAULT_GROUP_TIMEOUT_S

    @property
    def precision(self) -> float:
        """The prior precision in effect."""
        return self.prior_precision if self.prior_precision is not None else DEFAULT_PRIOR_PRECISION

    @property
    def attempts_ranked(self) -> bool:
        """Whether attempt tournaments run."""
        return self.attempt_tournaments is not False

    @property
    def live_challengers(self) -> int:
        """How many challengers may be live at once (default one)."""
        return self.challengers if self.challengers is not None else 1


class BudgetSpec(_Frozen):
    """Per-run ceilings."""

    max_model_calls: int = Field(50, ge=1, description="Model calls per run.")
    max_step_executions: int = Field(100, ge=1, description="Step executions per run (loops).")


class ResourceSpec(_Frozen):
    """What one run of the workflow asks of the model's GPU (§14.2), for admission.

    Unset fields take the deployment's: the agent's model, `ASSAY_CAPACITY_DEFAULT_
    CONTEXT_TOKENS` per call, and as many concurrent calls as the widest parallel step
    has model branches (at least one).
    """

    model: str | None = Field(
        None,
        min_length=1,
        description=(
            "The model its model steps need resident; a model other than the agent's must "
            "fit beside it, and is refused at registration if it does not."
        ),
    )
    max_context_tokens: int | None = Field(
        None, ge=1, le=10_000_000, description="Largest context (prompt and answer) of one call."
    )
    concurrent_calls: int | None = Field(
        None, ge=1, le=1024, description="Model calls one run has in flight at once."
    )


class WorkflowDef(_Frozen):
    """A workflow, as data. Its version is the blake3 of its canonical form."""

    id: WorkflowId = Field(description="Logical workflow id, stable across versions.")
    schema_version: Literal[1] = Field(1, alias="schema", description="IR schema version.")
    description: str = Field("", description="Free text for people.")
    steps: list[Step] = Field(min_length=1, description="Steps; the first is the entry.")
    transitions: list[Transition] = Field(
        default_factory=list, description="Edges; when empty, steps run in list order."
    )
    output: StepId | None = Field(None, description="Step whose output is the run's output.")
    verifiers: list[VerifierSpec] = Field(default_factory=list, description="Verifiers.")
    rubric: list[RubricItem] = Field(default_factory=list, description="Rubric for judges.")
    grading: GradingSpec = Field(default_factory=GradingSpec, description="Grading strategy.")
    budget: BudgetSpec = Field(default_factory=BudgetSpec, description="Per-run ceilings.")
    resources: ResourceSpec | None = Field(
        None, description="What a run asks of the model's GPU (§14.2); left out while unset."
    )
    drift: DriftSpec | None = Field(
        None, description="Task-mix drift check (§12.5); left out while unset."
    )

    @model_serializer(mode="wrap")
    def _omit_unset_resources(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Left out while unset, so versions written before them hash as they always did."""
        data: dict[str, Any] = handler(self)
        for name in ("resources", "drift"):
            if data.get(name) is None:
                data.pop(name, None)
        return data

    def model_call_width(self) -> int:
        """Model calls one run can have in flight at once: the most model branches of
        one parallel step, at least one."""
        widest = 1
        for s in self.steps:
            if isinstance(s, ParallelStep):
                calls = sum(1 for b in s.branches if isinstance(self.node(b), ModelStep))
                widest = max(widest, calls)
        return widest

    def canonical(self) -> bytes:
        """Canonical bytes of the IR, defaults filled in, key order irrelevant."""
        return canonical_bytes(self.model_dump(mode="json", by_alias=True))

    @property
    def version(self) -> WorkflowVersion:
        """blake3 of the canonical IR."""
        return WorkflowVersion(digest(self.canonical()))

    def node(self, step_id: StepId) -> AnyStep:
        """The step with this id, of any kind; raises `KeyError`."""
        for s in self.steps:
            if s.id == step_id:
                return s
        raise KeyError(step_id)

    def step(self, step_id: StepId) -> WorkStep:
        """The model or tool step with this id.

        Raises:
            KeyError: no step has this id.
            NotAWorkStep: the step is a conditional, parallel, subworkflow or await step.
        """
        s = self.node(step_id)
        if isinstance(s, ModelStep | ToolStep):
            return s
        raise NotAWorkStep(f"step {step_id!r} is a {s.kind} step, not a model or tool step")

    def parallel_branches(self) -> dict[StepId, StepId]:
        """Each parallel branch step's id, mapped to the id of the parallel step it belongs to."""
        owner: dict[StepId, StepId] = {}
        for s in self.steps:
            if isinstance(s, ParallelStep):
                for b in s.branches:
                    owner.setdefault(b, s.id)
        return owner

    def edges(self) -> list[Transition]:
        """Explicit transitions, or list order when none are declared.

        List order skips parallel branch steps (they run inside their parallel step)
        and adds no edge out of a conditional that has an `otherwise`.
        """
        if self.transitions:
            return list(self.transitions)
        branches = self.parallel_branches()
        chain = [s for s in self.steps if s.id not in branches]
        return [
            Transition.model_validate({"from": a.id, "to": b.id})
            for a, b in pairwise(chain)
            if not (isinstance(a, ConditionalStep) and a.otherwise is not None)
        ]

    @property
    def output_step(self) -> StepId:
        """The step whose output is the run's output (the declared one or the last)."""
        return self.output if self.output is not None else self.steps[-1].id
