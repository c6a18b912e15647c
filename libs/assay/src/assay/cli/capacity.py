"""`assay capacity`: what the declared GPU capacity implies for this deployment (§14.2).

Reads the settings (`ASSAY_CAPACITY_*`, `ASSAY_CAPACITY_FILE`, the model endpoints),
checks the residency invariant as start-up does, and prints the resident models,
each one's derived context ceiling, the judge's prompt budget and the retention
reduction target — or, with `--json`, the same as one JSON object.
"""

from __future__ import annotations

import json
from typing import Any

from assay.runtime.capacity_plan import plan_capacity
from assay.runtime.settings import AssaySettings


def capacity(settings: AssaySettings, *, as_json: bool) -> str:
    """The report of `settings`' declared capacity.

    Raises:
        SettingsInvalid: the declaration is inconsistent or does not hold the models.
    """
    plan = plan_capacity(settings)
    if plan is None:
        doc: dict[str, Any] = {"declared": False}
        if as_json:
            return json.dumps(doc)
        return "no capacity declared (ASSAY_CAPACITY_VRAM_BYTES_PER_DEVICE or ASSAY_CAPACITY_FILE)"
    doc = {"declared": True, **plan.summary(settings.retention)}
    if as_json:
        return json.dumps(doc, indent=2)
    gb = 1e9
    lines = [
        f"VRAM            {doc['vram_bytes_per_device'] / gb:.2f} GB x {doc['devices']} device(s)"
        f" = {doc['vram_bytes'] / gb:.2f} GB",
        f"resident        {len(doc['resident'])} of at most {doc['max_resident_models']} "
        f"(pinned: {', '.join(doc['pinned']) or 'none'}); weights "
        f"{doc['resident_weights_bytes'] / gb:.2f} GB",
    ]
    for m in doc["resident"]:
        lines.append(
            f"  {m['model']}: weights {m['weights_bytes'] / gb:.2f} GB, KV "
            f"{m['kv_bytes_per_token']} B/token, {m['devices_required']} device(s), "
            f"max_context_tokens {m['max_context_tokens']}"
        )
    lines += [
        f"agent model     {doc['agent_model'] or '(stub)'}",
        f"judge model     {doc['judge_model'] or '(stub)'}",
        f"judge context   {_or_dash(doc['judge_context_tokens'])} tokens; "
        f"episode budget {_or_dash(doc['judge_episode_chars'])} characters",
        f"retention       target {_or_dash(doc['retention_target_tokens'])} tokens "
        f"(max_context_tokens / 2); configured {doc['retention_configured_tokens']}, "
        f"effective {doc['retention_effective_tokens']}",
    ]
    return "\n".join(lines)


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)
