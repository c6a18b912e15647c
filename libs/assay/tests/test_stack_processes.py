"""`assay down` signals a recorded pid only while it still names the process `assay up`
started: a pid the kernel has since given to another process is left alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from assay.devstack.processes import ProcessIdentity, Stop, identify, terminate

ASSAY = str(Path(sys.executable).parent / "assay")

_HOLD_SIGTERM = (
    "import signal, sys, time\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
    "print('ready', flush=True)\n"
    "time.sleep(300)\n"
)
"""A bystander that blocks SIGTERM, so a SIGTERM sent to it stays pending where a test
can see it (`/proc/<pid>/status`) instead of racing with its exit."""


class Processes:
    """Processes a test starts; every one is killed and reaped afterwards."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def sleep(self) -> subprocess.Popen[bytes]:
        """`sleep 300` (Popen returns once it has been exec'd)."""
        proc = subprocess.Popen(["sleep", "300"])
        self.started.append(proc)
        return proc

    def bystander(self) -> subprocess.Popen[bytes]:
        """A process that holds SIGTERM pending; returns once it does."""
        proc = subprocess.Popen([sys.executable, "-c", _HOLD_SIGTERM], stdout=subprocess.PIPE)
        self.started.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        return proc


@pytest.fixture
def processes() -> Iterator[Processes]:
    procs = Processes()
    yield procs
    for proc in procs.started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def pending_signals(pid: int) -> int:
    """The signals sent to `pid` and not yet delivered (thread's and process's)."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


def test_identify_reads_a_live_process_and_not_an_exited_one() -> None:
    me = identify(os.getpid())
    assert me is not None
    assert me.pid == os.getpid()
    assert me.cmdline == tuple(
        a.decode() for a in Path("/proc/self/cmdline").read_bytes().split(b"\0")[:-1]
    )
    assert ProcessIdentity.from_json(json.loads(json.dumps(me.to_json()))) == me

    done = subprocess.Popen(["true"])
    os.waitid(os.P_PID, done.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    try:
        assert identify(done.pid) is None
    finally:
        done.wait()


def test_terminate_stops_the_recorded_process(processes: Processes) -> None:
    proc = processes.sleep()
    recorded = identify(proc.pid)
    assert recorded is not None
    assert recorded.cmdline == ("sleep", "300")

    outcome, _ = terminate(recorded)

    assert outcome is Stop.STOPPED
    assert proc.wait(timeout=5) == -signal.SIGTERM


def test_terminate_leaves_a_pid_that_names_another_process_alone(processes: Processes) -> None:
    proc = processes.bystander()
    now = identify(proc.pid)
    assert now is not None
    earlier = ProcessIdentity(proc.pid, now.start_ticks - 1, ("assay", "serve"), now.boot_id)

    outcome, line = terminate(earlier)

    assert outcome is Stop.NOT_OURS
    assert f"pid {proc.pid} is now another process" in line
    assert proc.poll() is None
    assert pending_signals(proc.pid) == 0


def test_down_signals_only_the_processes_up_started(processes: Processes, tmp_path: Path) -> None:
    ours = processes.sleep()
    reused = processes.bystander()  # has the pid a stage had when `up` recorded it
    unrecorded = processes.bystander()  # recorded by an `up` that kept no identities
    ours_id = identify(ours.pid)
    reused_now = identify(reused.pid)
    assert ours_id is not None
    assert reused_now is not None
    stage_before = ProcessIdentity(
        reused.pid,
        reused_now.start_ticks - 100,
        (sys.executable, ASSAY, "serve", "execute"),
        reused_now.boot_id,
    )
    (tmp_path / "stack.json").write_text(
        json.dumps(
            {
                "stages": {
                    "execute": {"pid": reused.pid, "process": stage_before.to_json()},
                    "verify": {"pid": ours.pid, "process": ours_id.to_json()},
                },
                "infra": {
                    "kafka": {"address": "127.0.0.1:1", "pid": unrecorded.pid},
                    "postgres": {"address": "postgresql://x", "pid": None, "process": None},
                },
            }
        )
    )

    down = subprocess.run(
        [ASSAY, "down", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=60
    )

    assert down.returncode == 0, down.stderr
    assert f"execute: pid {reused.pid} is now another process" in down.stdout
    assert f"kafka: pid {unrecorded.pid} was recorded without its identity" in down.stdout
    assert ours.wait(timeout=5) == -signal.SIGTERM
    for bystander in (reused, unrecorded):
        assert bystander.poll() is None
        assert pending_signals(bystander.pid) == 0, "down signalled a process it did not start"
    assert not (tmp_path / "stack.json").exists()


def _fake_proc(root: Path, pid: int, flags: int) -> Path:
    """A `/proc` with one process of `flags` (stat field 9) and no command line yet."""
    proc = root / str(pid)
    proc.mkdir(parents=True)
    # fields 3.. : state, ppid, pgrp, session, tty, tpgid, flags, ..., starttime (22)
    after = ["S", "1", "1", "1", "0", "-1", str(flags)] + ["0"] * 12 + ["4242"] + ["0"] * 10
    (proc / "stat").write_text(f"{pid} (sle ep) " + " ".join(after) + "\n")
    (proc / "cmdline").write_bytes(b"")
    boot = root / "sys/kernel/random"
    boot.mkdir(parents=True)
    (boot / "boot_id").write_text("b00t\n")
    return proc


def test_a_process_caught_mid_exec_is_identified_with_its_new_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after `Popen` returns, the child may still be inside `execve` with no
    arguments mapped: identifying it then must not record an empty command line, which
    `assay down` would later find changed and so never stop the process."""
    import threading

    from assay.devstack import processes as module

    proc = _fake_proc(tmp_path, 77, flags=0x400000)
    monkeypatch.setattr(module, "_PROC", tmp_path)
    monkeypatch.setattr(module, "_BOOT_ID", tmp_path / "sys/kernel/random/boot_id")
    exec_done = threading.Timer(0.05, (proc / "cmdline").write_bytes, [b"sleep\x00300\x00"])
    exec_done.start()
    try:
        found = identify(77, exec_wait_s=30)
    finally:
        exec_done.join()
    assert found == ProcessIdentity(77, 4242, ("sleep", "300"), "b00t")


def test_a_kernel_thread_has_no_command_line_and_is_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from assay.devstack import processes as module

    _fake_proc(tmp_path, 2, flags=0x00200000)
    monkeypatch.setattr(module, "_PROC", tmp_path)
    monkeypatch.setattr(module, "_BOOT_ID", tmp_path / "sys/kernel/random/boot_id")
    found = identify(2, exec_wait_s=60)  # the test's timeout fails it if this waits
    assert found == ProcessIdentity(2, 4242, (), "b00t")
