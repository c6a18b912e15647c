"""Configuration from the environment (documented in README): a distributed stage's
services, the model every mode calls, the judge grading calls, the sandbox, and
retention."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, Self, TypeVar

import httpx
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
)

from assay.engine.chat_model import ChatCompletionsModel, RetryPolicy
from assay.engine.models import Prices, StubModel
from assay.engine.retention import DEFAULT_TOKEN_CEILING, RetentionPolicy
from assay.grading.chat_judge import ChatJudge
from assay.grading.chat_proposer import ChatProposer
from assay.grading.judge_prompts import (
    DEFAULT_EPISODE_CHARS,
    DEFAULT_RUBRIC_CHARS,
    MIN_EPISODE_CHARS,
)
from assay.grading.judges import StubJudge
from assay.grading.proposers import CatalogProposer, ProposalPolicy
from assay.grading.replay import ReplayPolicy
from assay.grading.strategies import GradingCapacity, GradingPolicy
from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId, tenant_id
from assay.kernel.schema import one_line
from assay.sandbox.local import Limits, LocalSandbox
from assay.sandbox.port import NetworkPolicy
from assay.store.ports import BlobStore


class SettingsInvalid(AssayError):
    """A required setting is missing or a value does not parse."""


class _FromEnv(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """Read `ASSAY_*` variables; raise `SettingsInvalid` with a one-line reason."""
        env = os.environ if environ is None else environ
        values = {
            name: env[f"ASSAY_{name.upper()}"]
            for name in cls.model_fields
            if env.get(f"ASSAY_{name.upper()}") not in (None, "")
        }
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise SettingsInvalid(f"invalid setting: ASSAY_{one_line(exc).upper()}") from exc


class Settings(_FromEnv):
    """Everything `assay serve` needs; each field reads `ASSAY_<FIELD>`."""

    kafka_bootstrap: str | None = Field(None, description="Kafka bootstrap, host:port[,...].")
    kafka_member_timeout_ms: int = Field(
        10_000,
        ge=500,
        le=300_000,
        description=(
            "How long the consumer group waits for a silent member (one that was killed) "
            "before its partitions go to the others or to its replacement."
        ),
    )
    database_url: str | None = Field(None, description="The stage's own Postgres role DSN.")
    admin_database_url: str | None = Field(
        None, description="A superuser DSN, used only by `assay db provision`."
    )
    s3_endpoint: str | None = Field(None, description="S3 endpoint URL (None: AWS).")
    s3_bucket: str = Field("assay", description="Bucket for blobs (created if missing).")
    s3_access_key_id: str | None = Field(None, description="S3 access key id.")
    s3_secret_access_key: str | None = Field(None, description="S3 secret access key.")
    s3_region: str = Field("us-east-1", description="S3 region.")
    partitions: int = Field(12, ge=1, le=10_000, description="Partitions per topic at creation.")
    http_port: int = Field(8080, ge=0, le=65535, description="Port of /healthz and /metrics.")
    log_level: str = Field("INFO", description="Python logging level.")
    lease_ttl_s: float = Field(
        15.0, gt=0.1, le=3600, description="Lease of a run without a heartbeat, in seconds."
    )
    stage_password: str | None = Field(
        None,
        description="Password of every stage role at provisioning (or ASSAY_<STAGE>_PASSWORD).",
    )
    unready_after_s: float = Field(
        15.0,
        gt=0,
        le=3600,
        description=(
            "A stage whose store, message handling or relay has failed this long (seconds) "
            "answers /readyz with 503."
        ),
    )
    exit_after_s: float = Field(
        120.0,
        ge=0,
        le=86_400,
        description=(
            "A stage whose store or message handling has failed this long (seconds) exits "
            "with status 3 so that its supervisor restarts it; 0 never exits."
        ),
    )
    shutdown_grace_s: float = Field(
        20.0,
        gt=0,
        le=3600,
        description=(
            "After SIGTERM, a stage that has not finished stopping in this many seconds "
            "exits at once (status 1); keep it below the orchestrator's grace period."
        ),
    )

    def require(self, *names: str) -> None:
        """Raise `SettingsInvalid` naming every missing `ASSAY_*` variable of `names`."""
        missing = [f"ASSAY_{n.upper()}" for n in names if getattr(self, n) in (None, "")]
        if missing:
            raise SettingsInvalid(f"missing settings: {', '.join(missing)}")

    def stage_password_for(self, stage: str, environ: Mapping[str, str] | None = None) -> str:
        """The password of one stage's role at provisioning."""
        env = os.environ if environ is None else environ
        password = env.get(f"ASSAY_{stage.upper()}_PASSWORD") or self.stage_password
        if not password:
            raise SettingsInvalid(
                f"missing settings: ASSAY_{stage.upper()}_PASSWORD or ASSAY_STAGE_PASSWORD"
            )
        return password


