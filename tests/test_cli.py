"""The `assay` command as a user runs it: JSON on success, one error line and exit 2.

Every invocation is a real subprocess of the installed console script, started
from a scratch working directory. They are launched together once per module
(each with its own data directory) and each test checks one of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from assay.bus import FileLock

ROOT = Path(__file__).resolve().parents[1]
ARITH_V2 = ROOT / "examples" / "workflows" / "arith-v2.yaml"
ASSAY = Path(sys.executable).parent / "assay"
TASK = '{"question": "2 + 3", "answer": "5"}'
TENANT = "6f1c2b9e-8d0a-4c4e-9a57-0e1d2c3b4a59"
BT_ROWS = "a,b,winner\nx,y,a\ny,x,draw\nx,z,b\nz,y,a\ny,z,a\nz,x,draw\n"


@dataclass(frozen=True)
class Runs:
    """Finished invocations by case name, and the directory they ran in."""

    root: Path
    done: dict[str, subprocess.CompletedProcess[str]]

    def data(self, case: str) -> Path:
        return self.root / case / "data"

    def __getitem__(self, case: str) -> subprocess.CompletedProcess[str]:
        return self.done[case]


def _cases(root: Path) -> dict[str, list[str]]:
    """Each case's arguments (before `--data-dir` is added), writing the files it needs."""
    broken = root / "broken.yaml"
    broken.write_text("id: arith\nsteps: [\n  {id: solve, kind: model\n")
    dupes = root / "dupes.yaml"
    dupes.write_text(
        "id: arith\nsteps:\n"
        "  - {id: solve, kind: model, prompt: a}\n"
        "  - {id: solve, kind: model, prompt: b}\n"
    )
    toml = root / "arith.toml"
    toml.write_text('id = "arith"\n')
    bad_tasks = root / "bad-tasks.jsonl"
    bad_tasks.write_text(
        '{"idempotency_key": "a", "input": {"question": "1 + 1", "answer": "2"}}\n'
        "\n"
        '{"idempotency_key": "b", "input": \n'
    )
    no_input = root / "no-input.jsonl"
    no_input.write_text('{"idempotency_key": "a"}\n')
    awaits = root / "awaits.yaml"
    awaits.write_text(
        "id: approve\nsteps:\n"
        "  - {id: child, kind: subworkflow, workflow: other, version: latest}\n"
        "  - {id: x, kind: tool, tool: strip, args: {text: a}}\n"
    )
    (root / "rebuild_empty" / "data").mkdir(parents=True)
    rows = root / "rows.csv"
    rows.write_text(BT_ROWS)
    counts = root / "counts.csv"
    counts.write_text(
        "a,b,a_wins,b_wins,draws\nx,y,3,1,1\ny,z,2,2,0\nx,z,1,2,0\n",
    )
    bad_row = root / "bad-row.csv"
    bad_row.write_text("a,b,winner\nx,y,a\nx,y,x\n")
    separated = root / "separated.csv"
    separated.write_text("x,y,a\nx,z,a\ny,z,b\nz,y,a\n")
    v2 = str(ARITH_V2)
    return {
        "run_ok": ["run", v2, "--input", TASK],
        "run_wrong": ["run", v2, "--input", '{"question": "2 + 3", "answer": "-1000"}'],
        "broken_yaml": ["run", str(broken), "--input", TASK],
        "duplicate_steps": ["run", str(dupes), "--input", TASK],
        "unknown_extension": ["run", str(toml), "--input", TASK],
        "missing_file": ["run", str(root / "missing.yaml"), "--input", TASK],
        "input_not_json": ["run", v2, "--input", "{question: 2 + 3}"],
        "input_list": ["run", v2, "--input", '["2 + 3", "5"]'],
        "rebuild_empty": ["rebuild", "--check"],
        "rebuild_live": ["rebuild", "--database-url", "postgresql://postgres@127.0.0.1:9/x"],
        "rebuild_bad_stage": ["rebuild", "--check", "--stage", "judge"],
        "runs_show_unknown": ["runs", "show", "01NOSUCHRUN0000000000000000"],
        "demo_bad_tasks": ["demo", "--tasks", str(bad_tasks), "--no-progress"],
        "demo_no_input": ["demo", "--tasks", str(no_input), "--no-progress"],
        "demo_busy": ["demo", "--limit", "1", "--no-progress"],
        "demo_bad_sprt": ["demo", "--p1", "0.4", "--no-progress"],
        "cancel_bad_run": [
            "cancel",
            "not-a-run",
            "--tenant",
            "6f1c2b9e-8d0a-4c4e-9a57-0e1d2c3b4a59",
        ],
        "run_await": ["run", str(awaits), "--input", TASK],
        "health_empty": ["grade", "health"],
        "health_bad_tenant": ["grade", "health", "--tenant", "acme"],
        "ladder_empty": ["ladder"],
        "ladder_bad_tenant": ["ladder", "--tenant", "acme"],
        "demo_one_workflow": ["demo", "--workflows", v2, "--no-progress"],
        "demo_bad_ladder": ["demo", "--no-progress"],
        "register_bad_parent": ["register", v2, "--tenant", TENANT, "--parent", "v1"],
        "bt_rows": ["grade", "bt", "--input", str(rows)],
        "bt_counts": ["grade", "bt", "--input", str(counts), "--anchor", "y", "--ties", "davidson"],
        "bt_missing": ["grade", "bt", "--input", str(root / "missing.csv")],
        "bt_bad_row": ["grade", "bt", "--input", str(bad_row)],
        "bt_unknown_anchor": ["grade", "bt", "--input", str(rows), "--anchor", "nobody"],
        "bt_separated": ["grade", "bt", "--input", str(separated), "--prior-precision", "0"],
        "sprt": ["grade", "sprt", "--simulate-p", "0.7", "--reps", "4000", "--seed", "1"],
        "sprt_wald": ["grade", "sprt", "--simulate-p", "0.5", "--reps", "2000", "--wald"],
        "sprt_bad": ["grade", "sprt", "--simulate-p", "0.6", "--p1", "0.4"],
    }


