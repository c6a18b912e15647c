"""Serving the console: over a running stage's store, in one process with the pipeline
(`assay demo`, `assay console`) or alone (`assay serve console`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from assay.runtime.settings import AssaySettings
from assay.store.ports import EventLog
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.reads import ConsoleReads, PostgresRunsTable, SqliteRunsTable

log = logging.getLogger(__name__)


@dataclass
class RunningConsole:
    """A console being served: its address, and how to stop it."""

    url: str
    open: bool
    """No token is configured: every request acts as the administrator (loopback only)."""
    _server: uvicorn.Server
    _task: asyncio.Task[None]
    _reads: ConsoleReads

    async def aclose(self) -> None:
        """Stop serving and close the read connection."""
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._reads.close()


async def start_console(
    log_: EventLog, store: Path, settings: AssaySettings, host: str | None, port: int | None
) -> RunningConsole:
    """Serve the console over the console stage's SQLite store (`log_`, the file `store`).

    `host` and `port` default to `ASSAY_CONSOLE_HOST` / `ASSAY_CONSOLE_PORT`; port 0
    takes any free port (the returned `url` says which).

    Raises:
        AccessInvalid: no token is configured and `host` is not a loopback address.
        OSError: the address cannot be bound.
    """
    return await _serve(ConsoleReads(log_, SqliteRunsTable(store)), settings, host, port)


async def start_distributed(log_: EventLog, settings: AssaySettings) -> RunningConsole:
    """Serve the console beside `assay serve console`, over its Postgres schema, on
    `ASSAY_CONSOLE_HOST:ASSAY_CONSOLE_PORT`.

    Raises:
        AccessInvalid: no token is configured and the host is not a loopback address.
        OSError: the address cannot be bound.
    """
    settings.require("database.url")
    assert settings.database.url is not None
    table = await PostgresRunsTable.connect(settings.database.url, "console")
    running = await _serve(ConsoleReads(log_, table), settings, None, None)
    log.warning("console on %s", running.url)
    return running


async def _serve(
    reads: ConsoleReads, settings: AssaySettings, host: str | None, port: int | None
) -> RunningConsole:
    host = host or settings.console.host
    port = settings.console.port if port is None else port
    try:
        access = Access.parse(settings.console.tokens, settings.console.admin_token, host)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
    except BaseException:
        await reads.close()
        raise
    app = create_app(reads, access)
    sock.listen(128)  # connections wait in the backlog until the server accepts them
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    shown = f"[{host}]" if ":" in host else host
    return RunningConsole(f"http://{shown}:{bound}/", access.open, server, task, reads)