class _EndpointSettings(BaseModel):
    """An OpenAI-compatible endpoint and its model: what the agent's model and the
    judge are configured with."""

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
        try:
            parsed = httpx.URL(value)
        except httpx.InvalidURL as exc:
            raise ValueError(f"not a URL ({exc})") from exc
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError("must be an http:// or https:// URL with a host")
        return value

    @classmethod
    def _set_in(cls, env: Mapping[str, str], prefix: str) -> dict[str, str]:
        """Each field set by a non-empty `<prefix><FIELD>` variable, mapped to that name."""
        return {
            name: f"{prefix}{name.upper()}"
            for name in cls.model_fields
            if env.get(f"{prefix}{name.upper()}") not in (None, "")
        }

    @classmethod
    def _validated(cls, env: Mapping[str, str], sources: Mapping[str, str]) -> Self:
        """The settings from the variables `sources` names per field.

        Raises:
            SettingsInvalid: naming the variable (and its value, unless a key).
        """
        values = {name: env[variable] for name, variable in sources.items()}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = str(first["loc"][0]) if first["loc"] else ""
            shown = "" if field == "api_key" else f"={values.get(field)!r}"
            variable = sources.get(field, field.upper())
            raise SettingsInvalid(f"invalid setting {variable}{shown}: {first['msg']}") from exc

    @classmethod
    def _beside_the_agent(cls, env: Mapping[str, str], prefix: str) -> Self:
        """Read `<prefix>*` variables; without `<prefix>URL` but with `ASSAY_MODEL_URL`,
        every endpoint setting not set is the agent's `ASSAY_MODEL_*` one (one resident
        model, §14.2). The agent's API key never goes to a URL `<prefix>URL` names.

        Raises:
            SettingsInvalid: a value does not parse or is out of range (the message
                names the variable), or a URL is set without a model name.
        """
        sources = cls._set_in(env, prefix)
        if "url" not in sources and env.get("ASSAY_MODEL_URL"):
            agent = ModelSettings._set_in(env, "ASSAY_MODEL_")
            for name in _SHARED_WITH_THE_AGENT:
                if name not in sources and name in agent:
                    sources[name] = agent[name]
        settings = cls._validated(env, sources)
        if settings.url is not None and not settings.name:
            wanted = f"{prefix}NAME"
            url_from = sources.get("url", f"{prefix}URL")
            if url_from != f"{prefix}URL":
                wanted += " or ASSAY_MODEL_NAME"
            raise SettingsInvalid(f"missing settings: {wanted} (required when {url_from} is set)")
        return settings

    def _chat_model(self) -> ChatCompletionsModel:
        """The chat-completions model at the URL (the caller checked URL and name)."""
        assert self.url is not None
        assert self.name is not None
        return ChatCompletionsModel(
            self.url,
            self.name,
            api_key=self.api_key.get_secret_value() if self.api_key is not None else None,
            timeout_s=self.timeout_s,
            retry=RetryPolicy(max_retries=self.max_retries),
            prices=Prices(self.price_prompt_per_mtok, self.price_completion_per_mtok),
        )


class ModelSettings(_EndpointSettings):
    """The model runs call; each field reads `ASSAY_MODEL_<FIELD>`.

    Without `ASSAY_MODEL_URL` the deterministic stub model is used and the
    other variables are only checked, not used.
    """

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ModelSettings:
        """Read `ASSAY_MODEL_*` variables.

        Raises:
            SettingsInvalid: a value does not parse or is out of range (the message
                names the variable), or a URL is set without a model name.
        """
        env = os.environ if environ is None else environ
        settings = cls._validated(env, cls._set_in(env, "ASSAY_MODEL_"))
        settings._check()
        return settings

    def _check(self) -> None:
        if self.url is not None and not self.name:
            raise SettingsInvalid(
                "missing settings: ASSAY_MODEL_NAME (required when ASSAY_MODEL_URL is set)"
            )

    def build(self) -> StubModel | ChatCompletionsModel:
        """The model these settings describe: the stub without a URL.

        The caller owns the result and closes it with `aclose()`.

        Raises:
            SettingsInvalid: a URL without a model name.
        """
        if self.url is None:
            return StubModel()
        self._check()
        return self._chat_model()


