"""One settings tree: every `ASSAY_*` variable Assay reads, in one `AssaySettings`.

Read once at start-up with `AssaySettings.from_env()`; an invalid or missing value
stops start-up with `SettingsInvalid` naming the variable. A section's variables are
`ASSAY_<SECTION>_<FIELD>`, a top-level field's `ASSAY_<FIELD>`; `RENAMED` lists the
few that keep an older name. The judge and the proposer fall back to the agent's
`ASSAY_MODEL_*` endpoint settings when they have no URL of their own. The
configuration reference (`docs/reference/configuration.md`) is generated from the
fields' descriptions (`assay.runtime.config_reference`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings.sources.utils import parse_env_vars

from assay.engine.retention import RetentionPolicy
from assay.grading.calibration_policy import CalibrationPolicy
from assay.grading.ladder import LadderPolicy
from assay.grading.replay import ReplayPolicy
from assay.grading.sprt import SprtPolicy
from assay.grading.strategies import GradingPolicy
from assay.kernel.ids import TenantId
from assay.runtime.capacity import CapacitySettings
from assay.runtime.capacity_plan import plan_capacity
from assay.runtime.endpoints import (
    SHARED_WITH_THE_AGENT,
    EndpointSettings,
    JudgeSettings,
    ModelSettings,
    ProposerSettings,
)
from assay.runtime.leases import DEFAULT_LEASE_TTL_S
from assay.runtime.sections import (
    STAGE_ROLES,
    ConsoleSettings,
    DatabaseSettings,
    HttpSettings,
    KafkaSettings,
    S3Settings,
    SandboxSettings,
    SettingsInvalid,
)
from assay.store.inline_blobs import DEFAULT_INLINE_MAX_BYTES, MAX_INLINE_MAX_BYTES

__all__ = [
    "RENAMED",
    "AssaySettings",
    "CapacitySettings",
    "ConsoleSettings",
    "DatabaseSettings",
    "HttpSettings",
    "JudgeSettings",
    "KafkaSettings",
    "ModelSettings",
    "ProposerSettings",
    "S3Settings",
    "SandboxSettings",
    "SettingsInvalid",
    "variable",
]

PREFIX = "ASSAY_"

RENAMED: dict[tuple[str, str], str] = {
    ("ladder", "held_out_fraction"): "ASSAY_HELD_OUT_FRACTION",
    ("database", "admin_url"): "ASSAY_ADMIN_DATABASE_URL",
    ("database", "stage_password"): "ASSAY_STAGE_PASSWORD",
    **{("database", f"{s}_password"): f"ASSAY_{s.upper()}_PASSWORD" for s in STAGE_ROLES},
}
"""Fields of a section read from a variable other than `ASSAY_<SECTION>_<FIELD>`."""

_SECRET = frozenset({"api_key", "secret_access_key", "tokens", "admin_token"})
"""Fields whose value an error message never shows (nor any `*_password`)."""


def variable(section: str | None, field: str) -> str:
    """The environment variable a field is read from (`section` None: top level)."""
    if section is None:
        return f"{PREFIX}{field.upper()}"
    return RENAMED.get((section, field), f"{PREFIX}{section.upper()}_{field.upper()}")


class _Environment(EnvSettingsSource):
    """The `ASSAY_*` variables of `environ` (else the process's), by section.

    Beside pydantic-settings' nesting (`ASSAY_<SECTION>_<FIELD>`): variables a
    section does not define are ignored, and `RENAMED` fields are read from their
    own variable only.
    """

    def __init__(
        self, settings_cls: type[BaseSettings], environ: Mapping[str, str] | None = None
    ) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        env = os.environ if self._environ is None else self._environ
        return parse_env_vars(env, self.case_sensitive, self.env_ignore_empty)

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        for name, info in self.settings_cls.model_fields.items():
            section = info.annotation
            if not (isinstance(section, type) and issubclass(section, BaseModel)):
                continue
            given = data.get(name)
            known = {
                k: v
                for k, v in (given if isinstance(given, dict) else {}).items()
                if k in section.model_fields and (name, k) not in RENAMED
            }
            for (owner, field), var in RENAMED.items():
                value = self.env_vars.get(var.lower())
                if owner == name and value is not None:
                    known[field] = value
            if known:
                data[name] = known
            else:
                data.pop(name, None)
        return data


class AssaySettings(BaseSettings):
    """Every setting of Assay, in both modes. Build it with `from_env`."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX,
        env_nested_delimiter="_",
        env_nested_max_split=1,
        env_ignore_empty=True,
        env_parse_enums=False,
        enable_decoding=False,
        case_sensitive=False,
        extra="ignore",
        frozen=True,
    )

    data_dir: Path = Field(
        Path("assay-data"),
        description="Embedded mode's data directory (SQLite files, blobs, the sandbox).",
    )
    tenant: TenantId | None = Field(
        None, description="Tenant of `assay run` (default: the local tenant)."
    )
    partitions: int = Field(
        12,
        ge=1,
        le=10_000,
        description=(
            "Partitions of each topic with a record or more per run (tasks, runs, episodes, "
            "verified, graded, results, run-status, run-commands, aggregates, usage) at "
            "creation: they bound a stage's useful replica count."
        ),
    )
    control_partitions: int = Field(
        1,
        ge=1,
        le=10_000,
        description=(
            "Partitions of each control topic (assay.tenants, assay.workflows, "
            "assay.decisions) and dead-letter topic at creation. Their records are few; "
            "every partition is in every fetch of every stage that reads the topic, so "
            "more cost the broker work while idle."
        ),
    )
    log_level: str = Field("INFO", description="Python logging level of a served stage.")
    lease_ttl_s: float = Field(
        DEFAULT_LEASE_TTL_S,
        gt=0.1,
        le=3600,
        description=(
            "Lease of a run without a heartbeat, in seconds: after a crash, the restarted "
            "process waits this long at most before it resumes its predecessor's runs."
        ),
    )
    episode_inline_max_bytes: int = Field(
        DEFAULT_INLINE_MAX_BYTES,
        ge=0,
        le=MAX_INLINE_MAX_BYTES,
        description=(
            "An episode of at most this many bytes travels inline in `RunExecuted` and "
            "`RunVerified` besides being written to its blob, so verify and the tournament "
            "need not read the blob (0: never inline). Keep it well under the broker's "
            "largest message (1 MiB by default)."
        ),
    )
    shadow_rate: float = Field(
        1.0, ge=0, le=1, description="Share of current-served tasks re-run on the challenger."
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
    model: ModelSettings = Field(
        default_factory=ModelSettings, description="The model runs call (stub without a URL)."
    )
    judge: JudgeSettings = Field(
        default_factory=JudgeSettings,
        description="The judge grading calls; without a URL, the agent's model (else the stub).",
    )
    proposer: ProposerSettings = Field(
        default_factory=ProposerSettings,
        description="The slow loop's proposer and whose proposals skip approval.",
    )
    sandbox: SandboxSettings = Field(
        default_factory=SandboxSettings,
        description="The sandbox commands run in (local by default).",
    )
    grading: GradingPolicy = Field(
        default_factory=GradingPolicy,
        description="Grading capacity, daily ceilings (calls, tokens, dollars), order checks.",
    )
    calibration: CalibrationPolicy = Field(
        default_factory=CalibrationPolicy,
        description="Scheduled judge calibration against the verifier, and the promotion hold.",
    )
    capacity: CapacitySettings = Field(
        default_factory=CapacitySettings,
        description="Declared GPU capacity and model profiles: the residency invariant (§14.2).",
    )
    replay: ReplayPolicy = Field(
        default_factory=ReplayPolicy,
        description=(
            "Ceilings on the model calls, tokens and dollars shadow runs and replay candidates "
            "reserve (their worst cases)."
        ),
    )
    retention: RetentionPolicy = Field(
        default_factory=RetentionPolicy, description="When finished runs are reduced and tiered."
    )
    sprt: SprtPolicy = Field(
        default_factory=SprtPolicy, description="The sequential test on challenger wins."
    )
    ladder: LadderPolicy = Field(
        default_factory=LadderPolicy, description="The promotion ladder and the held-out set."
    )
    kafka: KafkaSettings = Field(
        default_factory=KafkaSettings, description="Kafka, in distributed mode."
    )
    database: DatabaseSettings = Field(
        default_factory=DatabaseSettings, description="Postgres, in distributed mode."
    )
    s3: S3Settings = Field(default_factory=S3Settings, description="S3, in distributed mode.")
    http: HttpSettings = Field(
        default_factory=HttpSettings, description="A served stage's status server."
    )
    console: ConsoleSettings = Field(
        default_factory=ConsoleSettings, description="The operator console."
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments, then the process's `ASSAY_*` variables; nothing else."""
        return init_settings, _Environment(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _beside_the_agent(cls, data: Any) -> Any:
        """Without a URL of its own but with the agent's, the judge and the proposer
        take each endpoint setting they do not set from the agent's model."""
        if not isinstance(data, dict):
            return data
        agent = data.get("model")
        if not isinstance(agent, dict) or not agent.get("url"):
            return data
        shared = {k: v for k, v in agent.items() if k in SHARED_WITH_THE_AGENT}
        out = dict(data)
        for name in ("judge", "proposer"):
            own = data.get(name) or {}
            if isinstance(own, dict) and not own.get("url"):
                out[name] = {**shared, **own}
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """The settings the `ASSAY_*` variables of `environ` (default: the process's)
        describe; unset and empty variables take their defaults.

        Raises:
            SettingsInvalid: a value does not parse or is out of range (the message names
                the variable, and its value unless it is a secret), a URL is set without a
                model name, or the declared capacity is inconsistent or does not hold the
                resident models (`assay.runtime.capacity_plan.plan_capacity`).
        """
        env = os.environ if environ is None else environ
        try:
            settings = cls.model_validate(_Environment(cls, env)())
        except ValidationError as exc:
            raise SettingsInvalid(_invalid(exc.errors()[0], env)) from exc
        missing = settings._names_missing(env)
        if missing:
            raise SettingsInvalid(f"missing settings: {'; '.join(missing)}")
        plan_capacity(settings)  # §14.2: the resident models must fit before anything starts
        return settings

    def _names_missing(self, env: Mapping[str, str]) -> list[str]:
        """Each endpoint with a URL but no model name, with where its URL came from."""
        missing = []
        endpoints: tuple[tuple[str, EndpointSettings], ...] = (
            ("model", self.model),
            ("judge", self.judge),
            ("proposer", self.proposer),
        )
        for section, endpoint in endpoints:
            if endpoint.url is None or endpoint.name:
                continue
            url_from = _source(section, "url", env)
            wanted = variable(section, "name")
            if url_from != variable(section, "url"):
                wanted += f" or {variable('model', 'name')}"
            missing.append(f"{wanted} (required when {url_from} is set)")
        return missing

    def require(self, *paths: str) -> None:
        """Raise `SettingsInvalid` naming every missing variable of `paths`
        (`"kafka.bootstrap"`, or a top-level field's name)."""
        missing = []
        for path in paths:
            section, _, field = path.rpartition(".")
            holder: object = getattr(self, section) if section else self
            if getattr(holder, field) in (None, ""):
                missing.append(variable(section or None, field))
        if missing:
            raise SettingsInvalid(f"missing settings: {', '.join(missing)}")


def _source(section: str, field: str, env: Mapping[str, str]) -> str:
    """The variable a section's field was read from: its own, else (for the judge and
    the proposer without a URL of their own) the agent's `ASSAY_MODEL_*` one."""
    own = variable(section, field)
    if (
        section in ("judge", "proposer")
        and field in SHARED_WITH_THE_AGENT
        and not env.get(own)
        and not env.get(variable(section, "url"))
        and env.get(variable("model", "url"))
    ):
        return variable("model", field)
    return own


def _invalid(error: ErrorDetails, env: Mapping[str, str]) -> str:
    """One line naming the variable (and its value, unless secret) and the reason."""
    ctx = error.get("ctx") or {}
    reason = str(ctx["error"]) if "error" in ctx else error["msg"]
    loc = [str(p) for p in error["loc"]]
    sections = {n for n, f in AssaySettings.model_fields.items() if _is_section(f.annotation)}
    if loc and loc[0] in sections:
        if len(loc) == 1:
            return f"invalid {variable(loc[0], '*')} settings: {reason}"
        name = _source(loc[0], loc[1], env)
        secret = loc[1] in _SECRET or loc[1].endswith("password")
    elif loc:
        name = variable(None, loc[0])
        secret = False
    else:
        return f"invalid settings: {reason}"
    shown = "" if secret else f"={env.get(name)!r}"
    return f"invalid setting {name}{shown}: {reason}"


def _is_section(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
