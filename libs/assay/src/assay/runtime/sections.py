"""The plain sections of the settings tree: the services a distributed stage uses
(Kafka, Postgres, S3, its HTTP port) and the local sandbox of both modes.

Each is read by `AssaySettings` from `ASSAY_<SECTION>_<FIELD>` variables, except
where `assay.runtime.settings.RENAMED` names another variable.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from assay.kernel.errors import AssayError
from assay.sandbox.local import Limits, LocalSandbox
from assay.sandbox.port import NetworkPolicy, SuspendPolicy
from assay.store.ports import BlobStore

PIPELINE_STAGES = ("ingest", "execute", "verify", "tournament", "aggregate", "decide")
"""The pipeline's stages, in pipeline order."""
STAGE_ROLES = (*PIPELINE_STAGES, "console")
"""The components whose Postgres roles `assay db provision` creates: the pipeline's
stages in order, then the console (which folds from the topics like a stage)."""


class SettingsInvalid(AssayError):
    """A required setting is missing or a value does not parse."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class KafkaSettings(_Section):
    """The Kafka cluster of distributed mode (`ASSAY_KAFKA_*`)."""

    bootstrap: str | None = Field(None, description="Kafka bootstrap, host:port[,...].")
    member_timeout_ms: int = Field(
        10_000,
        ge=500,
        le=300_000,
        description=(
            "How long the consumer group waits for a silent member (one that was killed) "
            "before its partitions go to the others or to its replacement."
        ),
    )
    fetch_max_wait_ms: int = Field(
        20,
        ge=1,
        le=30_000,
        description=(
            "The longest the broker holds a stage's fetch waiting for data. Apache Kafka "
            "answers as soon as data arrives, so there a long wait (500) costs no latency "
            "and saves the idle polling; a broker that holds every fetch for the whole "
            "wait (Tansu 0.6) makes it each hop's latency, hence the short default."
        ),
    )


class DatabaseSettings(_Section):
    """Postgres (`ASSAY_DATABASE_URL`, and the provisioning settings)."""

    url: str | None = Field(None, description="The stage's own Postgres role DSN.")
    admin_url: str | None = Field(
        None, description="A superuser DSN, used only by `assay db provision`."
    )
    stage_password: str | None = Field(
        None,
        description="Password of every stage role at provisioning, unless the stage has its own.",
    )
    ingest_password: str | None = Field(None, description="Password of the ingest role.")
    execute_password: str | None = Field(None, description="Password of the execute role.")
    verify_password: str | None = Field(None, description="Password of the verify role.")
    tournament_password: str | None = Field(None, description="Password of the tournament role.")
    aggregate_password: str | None = Field(None, description="Password of the aggregate role.")
    decide_password: str | None = Field(None, description="Password of the decide role.")
    console_password: str | None = Field(None, description="Password of the console role.")

    def stage_password_for(self, stage: str) -> str:
        """The password of one stage's role at provisioning: its own, else the shared one.

        Raises:
            SettingsInvalid: neither is set.
        """
        own = getattr(self, f"{stage}_password", None) if stage in STAGE_ROLES else None
        password = own or self.stage_password
        if not password:
            raise SettingsInvalid(
                f"missing settings: ASSAY_{stage.upper()}_PASSWORD or ASSAY_STAGE_PASSWORD"
            )
        return password


class S3Settings(_Section):
    """The S3 bucket blobs go to in distributed mode (`ASSAY_S3_*`)."""

    endpoint: str | None = Field(None, description="S3 endpoint URL (unset: AWS).")
    bucket: str = Field("assay", description="Bucket for blobs (created if missing).")
    access_key_id: str | None = Field(None, description="S3 access key id.")
    secret_access_key: str | None = Field(None, description="S3 secret access key.")
    region: str = Field("us-east-1", description="S3 region.")


class HttpSettings(_Section):
    """A distributed stage's status server (`ASSAY_HTTP_*`)."""

    port: int = Field(8080, ge=0, le=65535, description="Port of /healthz, /readyz and /metrics.")


