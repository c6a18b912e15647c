"""`assay serve-embedded` as a real process for the console's tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

ASSAY = str(Path(sys.executable).parent / "assay")
T = TypeVar("T")


@contextlib.contextmanager
def serve_embedded(data_dir: Path, tokens: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Start `assay serve-embedded --port 0` on `data_dir`; yield its URL and process.
    Killed on the way out if the test did not stop it."""
    env = {**os.environ, "ASSAY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    env["ASSAY_CONSOLE_TOKENS"] = tokens
    proc = subprocess.Popen(
        [ASSAY, "serve-embedded", "--port", "0"], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until it listens and says where
    assert line.startswith(f"serving {data_dir} on http://127.0.0.1:"), line
    try:
        yield line.split()[3], proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def until(found: Callable[[], T | None], proc: subprocess.Popen[str], timeout_s: float) -> T:
    """`found()` once it is not None; the answers come from the process's API."""
    deadline = time.monotonic() + timeout_s
    while (value := found()) is None:
        assert proc.poll() is None, "assay serve-embedded exited"
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s"
        time.sleep(0.2)  # the pipeline folds from its topics: ask the API again
    return value
