"""A candidate matrix from the command line (`assay submit --candidate/--candidates`).

A `--candidate` flag is `[NAME][*K]:KIND=VALUE` (the prefix may be left out):
`version=current`, `v2:version=3f9a…`, `big*3:model=gpt-4o` (three siblings),
`*5:version=current`, `prompt=Think step by step: {{ task.question }}`, or
`prompt.STEP=TEMPLATE` for one model step of several. A `--candidates` file (YAML
or JSON) is a list of candidates, or a rollout spec holding `candidates` (and
`control`, `budget`, `mode`…). Either is attached to every task submitted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from assay.kernel.errors import AssayError
from assay.kernel.schema import one_line
from assay.messages import RolloutSpec, TaskSubmitted

KINDS = ("version", "model", "prompt")


def parse_candidate(flag: str) -> dict[str, Any]:
    """One `--candidate` flag as a candidate document (`*K`: it runs K siblings).

    Raises:
        AssayError: no `=`, a kind other than version, model, prompt or prompt.STEP, or a
            K that is not a whole number (its range is the matrix's to check).
    """
    left, sep, value = flag.partition("=")
    if not sep or not value:
        raise AssayError(f"--candidate {flag!r}: expected [NAME][*K]:KIND=VALUE")
    prefix, _, kind = left.rpartition(":")
    name, star, samples = prefix.partition("*")
    doc: dict[str, Any] = {"name": name} if name else {}
    if star:
        if not samples.isdecimal():
            raise AssayError(f"--candidate {flag!r}: K in NAME*K is a whole number of siblings")
        doc["samples"] = int(samples)
    if kind.startswith("prompt.") and len(kind) > len("prompt."):
        return {**doc, "prompt": {kind.removeprefix("prompt."): value}}
    if kind not in KINDS:
        raise AssayError(f"--candidate {flag!r}: KIND is version, model, prompt or prompt.STEP")
    return {**doc, kind: value}


def read_matrix(path: Path) -> dict[str, Any]:
    """A `--candidates` file as rollout-spec fields (`candidates`, and whatever else it sets).

    Raises:
        AssayError: unreadable, not YAML/JSON, or neither a list nor an object.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise AssayError(f"{path}: {exc.strerror}") from exc
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml  # here: only a YAML matrix loads it

            doc: Any = yaml.safe_load(text)
        else:
            doc = json.loads(text)
    except Exception as exc:  # JSON's ValueError or yaml.YAMLError (yaml loaded lazily)
        raise AssayError(f"{path}: not a candidate matrix ({exc})") from exc
    if isinstance(doc, list):
        return {"candidates": doc}
    if isinstance(doc, dict) and isinstance(doc.get("candidates"), list):
        return doc
    raise AssayError(f"{path}: a candidate matrix is a list, or an object with `candidates`")


def matrix_of(
    flags: list[str] | None, path: Path | None, control: str | None
) -> dict[str, Any] | None:
    """The matrix the flags ask for (None: none), validated as a rollout spec.

    Raises:
        AssayError: both a file and flags, a bad flag or file, or a matrix that cannot be
            admitted whole (the reason names the problem).
    """
    if not flags and path is None:
        if control is not None:
            raise AssayError("--control names a candidate: give --candidate or --candidates")
        return None
    if flags and path is not None:
        raise AssayError("give --candidate flags or a --candidates file, not both")
    matrix = read_matrix(path) if path is not None else {}
    if flags:
        matrix["candidates"] = [parse_candidate(f) for f in flags]
    if control is not None:
        matrix["control"] = control
    try:
        RolloutSpec.model_validate(matrix)
    except ValidationError as exc:
        raise AssayError(f"candidate matrix: {one_line(exc)}") from exc
    return matrix


def with_matrix(tasks: list[TaskSubmitted], matrix: dict[str, Any] | None) -> list[TaskSubmitted]:
    """Each task with the matrix as its rollout spec (over its own budget and mode)."""
    if matrix is None:
        return tasks
    out = []
    for task in tasks:
        own = {} if task.rollout is None else task.rollout.model_dump(mode="json")
        for field in ("n", "admit", "candidates", "control"):
            own.pop(field, None)
        spec = RolloutSpec.model_validate({**own, **matrix})
        out.append(task.model_copy(update={"rollout": spec}))
    return out
