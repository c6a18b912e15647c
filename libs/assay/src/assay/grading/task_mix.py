"""Task-mix drift (§12.5): how far a window of incoming tasks has moved from the mix the
current version was promoted under, by the population stability index (PSI).

Every watched feature (`assay.workflow.DriftSpec`) is binned: a categorical one by its
value (the reference's `MAX_CATEGORIES` commonest, the rest `<other>`), a numeric one by
the quantiles of its reference values (`bins` bins of about equal reference mass; a
value that is not a number keeps its own bin). A task lacking a feature counts in the
bin `<missing>`. Then, per feature, with `p` the reference share and `q` the window
share of each bin (both floored at `SHARE_FLOOR`, so a bin empty on one side costs a
large but finite amount):

    PSI = sum over bins of (q - p) * ln(q / p)

Why PSI and not a chi-squared test: the question is "has the mix moved enough to
matter", not "has it moved at all". A chi-squared test's p-value shrinks with the
window, so with 500 tasks a shift nobody cares about is significant and every window
would hold promotion. PSI is an effect size: it does not grow with the window, it is
symmetric in the two distributions (a sum of two Kullback-Leibler divergences), each
bin's term says how much that bin contributed, and it has conventional readings — below
0.1 no real change, 0.1-0.25 a moderate shift, above 0.25 a major one — that a
threshold can be set against (default 0.2).
"""

from __future__ import annotations

import json
import math
import statistics
from bisect import bisect_right
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from assay.workflow.drift import TASK_ID_CLASS, DriftSpec

MISSING = "<missing>"
"""The bin of a task that lacks the feature."""
OTHER = "<other>"
"""The bin of a categorical value outside the reference's commonest."""
MAX_CATEGORIES = 50
"""Categorical values the reference keeps a bin for; rarer ones share `<other>`."""
SHARE_FLOOR = 1e-4
"""A bin's share is at least this on either side (an empty bin would be infinite PSI)."""
MAX_CATEGORY_CHARS = 200
"""A categorical value longer than this is cut (a bin label, not a copy of the input)."""

FeatureValue = str | float
"""A task's value of one feature: a number, or a category label."""


def _value(raw: Any) -> FeatureValue:
    if isinstance(raw, bool) or raw is None:
        return json.dumps(raw)
    if isinstance(raw, int | float) and math.isfinite(raw):
        return float(raw)
    if isinstance(raw, str):
        return raw[:MAX_CATEGORY_CHARS]
    return json.dumps(raw, sort_keys=True, default=str)[:MAX_CATEGORY_CHARS]


def features_of(spec: DriftSpec, task_input: Mapping[str, Any], keyed: bool) -> dict[str, Any]:
    """A task's value of every watched feature (`keyed`: the producer gave a task key)."""
    row: dict[str, Any] = {}
    for feature in spec.features:
        node: Any = task_input
        for name in feature.split(".")[1:]:
            if not isinstance(node, Mapping) or name not in node:
                node = MISSING
                break
            node = node[name]
        row[feature] = MISSING if node is MISSING else _value(node)
    row[TASK_ID_CLASS] = "task_key" if keyed else "content"
    return row


class FeatureReference(BaseModel):
    """One feature's reference distribution: its bins' shares, and for a numeric feature
    the quantile edges that bin its values."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    numeric: bool = Field(description="Binned by quantile edges (else by value).")
    edges: list[float] = Field(description="Inner quantile edges, ascending (numeric only).")
    shares: dict[str, float] = Field(description="Share of reference tasks per bin.")

    def bin(self, value: FeatureValue) -> str:
        """The bin `value` falls in."""
        if isinstance(value, float):
            if self.numeric:
                return f"q{bisect_right(self.edges, value)}"
            value = f"{value:g}"
        if not self.numeric and value not in self.shares and OTHER in self.shares:
            return OTHER
        return value


class Reference(BaseModel):
    """The task mix a window is compared with: each feature's distribution over
    `tasks` tasks."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    tasks: int = Field(ge=1, description="Tasks it was taken from.")
    features: dict[str, FeatureReference] = Field(description="Per feature.")


def _edges(numbers: Sequence[float], bins: int) -> list[float]:
    if len(set(numbers)) < 2:
        return []
    cuts = statistics.quantiles(numbers, n=bins, method="inclusive")
    return sorted(set(cuts))


def _feature_reference(values: Sequence[FeatureValue], bins: int) -> FeatureReference:
    numbers = [v for v in values if isinstance(v, float)]
    numeric = len(numbers) > 0 and len(set(numbers)) > 1
    ref = FeatureReference(
        numeric=numeric, edges=_edges(numbers, bins) if numeric else [], shares={}
    )
    labels = Counter(ref.bin(v) for v in values)
    if not numeric and len(labels) > MAX_CATEGORIES:
        kept = dict(labels.most_common(MAX_CATEGORIES))
        kept[OTHER] = sum(labels.values()) - sum(kept.values())
        labels = Counter(kept)
    total = sum(labels.values())
    return ref.model_copy(update={"shares": {k: n / total for k, n in sorted(labels.items())}})


def reference_of(rows: Sequence[Mapping[str, Any]], spec: DriftSpec) -> Reference:
    """The reference distribution of `rows` (one per task) for every watched feature.

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("a reference needs at least one task")
    features = {
        f: _feature_reference([row.get(f, MISSING) for row in rows], spec.bins)
        for f in spec.tracked()
    }
    return Reference(tasks=len(rows), features=features)


def psi(reference: FeatureReference, values: Sequence[FeatureValue]) -> float:
    """The population stability index of `values` against one feature's reference."""
    counts = Counter(reference.bin(v) for v in values)
    total = sum(counts.values())
    out = 0.0
    for label in sorted(set(reference.shares) | set(counts)):
        p = max(reference.shares.get(label, 0.0), SHARE_FLOOR)
        q = max(counts.get(label, 0) / total, SHARE_FLOOR)
        out += (q - p) * math.log(q / p)
    return out


def window_psi(reference: Reference, rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each feature's PSI of a window of tasks (`rows`) against the reference (features
    the reference lacks are skipped)."""
    return {
        f: round(psi(ref, [row.get(f, MISSING) for row in rows]), 6)
        for f, ref in reference.features.items()
    }
