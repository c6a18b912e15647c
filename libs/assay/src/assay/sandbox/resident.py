"""The local provider's resident sandbox: one long-lived process per run (DESIGN §9, §16).

A coding agent keeps a shell or an interpreter alive between its steps; the
memory that process holds is what suspending an idle sandbox gives back. The
local provider's resident sandbox is such a process: started through the same
launcher as every command (its namespaces, rlimits, uid, parent-death signal),
with the run's workspace as its working directory, it fills `memory_bytes` of
memory (written, so it is resident, not merely reserved), announces its
identity on stdout and then answers `ping` with it until its stdin closes.
Commands still run beside it, each through the launcher.

Stopping it closes its stdin and waits for its process group to end; only
then is the release confirmed. If Assay dies, the parent-death signal takes
the resident process with it: a resident sandbox never outlives its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from assay.sandbox.port import SandboxError

if TYPE_CHECKING:
    from assay.sandbox.local import LocalSandbox, LocalWorkspace

SEARCH_PATH = "/usr/local/bin:/usr/bin:/bin"
START_TIMEOUT_S = 30.0
"""How long a new generation may take to announce itself."""
PING_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0

HOLDER = """\
import sys
identity, size = sys.argv[1], int(sys.argv[2])
held = b"\\x01" * size
sys.stdout.write("ready " + identity + "\\n")
sys.stdout.flush()
for line in sys.stdin:
    if line.strip() == "ping":
        sys.stdout.write("pong " + identity + " " + str(len(held)) + "\\n")
        sys.stdout.flush()
"""
"""The resident process: fill memory, announce, answer pings until stdin closes."""


@dataclass
class LocalResident:
    """One generation of a run's resident sandbox in the local provider."""

    generation: int
    identity: str
    proc: asyncio.subprocess.Process = field(repr=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    async def ping(self) -> str:
        """Its answer to `ping` (`pong <identity> <bytes held>`)."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        async with self._lock:
            try:
                self.proc.stdin.write(b"ping\n")
                await self.proc.stdin.drain()
                line = await asyncio.wait_for(self.proc.stdout.readline(), PING_TIMEOUT_S)
            except (TimeoutError, BrokenPipeError, ConnectionResetError) as exc:
                raise SandboxError(f"resident sandbox {self.identity} did not answer") from exc
        if not line:
            raise SandboxError(f"resident sandbox {self.identity} is gone")
        return line.decode(errors="replace").strip()

    def memory_bytes(self) -> int:
        """RSS of its process tree, read from `/proc` (0 once it is gone)."""
        if self.proc.returncode is not None:
            return 0
        return tree_rss_bytes(self.proc.pid)

    async def stop(self) -> None:
        """Close its stdin, wait for it to end (SIGKILL its group after a while)."""
        if self.proc.returncode is None and self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.proc.stdin.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever it left behind
        await self.proc.wait()


async def start_resident(
    sandbox: LocalSandbox, ws: LocalWorkspace, *, generation: int, identity: str, memory_bytes: int
) -> LocalResident:
    """Start a generation in `ws`; return once it announced `identity`.

    Raises:
        SandboxError: the launcher could not start, or the process did not announce
            itself within `START_TIMEOUT_S`.
    """
    if memory_bytes < 0 or "\n" in identity or " " in identity:
        raise SandboxError("a resident sandbox needs memory >= 0 and a one-word identity")
    # The system's interpreter: Assay's own may live where the sandbox's uid cannot read.
    python = shutil.which("python3", path=SEARCH_PATH) or sandbox.python
    argv = [python, "-I", "-S", "-c", HOLDER, identity, str(memory_bytes)]
    env = {"PATH": SEARCH_PATH, "HOME": ws.root, "LANG": "C.UTF-8"}
    encoded = await asyncio.to_thread(lambda: json.dumps(sandbox.launch_spec(argv, env)).encode())
    with tempfile.TemporaryFile() as spec:
        spec.write(encoded)
        spec.flush()
        spec.seek(0)
        try:
            proc = await asyncio.create_subprocess_exec(
                *sandbox.launcher_argv(spec.fileno()),
                cwd=ws.path,
                env={"PATH": SEARCH_PATH, "LANG": "C.UTF-8"},
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                pass_fds=(spec.fileno(),),
                start_new_session=True,
            )
        except OSError as exc:
            raise SandboxError(f"cannot start a resident sandbox: {exc}") from exc
    resident = LocalResident(generation, identity, proc)
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
    except BaseException:
        await resident.stop()
        raise
    if line.decode(errors="replace").strip() != f"ready {identity}":
        await resident.stop()
        raise SandboxError(f"resident sandbox {identity} did not start (exit {proc.returncode})")
    return resident


def tree_rss_bytes(root: int) -> int:
    """Resident memory of `root` and every process below it, from `/proc` (best effort)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    page = os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
        todo.extend(children.get(pid, ()))
    return total
