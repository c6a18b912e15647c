"""Loaded by every stage process the pipeline bench starts with `ASSAY_BENCH_PROFILE`
set (`bench/pipeline.py` puts this directory on `PYTHONPATH`): profiles the whole
process with cProfile on CPU time (`time.process_time`: time spent waiting, for the
broker, Postgres or S3, or for work, is not counted) and writes
`<ASSAY_BENCH_PROFILE>/<stage>-<pid>.pstats` at exit. Read one with
`python -m pstats`, or `bench/profiling/top.py`."""

from __future__ import annotations

import atexit
import cProfile
import os
import sys
import time
from pathlib import Path

_OUT = os.environ.get("ASSAY_BENCH_PROFILE")

if _OUT and "serve" in sys.argv:
    _profiler = cProfile.Profile(time.process_time)
    _profiler.enable()

    def _write(out: str = _OUT) -> None:
        _profiler.disable()
        name = "-".join(sys.argv[sys.argv.index("serve") + 1 :]) or "serve"
        Path(out).mkdir(parents=True, exist_ok=True)
        _profiler.dump_stats(str(Path(out) / f"{name}-{os.getpid()}.pstats"))

    atexit.register(_write)
