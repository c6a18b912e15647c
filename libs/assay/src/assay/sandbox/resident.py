"""The local provider's resident sandbox: one long-lived process per run (DESIGN §9, §16).

A coding agent keeps a shell or an interpreter alive between its steps; the
memory that process holds is what suspending an idle sandbox gives back. The
local provider's resident sandbox is such a process: started through the same
launcher as every command (its namespaces, rlimits, uid, parent-death signal),
with the run's workspace as its working directory, it fills `memory_bytes` of
memory (written, so it is resident, not merely reserved), announces its
identity on stdout and then serves requests on its stdin until it closes:
`ping` (it answers with its identity) and commands.

Commands run inside it. While a generation is up, every command of its
workspace is sent to it (one JSON line) and it starts the command as its own
child, through the same launcher (rlimits, default signals, a parent-death
signal, the scrubbed environment it is given), in its namespaces and as its
user: the command's process tree and memory are the resident sandbox's, and
stopping the sandbox ends them. The resident enforces the command's timeout
and output limit and kills its process group when it ends; in a PID namespace
(`processes_contained`) it also kills, once no command is running, every other
process of the namespace — whatever a command left behind, even outside its
group. Its own CPU limit is not a command's: it lives as long as the run.

Stopping it closes its stdin and waits for its process group to end; only
then is the release confirmed. If Assay dies, the parent-death signal takes
the resident process with it: a resident sandbox never outlives its worker.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import itertools
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from assay.sandbox.port import CommandResult, SandboxError

if TYPE_CHECKING:
    from assay.sandbox.local import LocalSandbox, LocalWorkspace

SEARCH_PATH = "/usr/local/bin:/usr/bin:/bin"
START_TIMEOUT_S = 30.0
"""How long a new generation may take to announce itself."""
PING_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0
ANSWER_GRACE_S = 10.0
"""How long past a command's timeout the resident may take to report it ended."""
OWN_CPU_S = 1 << 30
"""The resident's own CPU limit: it lives as long as the run (commands keep theirs)."""

SERVER = """\
import base64, json, os, resource, signal, subprocess, sys, threading
identity, size, launcher = sys.argv[1], int(sys.argv[2]), sys.argv[3]
contained = sys.argv[4] == "1" and os.getpid() == 2
held = b"\\x01" * size
out = threading.Lock()
state = threading.Lock()
active = {}
RLIMITS = {"cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS, "nproc": resource.RLIMIT_NPROC,
           "fsize": resource.RLIMIT_FSIZE, "nofile": resource.RLIMIT_NOFILE,
           "core": resource.RLIMIT_CORE}
LAUNCH_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}

def send(line):
    with out:
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()

def killpg(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass

def sweep():
    # Whatever commands left behind, once none runs: every process of the namespace
    # but its init and this one (kill -1 spares both). Only in a PID namespace.
    if contained and not active:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass

def drain(stream, cap, into):
    buf, cut = bytearray(), False
    while True:
        chunk = stream.read1(1 << 16)
        if not chunk:
            break
        room = cap - len(buf)
        if room > 0:
            buf += chunk[:room]
        cut = cut or len(chunk) > room
    into.extend((bytes(buf), cut))

def feed(proc, data):
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except OSError:
        pass

def run(req):
    rid, spec, cap = req["id"], req["spec"], req["cap"]
    spec["parent"] = os.getpid()
    for name, value in spec["limits"].items():  # a command gets no more than this has
        hard = resource.getrlimit(RLIMITS[name])[1]
        if hard != resource.RLIM_INFINITY:
            spec["limits"][name] = min(value, hard - 1 if name == "cpu" else hard)
    data = None if req["stdin"] is None else base64.b64decode(req["stdin"])
    fd = os.memfd_create("spec")
    try:
        os.write(fd, json.dumps(spec).encode())
        os.lseek(fd, 0, os.SEEK_SET)
        with state:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", launcher, str(fd)],
                stdin=subprocess.DEVNULL if data is None else subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(fd,), start_new_session=True, env=LAUNCH_ENV,
            )
            active[rid] = proc
    except OSError as exc:
        send(json.dumps({"id": rid, "error": "cannot start the sandbox launcher: " + str(exc)}))
        return
    finally:
        os.close(fd)
    got_out, got_err = [], []
    readers = [threading.Thread(target=drain, args=(proc.stdout, cap, got_out), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, cap, got_err), daemon=True)]
    if data is not None:
        readers.append(threading.Thread(target=feed, args=(proc, data), daemon=True))
    for t in readers:
        t.start()
    timed_out = False
    try:
        proc.wait(req["timeout"])
    except subprocess.TimeoutExpired:
        timed_out = True
    killpg(proc.pid)
    code = proc.wait()
    with state:
        del active[rid]
        sweep()
    for t in readers[:2]:
        t.join(5.0)
    if len(got_out) < 2 or len(got_err) < 2:  # a process left the group and holds the pipes
        got_out, got_err = [b"", True], [b"(output lost: a process escaped)", True]
    send(json.dumps({
        "id": rid, "exit": code, "timed_out": timed_out,
        "stdout": base64.b64encode(got_out[0]).decode(),
        "stderr": base64.b64encode(got_err[0]).decode(),
        "truncated": got_out[1] or got_err[1],
    }))

sys.stdout.write("ready " + identity + "\\n")
sys.stdout.flush()
for line in sys.stdin:
    if line.strip() == "ping":
        send("pong " + identity + " " + str(len(held)))
        continue
    req = json.loads(line)
    if req["op"] == "run":
        threading.Thread(target=run, args=(req,), daemon=True).start()
    elif req["op"] == "kill":
        with state:
            proc = active.get(req["id"])
        if proc is not None:
            killpg(proc.pid)
with state:
    for proc in active.values():
        killpg(proc.pid)
    active.clear()
    sweep()
"""
"""The resident process: fill memory, announce, then serve pings and commands until its
stdin closes (see the module's description; standard library only)."""


