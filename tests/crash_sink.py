"""Tools of the crash-point tests, and the effect sink they write to.

Installed into the processes under test as a distribution with `assay.tools`
entry points (see `install_sink_tools`), so the stages load them exactly as
they load a user's tools. Every call that takes effect appends one JSON line to
the file named by `CRASH_SINK_PATH` and fsyncs it before returning: the sink is
the outside world's record of what happened, independent of Assay's own logs.

- `sink_price` is `Pure`: the amount to charge for an item.
- `sink_put` is `Idempotent(key=("item",))`: a store that deduplicates on the
  kernel's idempotency key — every call is recorded with its key, and
  `applied` says whether it was the first with that key (the effect).
- `sink_charge` is `Unsafe`: a charge with no way to deduplicate or ask.

`sink_price` passes `execute.tool.sink_price.during` (a Pure call under way, its
attempt not yet on record); both effectful tools pass crash points
`execute.tool.<tool>.before_effect` (dispatched, nothing done yet) and
`execute.tool.<tool>.after_effect` (the effect landed, its outcome not yet committed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from assay.crash import crash_point
from assay.engine.tools import Idempotent, Pure, Tool, ToolCall, ToolError, Unsafe

SINK_ENV = "CRASH_SINK_PATH"
MODULE = "assay_crash_sink"
"""The module name the tools are installed under in the processes under test."""


def _sink() -> Path:
    path = os.environ.get(SINK_ENV)
    if not path:
        raise ToolError(f"{SINK_ENV} is not set")
    return Path(path)


def read_sink(path: Path) -> list[dict[str, Any]]:
    """Every recorded call, in order (an empty list when nothing was recorded)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _record(entry: dict[str, Any]) -> None:
    fd = os.open(_sink(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _identity(call: ToolCall) -> dict[str, Any]:
    return {
        "tenant": str(call.tenant),
        "run": str(call.run_id),
        "step": call.step,
        "attempt": int(call.attempt),
        "request_id": call.request_id,
    }


async def _price(call: ToolCall) -> str:
    crash_point("execute.tool.sink_price.during")  # mid-call of a Pure step: nothing recorded
    return str(len(call.args["item"]) * 10)


async def _put(call: ToolCall) -> str:
    key = call.require_key()
    crash_point("execute.tool.sink_put.before_effect")
    applied = all(e.get("key") != key for e in read_sink(_sink()))
    _record({"tool": "sink_put", "key": key, "applied": applied, **_identity(call)})
    crash_point("execute.tool.sink_put.after_effect")
    return f"stored {call.args['item']}"


async def _charge(call: ToolCall) -> str:
    crash_point("execute.tool.sink_charge.before_effect")
    _record({"tool": "sink_charge", "amount": call.args["amount"], **_identity(call)})
    crash_point("execute.tool.sink_charge.after_effect")
    return f"charged {call.args['amount']}"


def tools() -> list[Tool]:
    """The three tools (the `assay.tools` entry point)."""
    return [
        Tool("sink_price", _price, Pure(), "The price of `item`."),
        Tool("sink_put", _put, Idempotent(key=("item",)), "Stores `item`, once per key."),
        Tool("sink_charge", _charge, Unsafe(), "Charges `amount`; never safe to repeat."),
    ]


def install_sink_tools(site: Path) -> Path:
    """Make `site` hold this module as an installed distribution; return `site`.

    Put `site` on a process's PYTHONPATH and its `load_tools()` finds the tools.
    """
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{MODULE}.py").write_text(Path(__file__).read_text())
    dist = site / f"{MODULE}-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {MODULE}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[assay.tools]\ncrash_sink = {MODULE}:tools\n")
    return site
