"""The model endpoints of the settings tree: the agent's model, the judge, the proposer.

Each is an OpenAI-compatible endpoint and a model on it. Without a URL of its own,
the judge and the proposer run on the agent's (§14.2: one resident model): the
settings tree fills each endpoint setting they do not set from `ASSAY_MODEL_*`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from assay.engine.models import Prices, StubModel
from assay.engine.priority import CallPriority, PriorityLimiter
from assay.grading.judge_prompts import (
    DEFAULT_EPISODE_CHARS,
    DEFAULT_RUBRIC_CHARS,
    MIN_EPISODE_CHARS,
)
from assay.grading.judges import StubJudge
from assay.grading.proposers import CatalogProposer, ProposalPolicy
from assay.runtime.sections import SettingsInvalid

if TYPE_CHECKING:
    # Imported by the methods that build them: settings that name no URL (every
    # command's, most stages') load no chat client and no message model.
    from assay.engine.chat_model import ChatCompletionsModel
    from assay.grading.chat_judge import ChatJudge
    from assay.grading.chat_proposer import ChatProposer

SHARED_WITH_THE_AGENT = (
    "url",
    "name",
    "api_key",
    "timeout_s",
    "max_retries",
    "price_prompt_per_mtok",
    "price_completion_per_mtok",
)
"""The judge's and proposer's settings that fall back to the agent's model when they
have no URL of their own."""


class EndpointSettings(BaseModel):
    """An OpenAI-compatible endpoint and its model."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    url: str | None = Field(
        None,
        description="Base URL of an OpenAI-compatible API, such as http://127.0.0.1:11434/v1.",
    )
    name: str | None = Field(None, description="Model id sent as `model`; needed with a URL.")
    api_key: SecretStr | None = Field(None, description="Sent as `Authorization: Bearer`.")
    timeout_s: float = Field(
        60.0, gt=0, allow_inf_nan=False, description="Deadline of one HTTP request, seconds."
    )
    max_retries: int = Field(
        4, ge=0, le=20, description="Retries of a 429, 5xx, connection error or timeout."
    )
    price_prompt_per_mtok: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="US dollars per million prompt tokens."
    )
    price_completion_per_mtok: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="US dollars per million completion tokens."
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        import httpx  # here: settings without a URL do not load the HTTP client

        try:
            parsed = httpx.URL(value)
        except httpx.InvalidURL as exc:
            raise ValueError(f"not a URL ({exc})") from exc
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError("must be an http:// or https:// URL with a host")
        return value

    def _chat_model(
        self, limiter: PriorityLimiter | None = None, priority: CallPriority = CallPriority.AGENT
    ) -> ChatCompletionsModel:
        """The chat-completions model at the URL, its calls through `limiter` at `priority`.

        Raises:
            SettingsInvalid: a URL without a model name.
        """
        if self.url is None or not self.name:
            raise SettingsInvalid("missing settings: a model name is required with a URL")
        from assay.engine.chat_model import ChatCompletionsModel, RetryPolicy

        return ChatCompletionsModel(
            self.url,
            self.name,
            api_key=self.api_key.get_secret_value() if self.api_key is not None else None,
            timeout_s=self.timeout_s,
            retry=RetryPolicy(max_retries=self.max_retries),
            prices=Prices(self.price_prompt_per_mtok, self.price_completion_per_mtok),
            limiter=limiter,
            priority=priority,
        )


class ModelSettings(EndpointSettings):
    """The model runs call (`ASSAY_MODEL_*`).

    Without `ASSAY_MODEL_URL` the deterministic stub model is used and the other
    variables are only checked, not used.
    """

    stub_delay_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        allow_inf_nan=False,
        description=(
            "Without a URL: how long each call to the stub model takes, as a remote "
            "model's would (a long model wait, for suspension and its benchmark)."
        ),
    )
    kind: str | None = Field(
        None,
        description=(
            "Which registered model (`assay.models`) to use: `stub`, `openai`, or one an installed "
            "package registers (default: `openai` with a URL, else `stub`)."
        ),
    )

    def build(self, limiter: PriorityLimiter | None = None) -> StubModel | ChatCompletionsModel:
        """The model these settings describe: the stub without a URL; its calls go
        through `limiter` first of all (agent work).

        The caller owns the result and closes it with `aclose()`.

        Raises:
            SettingsInvalid: a URL without a model name.
        """
        if self.url is None:
            return StubModel(delay_s=self.stub_delay_s)
        if not self.name:
            raise SettingsInvalid(
                "missing settings: ASSAY_MODEL_NAME (required when ASSAY_MODEL_URL is set)"
            )
        return self._chat_model(limiter, CallPriority.AGENT)

    @property
    def chosen(self) -> str:
        """The registered model these settings name."""
        return self.kind or ("openai" if self.url else "stub")