@dataclass
class LocalResident:
    """One generation of a run's resident sandbox in the local provider."""

    generation: int
    identity: str
    proc: asyncio.subprocess.Process = field(repr=False)
    on_stop: Callable[[LocalResident], None] | None = field(default=None, repr=False)
    _write: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    _pings: collections.deque[asyncio.Future[str]] = field(
        default_factory=collections.deque, repr=False
    )
    _answers: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict, repr=False)
    _ids: itertools.count[int] = field(default_factory=itertools.count, repr=False)
    _reader: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def up(self) -> bool:
        """Whether its process is still running."""
        return self.proc.returncode is None

    def serve(self) -> None:
        """Start reading its answers (once it announced itself)."""
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            while line := await self.proc.stdout.readline():
                if line.startswith(b"{"):
                    answer = json.loads(line)
                    waiter = self._answers.pop(answer["id"], None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(answer)
                elif self._pings:
                    ping = self._pings.popleft()
                    if not ping.done():
                        ping.set_result(line.decode(errors="replace").strip())
        except (ValueError, KeyError, OSError):
            pass  # a garbled answer: it is not trusted any further
        finally:
            gone = SandboxError(f"resident sandbox {self.identity} is gone")
            waiters: list[asyncio.Future[Any]] = [*self._pings, *self._answers.values()]
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(gone)
            self._pings.clear()
            self._answers.clear()

    async def _send(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        async with self._write:
            try:
                self.proc.stdin.write(line)
                await self.proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise SandboxError(f"resident sandbox {self.identity} is gone") from exc

    async def ping(self) -> str:
        """Its answer to `ping` (`pong <identity> <bytes held>`)."""
        if self._reader is None or self._reader.done():
            raise SandboxError(f"resident sandbox {self.identity} is gone")
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pings.append(waiter)
        await self._send(b"ping\n")
        try:
            return await asyncio.wait_for(waiter, PING_TIMEOUT_S)
        except TimeoutError as exc:
            raise SandboxError(f"resident sandbox {self.identity} did not answer") from exc

    async def run(
        self, spec: dict[str, Any], *, stdin: bytes | None, timeout_s: float, output_bytes: int
    ) -> CommandResult:
        """Run a command (a launcher spec) as a child of the resident process.

        Cancelling the call kills the command's process group.

        Raises:
            SandboxError: the resident is gone, or did not report the command's end
                within `ANSWER_GRACE_S` of its timeout.
        """
        if self._reader is None or self._reader.done():
            raise SandboxError(f"resident sandbox {self.identity} is gone")
        rid = next(self._ids)
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._answers[rid] = waiter
        request = {
            "op": "run",
            "id": rid,
            "spec": spec,
            "stdin": None if stdin is None else base64.b64encode(stdin).decode(),
            "timeout": timeout_s,
            "cap": output_bytes,
        }
        line = await asyncio.to_thread(lambda: json.dumps(request).encode() + b"\n")
        try:
            await self._send(line)
            answer = await asyncio.wait_for(waiter, timeout_s + ANSWER_GRACE_S)
        except BaseException as exc:
            self._answers.pop(rid, None)
            if self.up:  # cancelled, or it did not answer: the command goes
                with contextlib.suppress(SandboxError):
                    await self._send(json.dumps({"op": "kill", "id": rid}).encode() + b"\n")
            if isinstance(exc, TimeoutError):
                raise SandboxError(f"resident sandbox {self.identity} did not answer") from exc
            raise
        if "error" in answer:
            raise SandboxError(str(answer["error"]))
        out = base64.b64decode(answer["stdout"])
        err = base64.b64decode(answer["stderr"])
        return CommandResult(
            exit_code=int(answer["exit"]),
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            timed_out=bool(answer["timed_out"]),
            truncated=bool(answer["truncated"]),
        )

    def memory_bytes(self) -> int:
        """RSS of its process tree (its commands included), from `/proc` (0 once it is gone)."""
        if self.proc.returncode is not None:
            return 0
        return tree_rss_bytes(self.proc.pid)

    async def stop(self) -> None:
        """Close its stdin, wait for it to end (SIGKILL its group after a while)."""
        if self.on_stop is not None:
            self.on_stop(self)  # no command is sent to it from here on
        if self.proc.returncode is None and self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.proc.stdin.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever it left behind
        await self.proc.wait()
        if self._reader is not None:
            await self._reader


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
    contained = "1" if sandbox.capabilities.processes_contained else "0"
    argv = [python, "-I", "-S", "-c", SERVER, identity, str(memory_bytes), sandbox.launcher_source]
    argv.append(contained)
    env = {"PATH": SEARCH_PATH, "HOME": ws.root, "LANG": "C.UTF-8"}
    spec = await asyncio.to_thread(sandbox.launch_spec, argv, env)
    spec["limits"]["cpu"] = OWN_CPU_S
    encoded = json.dumps(spec).encode()
    with tempfile.TemporaryFile() as spec_file:
        spec_file.write(encoded)
        spec_file.flush()
        spec_file.seek(0)
        try:
            proc = await asyncio.create_subprocess_exec(
                *sandbox.launcher_argv(spec_file.fileno()),
                cwd=ws.path,
                env={"PATH": SEARCH_PATH, "LANG": "C.UTF-8"},
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                pass_fds=(spec_file.fileno(),),
                start_new_session=True,
                limit=4 * sandbox.limits.output_bytes + (1 << 16),  # one answer is one line
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
    resident.serve()
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
