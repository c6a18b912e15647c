"""`assay console` and `assay runs list`: the operator console over an embedded data
directory, and its runs list on the command line.

The console is the `assay-console` distribution; the library finds it through the
`assay.console` entry-point group (it never imports a service).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from assay.kernel.errors import AssayError
from assay.runtime.settings import AssaySettings
from assay.store.ports import EventLog

if TYPE_CHECKING:
    from assay.bus.embedded import EmbeddedBus
    from assay.runtime.embedded import Embedded

CONSOLE_STAGE = "console"
CONSOLE_STORE = "console.sqlite"


class ConsoleMissing(AssayError):
    """The console is not installed, or a data directory holds no console store."""


class Running(Protocol):
    """A console being served."""

    url: str
    open: bool

    async def aclose(self) -> None:
        """Stop serving."""
        ...


Starter = Callable[
    [
        EventLog,
        Path,
        AssaySettings,
        str | None,
        int | None,
        "EmbeddedBus | None",
        "Embedded | None",
    ],
    Awaitable[Running],
]


def _entry(name: str) -> Any:
    found = [ep for ep in entry_points(group="assay.console") if ep.name == name]
    if not found:
        raise ConsoleMissing("the console is not installed (install assay-console)")
    return found[0].load()


def console_installed() -> bool:
    """Whether the `assay-console` distribution is installed."""
    return any(ep.name == "start" for ep in entry_points(group="assay.console"))


async def start_console(
    log: EventLog,
    data_dir: Path,
    settings: AssaySettings,
    host: str | None,
    port: int | None,
    bus: EmbeddedBus | None = None,
    process: Embedded | None = None,
) -> Running:
    """Serve the console over the console stage's store in `data_dir`; its actions
    publish onto `bus` (the process's embedded bus; None: a read-only console); its
    overview shows the health and lag of the stages `process` runs (None: none).

    Raises:
        ConsoleMissing: `assay-console` is not installed.
        AccessInvalid: no token is configured and `host` is not loopback.
        OSError: the address cannot be bound.
    """
    starter: Starter = _entry("start")
    return await starter(log, data_dir / CONSOLE_STORE, settings, host, port, bus, process)


def announce(running: Running) -> None:
    """Print where the console is, and whether it is open without a token."""
    note = " (open: no token configured, loopback only)" if running.open else ""
    print(f"console on {running.url}{note}", flush=True)


async def console_command(data_dir: Path, host: str | None, port: int | None) -> int:
    """Fold the data directory's topics into the console's store and serve it until
    interrupted (SIGINT or SIGTERM)."""
    from assay.runtime.embedded import Embedded

    settings = AssaySettings.from_env()
    async with Embedded(data_dir, stages=(CONSOLE_STAGE,), settings=settings) as rt:
        rt.start()
        running = await start_console(
            rt.logs[CONSOLE_STAGE], data_dir, settings, host, port, rt.bus, rt
        )
        announce(running)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await running.aclose()
    return 0


async def runs_list_command(
    data_dir: Path, tenant: str | None, query: dict[str, str], as_json: bool
) -> int:
    """Print one page of the runs list, as the console's API gives it."""
    store = data_dir / CONSOLE_STORE
    if not store.exists():
        raise ConsoleMissing(
            f"{data_dir} holds no console store: run `assay demo` or `assay console` first"
        )
    page: dict[str, Any] = await _entry("runs")(store, tenant, query)
    if as_json:
        print(json.dumps(page, indent=2, sort_keys=True))
        return 0
    cols = ("run_id", "created_at", "workflow_id", "idempotency_key", "state", "passed", "status")
    rows = [[_cell(r.get(c)) for c in cols] for r in page["runs"]]
    widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(cols)]
    for row in [list(cols), *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    if page.get("next_cursor"):
        print(f"more: --cursor {page['next_cursor']}")
    return 0


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "passed" if value else "failed"
    return str(value).replace("\n", " ")[:40]
