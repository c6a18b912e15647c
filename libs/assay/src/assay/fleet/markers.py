"""Wait markers for agents that run outside Assay, under `assay fleet record`.

A marker is a reclaimability assertion: while it is open, nothing in the sandbox
needs to run. Do not wrap work that still runs in the sandbox (creating it, a
command in it) because the agent happens to block on it.

    from assay.fleet.markers import wait

    with wait("model"):
        response = call_model()

Markers carry no content: a kind, an edge and the system's monotonic clock. Outside
a recording (no `ASSAY_FLEET_MARKS` in the environment) they do nothing, so an
instrumented agent runs the same anywhere and a marker can never break it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from assay.fleet.trace import WaitKind

KINDS = ("model", "tool", "human")
"""The wait kinds (`WaitKind`'s values; not imported, so that markers stay light)."""
MARKS_ENV = "ASSAY_FLEET_MARKS"
"""Where the recorder tells its command to append marks."""

Edge = Literal["started", "finished"]


def mark(kind: WaitKind | str, edge: Edge) -> bool:
    """Append one mark to the recording this process runs under; False when there is none.

    Raises:
        ValueError: `kind` is not model, tool or human.
    """
    value = kind if isinstance(kind, str) else kind.value
    if value not in KINDS:
        raise ValueError(f"{value!r} is not a wait kind (model, tool, human)")
    path = os.environ.get(MARKS_ENV)
    if not path:
        return False
    line = json.dumps({"t_ns": time.monotonic_ns(), "kind": value, "edge": edge}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # the recorder made it; never create one
    try:
        os.write(fd, line.encode())  # one short append: atomic among writers
    finally:
        os.close(fd)
    return True


@contextmanager
def wait(kind: WaitKind | str) -> Iterator[None]:
    """Mark a wait of `kind` around the block (also when it raises)."""
    mark(kind, "started")
    try:
        yield
    finally:
        mark(kind, "finished")