CASE_ENV = {
    "demo_bad_ladder": {"ASSAY_LADDER_TRIAL_SHARE": "2"},
    "register_bad_parent": {"ASSAY_KAFKA_BOOTSTRAP": "127.0.0.1:9"},
}
"""Variables set for one case only."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("cli")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSAY_")}
    cases = _cases(root)
    held = FileLock(root / "demo_busy" / "data" / "assay.lock")  # another process's data dir
    assert held.try_acquire()
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, args in cases.items():
            cwd = root / name
            cwd.mkdir(exist_ok=True)
            procs[name] = subprocess.Popen(
                [str(ASSAY), "--data-dir", str(cwd / "data"), *args],
                cwd=cwd,
                env={**env, **CASE_ENV.get(name, {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        done = {}
        for name, p in procs.items():
            out, err = p.communicate(timeout=120)
            done[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        held.release()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return Runs(root, done)


def assert_usage_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit code 2, one `assay: error:` line on stderr naming the problem, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("assay: error: "), line
    for needle in needles:
        assert needle in line, line
    assert proc.stdout == ""
    return line


def test_console_script_is_installed() -> None:
    assert ASSAY.is_file(), f"no console script at {ASSAY}"


# -- assay run -----------------------------------------------------------------------------


def test_run_prints_the_episode_and_exits_by_verification(runs: Runs) -> None:
    proc = runs["run_ok"]
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)
    assert proc.returncode == (0 if doc["passed"] else 1), proc.stderr
    episode = doc["episode"]
    assert episode["input"] == json.loads(TASK)
    assert episode["run"]["workflow_id"] == "arith"
    assert episode["attempts"][-1]["step"] == "answer"
    assert {v["verifier"] for v in doc["verification"]} == {"correct", "integer"}
    assert doc["passed"] == (episode["succeeded"] and all(v["passed"] for v in doc["verification"]))
    ref = doc["episode_ref"]
    tenant = episode["run"]["tenant"]
    assert (runs.data("run_ok") / "blobs" / tenant / ref[:2] / ref).is_file()
    assert not (runs.root / "run_ok" / "assay-data").exists()  # --data-dir is honoured


def test_run_that_fails_verification_exits_1(runs: Runs) -> None:
    proc = runs["run_wrong"]
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["passed"] is False
    (correct,) = [v for v in doc["verification"] if v["verifier"] == "correct"]
    assert correct["passed"] is False
    assert "-1000" in correct["evidence"]


def test_run_with_broken_yaml_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["broken_yaml"], str(runs.root / "broken.yaml"), "not valid YAML")


def test_run_with_an_invalid_workflow_names_the_check(runs: Runs) -> None:
    assert_usage_error(runs["duplicate_steps"], "duplicate step ids ['solve']")


def test_run_with_an_unknown_extension_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["unknown_extension"], "no workflow format handles '.toml' files")


def test_run_with_a_missing_workflow_file_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["missing_file"], str(runs.root / "missing.yaml"), "No such file")


def test_run_with_input_that_is_not_json_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["input_not_json"], "--input is not JSON")


def test_run_with_input_that_is_a_json_list_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["input_list"], "--input must be a JSON object")


# -- assay rebuild -------------------------------------------------------------------------


def test_rebuild_check_on_an_empty_data_dir_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["rebuild_empty"], "no stage stores", str(runs.data("rebuild_empty")))


def test_rebuild_of_a_distributed_deployment_only_checks(runs: Runs) -> None:
    """Re-folding a live deployment's state in place is refused before connecting."""
    assert_usage_error(runs["rebuild_live"], "only checked, never rebuilt in place")


