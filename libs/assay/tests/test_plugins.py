"""Tools and verifier kinds from installed packages (`assay.tools`, `assay.verifiers`).

Each test installs a real distribution: a `*.dist-info` directory with an
`entry_points.txt`, beside a module it points at, on `sys.path`, where
`importlib.metadata` finds it exactly as it finds a pip-installed package.
"""

from __future__ import annotations

import uuid

import pytest

from assay.engine import BUILTIN_TOOLS, ToolCall, ToolRefused
from assay.kernel import (
    AttemptNo,
    AttemptState,
    BranchId,
    StepId,
    TaskId,
    TenantId,
    WorkflowVersion,
    new_run_id,
)
from assay.kernel.ids import WorkflowId
from assay.messages import AttemptView, Episode, Purpose, Role, RunRef, Usage
from assay.runtime.plugins import PluginInvalid, load_tools, load_verifiers
from assay.sandbox import NetworkPolicy
from assay.verification import verifier_registry, verify_episode
from assay.workflow import VerifierSpec, WorkflowDef, WorkflowInvalid, validate
from libs.assay.tests.plugin_install import Install

TOOLS_MODULE = """
from assay.engine import Idempotent, Pure, Tool, Unsafe

async def _shout(call):
    return call.args["text"].upper()

async def _noop(call):
    return ""

shout = Tool("shout", _shout, Pure(), "Upper-cases `text`.")

def more():
    return [
        Tool("remember", _noop, Idempotent(key=("fact",)), "Stores a fact."),
        Tool("fetch", _noop, Unsafe(), "Fetches a URL.", needs_network=True),
    ]
"""


def a_call(args: dict[str, str]) -> ToolCall:
    run_id = new_run_id()
    return ToolCall(
        tenant=TenantId(uuid.UUID(int=41)),
        run_id=run_id,
        branch=BranchId(0),
        step=StepId("s"),
        attempt=AttemptNo(1),
        args=args,
        request_id=f"{run_id}/0/s/1",
    )


# -- tools ---------------------------------------------------------------------------------


async def test_installed_tools_join_the_built_in_and_sandboxed_ones(install: Install) -> None:
    install(TOOLS_MODULE, {"assay.tools": ["shout = {module}:shout", "more = {module}:more"]})
    tools = load_tools()
    assert set(BUILTIN_TOOLS) <= set(tools)
    assert {"command", "write_file", "http_request"} <= set(tools)
    assert {"shout", "remember", "fetch"} <= set(tools)
    assert await tools["shout"].fn(a_call({"text": "quiet"})) == "QUIET"
    # The gate applies to installed tools too: network refused unless allowed.
    with pytest.raises(ToolRefused, match="needs the network"):
        await tools["fetch"].fn(a_call({}))
    assert await load_tools(network=NetworkPolicy.ALLOW)["fetch"].fn(a_call({})) == ""


@pytest.mark.parametrize(
    ("source", "entry", "message"),
    [
        (TOOLS_MODULE, "strip = {module}:dup", "tool 'strip' is already registered by Assay"),
        ("answer = 42\n", "answer = {module}:answer", "is a int, not a Tool"),
        ("def f():\n    return ['x']\n", "f = {module}:f", "gave a str, not a Tool"),
        ("def f():\n    return 'x'\n", "f = {module}:f", "returned a str, not Tools"),
        ("def f():\n    raise RuntimeError('boom')\n", "f = {module}:f", "raised RuntimeError"),
        (
            "from assay.engine import Tool\nasync def g(c):\n    return ''\n"
            "bad = Tool('bad', g, 'unsafe', 'No effect class.')\n",
            "bad = {module}:bad",
            "does not load: TypeError",
        ),
        (
            "from assay.engine import Pure, Tool\nasync def g(c):\n    return ''\n"
            "sly = Tool('sly', g, Pure(), 'Effect class swapped after the check.')\n"
            "object.__setattr__(sly, 'effects', 'retry-me')\n",
            "sly = {module}:sly",
            "declares effects 'retry-me'",
        ),
        ("x = 1\n", "gone = {module}_missing:thing", "does not load: ModuleNotFoundError"),
    ],
    ids=[
        "duplicate",
        "not-a-tool",
        "iterable-of-non-tools",
        "string",
        "factory-raises",
        "no-effect-class",
        "effect-class-swapped",
        "missing-module",
    ],
)
def test_a_bad_tool_entry_point_is_a_typed_error_naming_it(
    install: Install, source: str, entry: str, message: str
) -> None:
    extra = "\nasync def _d(c):\n    return ''\ndup = Tool('strip', _d, Pure(), 'Clash.')\n"
    if "{module}:dup" in entry:
        source = source + extra
    module = install(source, {"assay.tools": [entry]})
    with pytest.raises(PluginInvalid) as err:
        load_tools()
    assert message in str(err.value)
    assert "assay.tools:" in str(err.value)
    assert module in str(err.value)