_SHARED_WITH_THE_AGENT = (
    "url",
    "name",
    "api_key",
    "timeout_s",
    "max_retries",
    "price_prompt_per_mtok",
    "price_completion_per_mtok",
)
"""The judge settings that fall back to the agent's model when the judge has no URL."""


class JudgeSettings(_EndpointSettings):
    """The judge grading calls (§11.1); each field reads `ASSAY_JUDGE_<FIELD>`.

    With `ASSAY_JUDGE_URL` the judge is a `ChatJudge` on that endpoint. Without
    it but with `ASSAY_MODEL_URL`, the judge runs on the agent's endpoint and
    model — the default strategy's single resident model (§11.1, §14.2): each
    endpoint setting the judge does not set (name, API key, timeout, retries,
    prices) is the agent's `ASSAY_MODEL_*` one. With neither URL the stub judge
    is used and the other variables are only checked. The agent's API key is
    never sent to an endpoint `ASSAY_JUDGE_URL` names.
    """

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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JudgeSettings:
        """Read `ASSAY_JUDGE_*` variables, falling back to `ASSAY_MODEL_*` ones.

        Raises:
            SettingsInvalid: a value does not parse or is out of range (the message
                names the variable), or a URL is set without a model name.
        """
        return cls._beside_the_agent(os.environ if environ is None else environ, "ASSAY_JUDGE_")

    def build(self) -> StubJudge | ChatJudge:
        """The judge these settings describe: the stub without a URL.

        The caller owns the result and closes it with `aclose()`.

        Raises:
            SettingsInvalid: a URL without a model name.
        """
        if self.url is None:
            return StubJudge()
        return ChatJudge(
            self._chat_model(), episode_chars=self.episode_chars, rubric_chars=self.rubric_chars
        )


class ProposerSettings(_EndpointSettings):
    """The slow loop's proposer (§12.1); each field reads `ASSAY_PROPOSER_<FIELD>`.

    With `ASSAY_PROPOSER_URL` (or, without it, `ASSAY_MODEL_URL`: the agent's model,
    as for the judge) the proposer is a `ChatProposer` on that endpoint; with neither,
    the deterministic `CatalogProposer`. `ungated` lists the tenants (UUIDs, comma
    separated) whose proposals are registered without an operator's approval.
    """

    max_tokens: int = Field(4096, ge=1, description="Completion tokens one draft may take.")
    ungated: str = Field(
        "", description="Tenants whose proposals skip approval: UUIDs, comma separated."
    )

    @field_validator("ungated")
    @classmethod
    def _tenants(cls, value: str) -> str:
        for part in filter(None, (p.strip() for p in value.split(","))):
            try:
                tenant_id(part)
            except ValueError as exc:
                raise ValueError(f"{part!r} is not a tenant UUID") from exc
        return value

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProposerSettings:
        """Read `ASSAY_PROPOSER_*` variables, falling back to `ASSAY_MODEL_*` ones.

        Raises:
            SettingsInvalid: a value does not parse or is out of range (the message
                names the variable), or a URL is set without a model name.
        """
        env = os.environ if environ is None else environ
        return cls._beside_the_agent(env, "ASSAY_PROPOSER_")

    def policy(self) -> ProposalPolicy:
        """Who is ungated."""
        tenants = (p.strip() for p in self.ungated.split(","))
        return ProposalPolicy(ungated=frozenset(str(tenant_id(t)) for t in tenants if t))

    def build(self) -> CatalogProposer | ChatProposer:
        """The proposer these settings describe: the catalog without a URL.

        The caller owns the result and closes it with `aclose()`.
        """
        if self.url is None:
            return CatalogProposer()
        return ChatProposer(self._chat_model(), max_answer_tokens=self.max_tokens)


_DEFAULT_LIMITS = Limits()