def test_rebuild_of_an_unknown_stage_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["rebuild_bad_stage"], "no such stage: judge")


# -- assay runs show ------------------------------------------------------------------------


def test_runs_show_renders_a_run_of_assay_run_from_its_log(runs: Runs) -> None:
    run_id = json.loads(runs["run_ok"].stdout)["episode"]["run"]["run_id"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSAY_")}
    data = str(runs.data("run_ok"))
    proc = subprocess.run(
        [str(ASSAY), "--data-dir", data, "runs", "show", run_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"run {run_id}  tenant ")
    assert "\nbranch 0 (live)  succeeded  started " in proc.stdout
    assert "\n  step solve\n    attempt 1  succeeded" in proc.stdout


def test_runs_show_of_an_unknown_run_is_one_line(runs: Runs) -> None:
    assert_usage_error(
        runs["runs_show_unknown"],
        "no run 01NOSUCHRUN0000000000000000",
        str(runs.data("runs_show_unknown")),
    )


# -- assay demo ----------------------------------------------------------------------------


def test_demo_with_a_malformed_task_file_is_one_line(runs: Runs) -> None:
    tasks = runs.root / "bad-tasks.jsonl"
    assert_usage_error(runs["demo_bad_tasks"], f"{tasks}:3", "not a task line")
    assert not runs.data("demo_bad_tasks").exists()  # refused before anything was written


def test_demo_with_a_task_line_missing_its_input_is_one_line(runs: Runs) -> None:
    tasks = runs.root / "no-input.jsonl"
    assert_usage_error(runs["demo_no_input"], f"{tasks}:1", "not a task line")


def test_demo_on_a_data_dir_held_by_another_process_is_one_line(runs: Runs) -> None:
    data = runs.data("demo_busy")
    assert_usage_error(runs["demo_busy"], str(data), "in use by another Assay process")
    assert not (data / "bus.sqlite").exists()  # it touched nothing


def test_demo_with_an_inconsistent_sprt_policy_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["demo_bad_sprt"], "invalid SPRT policy", "p1 must exceed p0")


def test_demo_with_one_workflow_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["demo_one_workflow"], "--workflows takes the current version")


def test_demo_with_a_bad_ladder_setting_names_the_variable(runs: Runs) -> None:
    assert_usage_error(runs["demo_bad_ladder"], "ASSAY_LADDER_TRIAL_SHARE='2'", "less than 1")
    assert not (runs.data("demo_bad_ladder") / "bus.sqlite").exists()


def test_register_with_a_parent_that_is_not_a_version_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["register_bad_parent"], "--parent", "parents.0")


def test_cancel_of_something_that_is_not_a_run_id_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["cancel_bad_run"], "not a run id", "not-a-run")


