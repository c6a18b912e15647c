"""Retention of finished runs (§8.6, §10.3): the token measure, reduction, archives.

Vocabulary, as in the design: **reduction** shortens an episode's texts into a
new summary blob once the run is over its tenant's token ceiling; **tiering**
moves a terminal, reduced run's log records to an archive blob. Both happen only
once grading has ended (`Graded`, `Ungraded`, or a cancelled run).

The measure is text, because text is what every later reader of a record pays
for — a judge's context window, an export, a replay's prompt. A run's tokens are
`ceil(characters / 4)` over the texts of its episode that reduction can shorten:
the task input's strings, each attempt's prompt, output and error, each step's
output and the run's output. Four characters a token is the usual rule of thumb
for English under BPE tokenizers; it is an estimate, deliberately simple and the
same everywhere. Model usage (`Usage`) is not added: it is what a model consumed
(context included) and was already spent, it counts the prompts the texts hold a
second time, and no summary could lower it — it is kept, verbatim, as a fact.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from assay.kernel.canonical import canonical_bytes
from assay.kernel.ids import BranchId, Lsn, TenantId, tenant_id
from assay.kernel.tenant_maps import tenant_map
from assay.record.events import BranchKey, EventRegistry, LogRecord

if TYPE_CHECKING:
    from assay.messages.episode import Elision, Episode, ReducedEpisode

DEFAULT_TOKEN_CEILING = 200_000
"""Tokens a run's episode may hold before it is reduced (§8.6), unless its tenant's
ceiling says otherwise."""
CHARS_PER_TOKEN = 4
"""The measure's estimate: characters per token."""
DAY_S = 86_400.0
KAFKA_DEFAULT_RETENTION_S = 7 * DAY_S
"""Kafka's own default topic retention (`log.retention.hours=168`), which the deployment
files set explicitly."""


class RetentionPolicy(BaseModel):
    """How long every store keeps what (`ASSAY_RETENTION_*`); the table of what each stage
    keeps is `assay.runtime.retention.RETENTION`. The defaults are the design's.

    `ceilings` overrides `token_ceiling` per tenant (written `<tenant-uuid>=<tokens>,...`
    in the environment). A run is tiered once it is reduced and `tier_after_s` has
    passed since; the sweep that tiers runs goes at most once per `sweep_interval_s`
    per tenant, and tiers at most `sweep_limit` runs each time. Inbox entries and
    finished records must be kept longer than the bus keeps the messages that could
    deliver them again (`topic_retention_s`): anything else is refused.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    token_ceiling: int = Field(
        DEFAULT_TOKEN_CEILING, ge=1, description="Tokens a run may hold before it is reduced."
    )
    ceilings: dict[TenantId, int] = Field(
        default_factory=dict, description="Per-tenant ceilings: `<tenant-uuid>=<tokens>,...`."
    )
    keep_chars: int = Field(
        2_000,
        ge=0,
        description="Characters a summary keeps per text (head and tail around the marker).",
    )
    tier_after_s: float = Field(
        7 * DAY_S,
        ge=0,
        allow_inf_nan=False,
        description="Seconds after its reduction that a run is tiered.",
    )
    sweep_interval_s: float = Field(
        60.0,
        ge=0,
        allow_inf_nan=False,
        description="Least seconds between two tiering sweeps of one tenant.",
    )
    sweep_limit: int = Field(16, ge=1, description="Runs one tiering sweep tiers at most.")
    topic_retention_s: float = Field(
        KAFKA_DEFAULT_RETENTION_S,
        gt=0,
        allow_inf_nan=False,
        description=(
            "How long the bus keeps a message, in seconds: the topics' `retention.ms` that "
            "Assay creates Kafka topics with (distributed mode), and how long the embedded "
            "bus keeps a record every stage has read (embedded mode)."
        ),
    )
    inbox_keep_s: float = Field(
        KAFKA_DEFAULT_RETENTION_S + DAY_S,
        gt=0,
        allow_inf_nan=False,
        description=(
            "Seconds a stage remembers a handled message's id (its inbox entry); must exceed "
            "the topic retention, so no copy of the message can still be delivered."
        ),
    )
    records_keep_s: float = Field(
        30 * DAY_S,
        gt=0,
        allow_inf_nan=False,
        description=(
            "Seconds finished records stay in a stage's log before they are dropped or "
            "folded into a `Compacted` checkpoint (the retention table says which); must "
            "exceed the topic retention."
        ),
    )
    usage_keep_s: float = Field(
        91 * DAY_S,
        gt=0,
        allow_inf_nan=False,
        description=(
            "Seconds the console keeps each model call it folded for the spend page (whose "
            "longest range is 90 days); must exceed the topic retention."
        ),
    )
    prune_interval_s: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds between two retention sweeps of a stage (inbox and records).",
    )
    prune_limit: int = Field(
        500, ge=1, description="Branches one retention sweep compacts at most, per rule."
    )

    @model_validator(mode="after")
    def _beyond_the_topic_retention(self) -> RetentionPolicy:
        for name in ("inbox_keep_s", "records_keep_s", "usage_keep_s"):
            if getattr(self, name) <= self.topic_retention_s:
                raise ValueError(
                    f"ASSAY_RETENTION_{name.upper()}={getattr(self, name):g} must exceed "
                    f"ASSAY_RETENTION_TOPIC_RETENTION_S={self.topic_retention_s:g}: a copy of "
                    "a message could still be delivered after what handled it was forgotten"
                )
        return self

    @field_validator("ceilings", mode="before")
    @classmethod
    def _tenant_map(cls, value: object) -> object:
        return tenant_map(value, "tokens")

    def ceiling_for(self, tenant: TenantId) -> int:
        """The token ceiling of `tenant`."""
        return self.ceilings.get(tenant, self.token_ceiling)


# -- the measure ------------------------------------------------------------------


def episode_texts(episode: Episode) -> Iterator[tuple[str, str]]:
    """(path, text) of every text the measure counts and reduction may shorten."""
    yield from _strings("input", episode.input)
    for i, a in enumerate(episode.attempts):
        for name in ("prompt", "output", "error"):
            text = getattr(a, name)
            if text is not None:
                yield f"attempts[{i}].{name}", text
    for step, text in episode.outputs.items():
        yield f"outputs.{step}", text
    if episode.output is not None:
        yield "output", episode.output


def _strings(path: str, value: Any) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(f"{path}.{k}", v)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(f"{path}[{i}]", v)


def episode_tokens(episode: Episode) -> int:
    """The episode's tokens: `ceil(characters / CHARS_PER_TOKEN)` of its texts."""
    chars = sum(len(text) for _, text in episode_texts(episode))
    return math.ceil(chars / CHARS_PER_TOKEN)


