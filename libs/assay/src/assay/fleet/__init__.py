"""Fleet suspension analysis on lifecycle traces (DESIGN §16).

Pure functions over traces: no file, process or network is touched here except by
the recorder (`assay.fleet.recorder`) and the wait markers (`assay.fleet.markers`),
which are the I/O edge for agents that run outside Assay. The command line
(`assay fleet ...`) reads and writes the files.
"""

from assay.fleet.errors import FleetError
from assay.fleet.simulate import Gates, Policy, SetResult, simulate, simulate_trace
from assay.fleet.trace import (
    TRACE_FORMAT,
    TRACE_VERSION,
    Trace,
    TraceEvent,
    TraceHeader,
    Wait,
    WaitKind,
)
from assay.fleet.validate import Issue, TraceInvalid, parse_trace

__all__ = [
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "FleetError",
    "Gates",
    "Issue",
    "Policy",
    "SetResult",
    "Trace",
    "TraceEvent",
    "TraceHeader",
    "TraceInvalid",
    "Wait",
    "WaitKind",
    "parse_trace",
    "simulate",
    "simulate_trace",
]
