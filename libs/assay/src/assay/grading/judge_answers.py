"""Strict parsing of a model judge's answers: a verdict or a violation list, or a failure.

What is accepted, exactly:

- The answer, with surrounding whitespace stripped, is one JSON object — or one
  Markdown code fence (```` ``` ```` or ```` ```json ````, the fence lines on
  their own) holding one JSON object and nothing else. No prose before, after or
  inside; one fence, never several.
- The object has no duplicate keys and no keys but those below.
- `compare`: `{"verdict": "A" | "B" | "draw", "reason": "..."}` — the verdict
  spelled exactly so (case matters); `reason` optional, a string when present.
- `screen`: `{"violations": [{"criterion": "<id>", "evidence": "..."}, ...]}` —
  every criterion the id of a `core` item of the rubric, every evidence a
  non-empty string; an empty list means no violation.

Anything else raises `JudgeFailed` with the reason and an excerpt of the answer.
A failure is never read as a draw or as "no violations".
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from assay.grading.judges import JudgeFailed
from assay.kernel.scores import CoreViolation, Verdict

if TYPE_CHECKING:
    from assay.workflow.ir import RubricItem

_FENCE = re.compile(r"```(?:json)?[ \t]*\n(?P<body>.*)\n[ \t]*```", re.DOTALL)
_VERDICTS = {"A": Verdict.A, "B": Verdict.B, "draw": Verdict.DRAW}


def parse_verdict(answer: str) -> tuple[Verdict, str]:
    """The verdict of a `compare` answer and its reason ("" when none was given).

    Raises:
        JudgeFailed: the answer is not exactly the accepted format.
    """
    doc = one_object(answer, required={"verdict"}, optional={"reason"})
    verdict = doc["verdict"]
    if not isinstance(verdict, str) or verdict not in _VERDICTS:
        raise JudgeFailed(f'"verdict" is {_shown(verdict)}, not one of "A", "B", "draw"', answer)
    reason = doc.get("reason", "")
    if not isinstance(reason, str):
        raise JudgeFailed(f'"reason" is {_shown(reason)}, not a string', answer)
    return _VERDICTS[verdict], reason


def parse_violations(answer: str, core: Sequence[RubricItem]) -> list[CoreViolation]:
    """The violations a `screen` answer lists, each of a `core` criterion in `core`.

    Raises:
        JudgeFailed: the answer is not exactly the accepted format, or names a
            criterion that is not a core item of the rubric.
    """
    ids = {item.id for item in core if item.layer == "core"}
    doc = one_object(answer, required={"violations"}, optional=set())
    listed = doc["violations"]
    if not isinstance(listed, list):
        raise JudgeFailed(f'"violations" is {_shown(listed)}, not a list', answer)
    out = []
    for n, entry in enumerate(listed):
        if not isinstance(entry, dict) or set(entry) != {"criterion", "evidence"}:
            raise JudgeFailed(
                f"violation {n} is {_shown(entry)}, not an object with exactly "
                '"criterion" and "evidence"',
                answer,
            )
        criterion, evidence = entry["criterion"], entry["evidence"]
        if not isinstance(criterion, str) or criterion not in ids:
            raise JudgeFailed(
                f"violation {n} names criterion {_shown(criterion)}, not a core criterion "
                f"of the rubric ({', '.join(sorted(ids)) or 'it has none'})",
                answer,
            )
        if not isinstance(evidence, str) or not evidence.strip():
            raise JudgeFailed(f"violation {n} has evidence {_shown(evidence)}", answer)
        out.append(CoreViolation(criterion=criterion, evidence=evidence))
    return out


def one_object(answer: str, *, required: set[str], optional: set[str]) -> dict[str, Any]:
    """The one JSON object `answer` holds, with exactly the allowed keys."""
    text = answer.strip()
    if text.startswith("```"):
        fenced = _FENCE.fullmatch(text)
        if fenced is None or "```" in fenced["body"]:
            raise JudgeFailed("not one JSON object in one code fence", answer)
        text = fenced["body"].strip()
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise JudgeFailed(
            f"not one JSON object ({exc.msg} at character {exc.pos})", answer
        ) from exc
    except _DuplicateKey as exc:
        raise JudgeFailed(f"the key {str(exc)!r} appears twice", answer) from None
    if not isinstance(doc, dict):
        raise JudgeFailed(f"the answer is {_shown(doc)}, not a JSON object", answer)
    missing = required - doc.keys()
    if missing:
        raise JudgeFailed(f"no {', '.join(map(json.dumps, sorted(missing)))} field", answer)
    extra = doc.keys() - required - optional
    if extra:
        raise JudgeFailed(
            f"unexpected field(s) {', '.join(map(json.dumps, sorted(extra)))}", answer
        )
    return doc


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:
            raise _DuplicateKey(key)
        doc[key] = value
    return doc


def _shown(value: Any) -> str:
    """A JSON value as the answer wrote it, shortened."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:60] + "…"