class ConsoleSettings(_Section):
    """The operator console (`ASSAY_CONSOLE_*`), served by the `console` component."""

    host: str = Field(
        "127.0.0.1",
        description="Address the console listens on; other than loopback, a token is required.",
    )
    port: int = Field(8090, ge=0, le=65535, description="Port of the console's pages and API.")
    tokens: str | None = Field(
        None,
        description=(
            "Tenant tokens, comma-separated `tenant=token` pairs (or `tenant=blake3:<hex>` "
            "to give only the token's digest); kept only as digests."
        ),
    )
    admin_token: str | None = Field(
        None, description="A token that reads every tenant (naming it with `?tenant=`)."
    )
    execute_url: str | None = Field(
        None,
        description=(
            "Distributed: the execute stage's status port (`http://execute:8080`), which "
            "answers a run's full log for the run page; unset: the page shows no attempts."
        ),
    )
    stage_urls: str | None = Field(
        None,
        description=(
            "Distributed: where the console reads each stage's `/readyz` and `/metrics` for "
            "the overview's stage health and lag, comma-separated `name=url` pairs of status "
            "ports (`ingest=http://ingest:8080,execute=http://execute:8080`); unset: the "
            "overview shows no stages."
        ),
    )
    session_secret: str | None = Field(
        None,
        description=(
            "Key signing login sessions (the `/login` cookie); unset: a random key per "
            "process, so sessions end when it restarts and are not shared between replicas."
        ),
    )
    session_ttl_s: int = Field(
        12 * 3600, ge=60, description="How long a login session lasts, in seconds."
    )

    @field_validator("stage_urls")
    @classmethod
    def _stage_urls(cls, value: str | None) -> str | None:
        if value is not None:
            stage_urls(value)
        return value

    def stages(self) -> dict[str, str]:
        """`stage_urls` by name, in the order given (empty when unset)."""
        return stage_urls(self.stage_urls) if self.stage_urls else {}


def stage_urls(value: str) -> dict[str, str]:
    """The `name=url` pairs of `ASSAY_CONSOLE_STAGE_URLS`, by name.

    Raises:
        ValueError: a pair without a name, or whose URL is not http(s), or a name twice.
    """
    found: dict[str, str] = {}
    for pair in (p.strip() for p in value.split(",")):
        if not pair:
            continue
        name, _, url = (s.strip() for s in pair.partition("="))
        if not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"{pair!r} is not name=http://host:port")
        if name in found:
            raise ValueError(f"stage {name!r} is named twice")
        found[name] = url.rstrip("/")
    return found


_DEFAULT_LIMITS = Limits()


class SandboxSettings(_Section):
    """The sandbox, in both modes (`ASSAY_SANDBOX_*`)."""

    kind: str = Field(
        "local",
        description=(
            "Which registered sandbox provider (`assay.sandboxes`) to use: `local`, or one an "
            "installed package registers."
        ),
    )

    root: str | None = Field(
        None, description="Directory of the workspaces (default: <data dir>/sandbox)."
    )
    network: NetworkPolicy = Field(
        NetworkPolicy.DENY,
        description="deny: no network for commands and network tools; allow: the host's.",
    )
    cpu_s: int = Field(_DEFAULT_LIMITS.cpu_s, ge=1, description="CPU seconds a command.")
    memory_bytes: int = Field(
        _DEFAULT_LIMITS.address_space_bytes, ge=1 << 20, description="Address space of a command."
    )
    processes: int = Field(
        _DEFAULT_LIMITS.processes, ge=1, description="Processes a command may start."
    )
    file_size_bytes: int = Field(
        _DEFAULT_LIMITS.file_size_bytes, ge=1, description="Largest file a command may write."
    )
    uid: int | None = Field(
        None, ge=1, description="uid commands run as when Assay runs as root (default 65534)."
    )
    gid: int | None = Field(
        None, ge=1, description="gid commands run as when Assay runs as root (default 65534)."
    )
    suspend_idle_after_s: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description=(
            "Unset: off. Set: each run that uses the sandbox keeps a resident sandbox "
            "process, checkpointed and released once a model call has lasted this many "
            "seconds (and at once at an await step), and restored as a verified new "
            "generation before the next step that needs it."
        ),
    )
    resident_memory_bytes: int = Field(
        64 << 20,
        ge=0,
        description="Memory a resident sandbox process holds (as an agent's interpreter).",
    )

    @property
    def suspend(self) -> SuspendPolicy | None:
        """The suspension policy these settings describe; None when it is off."""
        if self.suspend_idle_after_s is None:
            return None
        return SuspendPolicy(self.suspend_idle_after_s, self.resident_memory_bytes)

    @property
    def limits(self) -> Limits:
        """Resource limits of each command."""
        return Limits(
            cpu_s=self.cpu_s,
            address_space_bytes=self.memory_bytes,
            processes=self.processes,
            file_size_bytes=self.file_size_bytes,
        )

    def provider(self, blobs: BlobStore, data_dir: Path) -> LocalSandbox:
        """The local sandbox these settings describe, its snapshots in `blobs`.

        Raises:
            SandboxUnavailable: commands cannot run on this machine at all.
        """
        root = Path(self.root) if self.root else data_dir / "sandbox"
        return LocalSandbox(
            root, blobs, limits=self.limits, network=self.network, uid=self.uid, gid=self.gid
        )
