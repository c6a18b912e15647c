"""Workflows are data (§4): IR, version hashing, formats, load-time checks and templates."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from assay.engine import BUILTIN_TOOLS
from assay.workflow import (
    JsonFormat,
    TemplateError,
    WorkflowDef,
    WorkflowFormat,
    WorkflowInvalid,
    YamlFormat,
    check_version_bump,
    formats,
    from_document,
    load_workflow,
    placeholders,
    render,
    validate,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "workflows"
Doc = dict[str, Any]

# --- a small generator of valid workflow documents ---------------------------------------------

step_ids = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True)
task_fields = st.sampled_from(["x", "question", "answer", "n"])
# Control characters and line separators are left out: PyYAML's emitter does not always
# round-trip them (it can fold an escaped double-quoted scalar into a different string).
literal_text = st.text(
    alphabet=st.characters(
        codec="utf-8", exclude_characters="{}", exclude_categories=["Cc", "Cs", "Zl", "Zp"]
    ),
    max_size=12,
)


@st.composite
def templates(draw: st.DrawFn, earlier: list[str]) -> str:
    refs = st.builds(lambda f: f"{{{{ task.{f} }}}}", task_fields)
    if earlier:
        refs = refs | st.builds(lambda s: f"{{{{ steps.{s}.output }}}}", st.sampled_from(earlier))
    pieces = draw(st.lists(literal_text | refs, min_size=1, max_size=4))
    return "".join(pieces) + draw(refs)


@st.composite
def workflow_docs(draw: st.DrawFn) -> Doc:
    """A valid workflow document with 1-5 model/tool steps; defaults filled in at random."""
    ids = draw(st.lists(step_ids, min_size=1, max_size=5, unique=True))

    def maybe(doc: Doc, key: str, default: Any) -> None:
        if draw(st.booleans()):
            doc[key] = default

    steps: list[Doc] = []
    for i, sid in enumerate(ids):
        step: Doc = {"id": sid}
        if draw(st.booleans()):
            step |= {"kind": "model", "prompt": draw(templates(ids[:i]))}
            maybe(step, "max_tokens", 256)
        else:
            step |= {"kind": "tool", "tool": draw(st.sampled_from(sorted(BUILTIN_TOOLS)))}
            args = draw(st.dictionaries(st.sampled_from(["text", "field"]), templates(ids[:i])))
            if args:
                step["args"] = args
            else:
                maybe(step, "args", {})
        if draw(st.booleans()):
            step["retry"] = {"max_attempts": draw(st.integers(1, 5))}
            maybe(step["retry"], "backoff_s", 0.0)
        else:
            maybe(step, "retry", {"max_attempts": 1, "backoff_s": 0.0})
        maybe(step, "timeout_s", 30.0)
        steps.append(step)
    doc: Doc = {"id": draw(st.sampled_from(["arith", "summarise", "w-1"])), "steps": steps}
    maybe(doc, "schema", 1)
    maybe(doc, "description", "")
    maybe(doc, "transitions", [])
    maybe(doc, "output", None)
    maybe(doc, "rubric", [])
    maybe(doc, "grading", {"strategy": "pairwise_sequential"})
    maybe(doc, "budget", {"max_model_calls": 50, "max_step_executions": 100})
    if draw(st.booleans()):
        verifier: Doc = {"id": "v", "kind": "exact", "expected": "{{ task.answer }}"}
        maybe(verifier, "step", None)
        maybe(verifier, "strip", True)
        doc["verifiers"] = [verifier]
    else:
        maybe(doc, "verifiers", [])
    return doc


def _shuffled(value: Any, rnd: random.Random) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {k: _shuffled(v, rnd) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rnd) for v in value]
    return value


def _defaults_dropped(value: Any) -> Any:
    """The same document with every field equal to its default omitted."""
    defaults: dict[str, Any] = {
        "schema": 1,
        "description": "",
        "transitions": [],
        "output": None,
        "rubric": [],
        "verifiers": [],
        "grading": {"strategy": "pairwise_sequential"},
        "budget": {"max_model_calls": 50, "max_step_executions": 100},
        "max_tokens": 256,
        "timeout_s": 30.0,
        "args": {},
        "retry": {"max_attempts": 1, "backoff_s": 0.0},
        "backoff_s": 0.0,
        "step": None,
        "strip": True,
    }
    if isinstance(value, dict):
        return {
            k: _defaults_dropped(v)
            for k, v in value.items()
            if not (k in defaults and v == defaults[k])
        }
    if isinstance(value, list):
        return [_defaults_dropped(v) for v in value]
    return value


def _model(sid: str, prompt: str = "{{ task.x }}") -> Doc:
    return {"id": sid, "kind": "model", "prompt": prompt}


def _doc(*steps: str | Doc, **extra: Any) -> Doc:
    """A workflow `w`; a bare string is a model step with that id."""
    return {"id": "w", "steps": [_model(s) if isinstance(s, str) else s for s in steps], **extra}


def _edges(*spec: str) -> list[Doc]:
    """`"a>b"` is an edge; `"a>b:3"` one bounded by max_iterations 3."""
    out: list[Doc] = []
    for e in spec:
        ends, _, bound = e.partition(":")
        frm, to = ends.split(">")
        out.append({"from": frm, "to": to} | ({"max_iterations": int(bound)} if bound else {}))
    return out


def _version(doc: Doc) -> str:
    return validate(from_document(doc)).version


# --- the shipped examples ------------------------------------------------------------------------


def test_arith_examples_load_share_an_id_and_differ_in_version() -> None:
    v1 = load_workflow(EXAMPLES / "arith-v1.yaml", known_tools=frozenset(BUILTIN_TOOLS))
    v2 = load_workflow(EXAMPLES / "arith-v2.yaml", known_tools=frozenset(BUILTIN_TOOLS))
    assert v1.id == v2.id == "arith"
    assert v1.version != v2.version
    assert [s.id for s in v1.steps] == [s.id for s in v2.steps] == ["solve", "answer"]
    assert len(v1.version) == 64


def test_arith_version_bump_retains_every_step_id() -> None:
    v1 = load_workflow(EXAMPLES / "arith-v1.yaml")
    v2 = load_workflow(EXAMPLES / "arith-v2.yaml")
    diff = check_version_bump(v1, v2, rewrite=False)
    assert diff.retained == {"solve", "answer"}
    assert diff.added == diff.removed == frozenset()


# Measured before the conditional, parallel, subworkflow and await kinds joined the IR. New
# kinds must never move the version of a workflow that does not use them.
EXAMPLE_VERSIONS = {
    "arith-v1.yaml": "eda0fb6fc6de0acd52a8334feb74056b98809ea9af972120c0fd9cf5cfa74319",
    "arith-v2.yaml": "a5b34ba1ee1c0a3140b9f6ae5bbcbe76cdb1cec03c33b360d191f656ed8526e7",
}


@pytest.mark.parametrize(("name", "version"), sorted(EXAMPLE_VERSIONS.items()))
def test_example_workflows_keep_their_version_hash(name: str, version: str) -> None:
    assert load_workflow(EXAMPLES / name).version == version


# --- the version is a hash of the IR, not of the text (§4.1) ------------------------------------


@settings(max_examples=60, deadline=None)
@given(workflow_docs(), st.randoms(use_true_random=False), st.data())
def test_version_ignores_format_key_order_layout_and_explicit_defaults(
    doc: Doc, rnd: random.Random, data: st.DataObject
) -> None:
    expected = _version(_defaults_dropped(doc))
    as_json = json.dumps(
        _shuffled(doc, rnd),
        indent=data.draw(st.sampled_from([None, 0, 2, 4]), label="json indent"),
        ensure_ascii=data.draw(st.booleans(), label="ascii"),
    ).encode()
    as_yaml = yaml.safe_dump(
        _shuffled(doc, rnd),
        sort_keys=False,
        default_flow_style=data.draw(st.sampled_from([True, False, None]), label="flow"),
        indent=data.draw(st.integers(2, 6), label="yaml indent"),
        allow_unicode=data.draw(st.booleans(), label="unicode"),
        width=data.draw(st.sampled_from([20, 80, 10_000]), label="width"),
    ).encode()
    from_json = validate(JsonFormat().parse(as_json))
    from_yaml = validate(YamlFormat().parse(as_yaml))
    assert from_json.version == from_yaml.version == _version(doc) == expected
    assert from_json == from_yaml


def _rename(doc: Doc, old: str, new: str) -> Doc:
    out = copy.deepcopy(doc)
    for step in out["steps"]:
        if step["id"] == old:
            step["id"] = new
        if "prompt" in step:
            step["prompt"] = step["prompt"].replace(f"steps.{old}.output", f"steps.{new}.output")
        for k, v in step.get("args", {}).items():
            step["args"][k] = v.replace(f"steps.{old}.output", f"steps.{new}.output")
    return out


MUTATIONS = ["prompt_or_args", "retry", "add_verifier", "rename", "timeout", "add_step"]


def _mutate(doc: Doc, how: str, data: st.DataObject) -> Doc:
    out = copy.deepcopy(doc)
    step = data.draw(st.sampled_from(out["steps"]), label="step")
    taken = {s["id"] for s in out["steps"]}
    fresh = step_ids.filter(lambda s: s not in taken)
    if how == "prompt_or_args":
        if step["kind"] == "model":
            step["prompt"] += data.draw(st.sampled_from([" ", ".", "!"]), label="suffix")
        else:
            step["args"] = {**step.get("args", {}), "extra": "{{ task.x }}"}
    elif how == "retry":
        current = step.get("retry", {}).get("max_attempts", 1)
        step["retry"] = {**step.get("retry", {}), "max_attempts": current % 20 + 1}
    elif how == "add_verifier":
        out["verifiers"] = [*out.get("verifiers", []), {"id": "r", "kind": "regex", "pattern": "."}]
    elif how == "rename":
        return _rename(out, step["id"], data.draw(fresh, label="new id"))
    elif how == "timeout":
        step["timeout_s"] = step.get("timeout_s", 30.0) + 1
    else:
        out["steps"].append(_model(data.draw(fresh, label="added id")))
    return out


@settings(max_examples=80, deadline=None)
@given(workflow_docs(), st.sampled_from(MUTATIONS), st.data())
def test_any_semantic_change_changes_the_version(doc: Doc, how: str, data: st.DataObject) -> None:
    changed = _mutate(doc, how, data)
    assert _version(changed) != _version(doc)


def test_writing_a_default_explicitly_does_not_change_the_version() -> None:
    explicit = {**_model("a"), "max_tokens": 256, "retry": {"max_attempts": 1}, "timeout_s": 30}
    doc = _doc(explicit, schema=1, transitions=[], budget={"max_model_calls": 50})
    assert _version(doc) == _version(_doc("a"))


# --- load-time checks (§4.3, DESIGN §8) ---------------------------------------------------------


def _invalid(doc: Doc, known_tools: frozenset[str] | None = None) -> str:
    with pytest.raises(WorkflowInvalid) as info:
        validate(from_document(doc), known_tools)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_duplicate_step_ids_are_rejected_by_name() -> None:
    assert "duplicate step ids ['a']" in _invalid(_doc("a", "b", "a"))


def test_transition_to_an_unknown_step_is_rejected() -> None:
    assert "unknown step 'ghost'" in _invalid(_doc("a", transitions=_edges("a>ghost")))


def test_cycle_without_a_loop_bound_is_rejected_naming_the_cycle() -> None:
    msg = _invalid(_doc("a", "b", "c", transitions=_edges("a>b", "b>c", "c>b")))
    assert "cycle b -> c -> b" in msg
    assert "max_iterations" in msg


def test_self_loop_without_a_bound_is_a_cycle() -> None:
    assert "cycle a -> a" in _invalid(_doc("a", transitions=_edges("a>a")))


def test_cycle_with_max_iterations_is_accepted() -> None:
    doc = _doc("a", _model("b", "{{ steps.a.output }}"), "c")
    doc["transitions"] = _edges("a>b", "b>a:3", "b>c")
    wf = validate(from_document(doc))
    assert wf.transitions[1].max_iterations == 3


def test_a_step_with_two_forward_edges_is_rejected() -> None:
    msg = _invalid(_doc("a", "b", "c", transitions=_edges("a>b", "a>c")))
    assert "step 'a' has 2 outgoing transitions" in msg


def test_a_step_with_two_bounded_loop_edges_is_rejected() -> None:
    msg = _invalid(_doc("a", "b", "c", transitions=_edges("a>b", "b>c", "c>a:2", "c>b:2")))
    assert "step 'c' has 2 outgoing transitions" in msg


def test_an_unreachable_step_is_rejected_by_name() -> None:
    msg = _invalid(_doc("a", "b", "island", transitions=_edges("a>b")))
    assert "['island'] are unreachable from entry 'a'" in msg


@pytest.mark.parametrize(
    "prompt", ["{{ steps.ghost.output }}", "{{ steps.a.input }}", "{{ secrets.key }}"]
)
def test_a_template_referring_outside_task_and_declared_steps_is_rejected(prompt: str) -> None:
    path = prompt.strip("{} ")
    assert f"step 'b' refers to '{path}'" in _invalid(_doc("a", _model("b", prompt)))


def test_a_tool_argument_template_is_checked_too() -> None:
    step = {"id": "t", "kind": "tool", "tool": "strip", "args": {"text": "{{ steps.no.output }}"}}
    assert "refers to 'steps.no.output'" in _invalid(_doc(step))


def test_an_exact_verifier_without_expected_is_rejected() -> None:
    msg = _invalid(_doc("a", verifiers=[{"id": "eq", "kind": "exact"}]))
    assert "verifier 'eq' (exact) needs `expected`" in msg


def test_a_verifier_with_a_bad_regex_is_rejected() -> None:
    msg = _invalid(_doc("a", verifiers=[{"id": "re", "kind": "regex", "pattern": "(unclosed"}]))
    assert "verifier 're' pattern:" in msg


def test_a_verifier_on_an_unknown_step_is_rejected() -> None:
    verifier = {"id": "v", "kind": "regex", "step": "ghost", "pattern": "x"}
    assert "checks unknown step 'ghost'" in _invalid(_doc("a", verifiers=[verifier]))


def test_an_unknown_tool_is_rejected_only_when_known_tools_are_given() -> None:
    doc = _doc({"id": "t", "kind": "tool", "tool": "rm_rf"})
    assert "unknown tool 'rm_rf'" in _invalid(doc, frozenset(BUILTIN_TOOLS))
    validate(from_document(doc))


def test_an_unknown_file_extension_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "wf.toml"
    path.write_text('id = "w"')
    with pytest.raises(WorkflowInvalid, match=r"no workflow format handles '\.toml' files"):
        load_workflow(path)


def test_a_missing_file_is_workflow_invalid(tmp_path: Path) -> None:
    with pytest.raises(WorkflowInvalid, match=r"wf\.yaml"):
        load_workflow(tmp_path / "wf.yaml")


def test_invalid_yaml_is_one_line_naming_yaml(tmp_path: Path) -> None:
    path = tmp_path / "wf.yml"
    path.write_text("id: w\nsteps: [\n  - {id: a\n")
    with pytest.raises(WorkflowInvalid, match="not valid YAML") as info:
        load_workflow(path)
    assert "\n" not in str(info.value)
    assert str(path) in str(info.value)


def test_invalid_json_is_rejected() -> None:
    with pytest.raises(WorkflowInvalid, match="not valid JSON"):
        JsonFormat().parse(b'{"id": ')


def test_a_non_mapping_document_is_rejected() -> None:
    with pytest.raises(WorkflowInvalid, match="expected a mapping"):
        YamlFormat().parse(b"- just\n- a list\n")


def test_a_pydantic_error_comes_back_as_one_line_naming_the_field() -> None:
    doc = _doc({**_model("a"), "retry": {"max_attempts": 0}})
    with pytest.raises(WorkflowInvalid) as info:
        from_document(doc)
    msg = str(info.value)
    assert "\n" not in msg
    assert "steps.0.model.retry.max_attempts" in msg


def test_several_pydantic_errors_report_the_first_and_count_the_rest() -> None:
    doc = _doc({**_model("a"), "max_tokens": 0, "timeout_s": -1})
    with pytest.raises(WorkflowInvalid, match=r"\(\+1 more\)$"):
        from_document(doc)


def test_load_workflow_prefixes_check_failures_with_the_path(tmp_path: Path) -> None:
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(_doc("a", "a")))
    with pytest.raises(WorkflowInvalid, match="duplicate step ids") as info:
        load_workflow(path)
    assert str(info.value).startswith(str(path))


# --- version bumps (§4.3) -----------------------------------------------------------------------


def _wf(wid: str, *ids: str) -> WorkflowDef:
    return validate(from_document({"id": wid, "steps": [_model(i) for i in ids]}))


def test_version_bump_reports_added_removed_and_retained() -> None:
    diff = check_version_bump(_wf("w", "a", "b"), _wf("w", "b", "c"), rewrite=False)
    assert diff.added == {"c"}
    assert diff.removed == {"a"}
    assert diff.retained == {"b"}


def test_version_bump_retaining_no_ids_is_rejected_unless_marked_a_rewrite() -> None:
    parent, child = _wf("w", "a", "b"), _wf("w", "step1", "step2")
    with pytest.raises(WorkflowInvalid, match="retains none of its parent's step ids"):
        check_version_bump(parent, child, rewrite=False)
    diff = check_version_bump(parent, child, rewrite=True)
    assert diff.retained == frozenset()
    assert diff.added == {"step1", "step2"}
    assert diff.removed == {"a", "b"}


def test_version_bump_across_workflow_ids_is_rejected_even_as_a_rewrite() -> None:
    with pytest.raises(WorkflowInvalid, match="changes workflow id 'w' -> 'v'"):
        check_version_bump(_wf("w", "a"), _wf("v", "a"), rewrite=True)


# --- templates ----------------------------------------------------------------------------------


def test_render_substitutes_strings_verbatim_and_json_encodes_the_rest() -> None:
    context = {
        "task": {"q": 'say "hi"', "n": 3, "ok": True, "none": None, "obj": {"b": 1, "a": [1]}},
        "steps": {"s-1": {"output": "done"}},
    }
    template = "{{task.q}}|{{ task.n }}|{{ task.ok }}|{{ task.none }}|{{ task.obj }}|"
    template += "{{ steps.s-1.output }}"
    assert render(template, context) == 'say "hi"|3|true|null|{"a": [1], "b": 1}|done'


def test_render_does_not_expand_placeholders_inside_substituted_values() -> None:
    context = {"task": {"a": "{{ task.b }}", "b": "secret"}}
    assert render("{{ task.a }}", context) == "{{ task.b }}"


@pytest.mark.parametrize("template", ["{{ task.missing }}", "{{ task.q.deeper }}", "{{ steps }}x"])
def test_render_raises_template_error_on_a_path_the_context_lacks(template: str) -> None:
    with pytest.raises(TemplateError, match="template refers to"):
        render(template, {"task": {"q": "text"}})


def test_placeholders_lists_dotted_paths_in_order() -> None:
    template = "{{ task.a }} {{steps.s-1.output}} { task.no } {{ }} {{ task.a }}"
    assert placeholders(template) == [("task", "a"), ("steps", "s-1", "output"), ("task", "a")]


def test_text_without_placeholders_renders_unchanged() -> None:
    assert render("plain {text}", {}) == "plain {text}"


# --- formats are plugins (§4.2) -----------------------------------------------------------------


class KeyValueFormat:
    """A toy format: `key = value` lines; `step.<id> = <prompt>` declares a model step."""

    extensions: tuple[str, ...] = (".kv",)

    def parse(self, src: bytes) -> WorkflowDef:
        doc: Doc = {"steps": []}
        for line in src.decode().splitlines():
            if not line.strip():
                continue
            key, _, value = (part.strip() for part in line.partition("="))
            if key.startswith("step."):
                doc["steps"].append(_model(key.removeprefix("step."), value))
            else:
                doc[key] = value
        return from_document(doc, origin="kv")


def test_formats_include_yaml_and_json() -> None:
    found = formats()
    extensions = {ext for f in found for ext in f.extensions}
    assert {".yaml", ".yml", ".json"} <= extensions
    assert any(isinstance(f, YamlFormat) for f in found)
    assert any(isinstance(f, JsonFormat) for f in found)


def test_a_custom_format_parses_into_the_ir_and_passes_validation() -> None:
    fmt: WorkflowFormat = KeyValueFormat()
    src = (
        b"id = w\n"
        b"step.solve = What is {{ task.question }}?\n"
        b"step.check = {{ steps.solve.output }}\n"
    )
    wf = validate(fmt.parse(src))
    twin = _doc(
        _model("solve", "What is {{ task.question }}?"), _model("check", "{{ steps.solve.output }}")
    )
    assert wf.version == from_document(twin).version


def test_a_custom_format_inherits_every_load_time_check() -> None:
    fmt: WorkflowFormat = KeyValueFormat()
    wf = fmt.parse(b"id = w\nstep.a = {{ steps.nowhere.output }}\n")
    with pytest.raises(WorkflowInvalid, match=r"refers to 'steps\.nowhere\.output'"):
        validate(wf)


def test_a_malformed_placeholder_is_refused_at_load() -> None:
    doc = {
        "id": "w",
        "steps": [{"id": "s", "kind": "model", "prompt": "Say {{ task.fïeld }} please"}],
    }
    with pytest.raises(WorkflowInvalid, match="malformed placeholder"):
        validate(from_document(doc))
