"""Every `ASSAY_*` variable Assay reads still takes effect through the one settings tree,
under its exact name, and the one bootstrap wires the tree's sections into a stage."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from assay.engine.models import StubModel
from assay.grading.judges import StubJudge, TracedJudge
from assay.kernel.capacity import ModelProfile
from assay.runtime.bootstrap import stage_deps
from assay.runtime.config_reference import entries
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.sandbox.port import NetworkPolicy
from assay.store.fs_blobs import FsBlobStore

CAPACITY_FILE = (
    Path(__file__).resolve().parents[3] / "examples" / "capacity" / "llama-3.1-8b-1xh100.yaml"
)
TENANT = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
UID = uuid.UUID(TENANT)

# variable -> (value to set, path in the tree, value it must then have)
EVERY_VARIABLE: dict[str, tuple[str, str, Any]] = {
    "ASSAY_DATA_DIR": ("/tmp/elsewhere", "data_dir", Path("/tmp/elsewhere")),
    "ASSAY_TENANT": (TENANT, "tenant", UID),
    "ASSAY_PARTITIONS": ("3", "partitions", 3),
    "ASSAY_CONTROL_PARTITIONS": ("2", "control_partitions", 2),
    "ASSAY_LOG_LEVEL": ("DEBUG", "log_level", "DEBUG"),
    "ASSAY_LEASE_TTL_S": ("2.5", "lease_ttl_s", 2.5),
    "ASSAY_EPISODE_INLINE_MAX_BYTES": ("1024", "episode_inline_max_bytes", 1024),
    "ASSAY_SHADOW_RATE": ("0.25", "shadow_rate", 0.25),
    "ASSAY_UNREADY_AFTER_S": ("5", "unready_after_s", 5.0),
    "ASSAY_EXIT_AFTER_S": ("0", "exit_after_s", 0.0),
    "ASSAY_SHUTDOWN_GRACE_S": ("7", "shutdown_grace_s", 7.0),
    "ASSAY_MODEL_KIND": ("stub", "model.kind", "stub"),
    "ASSAY_MODEL_URL": ("http://127.0.0.1:9/v1", "model.url", "http://127.0.0.1:9/v1"),
    "ASSAY_MODEL_NAME": ("m", "model.name", "m"),
    "ASSAY_MODEL_API_KEY": ("sk-1", "model.api_key.get_secret_value", "sk-1"),
    "ASSAY_MODEL_TIMEOUT_S": ("3", "model.timeout_s", 3.0),
    "ASSAY_MODEL_MAX_RETRIES": ("1", "model.max_retries", 1),
    "ASSAY_MODEL_PRICE_PROMPT_PER_MTOK": ("0.5", "model.price_prompt_per_mtok", 0.5),
    "ASSAY_MODEL_PRICE_COMPLETION_PER_MTOK": ("1.5", "model.price_completion_per_mtok", 1.5),
    "ASSAY_MODEL_STUB_DELAY_S": ("0.25", "model.stub_delay_s", 0.25),
    "ASSAY_JUDGE_KIND": ("openai", "judge.kind", "openai"),
    "ASSAY_JUDGE_URL": ("http://127.0.0.1:8/v1", "judge.url", "http://127.0.0.1:8/v1"),
    "ASSAY_JUDGE_NAME": ("j", "judge.name", "j"),
    "ASSAY_JUDGE_API_KEY": ("sk-2", "judge.api_key.get_secret_value", "sk-2"),
    "ASSAY_JUDGE_TIMEOUT_S": ("4", "judge.timeout_s", 4.0),
    "ASSAY_JUDGE_MAX_RETRIES": ("2", "judge.max_retries", 2),
    "ASSAY_JUDGE_PRICE_PROMPT_PER_MTOK": ("2", "judge.price_prompt_per_mtok", 2.0),
    "ASSAY_JUDGE_PRICE_COMPLETION_PER_MTOK": ("3", "judge.price_completion_per_mtok", 3.0),
    "ASSAY_JUDGE_EPISODE_CHARS": ("5000", "judge.episode_chars", 5000),
    "ASSAY_JUDGE_RUBRIC_CHARS": ("100", "judge.rubric_chars", 100),
    "ASSAY_PROPOSER_KIND": ("catalog", "proposer.kind", "catalog"),
    "ASSAY_PROPOSER_URL": ("http://127.0.0.1:7/v1", "proposer.url", "http://127.0.0.1:7/v1"),
    "ASSAY_PROPOSER_NAME": ("p", "proposer.name", "p"),
    "ASSAY_PROPOSER_API_KEY": ("sk-3", "proposer.api_key.get_secret_value", "sk-3"),
    "ASSAY_PROPOSER_TIMEOUT_S": ("5", "proposer.timeout_s", 5.0),
    "ASSAY_PROPOSER_MAX_RETRIES": ("3", "proposer.max_retries", 3),
    "ASSAY_PROPOSER_PRICE_PROMPT_PER_MTOK": ("4", "proposer.price_prompt_per_mtok", 4.0),
    "ASSAY_PROPOSER_PRICE_COMPLETION_PER_MTOK": ("5", "proposer.price_completion_per_mtok", 5.0),
    "ASSAY_PROPOSER_MAX_TOKENS": ("64", "proposer.max_tokens", 64),
    "ASSAY_PROPOSER_UNGATED": (TENANT, "proposer.ungated", frozenset({TENANT})),
    "ASSAY_SANDBOX_KIND": ("scratch", "sandbox.kind", "scratch"),
    "ASSAY_SANDBOX_ROOT": ("/tmp/ws", "sandbox.root", "/tmp/ws"),
    "ASSAY_SANDBOX_NETWORK": ("allow", "sandbox.network", NetworkPolicy.ALLOW),
    "ASSAY_SANDBOX_CPU_S": ("9", "sandbox.cpu_s", 9),
    "ASSAY_SANDBOX_MEMORY_BYTES": (str(64 << 20), "sandbox.memory_bytes", 64 << 20),
    "ASSAY_SANDBOX_PROCESSES": ("3", "sandbox.processes", 3),
    "ASSAY_SANDBOX_FILE_SIZE_BYTES": ("4096", "sandbox.file_size_bytes", 4096),
    "ASSAY_SANDBOX_UID": ("1000", "sandbox.uid", 1000),
    "ASSAY_SANDBOX_GID": ("1001", "sandbox.gid", 1001),
    "ASSAY_SANDBOX_SUSPEND_IDLE_AFTER_S": ("2.5", "sandbox.suspend_idle_after_s", 2.5),
    "ASSAY_SANDBOX_RESIDENT_MEMORY_BYTES": ("1048576", "sandbox.resident_memory_bytes", 1 << 20),
    "ASSAY_GRADING_MAX_MODELS": ("2", "grading.max_models", 2),
    "ASSAY_GRADING_MAX_CONTEXT_TOKENS": ("1024", "grading.max_context_tokens", 1024),
    "ASSAY_GRADING_MAX_CALLS_PER_EPISODE": ("3", "grading.max_calls_per_episode", 3.0),
    "ASSAY_GRADING_CALLS_PER_DAY": ("10", "grading.calls_per_day", 10),
    "ASSAY_GRADING_CEILINGS": (f"{TENANT}=4", "grading.ceilings", {TENANT: 4}),
    "ASSAY_PROPOSER_CALLS_PER_DAY": ("12", "proposer.calls_per_day", 12),
    "ASSAY_PROPOSER_CEILINGS": (f"{TENANT}=2", "proposer.ceilings", {TENANT: 2}),
    "ASSAY_PROPOSER_TOKENS_PER_DAY": ("50000", "proposer.tokens_per_day", 50_000),
    "ASSAY_PROPOSER_USD_PER_DAY": ("0.5", "proposer.usd_per_day", 0.5),
    "ASSAY_PROPOSER_TOKEN_CEILINGS": (f"{TENANT}=9", "proposer.token_ceilings", {TENANT: 9}),
    "ASSAY_PROPOSER_USD_CEILINGS": (f"{TENANT}=0.25", "proposer.usd_ceilings", {TENANT: 0.25}),
    "ASSAY_GRADING_TOKENS_PER_DAY": ("90000", "grading.tokens_per_day", 90_000),
    "ASSAY_GRADING_USD_PER_DAY": ("2.5", "grading.usd_per_day", 2.5),
    "ASSAY_GRADING_TOKEN_CEILINGS": (f"{TENANT}=1000", "grading.token_ceilings", {TENANT: 1000}),
    "ASSAY_GRADING_USD_CEILINGS": (f"{TENANT}=0.75", "grading.usd_ceilings", {TENANT: 0.75}),
    "ASSAY_GRADING_ORDER_CHECK": ("0.5", "grading.order_check", 0.5),
    "ASSAY_REPLAY_CALLS_PER_DAY": ("6", "replay.calls_per_day", 6),
    "ASSAY_CALIBRATION_INTERVAL_S": ("900", "calibration.interval_s", 900.0),
    "ASSAY_CALIBRATION_PAIRS": ("4", "calibration.pairs", 4),
    "ASSAY_CALIBRATION_CALLS_PER_DAY": ("40", "calibration.calls_per_day", 40),
    "ASSAY_CALIBRATION_BUDGETS": (f"{TENANT}=8", "calibration.budgets", {TENANT: 8}),
    "ASSAY_CALIBRATION_MIN_AGREEMENT": ("0.8", "calibration.min_agreement", 0.8),
    "ASSAY_CALIBRATION_MIN_JUDGED": ("6", "calibration.min_judged", 6),
    "ASSAY_CALIBRATION_FILE": ("/tmp/set.jsonl", "calibration.file", Path("/tmp/set.jsonl")),
    "ASSAY_REPLAY_CEILINGS": (f"{TENANT}=2", "replay.ceilings", {TENANT: 2}),
    "ASSAY_REPLAY_TOKENS_PER_DAY": ("40000", "replay.tokens_per_day", 40_000),
    "ASSAY_REPLAY_USD_PER_DAY": ("1.5", "replay.usd_per_day", 1.5),
    "ASSAY_REPLAY_TOKEN_CEILINGS": (f"{TENANT}=500", "replay.token_ceilings", {TENANT: 500}),
    "ASSAY_REPLAY_USD_CEILINGS": (f"{TENANT}=0.25", "replay.usd_ceilings", {TENANT: 0.25}),
    "ASSAY_RETENTION_TOKEN_CEILING": ("100", "retention.token_ceiling", 100),
    "ASSAY_RETENTION_CEILINGS": (f"{TENANT}=50", "retention.ceilings", {UID: 50}),
    "ASSAY_RETENTION_KEEP_CHARS": ("10", "retention.keep_chars", 10),
    "ASSAY_RETENTION_TIER_AFTER_S": ("1", "retention.tier_after_s", 1.0),
    "ASSAY_RETENTION_SWEEP_INTERVAL_S": ("2", "retention.sweep_interval_s", 2.0),
    "ASSAY_RETENTION_SWEEP_LIMIT": ("3", "retention.sweep_limit", 3),
    "ASSAY_RETENTION_TOPIC_RETENTION_S": ("3600", "retention.topic_retention_s", 3600.0),
    "ASSAY_RETENTION_INBOX_KEEP_S": ("700000", "retention.inbox_keep_s", 700000.0),
    "ASSAY_RETENTION_RECORDS_KEEP_S": ("700000", "retention.records_keep_s", 700000.0),
    "ASSAY_RETENTION_USAGE_KEEP_S": ("800000", "retention.usage_keep_s", 800000.0),
    "ASSAY_RETENTION_PRUNE_INTERVAL_S": ("5", "retention.prune_interval_s", 5.0),
    "ASSAY_RETENTION_PRUNE_LIMIT": ("7", "retention.prune_limit", 7),
    "ASSAY_SPRT_P0": ("0.4", "sprt.p0", 0.4),
    "ASSAY_SPRT_P1": ("0.8", "sprt.p1", 0.8),
    "ASSAY_SPRT_ALPHA": ("0.01", "sprt.alpha", 0.01),
    "ASSAY_SPRT_BETA": ("0.02", "sprt.beta", 0.02),
    "ASSAY_SPRT_DRAW_CEILING": ("0.4", "sprt.draw_ceiling", 0.4),
    "ASSAY_SPRT_MIN_FOR_DRAWS": ("7", "sprt.min_for_draws", 7),
    "ASSAY_SPRT_CALIBRATED": ("false", "sprt.calibrated", False),
    "ASSAY_LADDER_TRIAL_SHARE": ("0.1", "ladder.trial_share", 0.1),
    "ASSAY_LADDER_RAMP_SHARES": ("0.3, 0.6", "ladder.ramp_shares", (0.3, 0.6)),
    "ASSAY_LADDER_MIN_SHADOW_RUNS": ("2", "ladder.min_shadow_runs", 2),
    "ASSAY_LADDER_MIN_TRIAL_RUNS": ("3", "ladder.min_trial_runs", 3),
    "ASSAY_LADDER_MIN_STRENGTH_EPISODES": ("4", "ladder.min_strength_episodes", 4),
    "ASSAY_LADDER_RAMP_EPISODES": ("6", "ladder.ramp_episodes", 6),
    "ASSAY_LADDER_PASS_RATE_MARGIN": ("0.2", "ladder.pass_rate_margin", 0.2),
    "ASSAY_LADDER_MIN_PASS_RATE_RUNS": ("8", "ladder.min_pass_rate_runs", 8),
    "ASSAY_LADDER_MAX_ORDER_INCONSISTENCY": ("0.4", "ladder.max_order_inconsistency", 0.4),
    "ASSAY_LADDER_MAX_CHALLENGERS": ("3", "ladder.max_challengers", 3),
    "ASSAY_HELD_OUT_FRACTION": ("0.3", "ladder.held_out_fraction", 0.3),
    "ASSAY_KAFKA_BOOTSTRAP": ("k:9092", "kafka.bootstrap", "k:9092"),
    "ASSAY_KAFKA_MEMBER_TIMEOUT_MS": ("6000", "kafka.member_timeout_ms", 6000),
    "ASSAY_KAFKA_FETCH_MAX_WAIT_MS": ("500", "kafka.fetch_max_wait_ms", 500),
    "ASSAY_DATABASE_URL": ("postgresql://s@h/d", "database.url", "postgresql://s@h/d"),
    "ASSAY_ADMIN_DATABASE_URL": ("postgresql://a@h/d", "database.admin_url", "postgresql://a@h/d"),
    "ASSAY_STAGE_PASSWORD": ("shared", "database.stage_password", "shared"),
    "ASSAY_INGEST_PASSWORD": ("pi", "database.ingest_password", "pi"),
    "ASSAY_EXECUTE_PASSWORD": ("pe", "database.execute_password", "pe"),
    "ASSAY_VERIFY_PASSWORD": ("pv", "database.verify_password", "pv"),
    "ASSAY_TOURNAMENT_PASSWORD": ("pt", "database.tournament_password", "pt"),
    "ASSAY_AGGREGATE_PASSWORD": ("pa", "database.aggregate_password", "pa"),
    "ASSAY_DECIDE_PASSWORD": ("pd", "database.decide_password", "pd"),
    "ASSAY_CONSOLE_PASSWORD": ("pc", "database.console_password", "pc"),
    "ASSAY_S3_ENDPOINT": ("http://s3:9000", "s3.endpoint", "http://s3:9000"),
    "ASSAY_S3_BUCKET": ("b", "s3.bucket", "b"),
    "ASSAY_S3_ACCESS_KEY_ID": ("ak", "s3.access_key_id", "ak"),
    "ASSAY_S3_SECRET_ACCESS_KEY": ("sk", "s3.secret_access_key", "sk"),
    "ASSAY_S3_REGION": ("eu-west-1", "s3.region", "eu-west-1"),
    "ASSAY_HTTP_PORT": ("9090", "http.port", 9090),
    "ASSAY_CAPACITY_FILE": (str(CAPACITY_FILE), "capacity.file", CAPACITY_FILE),
    "ASSAY_CAPACITY_VRAM_BYTES_PER_DEVICE": ("80GB", "capacity.vram_bytes_per_device", 80 * 10**9),
    "ASSAY_CAPACITY_DEVICES": ("2", "capacity.devices", 2),
    "ASSAY_CAPACITY_MAX_RESIDENT_MODELS": ("3", "capacity.max_resident_models", 3),
    "ASSAY_CAPACITY_PINNED": (" m, ", "capacity.pinned", ("m",)),
    "ASSAY_CAPACITY_MODELS": (  # the agent's, the judge's and the proposer's models below
        "["
        + ",".join(
            f'{{"id": "{m}", "weights_bytes": "16GB", "kv_bytes_per_token": 131072}}' for m in "mjp"
        )
        + "]",
        "capacity.models",
        tuple(
            ModelProfile(id=m, weights_bytes=16 * 10**9, kv_bytes_per_token=131_072) for m in "mjp"
        ),
    ),
    "ASSAY_CAPACITY_DEFAULT_CONTEXT_TOKENS": ("4096", "capacity.default_context_tokens", 4096),
    "ASSAY_CAPACITY_ENDPOINT_CONCURRENCY": ("4", "capacity.endpoint_concurrency", 4),
    "ASSAY_CAPACITY_AGENT_RESERVED_CALLS": ("2", "capacity.agent_reserved_calls", 2),
    "ASSAY_CONSOLE_HOST": ("0.0.0.0", "console.host", "0.0.0.0"),
    "ASSAY_CONSOLE_PORT": ("9091", "console.port", 9091),
    "ASSAY_CONSOLE_TOKENS": ("t=x", "console.tokens", "t=x"),
    "ASSAY_CONSOLE_ADMIN_TOKEN": ("adm", "console.admin_token", "adm"),
    "ASSAY_CONSOLE_EXECUTE_URL": ("http://x:8080", "console.execute_url", "http://x:8080"),
    "ASSAY_CONSOLE_STAGE_URLS": (
        "ingest=http://i:8080/, execute=http://e:8080",
        "console.stages",
        {"ingest": "http://i:8080", "execute": "http://e:8080"},
    ),
    "ASSAY_CONSOLE_SESSION_SECRET": ("k", "console.session_secret", "k"),
    "ASSAY_CONSOLE_SESSION_TTL_S": ("600", "console.session_ttl_s", 600),
}

NEEDS = {  # a variable that only parses beside another
    "ASSAY_MODEL_URL": {"ASSAY_MODEL_NAME": "m"},
    "ASSAY_JUDGE_URL": {"ASSAY_JUDGE_NAME": "j"},
    "ASSAY_PROPOSER_URL": {"ASSAY_PROPOSER_NAME": "p"},
}


def at(settings: AssaySettings, path: str) -> Any:
    value: Any = settings
    for part in path.split("."):
        if value is None:  # an unset secret
            return None
        value = getattr(value, part)
    return value() if callable(value) else value


def test_the_list_covers_every_setting_of_the_tree() -> None:
    assert {e.variable for e in entries()} == set(EVERY_VARIABLE)


@pytest.mark.parametrize("variable", sorted(EVERY_VARIABLE))
def test_every_variable_takes_effect_under_its_name(variable: str) -> None:
    value, path, expected = EVERY_VARIABLE[variable]
    settings = AssaySettings.from_env({variable: value, **NEEDS.get(variable, {})})
    assert at(settings, path) == expected
    assert at(AssaySettings.from_env({}), path) != expected  # the default differs


def test_all_variables_at_once_and_from_the_process_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variable, (value, _, _) in EVERY_VARIABLE.items():
        monkeypatch.setenv(variable, value)
    settings = AssaySettings.from_env()
    for variable, (_, path, expected) in EVERY_VARIABLE.items():
        assert at(settings, path) == expected, variable


def test_the_capacity_file_declares_and_variables_beat_it() -> None:
    settings = AssaySettings.from_env({"ASSAY_CAPACITY_FILE": str(CAPACITY_FILE)})
    assert settings.capacity.vram_bytes_per_device == 72 * 10**9
    assert len(settings.capacity.models) == 3
    both = {"ASSAY_CAPACITY_FILE": str(CAPACITY_FILE), "ASSAY_CAPACITY_DEVICES": "2"}
    assert AssaySettings.from_env(both).capacity.devices == 2


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("vram_bytes_per_device: [80GB", "not YAML"),
        ("- 1", "must be a mapping"),
        ("vram_bytes_per_device: 0", "vram_bytes_per_device: Input should be greater than 0"),
        ("vram_bytes_per_device: 80GB\nspeed: 3", "speed: Extra inputs are not permitted"),
        (
            "vram_bytes_per_device: 80GB\n"
            "models: [{id: m, weights_bytes: -1, kv_bytes_per_token: 1}]",
            "models.0.weights_bytes",
        ),
        ("vram_bytes_per_device: 80GB\npinned: [m]", "pinned: model 'm' has no profile"),
        (
            "vram_bytes_per_device: 8GB\npinned: [m]\n"
            "models: [{id: m, weights_bytes: 16GB, kv_bytes_per_token: 131072}]",
            "the resident models do not fit: resident weights 16.00 GB",
        ),
    ],
)
def test_a_bad_capacity_file_stops_start_up_naming_the_field(
    tmp_path: Path, text: str, named: str
) -> None:
    path = tmp_path / "capacity.yaml"
    path.write_text(text.replace("\\n", "\n"))
    with pytest.raises(SettingsInvalid, match=named):
        AssaySettings.from_env({"ASSAY_CAPACITY_FILE": str(path)})


def test_a_model_without_a_profile_stops_start_up() -> None:
    with pytest.raises(
        SettingsInvalid, match="ASSAY_MODEL_NAME: model 'x' has no capacity profile"
    ):
        AssaySettings.from_env(
            {
                "ASSAY_CAPACITY_FILE": str(CAPACITY_FILE),
                "ASSAY_MODEL_URL": "http://127.0.0.1:1/v1",
                "ASSAY_MODEL_NAME": "x",
                "ASSAY_CAPACITY_PINNED": "meta-llama/Llama-3.1-8B-Instruct",
            }
        )


def test_a_section_does_not_read_a_renamed_field_under_the_usual_name() -> None:
    settings = AssaySettings.from_env(
        {"ASSAY_LADDER_HELD_OUT_FRACTION": "0.3", "ASSAY_DATABASE_ADMIN_URL": "postgresql://x"}
    )
    assert (settings.ladder.held_out_fraction, settings.database.admin_url) == (0.2, None)


def test_unknown_and_empty_variables_are_ignored() -> None:
    settings = AssaySettings.from_env(
        {"ASSAY_SPRT_UNKNOWN": "1", "ASSAY_GRADING_NOPE": "x", "ASSAY_PARTITIONS": ""}
    )
    assert settings == AssaySettings.from_env({})


def test_a_stage_password_falls_back_to_the_shared_one() -> None:
    settings = AssaySettings.from_env({"ASSAY_STAGE_PASSWORD": "s", "ASSAY_VERIFY_PASSWORD": "v"})
    assert settings.database.stage_password_for("verify") == "v"
    assert settings.database.stage_password_for("ingest") == "s"
    with pytest.raises(SettingsInvalid, match="ASSAY_INGEST_PASSWORD or ASSAY_STAGE_PASSWORD"):
        AssaySettings.from_env({}).database.stage_password_for("ingest")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("ASSAY_LEASE_TTL_S", "0"),
        ("ASSAY_SHADOW_RATE", "2"),
        ("ASSAY_EPISODE_INLINE_MAX_BYTES", "1048576"),  # a broker's whole largest message
        ("ASSAY_KAFKA_MEMBER_TIMEOUT_MS", "1"),
        ("ASSAY_HTTP_PORT", "port"),
        ("ASSAY_TENANT", "acme"),
        ("ASSAY_GRADING_CEILINGS", "acme=1"),
        ("ASSAY_GRADING_USD_CEILINGS", f"{TENANT}=lots"),
        ("ASSAY_HELD_OUT_FRACTION", "1"),
        ("ASSAY_CONSOLE_STAGE_URLS", "execute"),
        ("ASSAY_CONSOLE_STAGE_URLS", "execute=ftp://e:21"),
        ("ASSAY_CONSOLE_STAGE_URLS", "execute=http://a:1,execute=http://b:1"),
    ],
)
def test_an_invalid_value_stops_start_up_naming_the_variable(variable: str, value: str) -> None:
    with pytest.raises(SettingsInvalid, match=f"invalid setting {variable}={value!r}: "):
        AssaySettings.from_env({variable: value})


def test_a_secret_is_never_shown() -> None:
    env = {
        "ASSAY_MODEL_URL": "http://127.0.0.1:9/v1",
        "ASSAY_MODEL_NAME": "m",
        "ASSAY_MODEL_API_KEY": "sk-secret",
    }
    assert "sk-secret" not in repr(AssaySettings.from_env(env))


def test_require_names_the_missing_variables() -> None:
    settings = AssaySettings.from_env({"ASSAY_KAFKA_BOOTSTRAP": "k:9092"})
    settings.require("kafka.bootstrap")
    with pytest.raises(
        SettingsInvalid, match="missing settings: ASSAY_DATABASE_URL, ASSAY_ADMIN_DATABASE_URL"
    ):
        settings.require("kafka.bootstrap", "database.url", "database.admin_url")


async def test_the_bootstrap_wires_the_sections_themselves(tmp_path: Path) -> None:
    settings = AssaySettings.from_env(
        {
            "ASSAY_GRADING_CALLS_PER_DAY": "3",
            "ASSAY_SHADOW_RATE": "0.5",
            "ASSAY_LEASE_TTL_S": "2",
            "ASSAY_EPISODE_INLINE_MAX_BYTES": "100",
        }
    )
    async with stage_deps(settings, FsBlobStore(tmp_path / "blobs"), data_dir=tmp_path) as wired:
        deps = wired.deps
        assert deps.grading is settings.grading
        assert deps.retention is settings.retention
        assert deps.replay is settings.replay
        assert deps.sprt is settings.sprt
        assert deps.ladder is settings.ladder
        assert deps.proposals is settings.proposer
        assert (deps.shadow_rate, deps.lease_ttl_s) == (0.5, 2.0)
        assert deps.episode_inline_max_bytes == 100
        assert isinstance(deps.model, StubModel)
        assert isinstance(deps.judge, TracedJudge)  # every judge call is a span
        assert isinstance(deps.judge.judge, StubJudge)