class JudgeSettings(EndpointSettings):
    """The judge grading calls (§11.1; `ASSAY_JUDGE_*`).

    With `ASSAY_JUDGE_URL` the judge is a `ChatJudge` on that endpoint. Without
    it but with `ASSAY_MODEL_URL`, the judge runs on the agent's endpoint and
    model — the default strategy's single resident model (§11.1, §14.2): each
    endpoint setting the judge does not set (name, API key, timeout, retries,
    prices) is the agent's `ASSAY_MODEL_*` one. With neither URL the stub judge
    is used and the other variables are only checked. The agent's API key is
    never sent to an endpoint `ASSAY_JUDGE_URL` names.
    """

    kind: str | None = Field(
        None,
        description=(
            "Which registered judge (`assay.judges`) to use: `stub`, `openai`, or one an installed "
            "package registers (default: `openai` with a URL, else `stub`)."
        ),
    )

    episode_chars: int = Field(
        DEFAULT_EPISODE_CHARS,
        ge=MIN_EPISODE_CHARS,
        description="Characters one episode may take in a judge's prompt; longer texts are cut.",
    )
    rubric_chars: int = Field(
        DEFAULT_RUBRIC_CHARS,
        ge=1,
        description="Characters a prompt's rubric criteria may take; a longer rubric fails.",
    )

    def build(
        self, episode_chars: int | None = None, limiter: PriorityLimiter | None = None
    ) -> StubJudge | ChatJudge:
        """The judge these settings describe: the stub without a URL.

        `episode_chars`, when given, replaces the configured episode budget (the one the
        derived context ceiling allows, §14.2); the judge's calls go through `limiter`
        after agent calls. The caller owns the result and closes it with `aclose()`.

        Raises:
            SettingsInvalid: a URL without a model name.
        """
        if self.url is None:
            return StubJudge()
        from assay.grading.chat_judge import ChatJudge

        return ChatJudge(
            self._chat_model(limiter, CallPriority.GRADING),
            episode_chars=self.episode_chars if episode_chars is None else episode_chars,
            rubric_chars=self.rubric_chars,
        )

    @property
    def chosen(self) -> str:
        """The registered judge these settings name."""
        return self.kind or ("openai" if self.url else "stub")


class ProposerSettings(EndpointSettings, ProposalPolicy):
    """The slow loop's proposer (§12.1; `ASSAY_PROPOSER_*`), and whose proposals skip
    approval: the section is the `ProposalPolicy` decide applies.

    With `ASSAY_PROPOSER_URL` (or, without it, `ASSAY_MODEL_URL`: the agent's model,
    as for the judge) the proposer is a `ChatProposer` on that endpoint; with neither,
    the deterministic `CatalogProposer`.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    max_tokens: int = Field(4096, ge=1, description="Completion tokens one draft may take.")

    kind: str | None = Field(
        None,
        description=(
            "Which registered proposer (`assay.proposers`) to use: `catalog`, `openai`, or "
            "one an installed package registers (default: `openai` with a URL, else `catalog`)."
        ),
    )

    def build(self, limiter: PriorityLimiter | None = None) -> CatalogProposer | ChatProposer:
        """The proposer these settings describe: the catalog without a URL; its calls go
        through `limiter` last.

        The caller owns the result and closes it with `aclose()`.

        Raises:
            SettingsInvalid: a URL without a model name.
        """
        if self.url is None:
            return CatalogProposer()
        from assay.grading.chat_proposer import ChatProposer

        return ChatProposer(
            self._chat_model(limiter, CallPriority.PROPOSER), max_answer_tokens=self.max_tokens
        )

    @property
    def chosen(self) -> str:
        """The registered proposer these settings name."""
        return self.kind or ("openai" if self.url else "catalog")
