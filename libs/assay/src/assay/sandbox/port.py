"""The sandbox port: a run's workspace, where tools and command verifiers run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class CommandResult:
    """What a command did in the workspace."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False


class Workspace(Protocol):
    """One run's writable workspace inside a sandbox."""

    async def run(
        self, argv: Sequence[str], *, timeout_s: float, stdin: bytes | None = None
    ) -> CommandResult:
        """Run a command in the workspace under the sandbox's limits."""
        ...

    async def write_file(self, path: str, content: bytes) -> None:
        """Write a file inside the workspace (paths escaping it are refused)."""
        ...

    async def read_file(self, path: str) -> bytes:
        """Read a file inside the workspace."""
        ...
