"""The `command` verifier: run a command in a sandbox; exit code 0 passes (§10).

The workspace is the episode's own snapshot, restored into a workspace of its
own, when the run left one; otherwise a fresh one holding the checked output
in `output.txt`. Everything that is not a clean exit 0 within the time — a
non-zero exit, a signal, a timeout, a missing snapshot, a sandbox that cannot
run commands or is not configured — is a fail, with the reason as evidence.
"""

from __future__ import annotations

from assay.kernel.canonical import digest
from assay.kernel.ids import BranchId
from assay.messages.episode import Episode
from assay.sandbox.port import CommandResult, SandboxError, SandboxProvider
from assay.workflow.ir import VerifierSpec
from assay.workflow.templates import render

DEFAULT_TIMEOUT_S = 60.0
"""Wall-clock limit of a command verifier that names no `timeout_s`."""
OUTPUT_FILE = "output.txt"
"""Where a fresh verifier workspace holds the output under test."""


def _verdict(argv: list[str], result: CommandResult, timeout_s: float) -> tuple[bool, str]:
    shown = " ".join(argv)
    shown = shown if len(shown) <= 120 else shown[:120] + "…"
    how = result.describe()
    if result.timed_out:
        how = f"{how} after {timeout_s}s"
    return result.ok, f"`{shown}` {how}"


class CommandVerifier:
    """Exit code 0 of `argv`, run in a sandbox workspace, passes; anything else fails."""

    kind = "command"
    version = "1"

    def __init__(self, sandbox: SandboxProvider | None) -> None:
        self._sandbox = sandbox

    async def check(self, spec: VerifierSpec, episode: Episode, subject: str) -> tuple[bool, str]:
        """Run the rendered `argv`; pass only on a clean exit 0 within `timeout_s`."""
        if self._sandbox is None:
            return False, "no sandbox is configured, so no command can run"
        if not spec.argv:
            return False, "the verifier has no `argv`"
        context = {
            "task": episode.input,
            "steps": {k: {"output": v} for k, v in episode.outputs.items()},
        }
        argv = [render(a, context) for a in spec.argv]
        timeout_s = spec.timeout_s or DEFAULT_TIMEOUT_S
        tenant, run_id = episode.run.tenant, episode.run.run_id
        # A workspace of its own per verifier: the run's (if still open) and the
        # other verifiers' are never touched.
        scope = "verify-" + digest(spec.id.encode())[:16]
        try:
            if episode.workspace is not None:
                ws = await self._sandbox.restore(
                    tenant, run_id, BranchId(0), episode.workspace, scope=scope
                )
            else:
                ws = await self._sandbox.open(tenant, run_id, BranchId(0), scope=scope)
        except SandboxError as exc:
            return False, f"no workspace: {type(exc).__name__}: {exc}"
        try:
            if episode.workspace is None:
                await ws.write_file(OUTPUT_FILE, subject.encode())
            result = await ws.run(argv, timeout_s=timeout_s)
        except SandboxError as exc:
            return False, f"the sandbox refused: {type(exc).__name__}: {exc}"
        finally:
            await self._sandbox.discard(ws)
        return _verdict(argv, result, timeout_s)