class SandboxSettings(_FromEnv):
    """The local sandbox, in both modes; each field reads `ASSAY_<FIELD>` (see README)."""

    sandbox_root: str | None = Field(
        None, description="Directory of the workspaces (default: <data dir>/sandbox)."
    )
    sandbox_network: Literal["deny", "allow"] = Field(
        "deny", description="deny: no network for commands and network tools; allow: the host's."
    )
    sandbox_cpu_s: int = Field(_DEFAULT_LIMITS.cpu_s, ge=1, description="CPU seconds a command.")
    sandbox_memory_bytes: int = Field(
        _DEFAULT_LIMITS.address_space_bytes, ge=1 << 20, description="Address space of a command."
    )
    sandbox_processes: int = Field(
        _DEFAULT_LIMITS.processes, ge=1, description="Processes a command may start."
    )
    sandbox_file_size_bytes: int = Field(
        _DEFAULT_LIMITS.file_size_bytes, ge=1, description="Largest file a command may write."
    )
    sandbox_uid: int | None = Field(
        None, ge=1, description="uid commands run as when Assay runs as root (default 65534)."
    )
    sandbox_gid: int | None = Field(
        None, ge=1, description="gid commands run as when Assay runs as root (default 65534)."
    )

    @property
    def network(self) -> NetworkPolicy:
        """The network policy."""
        return NetworkPolicy(self.sandbox_network)

    @property
    def limits(self) -> Limits:
        """Resource limits of each command."""
        return Limits(
            cpu_s=self.sandbox_cpu_s,
            address_space_bytes=self.sandbox_memory_bytes,
            processes=self.sandbox_processes,
            file_size_bytes=self.sandbox_file_size_bytes,
        )

    def provider(self, blobs: BlobStore, data_dir: Path) -> LocalSandbox:
        """The local sandbox these settings describe, its snapshots in `blobs`.

        Raises:
            SandboxUnavailable: commands cannot run on this machine at all.
        """
        root = Path(self.sandbox_root) if self.sandbox_root else data_dir / "sandbox"
        return LocalSandbox(
            root,
            blobs,
            limits=self.limits,
            network=self.network,
            uid=self.sandbox_uid,
            gid=self.sandbox_gid,
        )


def tenant_map(value: object, unit: str) -> object:
    """Parse `<tenant-uuid>=<n>,...` (a per-tenant override map); other values pass through.

    Raises:
        ValueError: an entry is malformed, a tenant is not a UUID or is given twice, or
            a number is not a whole number >= 1.
    """
    if not isinstance(value, str):
        return value
    out: dict[TenantId, int] = {}
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        tenant, sep, number = entry.partition("=")
        if not sep:
            raise ValueError(f"{entry!r} is not <tenant-uuid>=<{unit}>")
        try:
            who = tenant_id(tenant.strip())
        except ValueError:
            raise ValueError(f"{tenant.strip()!r} is not a tenant UUID") from None
        if not number.strip().isdigit() or int(number) < 1:
            raise ValueError(f"{number.strip()!r} for {who} is not a whole number >= 1")
        if who in out:
            raise ValueError(f"tenant {who} is given twice")
        out[who] = int(number)
    return out


_S = TypeVar("_S", bound=BaseModel)


def _from_env(model: type[_S], prefix: str, environ: Mapping[str, str] | None) -> _S:
    """`model` from the `<prefix><FIELD>` variables set and non-empty; an invalid one is
    named with its value in the `SettingsInvalid` it raises."""
    env = os.environ if environ is None else environ
    values = {
        name: env[f"{prefix}{name.upper()}"]
        for name in model.model_fields
        if env.get(f"{prefix}{name.upper()}") not in (None, "")
    }
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else ""
        reason = str(first["ctx"]["error"]) if "error" in first.get("ctx", {}) else first["msg"]
        raise SettingsInvalid(
            f"invalid setting {prefix}{name.upper()}={values.get(name)!r}: {reason}"
        ) from exc


_DEFAULT_RETENTION = RetentionPolicy()