def test_run_of_a_workflow_with_a_subworkflow_step_says_where_it_runs(runs: Runs) -> None:
    assert_usage_error(runs["run_await"], "sub-workflow steps", "run it in the pipeline")


# -- assay grade health -------------------------------------------------------------------------


def test_grade_health_where_nothing_was_graded_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs.done["health_empty"], "no tournament state", "nothing was graded")


def test_grade_health_with_a_tenant_that_is_not_a_uuid_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs.done["health_bad_tenant"], "--tenant must be a UUID")


# -- assay ladder ------------------------------------------------------------------------------


def test_ladder_where_no_workflow_was_registered_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs.done["ladder_empty"], "no decide state", "no workflow was registered")


def test_ladder_with_a_tenant_that_is_not_a_uuid_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs.done["ladder_bad_tenant"], "--tenant must be a UUID")


# -- assay grade -------------------------------------------------------------------------------


def strengths(proc: subprocess.CompletedProcess[str]) -> dict[str, dict[str, object]]:
    """The `grade bt` document: exactly name -> {strength, se, interval}."""
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, dict[str, object]] = json.loads(proc.stdout)
    for entry in doc.values():
        assert set(entry) == {"strength", "se", "interval"}
    return doc


def test_grade_bt_prints_strengths_against_the_first_player(runs: Runs) -> None:
    doc = strengths(runs["bt_rows"])
    assert list(doc) == ["x", "y", "z"]
    assert doc["x"] == {"strength": 0.0, "se": 0.0, "interval": [0.0, 0.0]}
    assert "tie parameter" in runs["bt_rows"].stderr
    assert "6 comparisons" in runs["bt_rows"].stderr


def test_grade_bt_reads_counts_and_pins_the_named_anchor(runs: Runs) -> None:
    doc = strengths(runs["bt_counts"])
    assert doc["y"]["strength"] == 0.0
    assert "anchor y" in runs["bt_counts"].stderr


def test_grade_bt_reads_stdin(runs: Runs) -> None:
    proc = subprocess.run(
        [str(ASSAY), "grade", "bt", "--input", "-"],
        input=BT_ROWS,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert strengths(proc) == strengths(runs["bt_rows"])


def test_grade_bt_of_a_missing_file_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["bt_missing"], "cannot read", "missing.csv")


def test_grade_bt_names_the_line_of_a_malformed_row(runs: Runs) -> None:
    assert_usage_error(runs["bt_bad_row"], "bad-row.csv:3", "winner must be a, b or draw")


def test_grade_bt_with_an_unknown_anchor_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["bt_unknown_anchor"], "unknown anchor 'nobody'")


def test_grade_bt_of_separated_data_without_a_prior_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["bt_separated"], "'x' won every comparison", "prior_precision > 0")


def test_grade_sprt_prints_the_cost_beside_the_fixed_n_test(runs: Runs) -> None:
    proc = runs["sprt"]
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["fixed_n"] == 67
    assert doc["ratio"] == pytest.approx(doc["simulated"]["mean_n"] / 67)
    assert doc["ratio"] < 0.55
    assert set(doc["simulated"]["quantiles"]) == {"p50", "p90", "p99"}
    assert doc["simulated"]["accept_rate"] + doc["simulated"]["reject_rate"] == 1.0
    assert doc["exact"]["accept_rate"] == pytest.approx(0.95, abs=0.005)
    bounds = doc["boundaries"]
    assert bounds["wald_lower"] < bounds["lower"] < 0 < bounds["upper"] < bounds["wald_upper"]
    assert doc["policy"]["calibrated"] is True


def test_grade_sprt_with_wald_uses_walds_boundaries(runs: Runs) -> None:
    proc = runs["sprt_wald"]
    assert proc.returncode == 0, proc.stderr
    bounds = json.loads(proc.stdout)["boundaries"]
    assert bounds["upper"] == bounds["wald_upper"]
    assert bounds["lower"] == bounds["wald_lower"]


def test_grade_sprt_with_an_inconsistent_policy_is_one_line(runs: Runs) -> None:
    assert_usage_error(runs["sprt_bad"], "invalid SPRT policy", "p1 must exceed p0")
