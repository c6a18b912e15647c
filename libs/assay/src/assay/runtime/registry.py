"""Models, judges, proposers, sandbox providers and grading strategies that packages
register (entry points, DESIGN §13 of the seed: a user extends Assay by writing an
implementation, not a fork).

| group | an entry point gives | chosen by |
|---|---|---|
| `assay.models` | `ModelPlugin` | `ASSAY_MODEL_KIND` |
| `assay.judges` | `JudgePlugin` | `ASSAY_JUDGE_KIND` |
| `assay.proposers` | `ProposerPlugin` | `ASSAY_PROPOSER_KIND` |
| `assay.sandboxes` | `SandboxPlugin` | `ASSAY_SANDBOX_KIND` |
| `assay.grading_strategies` | a `GradingStrategy` | a workflow's `grading.strategy` |

The built-in ones register the same way (in the `assay` distribution's own entry
points). An entry point resolves to the object, or to a callable (taking no arguments)
that returns one or an iterable of them. Anything else — an object of the wrong type, a
name registered twice, a strategy without a resource profile, an entry point that does
not import — stops start-up with `PluginInvalid` naming the entry point.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from assay.grading.strategies import GradingStrategy
from assay.kernel.scores import Ranked, Relative
from assay.runtime.plugins import PluginInvalid, _resolve, describe

if TYPE_CHECKING:
    from assay.engine.models import Model
    from assay.engine.priority import PriorityLimiter
    from assay.grading.judges import Judge
    from assay.grading.proposers import Proposer
    from assay.runtime.endpoints import JudgeSettings, ModelSettings, ProposerSettings
    from assay.runtime.sections import SandboxSettings
    from assay.sandbox.port import SandboxProvider
    from assay.store.ports import BlobStore

MODELS_GROUP = "assay.models"
JUDGES_GROUP = "assay.judges"
PROPOSERS_GROUP = "assay.proposers"
SANDBOXES_GROUP = "assay.sandboxes"
STRATEGIES_GROUP = "assay.grading_strategies"
_NAME = re.compile(r"[a-z][a-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class ModelPlugin:
    """A model `ASSAY_MODEL_KIND` may name: `build(settings, limiter)` makes the agent's
    model from the `ASSAY_MODEL_*` settings; its calls should go through `limiter`
    (None: no endpoint to share). The result needs `name` and `async complete`."""

    name: str
    build: Callable[[ModelSettings, PriorityLimiter | None], Model]


@dataclass(frozen=True)
class JudgePlugin:
    """A judge `ASSAY_JUDGE_KIND` may name: `build(settings, episode_chars, limiter)`
    makes it; `episode_chars`, when not None, is the episode budget the declared capacity
    allows. The result needs `name`, `max_context_tokens`, `async compare` and `async
    screen`."""

    name: str
    build: Callable[[JudgeSettings, int | None, PriorityLimiter | None], Judge]


@dataclass(frozen=True)
class ProposerPlugin:
    """A proposer `ASSAY_PROPOSER_KIND` may name: `build(settings, limiter)` makes it.
    The result needs `name`, `async propose` and `async aclose`."""

    name: str
    build: Callable[[ProposerSettings, PriorityLimiter | None], Proposer]


@dataclass(frozen=True)
class SandboxPlugin:
    """A sandbox provider `ASSAY_SANDBOX_KIND` may name: `build(settings, blobs,
    data_dir)` makes it (snapshots go to `blobs`). It may raise `SandboxError` when
    commands cannot run here. The result needs `capabilities`, `open`, `snapshot`,
    `restore` and `discard`."""

    name: str
    build: Callable[[SandboxSettings, BlobStore, Path], SandboxProvider]


Built = TypeVar("Built", ModelPlugin, JudgePlugin, ProposerPlugin, SandboxPlugin)

_PRODUCT_NEEDS: dict[type, tuple[str, ...]] = {
    ModelPlugin: ("name", "complete"),
    JudgePlugin: ("name", "max_context_tokens", "compare", "screen"),
    ProposerPlugin: ("name", "propose", "aclose"),
    SandboxPlugin: ("capabilities", "open", "snapshot", "restore", "discard"),
}


@dataclass(frozen=True)
class Plugins:
    """Every registered kind, by name, and the entry point each came from."""

    models: Mapping[str, ModelPlugin]
    judges: Mapping[str, JudgePlugin]
    proposers: Mapping[str, ProposerPlugin]
    sandboxes: Mapping[str, SandboxPlugin]
    strategies: Mapping[str, GradingStrategy]
    origins: Mapping[tuple[str, str], str]
    """`(group, name)` -> the entry point that registered it."""

    def product(self, group: str, name: str, built: object) -> object:
        """`built`, if it has what its group requires.

        Raises:
            PluginInvalid: naming the entry point and what the built object lacks.
        """
        plugin_type = {
            MODELS_GROUP: ModelPlugin,
            JUDGES_GROUP: JudgePlugin,
            PROPOSERS_GROUP: ProposerPlugin,
            SANDBOXES_GROUP: SandboxPlugin,
        }[group]
        lacking = [a for a in _PRODUCT_NEEDS[plugin_type] if not hasattr(built, a)]
        if lacking:
            raise PluginInvalid(
                f"{self.origins[(group, name)]} built a {type(built).__name__} without "
                f"{', '.join(lacking)}"
            )
        return built


def check_strategy(strategy: object, label: str) -> GradingStrategy:
    """`strategy`, if it names itself, declares its `Score` variant and its resource
    profile, and (unless grouped) compares pairs with a coroutine.

    Raises:
        PluginInvalid: naming `label` and what is wrong.
    """
    if not hasattr(strategy, "produces"):
        raise PluginInvalid(
            f"{label}: a {type(strategy).__name__} is not a grading strategy (it declares "
            "no `produces`)"
        )
    name: object = getattr(strategy, "name", None)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise PluginInvalid(
            f"{label}: grading strategy name {name!r} is not [a-z][a-z0-9_.-]{{0,63}}"
        )
    where = f"{label}: grading strategy {name!r}"
    produces: object = getattr(strategy, "produces", None)
    if produces not in (Relative, Ranked):
        raise PluginInvalid(
            f"{where} declares produces={produces!r}; it must be the Score variant it grades "
            "to, Relative or Ranked"
        )
    for flag in ("grouped", "judged"):
        if not isinstance(getattr(strategy, flag, None), bool):
            raise PluginInvalid(f"{where} does not declare `{flag}` (True or False)")
    if not callable(getattr(strategy, "profile", None)):
        raise PluginInvalid(f"{where} declares no resource profile (`profile`)")
    if not strategy.grouped and not inspect.iscoroutinefunction(  # type: ignore[attr-defined]
        getattr(strategy, "compare", None)
    ):
        raise PluginInvalid(f"{where} is pairwise but has no `async def compare`")
    rank = getattr(strategy, "rank", None)
    if rank is not None and not (
        strategy.grouped and inspect.iscoroutinefunction(rank)  # type: ignore[attr-defined]
    ):
        raise PluginInvalid(
            f"{where} has a `rank`, which only a grouped strategy may have, as `async def rank`"
        )
    params = getattr(strategy, "params_model", None)
    if params is not None and not (isinstance(params, type) and issubclass(params, BaseModel)):
        raise PluginInvalid(
            f"{where} declares params_model={params!r}; it must be a pydantic model class"
        )
    return strategy  # type: ignore[return-value]


def _check_built(plugin_type: type[Built]) -> Callable[[object, str], Built]:
    def check(obj: object, label: str) -> Built:
        if not isinstance(obj, plugin_type):
            raise PluginInvalid(
                f"{label} gave a {type(obj).__name__}, not a {plugin_type.__name__}"
            )
        if not isinstance(obj.name, str) or not _NAME.fullmatch(obj.name):
            raise PluginInvalid(f"{label}: name {obj.name!r} is not [a-z][a-z0-9_.-]{{0,63}}")
        if not callable(obj.build):
            raise PluginInvalid(f"{label}: {obj.name!r} has no callable `build`")
        return obj

    return check


def _accept_any(obj: object) -> bool:
    """An object is taken as given (and checked); a class or a function is a factory,
    called for the plugin(s), and a collection holds several."""
    return not (
        isinstance(obj, type | list | tuple | set | frozenset)
        or inspect.isfunction(obj)
        or inspect.isgenerator(obj)
    )


def _group(
    group: str, check: Callable[[object, str], Any], origins: dict[tuple[str, str], str]
) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for ep in entry_points(group=group):
        label = f"entry point {describe(ep)}"
        for obj in _resolve(ep, _accept_any, "plugin"):
            plugin = check(obj, label)
            if plugin.name in found:
                raise PluginInvalid(
                    f"{label}: {plugin.name!r} is already registered by "
                    f"{origins[(group, plugin.name)]}"
                )
            found[plugin.name] = plugin
            origins[(group, plugin.name)] = label
    return found


def load_plugins() -> Plugins:
    """Every model, judge, proposer, sandbox provider and grading strategy registered,
    the built-in ones included.

    Raises:
        PluginInvalid: an entry point does not load or gives something of the wrong
            type, a strategy lacks its profile or its `Score` variant, or a name is
            registered twice in a group.
    """
    origins: dict[tuple[str, str], str] = {}
    return Plugins(
        models=_group(MODELS_GROUP, _check_built(ModelPlugin), origins),
        judges=_group(JUDGES_GROUP, _check_built(JudgePlugin), origins),
        proposers=_group(PROPOSERS_GROUP, _check_built(ProposerPlugin), origins),
        sandboxes=_group(SANDBOXES_GROUP, _check_built(SandboxPlugin), origins),
        strategies=_group(STRATEGIES_GROUP, check_strategy, origins),
        origins=origins,
    )
