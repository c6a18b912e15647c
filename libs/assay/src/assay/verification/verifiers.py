"""Verifiers (§10): fail-closed checks on a frozen episode.

Any error, exception or timeout is a `Fail`, never a `Pass`. Verifiers of one
run execute in parallel; each result records the verifier's identity, its
implementation version and the evidence it saw.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from typing import Protocol

from assay.messages.episode import Episode, ModelContext
from assay.messages.models import VerifierResult
from assay.sandbox.port import SandboxProvider
from assay.verification.command import DEFAULT_TIMEOUT_S, CommandVerifier
from assay.workflow.ir import VerifierSpec
from assay.workflow.templates import render


class Verifier(Protocol):
    """A check on an episode. Implementations may raise; the runner fails them closed.

    An installed package adds a kind by registering, under the `assay.verifiers`
    entry-point group, an object like this (or a callable returning one or an
    iterable of them). A workflow then names the kind in a verifier and passes
    its settings in `params`. `version` is recorded with every result.
    """

    kind: str
    version: str

    async def check(self, spec: VerifierSpec, episode: Episode, subject: str) -> tuple[bool, str]:
        """Return (passed, evidence) for `subject`, the output under test.

        Only a returned `(True, str)` passes; raising, hanging past the
        deadline or returning anything else is a fail.
        """
        ...


def _clip(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n] + "…"


class ExactVerifier:
    """The output equals the rendered `expected` template."""

    kind = "exact"
    version = "1"

    async def check(self, spec: VerifierSpec, episode: Episode, subject: str) -> tuple[bool, str]:
        assert spec.expected is not None
        expected = render(
            spec.expected,
            {
                "task": episode.input,
                "steps": {k: {"output": v} for k, v in episode.outputs.items()},
            },
        )
        got, want = (subject.strip(), expected.strip()) if spec.strip else (subject, expected)
        return got == want, f"expected {_clip(want)!r}, got {_clip(got)!r}"


class RegexVerifier:
    """The output fully matches `pattern`."""

    kind = "regex"
    version = "1"

    async def check(self, spec: VerifierSpec, episode: Episode, subject: str) -> tuple[bool, str]:
        assert spec.pattern is not None
        text = subject.strip() if spec.strip else subject
        ok = re.fullmatch(spec.pattern, text) is not None
        return ok, f"{_clip(text)!r} {'matches' if ok else 'does not match'} /{spec.pattern}/"


class JsonSchemaVerifier:
    """The output is JSON valid against `json_schema`."""

    kind = "json_schema"
    version = "1"

    async def check(self, spec: VerifierSpec, episode: Episode, subject: str) -> tuple[bool, str]:
        import jsonschema  # here: a stage whose workflows check no schema does not load it

        assert spec.json_schema is not None
        try:
            doc = json.loads(subject)
        except json.JSONDecodeError as exc:
            return False, f"not JSON: {exc}"
        errors = sorted(
            jsonschema.Draft202012Validator(spec.json_schema).iter_errors(doc),
            key=lambda e: list(e.path),
        )
        if errors:
            return False, f"{len(errors)} schema error(s); first: {_clip(errors[0].message)}"
        return True, "valid against the schema"


class ContextVerifier:
    """A model call had what it needed (§10.1): every reference in `expect.packed` was
    packed into its context and every tool in `expect.tools_offered` offered to it — the
    step's last model call, or, without `step`, some model call of the run. The evidence
    says where each missing reference was: available and not packed, dropped by a
    budget, or not there at all.

    On the budget: every reference in `expect.dropped` was dropped (from the step's last
    call, or some call), and no call checked dropped more than `expect.max_dropped`
    references; the evidence names what was dropped and its size."""

    kind = "context"
    version = "1"

    async def check(self, spec: VerifierSpec, episode: Episode, subject: str) -> tuple[bool, str]:
        assert spec.expect is not None
        calls = [
            a.context
            for a in episode.attempts
            if a.context is not None and (spec.step is None or a.step == spec.step)
        ]
        if not calls:
            return False, "no model call recorded its context"
        if spec.step is not None:
            calls = calls[-1:]  # the step's last call: the one whose output is checked
        e = spec.expect
        missing = [r for r in e.packed if not any(c.holds(r) for c in calls)]
        offered = {t for c in calls for t in c.tools_offered}
        unoffered = [t for t in e.tools_offered if t not in offered]
        dropped = {r.ref for c in calls for r in c.dropped}
        kept = [r for r in e.dropped or () if r not in dropped]
        most = max(len(c.dropped) for c in calls)
        over = e.max_dropped is not None and most > e.max_dropped
        if not (missing or unoffered or kept or over):
            said = [f"packed {e.packed}", f"offered {e.tools_offered}"]
            if e.dropped is not None or e.max_dropped is not None:
                said.append(f"dropped {_sizes(calls)}")
            return True, _clip("; ".join(said), 400)
        why = [f"{r} {_whereabouts(r, calls)}" for r in missing]
        why += [f"tool {t} not offered" for t in unoffered]
        why += [f"{r} was not dropped" for r in kept]
        if over:
            why.append(f"{most} references dropped, more than {e.max_dropped}: {_sizes(calls)}")
        return False, _clip("; ".join(why), 400)


def _sizes(calls: list[ModelContext]) -> str:
    """What the budget dropped from the calls, as `ref (N chars)`, or `nothing`."""
    refs = [f"{r.ref} ({r.chars} chars)" for c in calls for r in c.dropped]
    return ", ".join(refs) if refs else "nothing"


def _whereabouts(ref: str, calls: list[ModelContext]) -> str:
    if any(r.ref == ref for c in calls for r in c.dropped):
        return "was dropped by the context budget"
    if any(r.ref == ref for c in calls for r in c.available):
        return "was available and not packed"
    return "was not available"


def _checked(outcome: object) -> tuple[bool, str]:
    """A verifier's `(passed, evidence)`; anything else raises, so only a real `True` passes."""
    if (
        isinstance(outcome, tuple)
        and len(outcome) == 2
        and isinstance(outcome[0], bool)
        and isinstance(outcome[1], str)
    ):
        return outcome[0], outcome[1]
    raise TypeError(f"a verifier returned {type(outcome).__name__}, not (bool, str)")


