"""The models, judges, proposers and sandbox provider Assay ships, as the plugins its
own entry points register (`assay.runtime.registry`): an installed package's plugin
is chosen the same way as these.

- models: `stub` (deterministic, for tests and the demo), `openai` (an OpenAI-compatible
  endpoint, `ASSAY_MODEL_URL`);
- judges: `stub`, `openai`;
- proposers: `catalog` (deterministic), `openai`;
- sandboxes: `local` (a workspace per run on this machine).
"""

from __future__ import annotations

from pathlib import Path

from assay.engine.models import Model, StubModel
from assay.engine.priority import PriorityLimiter
from assay.grading.judges import Judge, StubJudge
from assay.grading.proposers import CatalogProposer, Proposer
from assay.runtime.endpoints import JudgeSettings, ModelSettings, ProposerSettings
from assay.runtime.registry import JudgePlugin, ModelPlugin, ProposerPlugin, SandboxPlugin
from assay.runtime.sections import SandboxSettings, SettingsInvalid
from assay.sandbox.port import SandboxProvider
from assay.store.ports import BlobStore


def _url(section: str, url: str | None) -> None:
    if url is None:
        raise SettingsInvalid(
            f"missing settings: ASSAY_{section.upper()}_URL (required when "
            f"ASSAY_{section.upper()}_KIND is openai)"
        )


def _stub_model(settings: ModelSettings, limiter: PriorityLimiter | None) -> Model:
    return StubModel(delay_s=settings.stub_delay_s)


def _openai_model(settings: ModelSettings, limiter: PriorityLimiter | None) -> Model:
    _url("model", settings.url)
    return settings.build(limiter)


def _stub_judge(
    settings: JudgeSettings, episode_chars: int | None, limiter: PriorityLimiter | None
) -> Judge:
    return StubJudge()


def _openai_judge(
    settings: JudgeSettings, episode_chars: int | None, limiter: PriorityLimiter | None
) -> Judge:
    _url("judge", settings.url)
    return settings.build(episode_chars, limiter)


def _catalog_proposer(settings: ProposerSettings, limiter: PriorityLimiter | None) -> Proposer:
    return CatalogProposer()


def _openai_proposer(settings: ProposerSettings, limiter: PriorityLimiter | None) -> Proposer:
    _url("proposer", settings.url)
    return settings.build(limiter)


def _local_sandbox(settings: SandboxSettings, blobs: BlobStore, data_dir: Path) -> SandboxProvider:
    return settings.provider(blobs, data_dir)


STUB_MODEL = ModelPlugin("stub", _stub_model)
OPENAI_MODEL = ModelPlugin("openai", _openai_model)
STUB_JUDGE = JudgePlugin("stub", _stub_judge)
OPENAI_JUDGE = JudgePlugin("openai", _openai_judge)
CATALOG_PROPOSER = ProposerPlugin("catalog", _catalog_proposer)
OPENAI_PROPOSER = ProposerPlugin("openai", _openai_proposer)
LOCAL_SANDBOX = SandboxPlugin("local", _local_sandbox)
