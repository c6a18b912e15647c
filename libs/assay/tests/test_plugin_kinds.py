"""Models, judges, proposers, sandbox providers and grading strategies from installed
packages (`assay.models`, `assay.judges`, `assay.proposers`, `assay.sandboxes`,
`assay.grading_strategies`).

Each test installs a real distribution — a `*.dist-info` with an `entry_points.txt`
beside the module it points at, on `sys.path` — as `test_plugins` does for tools.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
from pydantic import BaseModel, ConfigDict, Field

from assay.grading import StubJudge
from assay.grading.ladder import ladder_for
from assay.grading.strategies import (
    GradingStrategy,
    ResourceProfile,
    StrategyParamsInvalid,
    StrategyRefused,
    StrategyUnknown,
    builtin_strategies,
    params_of,
    profile,
)
from assay.kernel.scores import Ranked, Relative
from assay.messages.rungs import Ladder
from assay.runtime.bootstrap import stage_deps
from assay.runtime.plugins import PluginInvalid
from assay.runtime.registry import load_plugins
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.store import FsBlobStore
from assay.workflow import GradingSpec, from_document
from libs.assay.tests.plugin_install import Install

KINDS = """
from assay.engine import StubModel
from assay.grading.strategies import ResourceProfile
from assay.kernel.scores import Capped, Ranked, Relative
from assay.runtime.registry import JudgePlugin, ModelPlugin

twin = ModelPlugin("twin", lambda settings, limiter: StubModel())
again = ModelPlugin("stub", lambda settings, limiter: StubModel())
not_a_plugin = "a model, honest"
judge_in_models = JudgePlugin("sly", lambda settings, chars, limiter: None)
builds_nothing = ModelPlugin("hollow", lambda settings, limiter: object())

class Unprofiled:
    name = "unprofiled"
    produces = Relative
    grouped = False
    judged = True
    async def compare(self, pair): ...

class Capping:
    name = "capping"
    produces = Capped
    grouped = False
    judged = True
    def profile(self, spec, judge, rubric, order_check): ...
    async def compare(self, pair): ...

class Sync:
    name = "sync"
    produces = Relative
    grouped = False
    judged = False
    def profile(self, spec, judge, rubric, order_check): ...
    def compare(self, pair): ...

class Unmeasured:
    name = "unmeasured"
    produces = Relative
    grouped = False
    judged = False
    def profile(self, spec, judge, rubric, order_check): ...
    async def compare(self, pair): ...

class Grouped:
    name = "grouped"
    produces = Ranked
    grouped = True
    judged = True
    def profile(self, spec, judge, rubric, order_check): ...

class Fine:
    name = "fine"
    produces = Relative
    grouped = False
    judged = False
    def profile(self, spec, judge, rubric, order_check):
        return ResourceProfile(
            strategy="fine", models=(), max_context_tokens=0, calls_per_episode=0
        )
    async def compare(self, pair): ...

class SyncRank:
    name = "sync_rank"
    produces = Ranked
    grouped = True
    judged = False
    def profile(self, spec, judge, rubric, order_check): ...
    def rank(self, group): ...

class PairRank:
    name = "pair_rank"
    produces = Relative
    grouped = False
    judged = False
    def profile(self, spec, judge, rubric, order_check): ...
    async def compare(self, pair): ...
    async def rank(self, group): ...

class LooseParams:
    name = "loose_params"
    produces = Ranked
    grouped = True
    judged = False
    params_model = dict
    def profile(self, spec, judge, rubric, order_check): ...

def several():
    return [twin, JudgePlugin("spare", lambda settings, chars, limiter: None)]