# -- reduction --------------------------------------------------------------------


def elide(text: str, keep: int) -> tuple[str, int]:
    """`text` cut to its first and last characters (`keep` in all, three quarters at
    the head) around a marker naming how many were removed; and that number. A text
    that would not get shorter (it is at most `keep` characters, or the marker is
    longer than what it replaces) is returned whole, with 0."""
    if len(text) <= keep:
        return text, 0
    head = keep * 3 // 4
    tail = keep - head
    gone = len(text) - keep
    short = f"{text[:head]}\n…[{gone} characters elided]…\n{text[len(text) - tail :]}"
    return (short, gone) if len(short) < len(text) else (text, 0)


def reduce_episode(episode: Episode, original: str, keep_chars: int) -> ReducedEpisode:
    """The summary of `episode` (stored under `original`): every transition kept, each
    text longer than `keep_chars` shortened with a marker. Deterministic: the same
    episode always gives the same bytes, so a repeated reduction writes the same blob.
    """
    # Here: the settings read this module's policy, and need no message model.
    from assay.messages.episode import Elision, Episode, ReducedEpisode

    elisions: list[Elision] = []

    def cut(path: str, text: str) -> str:
        short, gone = elide(text, keep_chars)
        if gone:
            elisions.append(Elision(path=path, chars=len(text), elided=gone))
        return short

    def walk(path: str, value: Any) -> Any:
        if isinstance(value, str):
            return cut(path, value)
        if isinstance(value, dict):
            return {k: walk(f"{path}.{k}", v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(f"{path}[{i}]", v) for i, v in enumerate(value)]
        return value

    task_input = walk("input", episode.input)
    attempts = []
    for i, a in enumerate(episode.attempts):
        texts = {
            name: cut(f"attempts[{i}].{name}", text)
            for name in ("prompt", "output", "error")
            if (text := getattr(a, name)) is not None
        }
        attempts.append(a.model_copy(update=texts))
    outputs = {step: cut(f"outputs.{step}", text) for step, text in episode.outputs.items()}
    output = cut("output", episode.output) if episode.output is not None else None
    reduced = episode.model_copy(
        update={"input": task_input, "attempts": attempts, "outputs": outputs, "output": output}
    )
    # Validated again: the copy must still be an episode every reader can decode.
    reduced = Episode.model_validate(reduced.model_dump(mode="json"))
    return ReducedEpisode(
        original=original,
        episode=reduced,
        elisions=elisions,
        tokens_before=episode_tokens(episode),
        tokens_after=episode_tokens(reduced),
    )


# -- tiering ----------------------------------------------------------------------


def tiered_stream(run: str) -> str:
    """The tombstone stream of a tiered run: its `Tiered` record, which stays in the log."""
    return f"{run}/tiered"


def encode_archive(records: list[LogRecord]) -> bytes:
    """The archive of a run's records: canonical JSON, one line per record, in the
    order given. Each line holds the record's key, LSN, commit time and stored schema
    version, and its event as it decodes today (`type`, `version`, `event`)."""
    lines = [
        canonical_bytes(
            {
                "tenant": str(r.key.tenant),
                "stream": r.key.stream,
                "branch": r.key.branch,
                "lsn": r.lsn,
                "at_ms": r.at_ms,
                "schema_version": r.schema_version,
                "type": r.event.type,
                "version": r.event.version,
                "event": r.event.model_dump(mode="json"),
            }
        )
        for r in records
    ]
    return b"".join(line + b"\n" for line in lines)


def decode_archive(data: bytes, registry: EventRegistry) -> list[LogRecord]:
    """The records an archive holds, decoded (and upcast) with `registry` — for the
    execute stage's, `assay.engine.WORK_EVENTS`.

    Raises:
        ValueError: not an archive (a line is not a record).
        UnknownSchema: a record of a type or version `registry` cannot decode.
    """
    out: list[LogRecord] = []
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            key = BranchKey(tenant_id(doc["tenant"]), doc["stream"], BranchId(doc["branch"]))
            event = registry.decode(doc["type"], doc["version"], doc["event"])
            out.append(LogRecord(key, Lsn(doc["lsn"]), doc["schema_version"], doc["at_ms"], event))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an archive line: {line[:80]!r}") from exc
    return out