class RetentionSettings(BaseModel):
    """Retention (§8.6); each field reads `ASSAY_RETENTION_<FIELD>` (see README).

    `ceilings` is a per-tenant map written `<tenant-uuid>=<tokens>,...`; a tenant
    not in it has `token_ceiling`.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    token_ceiling: int = Field(
        DEFAULT_TOKEN_CEILING, ge=1, description="Tokens a run may hold before it is reduced."
    )
    ceilings: dict[TenantId, int] = Field(
        default_factory=dict, description="Per-tenant ceilings: `<tenant-uuid>=<tokens>,...`."
    )
    keep_chars: int = Field(
        _DEFAULT_RETENTION.keep_chars, ge=0, description="Characters a summary keeps per text."
    )
    tier_after_s: float = Field(
        _DEFAULT_RETENTION.tier_after_s,
        ge=0,
        allow_inf_nan=False,
        description="Seconds after its reduction that a run is tiered.",
    )
    sweep_interval_s: float = Field(
        _DEFAULT_RETENTION.sweep_interval_s,
        ge=0,
        allow_inf_nan=False,
        description="Least seconds between two tiering sweeps of one tenant.",
    )

    @field_validator("ceilings", mode="before")
    @classmethod
    def _tenant_map(cls, value: object) -> object:
        return tenant_map(value, "tokens")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RetentionSettings:
        """Read `ASSAY_RETENTION_*` variables.

        Raises:
            SettingsInvalid: a value does not parse or is out of range (the message
                names the variable and the value).
        """
        return _from_env(cls, "ASSAY_RETENTION_", environ)

    def policy(self) -> RetentionPolicy:
        """The retention policy these settings describe."""
        return RetentionPolicy(
            token_ceiling=self.token_ceiling,
            ceilings=dict(self.ceilings),
            keep_chars=self.keep_chars,
            tier_after_s=self.tier_after_s,
            sweep_interval_s=self.sweep_interval_s,
        )


_DEFAULT_GRADING = GradingPolicy()


class GradingSettings(BaseModel):
    """Grading capacity, spend and health sampling; each field reads `ASSAY_GRADING_<FIELD>`.

    `ceilings` is a per-tenant map of judge calls per day, written
    `<tenant-uuid>=<calls>,...`; a tenant not in it has `calls_per_day`.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    max_models: int = Field(
        _DEFAULT_GRADING.capacity.max_models, ge=0, description="Models grading may keep resident."
    )
    max_context_tokens: int = Field(
        _DEFAULT_GRADING.capacity.max_context_tokens,
        ge=1,
        description="Largest single-call context a grading strategy may ask for.",
    )
    max_calls_per_episode: float = Field(
        _DEFAULT_GRADING.capacity.max_calls_per_episode,
        gt=0,
        allow_inf_nan=False,
        description="Judge calls per graded episode a strategy may declare.",
    )
    calls_per_day: int = Field(
        _DEFAULT_GRADING.calls_per_day, ge=0, description="Judge calls per tenant per UTC day."
    )
    ceilings: dict[TenantId, int] = Field(
        default_factory=dict, description="Per-tenant ceilings: `<tenant-uuid>=<calls>,...`."
    )
    order_check: float = Field(
        _DEFAULT_GRADING.order_check,
        ge=0,
        le=1,
        description="Fraction of pairwise comparisons asked again with positions swapped.",
    )

    @field_validator("ceilings", mode="before")
    @classmethod
    def _tenant_map(cls, value: object) -> object:
        return tenant_map(value, "calls")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GradingSettings:
        """Read `ASSAY_GRADING_*` variables.

        Raises:
            SettingsInvalid: a value does not parse or is out of range (named).
        """
        return _from_env(cls, "ASSAY_GRADING_", environ)

    def policy(self) -> GradingPolicy:
        """The grading policy these settings describe."""
        return GradingPolicy(
            capacity=GradingCapacity(
                max_models=self.max_models,
                max_context_tokens=self.max_context_tokens,
                max_calls_per_episode=self.max_calls_per_episode,
            ),
            calls_per_day=self.calls_per_day,
            ceilings={str(t): n for t, n in self.ceilings.items()},
            order_check=self.order_check,
        )


class ReplaySettings(BaseModel):
    """Replay's spend ceiling (§12.4, §14.1); each field reads `ASSAY_REPLAY_<FIELD>`.

    Model calls shadow runs may reserve per tenant per UTC day (each reserves its
    workflow's `budget.max_model_calls` when ingest admits it); unset: no ceiling.
    `ceilings` is a per-tenant map written `<tenant-uuid>=<calls>,...`; a tenant not
    in it has `calls_per_day`.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    calls_per_day: int | None = Field(
        None,
        ge=0,
        description="Model calls shadow runs may reserve per tenant per UTC day (unset: no limit).",
    )
    ceilings: dict[TenantId, int] = Field(
        default_factory=dict, description="Per-tenant ceilings: `<tenant-uuid>=<calls>,...`."
    )

    @field_validator("ceilings", mode="before")
    @classmethod
    def _tenant_map(cls, value: object) -> object:
        return tenant_map(value, "calls")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ReplaySettings:
        """Read `ASSAY_REPLAY_*` variables.

        Raises:
            SettingsInvalid: a value does not parse or is out of range (named).
        """
        return _from_env(cls, "ASSAY_REPLAY_", environ)

    def policy(self) -> ReplayPolicy:
        """The replay policy these settings describe."""
        return ReplayPolicy(
            calls_per_day=self.calls_per_day,
            ceilings={str(t): n for t, n in self.ceilings.items()},
        )
