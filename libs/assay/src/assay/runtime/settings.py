"""Configuration of a distributed stage, from the environment (documented in README)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from assay.kernel.errors import AssayError
from assay.kernel.schema import one_line


class SettingsInvalid(AssayError):
    """A required setting is missing or a value does not parse."""


class Settings(BaseModel):
    """Everything `assay serve` needs; each field reads `ASSAY_<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    kafka_bootstrap: str | None = Field(None, description="Kafka bootstrap, host:port[,...].")
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
    stage_password: str | None = Field(
        None,
        description="Password of every stage role at provisioning (or ASSAY_<STAGE>_PASSWORD).",
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
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
