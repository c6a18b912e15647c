"""`assay serve-embedded`: every installed stage in one long-running process on the data
directory, until SIGTERM or SIGINT, serving on one port.

With `assay-console` installed that port carries the console's pages and API,
`/metrics`, `/healthz`, `/readyz`, task intake (`POST /api/tasks`) and workflow
registration (`POST /api/workflows`); without it, `/metrics`, `/healthz` and `/readyz`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

from assay.cli.console import CONSOLE_STAGE, CONSOLE_STORE, Running, _entry, console_installed
from assay.runtime.embedded import STAGES, Embedded
from assay.runtime.settings import AssaySettings

log = logging.getLogger(__name__)


async def serve_embedded_command(data_dir: Path, host: str | None, port: int | None) -> int:
    """Run the pipeline and serve it until a signal; print where, once it listens.

    Raises:
        AccessInvalid: no console token is configured and `host` is not loopback.
        DataDirBusy: another process holds the data directory.
        OSError: the address cannot be bound.
    """
    settings = AssaySettings.from_env()
    logging.getLogger().setLevel(settings.log_level.upper())
    with_console = console_installed()
    stages = (*STAGES, CONSOLE_STAGE) if with_console else STAGES
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with (
        Embedded(data_dir, stages=stages, settings=settings) as rt,
        contextlib.AsyncExitStack() as stack,
    ):
        if with_console:
            running: Running = await _entry("embedded")(
                rt, data_dir / CONSOLE_STORE, settings, host, port
            )
            stack.push_async_callback(running.aclose)
            url, note = running.url, " (open: no token configured, loopback only)"
            note = note if running.open else ""
        else:
            status = await rt.serve_status(
                settings.console.port if port is None else port,
                host or settings.console.host,
            )
            stack.push_async_callback(status.close)
            shown = host or settings.console.host
            url, note = f"http://{shown}:{status.port}/", " (metrics and health only)"
        rt.start()
        print(f"serving {data_dir} on {url}{note}", flush=True)
        await stop.wait()
        print("stopping", flush=True)
    return 0