BUILTIN_VERIFIERS: dict[str, Verifier] = {
    v.kind: v for v in (ExactVerifier(), RegexVerifier(), JsonSchemaVerifier(), ContextVerifier())
}
"""The built-in verifiers that need nothing but the episode (`command` needs a sandbox)."""

SANDBOX_GRACE_S = 10.0
"""Time a command verifier gets beyond its own `timeout_s`, to set up its workspace."""


def verifier_registry(
    sandbox: SandboxProvider | None, extra: Mapping[str, Verifier] | None = None
) -> dict[str, Verifier]:
    """Every verifier kind a stage can run: the built-ins, `command`, and `extra`.

    `command` is always present: without a sandbox it fails every check with
    the reason. `extra` (the installed packages' verifiers) may not redefine a
    built-in kind.

    Raises:
        ValueError: a kind of `extra` is a built-in kind.
    """
    registry: dict[str, Verifier] = {**BUILTIN_VERIFIERS, "command": CommandVerifier(sandbox)}
    for kind, verifier in (extra or {}).items():
        if kind in registry:
            raise ValueError(f"verifier kind {kind!r} is built in and cannot be replaced")
        registry[kind] = verifier
    return registry


async def verify_episode(
    episode: Episode,
    specs: list[VerifierSpec],
    *,
    timeout_s: float = 10.0,
    registry: dict[str, Verifier] | None = None,
) -> list[VerifierResult]:
    """Run every verifier of the workflow on the episode, in parallel, failing closed.

    `registry` maps kinds to verifiers (default: the built-ins, without a
    sandbox); a kind it lacks fails. Each check gets `timeout_s`, a command
    check its own `timeout_s` plus `SANDBOX_GRACE_S`.
    """
    verifiers = verifier_registry(None) if registry is None else registry

    async def one(spec: VerifierSpec) -> VerifierResult:
        impl = verifiers.get(spec.kind)
        version = impl.version if impl else "missing"
        step = (
            spec.step or episode.definition.get("output") or (episode.definition["steps"][-1]["id"])
        )
        subject = episode.outputs.get(step) if episode.succeeded or spec.step else None
        if impl is None:
            passed, evidence = False, f"no verifier of kind {spec.kind!r} is registered"
        elif subject is None:
            passed, evidence = False, f"step {step!r} produced no output"
        else:
            limit = timeout_s
            if spec.kind == "command":
                limit = max(timeout_s, (spec.timeout_s or DEFAULT_TIMEOUT_S) + SANDBOX_GRACE_S)
            try:
                outcome: object = await asyncio.wait_for(impl.check(spec, episode, subject), limit)
                passed, evidence = _checked(outcome)
            except TimeoutError:
                passed, evidence = False, f"verifier timed out after {limit}s"
            except Exception as exc:  # fail closed: an error is never a pass
                passed, evidence = False, f"verifier raised {type(exc).__name__}: {exc}"
        return VerifierResult(
            verifier=spec.id,
            kind=spec.kind,
            verifier_version=version,
            passed=passed,
            evidence=evidence,
        )

    return list(await asyncio.gather(*(one(s) for s in specs)))
