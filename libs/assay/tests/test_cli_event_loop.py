"""Which event loop `assay` runs a command on (`assay.cli._run`)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from assay.cli import _run

uvloop = pytest.importorskip("uvloop")


async def loop_type() -> int:
    return 1 if isinstance(asyncio.get_running_loop(), uvloop.Loop) else 0


def test_a_stage_process_runs_on_uvloop_and_other_commands_on_asyncio() -> None:
    assert _run(argparse.Namespace(command="serve"), loop_type()) == 1
    assert _run(argparse.Namespace(command="run"), loop_type()) == 0
