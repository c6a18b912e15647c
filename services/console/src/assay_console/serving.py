"""Serving the console: over a running stage's store, in one process with the pipeline
(`assay demo`, `assay console`) or alone (`assay serve console`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.routing import BaseRoute

from assay.bus.embedded import EmbeddedBus
from assay.runtime.embedded import Embedded
from assay.runtime.settings import AssaySettings
from assay.store.ports import EventLog
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.outbox import EmbeddedOutbox, KafkaOutbox, Outbox
from assay_console.reads import ConsoleReads, PostgresRunsTable, SqliteRunsTable
from assay_console.runlog import DataDirRunLog, HttpRunLog, RunLog
from assay_console.stages import HttpStages, ProcessStages, StageStatus

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
    _outbox: Outbox | None = None

    async def aclose(self) -> None:
        """Stop serving and close the read connection (and the console's own producer)."""
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._reads.close()
        if self._outbox is not None:
            await self._outbox.close()


async def start_console(
    log_: EventLog,
    store: Path,
    settings: AssaySettings,
    host: str | None,
    port: int | None,
    bus: EmbeddedBus | None = None,
    process: Embedded | None = None,
) -> RunningConsole:
    """Serve the console over the console stage's SQLite store (`log_`, the file `store`);
    its actions publish onto `bus`, the embedded bus of this process (None: read-only);
    the overview shows the health and lag of the stages `process` runs (None: none).

    `host` and `port` default to `ASSAY_CONSOLE_HOST` / `ASSAY_CONSOLE_PORT`; port 0
    takes any free port (the returned `url` says which).

    Raises:
        AccessInvalid: no token is configured and `host` is not a loopback address.
        OSError: the address cannot be bound.
    """
    outbox = EmbeddedOutbox(bus) if bus is not None else None
    reads = ConsoleReads(log_, SqliteRunsTable(store))
    run_log = DataDirRunLog(store.parent)
    stages = ProcessStages.of(process) if process is not None else None
    return await _serve(reads, settings, host, port, outbox, run_log=run_log, stages=stages)


async def start_distributed(log_: EventLog, settings: AssaySettings) -> RunningConsole:
    """Serve the console beside `assay serve console`, over its Postgres schema, on
    `ASSAY_CONSOLE_HOST:ASSAY_CONSOLE_PORT`; its actions go to `ASSAY_KAFKA_BOOTSTRAP`,
    a run's full log is asked of execute at `ASSAY_CONSOLE_EXECUTE_URL`, and the stages'
    health and lag of the status ports `ASSAY_CONSOLE_STAGE_URLS` names.

    Raises:
        AccessInvalid: no token is configured and the host is not a loopback address.
        OSError: the address cannot be bound.
    """
    settings.require("database.url")
    assert settings.database.url is not None
    table = await PostgresRunsTable.connect(settings.database.url, "console")
    outbox = None
    if settings.kafka.bootstrap:
        outbox = await KafkaOutbox(settings.kafka.bootstrap).open()
    url = settings.console.execute_url
    run_log = HttpRunLog(url) if url else None
    urls = settings.console.stages()
    stages = HttpStages(urls) if urls else None
    reads = ConsoleReads(log_, table)
    running = await _serve(reads, settings, None, None, outbox, run_log=run_log, stages=stages)
    log.warning("console on %s", running.url)
    return running


async def _serve(
    reads: ConsoleReads,
    settings: AssaySettings,
    host: str | None,
    port: int | None,
    outbox: Outbox | None,
    extra: Callable[[Access], Sequence[BaseRoute]] | None = None,
    run_log: RunLog | None = None,
    stages: StageStatus | None = None,
) -> RunningConsole:
    host = host or settings.console.host
    port = settings.console.port if port is None else port
    try:
        c = settings.console
        access = Access.parse(c.tokens, c.admin_token, host, c.session_secret, c.session_ttl_s)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
    except BaseException:
        await reads.close()
        if outbox is not None:
            await outbox.close()
        raise
    app = create_app(reads, access, outbox, settings, run_log, stages)
    if extra is not None:  # ahead of the console's own routes (its /healthz too)
        app.router.routes[:0] = [*extra(access)]
    sock.listen(128)  # connections wait in the backlog until the server accepts them
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    shown = f"[{host}]" if ":" in host else host
    return RunningConsole(f"http://{shown}:{bound}/", access.open, server, task, reads, outbox)
