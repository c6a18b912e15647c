"""`assay` processes for the crash-point tests, forked from a server that imported Assay once.

Each crash point costs two process starts (the one that dies, the one that
recovers), and importing Assay takes about a second — most of a test. The
processes are therefore forked from a `multiprocessing` fork server that has
imported the command line once: each is still its own OS process, killed by
SIGKILL and recovered by a new process from what is on disk, but it starts in
a tenth of the time. The server forks before any event loop, thread or
connection exists, so a child inherits nothing but imported modules.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing.context import ForkServerContext, ForkServerProcess
from pathlib import Path

PRELOAD = [
    "assay.cli",
    "assay.cli.demo",
    "assay.cli.distributed",
    "assay.runtime.distributed",
    "assay.runtime.embedded",
    # Imported by assay on first use, not with the modules above: each stage when its
    # factory is called, the libraries when a workflow is read or a verdict computed.
    "assay_ingest",
    "assay_execute",
    "assay_verify",
    "assay_tournament",
    "assay_aggregate",
    "assay_decide",
    "assay.messages.registry",
    "jsonschema",
    "numpy",
    "yaml",
    "tests.crash_processes",
]


def _context() -> ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    assert isinstance(ctx, ForkServerContext)
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _main(argv: list[str], env: dict[str, str], output: str, site: str) -> None:
    """In the child: become `assay ARGV` with exactly `env`, writing to `output`."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.path.insert(0, site)  # where the tools' distribution is installed
    from assay.cli import main

    main(argv)


def start_assay(
    argv: list[str], env: dict[str, str], output: Path, site: Path
) -> ForkServerProcess:
    """Start `assay ARGV` as a new process; its stdout and stderr go to `output`.

    `exitcode` of the returned process is `-signal.SIGKILL` when a crash point killed it.
    """
    proc = _context().Process(
        target=_main, args=(argv, env, str(output), str(site)), name=f"assay {argv[0]}"
    )
    proc.start()
    return proc


def stop(proc: ForkServerProcess, timeout_s: float = 30) -> None:
    """SIGTERM (a clean stop), then SIGKILL if it does not end in time."""
    if proc.exitcode is None:
        proc.terminate()
        proc.join(timeout_s)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