def test_the_same_tool_from_two_packages_is_refused(install: Install) -> None:
    first = install(TOOLS_MODULE, {"assay.tools": ["shout = {module}:shout"]})
    second = install(TOOLS_MODULE, {"assay.tools": ["shout = {module}:shout"]})
    with pytest.raises(PluginInvalid, match="'shout' is already registered") as err:
        load_tools()
    assert first in str(err.value)
    assert second in str(err.value)


# -- verifiers -----------------------------------------------------------------------------

VERIFIER_MODULE = """
class Contains:
    kind = "acme.contains"
    version = "2"

    async def check(self, spec, episode, subject):
        needle = (spec.params or {}).get("needle", "")
        return needle in subject, f"looked for {needle!r}"
"""

DEFINITION = WorkflowDef.model_validate(
    {
        "id": "echo",
        "steps": [{"id": "say", "kind": "model", "prompt": "Say {{ task.word }}."}],
        "verifiers": [{"id": "has", "kind": "acme.contains", "params": {"needle": "153"}}],
    }
)


def episode_of(output: str) -> Episode:
    run_id = new_run_id()
    return Episode(
        run=RunRef(
            tenant=TenantId(uuid.UUID(int=42)),
            run_id=run_id,
            task_id=TaskId("t" * 64),
            idempotency_key=f"key-{run_id}",
            workflow_id=WorkflowId(DEFINITION.id),
            workflow_version=WorkflowVersion(DEFINITION.version),
            role=Role.CURRENT,
            purpose=Purpose.WORK,
        ),
        definition=DEFINITION.model_dump(mode="json", by_alias=True),
        input={"word": "153"},
        attempts=[
            AttemptView(
                step=StepId("say"),
                attempt=AttemptNo(1),
                iteration=0,
                state=AttemptState.SUCCEEDED,
                output=output,
                usage=Usage(),
                duration_ms=1,
            )
        ],
        outputs={"say": output},
        output=output,
        succeeded=True,
        usage=Usage(),
    )


async def test_an_installed_verifier_kind_is_usable_in_a_workflow(install: Install) -> None:
    install(VERIFIER_MODULE, {"assay.verifiers": ["contains = {module}:Contains"]})
    installed = load_verifiers()
    assert set(installed) == {"acme.contains"}
    # Load-time checks accept the kind only where it is installed.
    with pytest.raises(WorkflowInvalid, match=r"unknown kind 'acme\.contains'"):
        validate(DEFINITION)
    assert validate(DEFINITION, known_verifiers=frozenset(installed)) is DEFINITION
    registry = verifier_registry(None, installed)
    specs = list(DEFINITION.verifiers)
    [passed] = await verify_episode(episode_of("It is 153."), specs, registry=registry)
    assert passed.passed
    assert passed.verifier_version == "2"
    assert passed.evidence == "looked for '153'"
    [failed] = await verify_episode(episode_of("It is 154."), specs, registry=registry)
    assert not failed.passed
    # Without the package, the same workflow fails closed.
    [missing] = await verify_episode(episode_of("It is 153."), specs)
    assert not missing.passed
    assert missing.evidence == "no verifier of kind 'acme.contains' is registered"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (VERIFIER_MODULE.replace("acme.contains", "exact"), "kind 'exact' is built in"),
        (VERIFIER_MODULE.replace("async def check", "def check"), "no `async def check`"),
        (VERIFIER_MODULE.replace('"acme.contains"', '"Bad Kind"'), "is not [a-z]"),
        (VERIFIER_MODULE.replace('version = "2"', "version = 2"), "no version string"),
        (VERIFIER_MODULE + "\nContains = 42\n", "is a int, not a Verifier"),
    ],
    ids=["built-in-kind", "sync-check", "bad-kind", "no-version", "not-a-verifier"],
)
def test_a_bad_verifier_entry_point_is_a_typed_error_naming_it(
    install: Install, source: str, message: str
) -> None:
    module = install(source, {"assay.verifiers": ["contains = {module}:Contains"]})
    with pytest.raises(PluginInvalid) as err:
        load_verifiers()
    assert message in str(err.value)
    assert module in str(err.value)


def test_a_verifier_kind_from_two_packages_is_refused(install: Install) -> None:
    install(VERIFIER_MODULE, {"assay.verifiers": ["contains = {module}:Contains"]})
    install(VERIFIER_MODULE, {"assay.verifiers": ["contains = {module}:Contains"]})
    with pytest.raises(PluginInvalid, match=r"'acme\.contains' is already registered"):
        load_verifiers()


def test_an_installed_kind_cannot_replace_a_built_in_one() -> None:
    with pytest.raises(ValueError, match="built in"):
        verifier_registry(None, {"regex": verifier_registry(None)["exact"]})


def test_no_installed_plugins_means_the_built_ins_only() -> None:
    assert load_verifiers() == {}
    assert set(load_tools()) == set(BUILTIN_TOOLS) | {"command", "write_file", "http_request"}


def test_a_verifier_spec_needs_a_well_formed_kind() -> None:
    with pytest.raises(ValueError, match="kind"):
        VerifierSpec.model_validate({"id": "x", "kind": "Not A Kind"})
