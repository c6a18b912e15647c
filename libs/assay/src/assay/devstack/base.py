"""What every local service launcher shares."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from assay.kernel.errors import AssayError

T = TypeVar("T")


class InfraUnavailable(AssayError):
    """A service could not be found or started here."""


@dataclass
class Service:
    """A running (or borrowed) service: its address, and the process if we started it."""

    name: str
    address: str
    process: subprocess.Popen[bytes] | None = None
    stop_hook: Callable[[], None] | None = None
    details: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        """Pid of the process we started, if any."""
        return self.process.pid if self.process is not None else None

    def stop(self) -> None:
        """Stop what we started (a borrowed service is left alone)."""
        if self.stop_hook is not None:
            self.stop_hook()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def run_apart(coro: Coroutine[object, object, T]) -> T:
    """Run a coroutine to completion on a fresh loop on a helper thread.

    For synchronous code (fixtures, teardown, probes) that may itself be called
    from inside a running event loop, where `asyncio.run` would refuse.
    """
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_for_port(
    host: str, port: int, timeout_s: float, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Block until host:port accepts connections; raise `InfraUnavailable` on timeout or
    when the process we are waiting for exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_open(host, port, 0.2):
            return
        if process is not None and process.poll() is not None:
            raise InfraUnavailable(f"process {process.args!r} exited with {process.returncode}")
        time.sleep(0.05)
    raise InfraUnavailable(f"nothing listens on {host}:{port} after {timeout_s}s")


def docker_available(timeout_s: float = 0.5) -> bool:
    """Whether a Docker engine answers a ping right now (fast: never waits long)."""
    sock = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not sock.startswith("unix://"):
        host, _, port = sock.split("://", 1)[-1].partition(":")
        return port_open(host, int(port or 2375), timeout_s)
    path = Path(sock.removeprefix("unix://"))
    if not path.exists():
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(path))
            s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b"OK" in s.recv(256)
    except OSError:
        return False


def log_file(workdir: Path, name: str) -> Path:
    """Where a started service writes its output."""
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir / f"{name}.log"
