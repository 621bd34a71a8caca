"""The benchmark suite runs end to end and every row trains; timings are never asserted."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
from pathlib import Path

import pytest
from conftest import benchmark_environment, launcher

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.tooling  # runs the benchmark scripts
CORE_ROWS = ["torch_loop", "accelerate_loop", "trainer_default", "trainer_no_callbacks"]
OPTIONAL_ROWS = {"pytorch_accelerated": "pytorch_accelerated", "lightning": "lightning"}
WORKLOADS = ["overhead", "compute", "eval_heavy", "sched_accum_progress"]
WORKLOADS += ["overhead_long", "logits_train", "logits_eval"]
#: Workloads without same-process pairs: a long whole run, and memory (one process cannot measure two peaks)
UNPAIRED = {"overhead_long", "logits_train", "logits_eval"}


def _quick_run(script: str, tmp_path, timeout: int) -> tuple:
    """Run ``benchmarks/<script> --quick`` writing into ``tmp_path``; return the process and its results.json. The
    script and the processes it measures are forked from the warm launcher (``BENCHMARK_LAUNCHER``,
    benchmarks/launch.py): a smoke run checks what every row does, not its start-up."""
    completed = subprocess.run(
        [*launcher(1), str(REPO_ROOT / "benchmarks" / script), "--quick", "--output-dir", str(tmp_path)],
        env=benchmark_environment(),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=timeout,
    )
    assert (tmp_path / "results.json").exists(), completed.stderr[-4000:]
    return completed, json.loads((tmp_path / "results.json").read_text())


@pytest.mark.slow
def test_quick_benchmark_runs_every_row(tmp_path):
    """The quick benchmark runs every row and workload, and each trains."""
    completed, results = _quick_run("run.py", tmp_path, timeout=280)
    expected_rows = CORE_ROWS + [row for row, module in OPTIONAL_ROWS.items() if importlib.util.find_spec(module)]

    assert sorted(results["workloads"]) == sorted(WORKLOADS)
    assert results["rows"] == expected_rows
    for workload in WORKLOADS:
        rows = results["workloads"][workload]["rows"]
        assert list(rows) == expected_rows, workload
        for row, summary in rows.items():
            assert summary["errors"] == [], (workload, row, summary["errors"])
            assert summary["trained"], (workload, row, summary.get("first_loss"), summary.get("last_loss"))
            assert summary["whole_run_us_per_step"]["median"] > 0, (workload, row)
            if row != "torch_loop":
                assert summary["whole_run_ratio_to_baseline"]["n"] == 1, (workload, row)
                assert summary["extra_peak_over_baseline_mb"] is not None, (workload, row)
        paired = results["workloads"][workload]["paired"]
        if workload in UNPAIRED:
            assert paired == {}, workload
            continue
        assert list(paired) == expected_rows[1:], workload  # every row but the torch loop, against it
        for row, summary in paired.items():
            assert "error" not in summary and summary["trained"], (workload, row, summary)
            assert summary["pairs"] == 2 and summary["ratio"]["n"] == 2
    for module in ("accelerate", "pytorch_accel_trainer"):
        assert results["imports"]["modules"][module] is not None, module
    markdown = (tmp_path / "results.md").read_text()
    assert all(f"## {workload}" in markdown for workload in WORKLOADS)
    assert markdown.count("× one step's logits") == 2  # the memory tables of train() and evaluate()
    assert "FAIL" not in markdown
    assert completed.returncode == 0, completed.stderr[-4000:]


def test_window_trace_stays_small():
    """One accumulation window, marked by a callback of the user's (its dispatch counts), runs at most 25 of the
    package's functions in at most 5 files, and with the default callbacks at most 28 in 7 (benchmarks/step_trace.py):
    the step a newcomer reads stays in a few places."""
    spec = importlib.util.spec_from_file_location("step_trace", REPO_ROOT / "benchmarks" / "step_trace.py")
    step_trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_trace)
    summary, listing = step_trace.run("pytorch_accel_trainer", "none", count_all=False)
    assert summary["functions"] <= 25 and summary["files"] <= 5, "\n".join(listing)
    assert summary["functions_by_file"].get("callbacks/base.py") == 1, "the marking callback's dispatch is counted"
    summary, listing = step_trace.run("pytorch_accel_trainer", "default", count_all=False)
    assert summary["functions"] <= 28 and summary["files"] <= 7, "\n".join(listing)


def test_save_and_resume_traces_stay_small():
    """What ``save_training_state`` runs, and what a resume runs that a fresh ``train()`` does not
    (benchmarks/persistence_trace.py): a newcomer follows each in a few modules, and a new layer on either path fails
    here (the history of the figures is in benchmarks/README.md)."""
    spec = importlib.util.spec_from_file_location(
        "persistence_trace", REPO_ROOT / "benchmarks" / "persistence_trace.py"
    )
    persistence_trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(persistence_trace)
    figures = persistence_trace.measure()
    save, resume = figures["save"], figures["resume"]
    assert save["functions"] <= 106 and save["files"] <= 15, "\n".join(save["listing"])
    assert resume["functions"] <= 113 and resume["files"] <= 12, "\n".join(resume["listing"])
    # Named functions only (a comprehension or a lambda is read with the function that encloses it).
    assert save["named"]["functions"] <= 86 and save["named"]["files"] <= 15, "\n".join(save["listing"])
    assert resume["named"]["functions"] <= 83 and resume["named"]["files"] <= 12, "\n".join(resume["listing"])


#: The rows of benchmarks/sharded_state.py, in its order.
SHARDED_STATE_ROWS = [
    "dcp_save",
    "state_save",
    "dcp_load",
    "state_load",
    "async_blocked",
    "sync_in_run",
    "async_in_run",
]


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_state_benchmark_quick(tmp_path):
    """The quick sharded-state benchmark (2 FSDP2 processes on the CPU, one repeat) gives every row a time and a peak
    (background saves of several processes included: none is refused), every save row its files, and every goal a
    verdict; timings are never judged."""
    completed, results = _quick_run("sharded_state.py", tmp_path, timeout=240)
    rows = results["summary"]["rows"]
    assert list(rows) == SHARDED_STATE_ROWS
    for row, summary in rows.items():
        assert summary["errors"] == [] and summary["refused"] == [], (row, summary["errors"], summary["refused"])
        for figure in ("seconds", "peak_bytes"):
            assert summary[figure]["n"] == 1 and math.isfinite(summary[figure]["median"]), (row, figure)
        assert len(summary["peak_bytes_per_rank"]) == 2, row
        if row in ("dcp_save", "state_save", "async_blocked", "sync_in_run", "async_in_run"):
            assert summary["state_bytes"] > 0, row
    assert len(results["goals"]) == 5
    assert all(verdict in ("PASS", "FAIL") for _, _, verdict in results["goals"])
    assert "| goal |" in (tmp_path / "results.md").read_text()
    assert completed.returncode == 0, completed.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_stream_resume_benchmark_quick(tmp_path):
    """The quick stream-resume benchmark (20 updates, then a resume in a fresh process; and 2 processes): a stream with
    a position produces only the batches in flight before its first new update, a plain stream every sample trained
    again, and with stream_split="dataset" each process reads its own part and replays nothing; timings are never
    judged."""
    completed, results = _quick_run("stream_resume.py", tmp_path, timeout=240)
    rows = {row["kind"]: row for row in results["rows"]}
    assert list(rows) == ["stateful", "plain", "map"]
    for kind, row in rows.items():
        assert row["error"] is None and row["resume"]["first_update"] == 21, (kind, row)
    trained = rows["plain"]["train"]["updates"] * 4
    assert rows["stateful"]["resume"]["produced_before_first_update"] <= 12  # 3 batches: the loop's look-ahead
    assert rows["map"]["resume"]["produced_before_first_update"] <= 12
    assert rows["plain"]["resume"]["produced_before_first_update"] >= trained
    assert rows["plain"]["resume"]["replay_said"] and not rows["stateful"]["resume"]["replay_said"]
    configs = results["processes"]["configs"]
    dispatched, own_parts = configs["main_whole"]["per_rank"], configs["dataset_split"]["per_rank"]
    assert dispatched[0]["produced_before_first_update"] >= 20 * 2 * 4 and dispatched[1]["trained"]["produced"] == 0
    for rank in own_parts:
        assert rank["trained"]["produced"] >= 20 * 4 and rank["produced_before_first_update"] <= 12, rank
    assert "| updates before the stop |" in (tmp_path / "results.md").read_text()
    assert completed.returncode == 0, completed.stderr[-4000:]


@pytest.mark.slow
def test_memory_growth_benchmark_quick(tmp_path):
    """The quick long-run memory benchmark (40 steps of a small GPT-2, a fresh process per row) reads the memory at
    every step of every row, and each trains; the goals are never judged in a smoke run."""
    completed, results = _quick_run("memory_growth.py", tmp_path, timeout=300)
    rows = {row["row"]: row for row in results["rows"]}
    assert list(rows) == CORE_ROWS
    for name, row in rows.items():
        assert row["error"] is None and row["trained"], (name, row.get("error"))
        assert len(row["rss_at_step_start_mib"]) == 40 and list(row["rss_at_mib"]) == ["5", "40"]
        assert math.isfinite(row["slope_mib_per_step"])
    assert results["goals"] == [] and "| `trainer_default` |" in (tmp_path / "results.md").read_text()
    assert completed.returncode == 0, completed.stderr[-4000:]


@pytest.mark.slow
def test_time_lost_per_save_benchmark_in_fresh_processes():
    """``training_state_speed.py --time-lost --processes 2`` (one save of each mode after the warm-up ones): each
    fresh process times every update of its run and reports each mode's loss per save, the median of the two comes
    last, and no state is left behind; timings are never judged."""
    completed = subprocess.run(
        [
            *launcher(1),  # the driver forked warm; the processes it measures are fresh, as it says
            str(REPO_ROOT / "benchmarks" / "training_state_speed.py"),
            "--time-lost",
            "--processes",
            "2",
            "--saves",
            "1",
            "--every",
            "4",
        ],
        env=benchmark_environment(),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = completed.stdout.strip().splitlines()
    assert [line.split(" |")[0] for line in lines if line.startswith("| ") and line[2] in "12m"] == [
        "| 1",
        "| 2",
        "| median",
    ]
    results = json.loads(lines[-1])
    assert len(results["processes"]) == 2
    for result in results["processes"]:
        assert result["updates"] == 4 * (2 * (1 + 2) + 1) and len(result["update_s"]) == result["updates"]
        assert set(result["lost_per_save_s"]) == {"sync", "async"}
        assert not Path(result["state_dir"]).exists()
