"""The one place a stage's dependencies are built from the settings tree, in both modes.

`stage_deps` turns `AssaySettings` and a blob store into `StageDeps`: the model,
judge, proposer and sandbox the settings name among the registered ones (or ones
passed in), the tools, the verifiers and grading strategies installed packages
register, and the policies — which are
the settings' own sections, not copies of them. Embedded mode (`Embedded`) and
distributed mode (`serve`) both call it; only their blob stores and data
directories differ.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from assay.engine.models import Model
from assay.engine.priority import PriorityLimiter
from assay.grading.judges import Judge, traced
from assay.grading.ladder import LadderPolicy
from assay.grading.sprt import SprtPolicy
from assay.runtime.admission import Admission
from assay.runtime.capacity_plan import plan_capacity
from assay.runtime.plugins import load_tools, load_verifiers
from assay.runtime.registry import (
    JUDGES_GROUP,
    MODELS_GROUP,
    PROPOSERS_GROUP,
    SANDBOXES_GROUP,
    Plugins,
    load_plugins,
)
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.runtime.stage import StageDeps
from assay.sandbox.port import SandboxError, SandboxProvider
from assay.store.ports import BlobStore

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class StageWiring:
    """A stage's dependencies and what the bootstrap built for them.

    `aclose()` closes the model, judge and proposer built from the settings (never
    ones passed in: those belong to the caller). Also an async context manager.
    """

    deps: StageDeps
    _owned: AsyncExitStack = field(default_factory=AsyncExitStack)

    async def aclose(self) -> None:
        """Close what the bootstrap built; idempotent."""
        await self._owned.aclose()

    async def __aenter__(self) -> StageWiring:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class EndpointLimiters:
    """One `PriorityLimiter` per endpoint URL: the agent's model, the judge and the
    proposer share one when they share a URL, so agent calls go first on it."""

    def __init__(self, slots: int, reserved: int) -> None:
        self.slots = slots
        self.reserved = reserved
        self._by_url: dict[str, PriorityLimiter] = {}

    def at(self, url: str | None) -> PriorityLimiter | None:
        """The limiter of the endpoint at `url` (None without a URL: the stub)."""
        if url is None:
            return None
        key = url.rstrip("/")
        if key not in self._by_url:
            self._by_url[key] = PriorityLimiter(self.slots, self.reserved)
        return self._by_url[key]


def registered(registry: Mapping[str, T], name: str, variable: str) -> T:
    """The plugin `variable` names.

    Raises:
        SettingsInvalid: no installed package registers `name` (the registered ones listed).
    """
    found = registry.get(name)
    if found is None:
        raise SettingsInvalid(
            f"invalid setting {variable}={name!r}: not registered (registered: "
            f"{', '.join(sorted(registry))})"
        )
    return found


def model_for(settings: AssaySettings, plugins: Plugins | None = None) -> Model:
    """The agent's model `ASSAY_MODEL_KIND` names (no priority limiter: a run on its own).

    Raises:
        SettingsInvalid: it names no registered model, or its settings are incomplete.
        PluginInvalid: what the plugin built is not a model.
    """
    plugins = load_plugins() if plugins is None else plugins
    name = settings.model.chosen
    built = registered(plugins.models, name, "ASSAY_MODEL_KIND").build(settings.model, None)
    return cast(Model, plugins.product(MODELS_GROUP, name, built))


def sandbox_for(
    settings: AssaySettings, blobs: BlobStore, data_dir: Path, plugins: Plugins | None = None
) -> SandboxProvider | None:
    """The sandbox provider `settings.sandbox` names, its snapshots in `blobs`.

    None, with a warning, when commands cannot run on this machine at all:
    sandboxed tools are then refused and command verifiers fail, closed.

    Raises:
        SettingsInvalid: `ASSAY_SANDBOX_KIND` names no registered provider.
        PluginInvalid: the provider built is not a sandbox provider.
    """
    plugins = load_plugins() if plugins is None else plugins
    kind = settings.sandbox.kind
    plugin = registered(plugins.sandboxes, kind, "ASSAY_SANDBOX_KIND")
    try:
        built = plugin.build(settings.sandbox, blobs, data_dir)
    except SandboxError as exc:
        log.warning("no sandbox: sandboxed tools and command verifiers will fail: %s", exc)
        return None
    return cast(SandboxProvider, plugins.product(SANDBOXES_GROUP, kind, built))


def stage_deps(
    settings: AssaySettings,
    blobs: BlobStore,
    *,
    data_dir: Path | None = None,
    model: Model | None = None,
    judge: Judge | None = None,
    sprt: SprtPolicy | None = None,
    shadow_rate: float | None = None,
    ladder: LadderPolicy | None = None,
) -> StageWiring:
    """Every stage's dependencies, as `settings` describe them.

    `model`, `judge`, `sprt`, `shadow_rate` and `ladder` override the settings (a
    test's or the demo's own); the sandbox's default root is under `data_dir`
    (default: `settings.data_dir`). The caller closes the result (`aclose`).

    The agent's model, the judge and the proposer built here share one priority
    limiter per endpoint URL (agent calls first, `ASSAY_CAPACITY_ENDPOINT_CONCURRENCY`
    slots, `ASSAY_CAPACITY_AGENT_RESERVED_CALLS` of them for agent calls alone). With a
    declared capacity (§14.2), the judge's episode budget and the retention
    ceilings are cut to what the derived context ceiling allows, and ingest's admission
    holds runs against it.

    Raises:
        SettingsInvalid: an endpoint with a URL but no model name, a `*_KIND` that names
            no registered plugin, or a declared capacity that does not hold the resident
            models.
        PluginInvalid: an installed plugin is broken (the entry point is named).
    """
    owned = AsyncExitStack()
    plugins = load_plugins()
    plan = plan_capacity(settings)
    limiters = EndpointLimiters(
        settings.capacity.endpoint_concurrency, settings.capacity.agent_reserved_calls
    )
    if model is None:
        model = _owned(
            owned,
            plugins,
            MODELS_GROUP,
            settings.model.chosen,
            "ASSAY_MODEL_KIND",
            lambda p: p.build(settings.model, limiters.at(settings.model.url)),
        )
    if judge is None:
        episode_chars = plan.judge_episode_chars if plan else None
        judge = _owned(
            owned,
            plugins,
            JUDGES_GROUP,
            settings.judge.chosen,
            "ASSAY_JUDGE_KIND",
            lambda p: p.build(settings.judge, episode_chars, limiters.at(settings.judge.url)),
        )
    proposer = _owned(
        owned,
        plugins,
        PROPOSERS_GROUP,
        settings.proposer.chosen,
        "ASSAY_PROPOSER_KIND",
        lambda p: p.build(settings.proposer, limiters.at(settings.proposer.url)),
    )
    data_dir = settings.data_dir if data_dir is None else data_dir
    deps = StageDeps(
        blobs=blobs,
        model=model,
        judge=traced(judge),
        tools=load_tools(network=settings.sandbox.network),
        sprt=settings.sprt if sprt is None else sprt,
        shadow_rate=settings.shadow_rate if shadow_rate is None else shadow_rate,
        ladder=settings.ladder if ladder is None else ladder,
        lease_ttl_s=settings.lease_ttl_s,
        episode_inline_max_bytes=settings.episode_inline_max_bytes,
        sandbox=sandbox_for(settings, blobs, data_dir, plugins),
        verifiers=load_verifiers(),
        strategies=plugins.strategies,
        retention=plan.retention(settings.retention) if plan else settings.retention,
        grading=settings.grading,
        calibration=settings.calibration,
        replay=settings.replay,
        proposer=proposer,
        proposals=settings.proposer,
        admission=Admission(plan, settings.capacity.default_context_tokens),
        suspend=settings.sandbox.suspend,
    )
    return StageWiring(deps, owned)


def _owned(
    owned: AsyncExitStack,
    plugins: Plugins,
    group: str,
    name: str,
    variable: str,
    build: Callable[[Any], object],
) -> Any:
    """The plugin `variable` names in `group`, built, checked, and closed with `owned`."""
    registry: Mapping[str, object] = {
        MODELS_GROUP: plugins.models,
        JUDGES_GROUP: plugins.judges,
        PROPOSERS_GROUP: plugins.proposers,
    }[group]
    built = plugins.product(group, name, build(registered(registry, name, variable)))
    aclose = getattr(built, "aclose", None)
    if callable(aclose):
        owned.push_async_callback(aclose)
    return built