"""


def test_the_built_in_kinds_register_through_the_same_entry_points() -> None:
    plugins = load_plugins()
    assert set(plugins.models) == {"stub", "openai"}
    assert set(plugins.judges) == {"stub", "openai"}
    assert set(plugins.proposers) == {"catalog", "openai"}
    assert set(plugins.sandboxes) == {"local"}
    assert set(plugins.strategies) == set(builtin_strategies())
    assert "(from assay)" in plugins.origins[("assay.grading_strategies", "tournament")]
    assert plugins.strategies["tournament"].grouped
    assert not plugins.strategies["deterministic"].judged


def test_installed_kinds_join_the_built_in_ones(install: Install) -> None:
    install(
        KINDS,
        {
            "assay.models": ["twin = {module}:twin"],
            "assay.grading_strategies": ["fine = {module}:Fine"],
        },
    )
    plugins = load_plugins()
    assert set(plugins.models) == {"stub", "openai", "twin"}
    assert "fine" in plugins.strategies
    needs = profile(GradingSpec(strategy="fine"), StubJudge(), strategies=plugins.strategies)
    assert needs.calls_per_episode == 0


@pytest.mark.parametrize(
    ("group", "entry", "says"),
    [
        ("assay.models", "x = {module}:not_a_plugin", "gave a str, not a ModelPlugin"),
        ("assay.models", "x = {module}:judge_in_models", "gave a JudgePlugin, not a ModelPlugin"),
        ("assay.models", "x = {module}:again", "'stub' is already registered by entry point"),
        ("assay.models", "x = {module}_gone:twin", "does not load: ModuleNotFoundError"),
        ("assay.judges", "x = {module}:several", "gave a ModelPlugin, not a JudgePlugin"),
        ("assay.grading_strategies", "x = {module}:Unprofiled", "declares no resource profile"),
        ("assay.grading_strategies", "x = {module}:Capping", "Relative or Ranked"),
        ("assay.grading_strategies", "x = {module}:Sync", "no `async def compare`"),
        ("assay.grading_strategies", "x = {module}:twin", "is not a grading strategy"),
        ("assay.grading_strategies", "x = {module}:SyncRank", "as `async def rank`"),
        ("assay.grading_strategies", "x = {module}:PairRank", "only a grouped strategy may"),
        ("assay.grading_strategies", "x = {module}:LooseParams", "must be a pydantic model"),
    ],
    ids=[
        "str",
        "judge-in-models",
        "duplicate",
        "missing-module",
        "several",
        "unprofiled",
        "capping",
        "sync-compare",
        "model-as-strategy",
        "sync-rank",
        "pairwise-rank",
        "params-not-a-model",
    ],
)
def test_a_broken_plugin_stops_start_up_naming_its_entry_point(
    install: Install, group: str, entry: str, says: str
) -> None:
    module = install(KINDS, {group: [entry]})
    with pytest.raises(PluginInvalid) as caught:
        load_plugins()
    message = str(caught.value)
    assert says in message
    assert f"{group}:x = {module}" in message
    assert f"(from {module})" in message


def test_the_same_strategy_from_two_packages_is_refused(install: Install) -> None:
    install(KINDS, {"assay.grading_strategies": ["fine = {module}:Fine"]})
    second = install(KINDS, {"assay.grading_strategies": ["fine = {module}:Fine"]})
    with pytest.raises(PluginInvalid, match="'fine' is already registered by entry point") as c:
        load_plugins()
    assert second in str(c.value)


@pytest.mark.parametrize(
    ("section", "variable"),
    [
        ("model", "ASSAY_MODEL_KIND"),
        ("judge", "ASSAY_JUDGE_KIND"),
        ("proposer", "ASSAY_PROPOSER_KIND"),
        ("sandbox", "ASSAY_SANDBOX_KIND"),
    ],
)
def test_a_setting_naming_an_unregistered_kind_stops_start_up(
    tmp_path: Path, section: str, variable: str
) -> None:
    settings = AssaySettings.from_env({variable: "nobody-registers-this", "ASSAY_DATA_DIR": "x"})
    with pytest.raises(SettingsInvalid) as caught:
        stage_deps(settings, FsBlobStore(tmp_path / "blobs"), data_dir=tmp_path)
    message = str(caught.value)
    assert f"{variable}='nobody-registers-this': not registered (registered: " in message


async def test_a_plugin_that_builds_the_wrong_thing_stops_start_up(
    tmp_path: Path, install: Install
) -> None:
    module = install(KINDS, {"assay.models": ["hollow = {module}:builds_nothing"]})
    settings = AssaySettings.from_env({"ASSAY_MODEL_KIND": "hollow"})
    with pytest.raises(PluginInvalid, match="built a object without name, complete") as caught:
        stage_deps(settings, FsBlobStore(tmp_path / "blobs"), data_dir=tmp_path)
    assert module in str(caught.value)


async def test_the_settings_choose_an_installed_model(tmp_path: Path, install: Install) -> None:
    install(KINDS, {"assay.models": ["twin = {module}:twin"]})
    settings = AssaySettings.from_env({"ASSAY_MODEL_KIND": "twin"})
    async with stage_deps(settings, FsBlobStore(tmp_path / "blobs"), data_dir=tmp_path) as w:
        assert w.deps.model.name == "stub-arith-1"
        assert "twin" not in w.deps.strategies


def test_an_unregistered_strategy_is_refused_with_the_registered_ones_named() -> None:
    with pytest.raises(StrategyUnknown) as caught:
        profile(GradingSpec(strategy="nobody_registers_this"), StubJudge())
    message = str(caught.value)
    assert "'nobody_registers_this' is not registered" in message
    assert "pairwise_sequential" in message
    assert "tournament" in message


def test_a_strategy_name_must_be_one_a_package_could_register() -> None:
    with pytest.raises(ValueError, match="strategy\n  String should match pattern"):
        GradingSpec(strategy="Not A Name")


def test_a_strategy_whose_profile_is_not_a_resource_profile_is_refused(
    install: Install,
) -> None:
    install(KINDS, {"assay.grading_strategies": ["unmeasured = {module}:Unmeasured"]})
    strategies = load_plugins().strategies
    with pytest.raises(StrategyRefused, match="'unmeasured' declared a NoneType as its profile"):
        profile(GradingSpec(strategy="unmeasured"), StubJudge(), strategies=strategies)


def test_decide_gives_a_challenger_the_ladder_its_registered_strategy_declares(
    install: Install,
) -> None:
    install(KINDS, {"assay.grading_strategies": ["x = {module}:Grouped", "y = {module}:Fine"]})
    strategies = load_plugins().strategies
    for name, ladder in (
        ("grouped", Ladder.RESOURCED),
        ("fine", Ladder.DEFAULT),
        ("tournament", Ladder.RESOURCED),
        ("pairwise_sequential", Ladder.DEFAULT),
    ):
        assert ladder_for({"grading": {"strategy": name}}, strategies) is ladder, name


def test_an_installed_strategys_params_are_validated_by_its_own_model() -> None:
    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        per_token: float = Field(1.0, gt=0)

    class Tuned:
        name = "tuned"
        produces = Ranked
        grouped = True
        judged = False
        params_model = Params

        def profile(self, *args: object) -> ResourceProfile:
            return ResourceProfile(
                strategy="tuned", models=(), max_context_tokens=0, calls_per_episode=0
            )

    strategies = {**builtin_strategies(), "tuned": cast(GradingStrategy, Tuned())}
    judge = StubJudge()
    spec = GradingSpec(strategy="tuned", quorum=2, params={"per_token": 0.5})
    assert params_of(strategies["tuned"], spec) == Params(per_token=0.5)
    assert params_of(strategies["tuned"], GradingSpec(strategy="tuned")) == Params()
    profile(spec, judge, strategies=strategies)  # registers
    for params, says in (
        ({"per_token": 0}, "grading.params.per_token: Input should be greater than 0"),
        ({"per_tokens": 1}, "grading.params.per_tokens: Extra inputs are not permitted"),
    ):
        with pytest.raises(StrategyParamsInvalid) as caught:
            profile(GradingSpec(strategy="tuned", params=params), judge, strategies=strategies)
        assert str(caught.value) == f"grading strategy 'tuned': {says}"
    with pytest.raises(StrategyParamsInvalid, match=r"'tournament' takes no grading\.params"):
        profile(GradingSpec(strategy="tournament", params={"x": 1}), judge)
    with pytest.raises(StrategyRefused, match=r"grading\.quorum applies to a grouped strategy"):
        profile(GradingSpec(strategy="fine", quorum=2), judge, strategies={"fine": _fine()})


def _fine() -> GradingStrategy:
    class Fine:
        name = "fine"
        produces = Relative
        grouped = False
        judged = False

        def profile(self, *args: object) -> ResourceProfile:
            return ResourceProfile(
                strategy="fine", models=(), max_context_tokens=0, calls_per_episode=0
            )

        async def compare(self, pair: object) -> None: ...

    return cast(GradingStrategy, Fine())


def test_unset_params_leave_the_version_unchanged() -> None:
    doc = {"id": "x", "steps": [{"id": "s", "kind": "model", "prompt": "p"}]}
    plain = from_document(doc)
    assert "params" not in plain.model_dump(mode="json", by_alias=True)["grading"]
    tuned = from_document({**doc, "grading": {"strategy": "tuned", "params": {"per_token": 2}}})
    assert tuned.grading.params == {"per_token": 2}
