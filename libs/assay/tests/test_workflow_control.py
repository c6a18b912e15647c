"""Control step kinds in the IR (conditional, parallel, subworkflow, await) and their checks."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from assay.kernel.ids import StepId
from assay.workflow import (
    MAX_AWAIT_TIMEOUT_S,
    MAX_SUBWORKFLOW_DEPTH,
    AwaitStep,
    ConditionalStep,
    ControlGraph,
    JsonFormat,
    ModelStep,
    NotAWorkStep,
    ParallelStep,
    SubworkflowCycle,
    SubworkflowStep,
    SubworkflowTooDeep,
    WorkflowDef,
    WorkflowInvalid,
    WorkflowKey,
    YamlFormat,
    check_subworkflows,
    from_document,
    validate,
)

Doc = dict[str, Any]


def _model(sid: str, prompt: str = "{{ task.x }}") -> Doc:
    return {"id": sid, "kind": "model", "prompt": prompt}


def _cond(sid: str, *branches: tuple[str, str], otherwise: str | None = None) -> Doc:
    doc: Doc = {"id": sid, "kind": "conditional"}
    doc["branches"] = [{"when": when, "to": to} for when, to in branches]
    if otherwise is not None:
        doc["otherwise"] = otherwise
    return doc


def _par(sid: str, *branches: str, **extra: Any) -> Doc:
    return {"id": sid, "kind": "parallel", "branches": list(branches), **extra}


def _doc(*steps: str | Doc, wid: str = "w", **extra: Any) -> Doc:
    return {"id": wid, "steps": [_model(s) if isinstance(s, str) else s for s in steps], **extra}


def _edges(*spec: str) -> list[Doc]:
    """`"a>b"` is an edge; `"a>b:3"` one bounded by max_iterations 3."""
    out: list[Doc] = []
    for e in spec:
        ends, _, bound = e.partition(":")
        frm, to = ends.split(">")
        out.append({"from": frm, "to": to} | ({"max_iterations": int(bound)} if bound else {}))
    return out


def _valid(doc: Doc) -> WorkflowDef:
    return validate(from_document(doc))


def _invalid(doc: Doc) -> str:
    with pytest.raises(WorkflowInvalid) as info:
        validate(from_document(doc))
    message = str(info.value)
    assert "\n" not in message
    return message


# --- the IR -------------------------------------------------------------------------------------

EVERY_KIND = _doc(
    "classify",
    _cond("route", ("steps.classify.output == 'math'", "fan"), otherwise="approve"),
    _par("fan", "solve", "check", "child", join="quorum", quorum=2),
    _model("solve", "{{ steps.classify.output }}"),
    {"id": "check", "kind": "tool", "tool": "strip", "args": {"text": "{{ task.x }}"}},
    {"id": "child", "kind": "subworkflow", "workflow": "arith", "version": "latest"},
    {"id": "approve", "kind": "await", "timeout_s": 3600, "on_timeout": "continue"},
    _model("finish", "{{ steps.fan.output }}"),
    transitions=_edges("classify>route", "fan>finish", "approve>finish"),
)


def test_every_kind_parses_into_its_class_with_defaults_filled_in() -> None:
    wf = _valid(EVERY_KIND)
    kinds = {s.id: type(s) for s in wf.steps}
    assert kinds[StepId("route")] is ConditionalStep
    assert kinds[StepId("fan")] is ParallelStep
    assert kinds[StepId("child")] is SubworkflowStep
    assert kinds[StepId("approve")] is AwaitStep
    approve = wf.node(StepId("approve"))
    assert isinstance(approve, AwaitStep)
    assert approve.signal == "approval"
    child = wf.node(StepId("child"))
    assert isinstance(child, SubworkflowStep)
    assert child.input == {}
    assert wf.node(StepId("route")).kind == "conditional"


def test_explicit_defaults_key_order_and_format_do_not_change_the_version() -> None:
    explicit = json.loads(json.dumps(EVERY_KIND))
    explicit["steps"][6] |= {"signal": "approval"}
    explicit["steps"][5] |= {"input": {}}
    explicit["steps"][1]["branches"][0] = {"to": "fan", "when": "steps.classify.output == 'math'"}
    base = _valid(EVERY_KIND).version
    assert _valid(explicit).version == base
    assert validate(YamlFormat().parse(yaml.safe_dump(explicit).encode())).version == base
    assert validate(JsonFormat().parse(json.dumps(explicit).encode())).version == base
    changed = json.loads(json.dumps(EVERY_KIND))
    changed["steps"][2]["quorum"] = 3
    assert _valid(changed).version != base


@pytest.mark.parametrize(
    ("step", "field"),
    [
        ({"id": "c", "kind": "conditional", "branches": []}, "branches"),
        ({"id": "p", "kind": "parallel", "branches": []}, "branches"),
        ({"id": "p", "kind": "parallel", "branches": ["a"], "join": "most"}, "join"),
        ({"id": "s", "kind": "subworkflow", "workflow": "w2", "version": "v1"}, "version"),
        ({"id": "s", "kind": "subworkflow", "workflow": "w2", "version": "A" * 64}, "version"),
        ({"id": "s", "kind": "subworkflow", "workflow": "w2"}, "version"),
        ({"id": "a", "kind": "await", "timeout_s": 0}, "timeout_s"),
        ({"id": "a", "kind": "await", "signal": "has space"}, "signal"),
        ({"id": "a", "kind": "await", "on_timeout": "retry"}, "on_timeout"),
        ({"id": "x", "kind": "loop"}, "kind"),
    ],
)
def test_malformed_control_steps_are_refused_naming_the_field(step: Doc, field: str) -> None:
    with pytest.raises(WorkflowInvalid, match=field):
        from_document(_doc("a", step))


def test_step_returns_only_work_steps_and_node_returns_any() -> None:
    wf = _valid(EVERY_KIND)
    assert isinstance(wf.step(StepId("solve")), ModelStep)
    with pytest.raises(NotAWorkStep, match="'route' is a conditional step"):
        wf.step(StepId("route"))
    with pytest.raises(KeyError):
        wf.step(StepId("ghost"))
    assert wf.node(StepId("route")).id == "route"


def test_list_order_skips_branches_and_stops_at_a_conditional_with_otherwise() -> None:
    wf = _valid(
        _doc(
            "a",
            _par("fan", "b1", "b2"),
            "b1",
            "b2",
            _cond("route", ("true", "c"), otherwise="d"),
            "c",
            "d",
        )
    )
    assert [(e.source, e.target) for e in wf.edges()] == [
        ("a", "fan"),
        ("fan", "route"),
        ("c", "d"),
    ]
    graph = ControlGraph.of(wf)
    assert graph.successors[StepId("fan")] == ("route", "b1", "b2")
    assert graph.successors[StepId("b1")] == ("route",)
    assert graph.successors[StepId("route")] == ("c", "d")
    assert graph.ancestors(StepId("b1")) == {"a"}
    assert graph.ancestors(StepId("d")) == {"a", "fan", "b1", "b2", "route", "c"}


# --- conditional --------------------------------------------------------------------------------


def test_a_conditional_falls_through_its_transition_when_otherwise_is_null() -> None:
    wf = _valid(_doc("a", _cond("route", ("steps.a.output == 'skip'", "c")), "b", "c"))
    assert ControlGraph.of(wf).successors[StepId("route")] == ("b", "c")


@pytest.mark.parametrize(
    ("route", "message"),
    [
        (_cond("r", ("true", "ghost")), "step 'r': branch 1 goes to unknown step 'ghost'"),
        (_cond("r", ("true", "b"), otherwise="ghost"), "otherwise goes to unknown step 'ghost'"),
    ],
)
def test_a_conditional_target_must_exist(route: Doc, message: str) -> None:
    assert message in _invalid(_doc("a", route, "b"))


def test_a_condition_that_does_not_parse_is_refused_with_its_column() -> None:
    msg = _invalid(_doc("a", _cond("r", ("true", "b"), ("steps.a.output = 'x'", "b")), "b"))
    assert "step 'r' branch 2: condition \"steps.a.output = 'x'\" does not parse" in msg
    assert "column 16: '=' is not an operator" in msg


def test_a_long_condition_is_shortened_in_the_message() -> None:
    when = "1 == " + " + ".join(["1"] * 40) + " +"
    msg = _invalid(_doc("a", _cond("r", (when, "b")), "b"))
    assert "..." in msg
    assert f"column {len(when) + 1}" in msg


def test_a_condition_may_not_refer_to_an_unknown_step() -> None:
    msg = _invalid(_doc("a", _cond("r", ("steps.ghost.succeeded", "b")), "b"))
    assert "step 'r' branch 1: condition refers to unknown step 'ghost'" in msg


def test_a_condition_may_not_refer_to_a_step_that_cannot_have_run_before_it() -> None:
    doc = _doc("a", _cond("r", ("steps.b.output == 'x'", "c")), "b", "c")
    msg = _invalid(doc)
    assert "condition refers to 'steps.b.output', but step 'b' cannot have run before it" in msg
    itself = _doc("a", _cond("r", ("steps.r.succeeded", "b")), "b")
    assert "step 'r' cannot have run before it" in _invalid(itself)


def test_a_condition_may_refer_to_a_step_from_an_earlier_loop_iteration() -> None:
    doc = _doc(
        "a",
        _cond("r", ("steps.c.succeeded and steps.c.output == 'done'", "d")),
        "c",
        "d",
        transitions=_edges("a>r", "r>c", "c>a:3"),
    )
    _valid(doc)


def test_a_condition_may_read_task_fields_and_any_branch_of_an_earlier_parallel() -> None:
    doc = _doc(
        "a",
        _par("fan", "b1", "b2", join="any"),
        "b1",
        "b2",
        _cond("r", ("steps.b1.succeeded or number(task.n) > 2", "c")),
        "c",
    )
    _valid(doc)


def test_a_conditional_branch_back_to_an_earlier_step_is_an_unbounded_cycle() -> None:
    msg = _invalid(_doc("a", _cond("r", ("steps.a.output == 'again'", "a")), "b"))
    assert "cycle a -> r -> a has no loop bound" in msg


def test_a_conditional_with_otherwise_takes_no_transition() -> None:
    doc = _doc("a", _cond("r", ("true", "b"), otherwise="c"), "b", "c")
    doc["transitions"] = _edges("a>r", "r>b", "b>c")
    msg = _invalid(doc)
    assert "conditional step 'r' has `otherwise` and the transition r -> b" in msg


# --- parallel -----------------------------------------------------------------------------------


def _fan(*extra_steps: str | Doc, transitions: list[Doc] | None = None, **fan: Any) -> Doc:
    doc = _doc("a", _par("fan", "b1", "b2", **fan), "b1", "b2", *extra_steps)
    return doc | ({"transitions": transitions} if transitions else {})


def test_a_parallel_step_with_each_join_is_accepted() -> None:
    _valid(_fan())
    _valid(_fan(join="any"))
    _valid(_fan(join="quorum", quorum=1))
    _valid(_fan(join="quorum", quorum=2))


@pytest.mark.parametrize(
    ("fan", "message"),
    [
        ({"join": "quorum"}, "parallel step 'fan': join quorum needs `quorum` (1..2)"),
        ({"join": "quorum", "quorum": 0}, "quorum 0 is outside 1..2 (it has 2 branches)"),
        ({"join": "quorum", "quorum": 3}, "quorum 3 is outside 1..2"),
        ({"join": "all", "quorum": 1}, "`quorum` is set but join is 'all'"),
    ],
)
def test_quorum_is_required_for_join_quorum_and_bounded_by_the_branches(
    fan: Doc, message: str
) -> None:
    assert message in _invalid(_fan(**fan))


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (_doc("a", _par("fan", "ghost")), "parallel step 'fan' has unknown branch step 'ghost'"),
        (_doc("a", _par("fan", "fan", "b"), "b"), "parallel step 'fan' lists itself as a branch"),
        (_doc("a", _par("fan", "b", "b"), "b"), "parallel step 'fan' lists branch 'b' twice"),
        (
            _doc("a", _par("p1", "b"), _par("p2", "b"), "b"),
            "parallel step 'p2' lists branch 'b' and also in parallel step 'p1'",
        ),
        (
            _doc("a", _par("fan", "r"), _cond("r", ("true", "a"))),
            "branch 'r' has kind 'conditional'; a branch is a model, tool or subworkflow step",
        ),
        (
            _doc("a", _par("fan", "inner"), _par("inner", "a")),
            "branch 'inner' has kind 'parallel'",
        ),
        (
            _doc("a", _par("fan", "w"), {"id": "w", "kind": "await"}),
            "branch 'w' has kind 'await'",
        ),
        (_doc("a", _par("fan", "a")), "parallel step 'fan' branch 'a' is the workflow's entry"),
    ],
)
def test_parallel_branches_must_be_self_contained_steps(doc: Doc, message: str) -> None:
    assert message in _invalid(doc)


def test_a_branch_may_not_be_entered_or_left_by_a_transition() -> None:
    into = _fan("c", transitions=_edges("a>fan", "fan>c", "a>b1"))
    assert "has the transition a -> b1; a branch is entered only" in _invalid(into)
    out_of = _fan("c", transitions=_edges("a>fan", "fan>c", "b1>c"))
    assert "branch 'b1' has the transition b1 -> c" in _invalid(out_of)


def test_a_branch_may_not_be_a_conditional_target() -> None:
    doc = _doc("a", _cond("r", ("true", "b1")), _par("fan", "b1", "b2"), "b1", "b2")
    assert "branch 'b1' is a target of conditional step 'r'" in _invalid(doc)


def test_a_branch_template_may_not_read_a_sibling_running_beside_it() -> None:
    doc = _doc("a", _par("fan", "b1", "b2"), "b1", _model("b2", "{{ steps.b1.output }}"))
    msg = _invalid(doc)
    assert "step 'b2' refers to 'steps.b1.output', but step 'b1' cannot have run before it" in msg
    ok = _doc("a", _par("fan", "b1", "b2"), "b1", _model("b2", "{{ steps.a.output }}"))
    _valid(ok)


def test_steps_after_the_join_may_read_the_branches() -> None:
    _valid(_fan(_sub("s", "v", x="{{ steps.b2.output }}", all="{{ steps.fan.output }}")))


def test_a_parallel_step_in_a_bounded_loop_is_accepted() -> None:
    doc = _fan("c", transitions=_edges("a>fan", "fan>c", "c>fan:2"))
    graph = ControlGraph.of(_valid(doc))
    assert graph.ancestors(StepId("b1")) == {"a", "fan", "b1", "b2", "c"}


# --- subworkflow --------------------------------------------------------------------------------


def _sub(sid: str, workflow: str, version: str = "latest", **inputs: str) -> Doc:
    return {"id": sid, "kind": "subworkflow", "workflow": workflow, "version": version} | (
        {"input": inputs} if inputs else {}
    )


def test_a_subworkflow_may_not_call_its_own_latest() -> None:
    msg = _invalid(_doc("a", _sub("again", "w")))
    assert "step 'again' calls its own workflow at latest, a cycle" in msg


def test_subworkflow_input_templates_are_checked() -> None:
    msg = _invalid(_doc("a", _sub("s", "v", x="{{ steps.later.output }}"), "later"))
    assert "step 's' refers to 'steps.later.output', but step 'later' cannot have run" in msg
    assert "malformed placeholder" in _invalid(_doc("a", _sub("s", "v", x="{{ task.x ")))
    _valid(_doc("a", _sub("s", "v", x="{{ steps.a.output }}", y="{{ task.y }}")))


def _registry(*docs: Doc) -> dict[WorkflowKey, WorkflowDef]:
    out: dict[WorkflowKey, WorkflowDef] = {}
    for doc in docs:
        wf = _valid(doc)
        out[(wf.id, wf.version)] = wf
    return out


def test_a_chain_of_pinned_and_latest_calls_without_a_cycle_is_accepted() -> None:
    leaf = _valid(_doc("a", wid="leaf"))
    mid = _doc(_sub("call", "leaf", leaf.version), wid="mid")
    top = _doc(_sub("call", "mid"), _sub("also", "leaf"), wid="top")
    check_subworkflows(_registry(_doc("a", wid="leaf"), _doc("b", wid="leaf"), mid, top))


def test_a_cycle_through_latest_is_refused_naming_it() -> None:
    a = _doc(_sub("to_b", "b"), wid="a")
    b = _doc(_sub("to_a", "a"), wid="b")
    with pytest.raises(SubworkflowCycle) as info:
        check_subworkflows(_registry(a, b))
    message = str(info.value)
    assert message.startswith("sub-workflow cycle: a@")
    assert "(step 'to_b') -> latest=b@" in message
    assert "(step 'to_a') -> latest=a@" in message
    assert [key[0] for key in info.value.cycle] == ["a", "b", "a"]
    assert info.value.cycle[0] == info.value.cycle[-1]


def test_a_cycle_through_a_pinned_version_and_latest_is_refused() -> None:
    a = _valid(_doc(_sub("to_b", "b"), wid="a"))
    b = _valid(_doc(_sub("to_a", "a", a.version), wid="b"))
    with pytest.raises(SubworkflowCycle) as info:
        check_subworkflows({(a.id, a.version): a, (b.id, b.version): b})
    assert f"(step 'to_a') -> a@{a.version[:12]}" in str(info.value)


def test_latest_counts_every_known_version_of_the_callee() -> None:
    # Only the old version of b calls back; it may still be what `latest` meant at some spawn.
    old_b = _doc(_sub("to_a", "a"), "x", wid="b")
    new_b = _doc("x", wid="b")
    a = _doc(_sub("to_b", "b"), wid="a")
    with pytest.raises(SubworkflowCycle):
        check_subworkflows(_registry(a, old_b, new_b))
    check_subworkflows(_registry(a, new_b))


def test_a_workflow_calling_its_own_latest_is_a_cycle_here_too() -> None:
    wf = WorkflowDef.model_validate(_doc(_sub("again", "w")))
    with pytest.raises(SubworkflowCycle, match=r"cycle: w@.* latest=w@"):
        check_subworkflows({(wf.id, wf.version): wf})


def _chain(length: int) -> dict[WorkflowKey, WorkflowDef]:
    """`w0` calls `w1` ... calls `w<length>`, each pinned to the next version."""
    defs: dict[WorkflowKey, WorkflowDef] = {}
    callee = _valid(_doc("leaf", wid=f"w{length}"))
    defs[(callee.id, callee.version)] = callee
    for i in reversed(range(length)):
        callee = _valid(_doc(_sub("down", callee.id, callee.version), wid=f"w{i}"))
        defs[(callee.id, callee.version)] = callee
    return defs


def test_nesting_is_bounded() -> None:
    check_subworkflows(_chain(MAX_SUBWORKFLOW_DEPTH))
    with pytest.raises(SubworkflowTooDeep) as info:
        check_subworkflows(_chain(MAX_SUBWORKFLOW_DEPTH + 1))
    assert f"nest 9 deep, more than the limit of {MAX_SUBWORKFLOW_DEPTH}: w0@" in str(info.value)
    assert len(info.value.calls) == MAX_SUBWORKFLOW_DEPTH + 1
    with pytest.raises(SubworkflowTooDeep):
        check_subworkflows(_chain(3), max_depth=2)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (_sub("s", "nowhere"), "step 's' calls workflow 'nowhere', which has no known version"),
        (_sub("s", "leaf", "0" * 64), "step 's' calls leaf@000000000000, which is not known"),
    ],
)
def test_a_call_of_an_unknown_workflow_or_version_is_refused(step: Doc, message: str) -> None:
    with pytest.raises(WorkflowInvalid, match=message):
        check_subworkflows(_registry(_doc("a", wid="leaf"), _doc(step, wid="top")))


def test_a_key_that_is_not_its_definitions_version_is_refused() -> None:
    wf = _valid(_doc("a"))
    with pytest.raises(WorkflowInvalid, match=f"listed as w@ffffffffffff is w@{wf.version[:12]}"):
        check_subworkflows({(wf.id, "f" * 64): wf})  # type: ignore[dict-item]


# --- await --------------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [0.5, MAX_AWAIT_TIMEOUT_S + 1])
def test_an_await_timeout_outside_the_bounds_is_refused_naming_the_step(timeout: float) -> None:
    msg = _invalid(_doc("a", {"id": "gate", "kind": "await", "timeout_s": timeout}))
    assert "step 'gate': timeout_s" in msg
    assert "is outside 1..2592000 seconds" in msg


def test_an_await_on_a_named_signal_within_bounds_is_accepted() -> None:
    wf = _valid(
        _doc(
            {"id": "gate", "kind": "await", "signal": "ci.build:done", "timeout_s": 1},
            {"id": "last", "kind": "await", "timeout_s": MAX_AWAIT_TIMEOUT_S},
        )
    )
    gate = wf.node(StepId("gate"))
    assert isinstance(gate, AwaitStep)
    assert (gate.signal, gate.on_timeout) == ("ci.build:done", "fail")
