"""benchmarks/gpu_checks/run.py, the GPU checks in one command, cannot rot on a machine without a GPU: its smoke run
lists every check and fails none, ``--only`` picks checks, and the sync check names where a step synchronised
(CUDA's sync debug mode simulated, the one thing here that cannot run without a GPU). Timings are never asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import benchmark_environment, launcher

REPO_ROOT = Path(__file__).resolve().parents[1]
GPU_CHECKS = REPO_ROOT / "benchmarks" / "gpu_checks"
CHECKS = [
    "throughput_bf16",
    "throughput_fp16",
    "sync_free_no",
    "sync_free_bf16",
    "sync_free_fp16",
    "memory",
    "async_save",
    "fsdp2",
    "compile",
]
RUN_ON_THE_CPU = ["throughput_bf16", "async_save", "compile"]


def _load(name: str):
    """A module of benchmarks/gpu_checks, imported from its file (the folder is no package)."""
    sys.path.insert(0, str(GPU_CHECKS))  # checks.py imports fsdp_check.py beside it
    try:
        spec = importlib.util.spec_from_file_location(f"gpu_checks_{name}", GPU_CHECKS / f"{name}.py")
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(GPU_CHECKS))


def _run(*arguments: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """run.py (which imports no torch) in a new interpreter; the checks' processes forked from the warm launcher."""
    command = [sys.executable, str(GPU_CHECKS / "run.py"), *arguments]
    env = benchmark_environment()
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=timeout)


@pytest.mark.slow
@pytest.mark.tooling
def test_smoke_run_lists_every_check(tmp_path):
    """The smoke run lists every check, fails none, and writes the table and figures."""
    completed = _run("--smoke", "--output-dir", str(tmp_path))

    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["mode"] == "smoke" and record["failed"] == []
    assert list(record["checks"]) == CHECKS
    statuses = {name: check["status"] for name, check in record["checks"].items()}
    assert [name for name, status in statuses.items() if status == "PASS"] == RUN_ON_THE_CPU, statuses
    assert all(statuses[name] == "SKIPPED" for name in CHECKS if name not in RUN_ON_THE_CPU), statuses
    for name in CHECKS:  # a reason for each skip, figures for each run
        check = record["checks"][name]
        assert check["summary"] and check["goal"], name
        assert ("needs CUDA" in check["summary"]) == (name not in RUN_ON_THE_CPU), (name, check["summary"])
    figures = {name: record["checks"][name]["figures"] for name in RUN_ON_THE_CPU}
    assert len(figures["throughput_bf16"]["ratios"]) == 1 and figures["throughput_bf16"]["ratio"] > 0
    assert figures["async_save"]["runs"]["async"]["states"] == figures["async_save"]["runs"]["sync"]["states"] == 2
    assert figures["compile"]["runs"]["compiled"]["unique_graphs"] >= 1
    table = (tmp_path / "results.md").read_text()
    assert table in completed.stdout  # the one table printed is the one written
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert [row.split(" | ")[0][2:] for row in rows] == CHECKS
    assert "FAIL" not in table
    assert sorted(path.name for path in (tmp_path / "runs").iterdir()) == [
        f"{name}.log" for name in sorted(RUN_ON_THE_CPU)
    ]


def test_only_runs_named_checks_in_order(tmp_path):
    # both need CUDA, so the smoke run skips them without starting a process
    """--only runs the checks named, in their order, and refuses an unknown one."""
    completed = _run("--smoke", "--only", "fsdp2,memory", "--output-dir", str(tmp_path), timeout=60)

    assert completed.returncode == 0, completed.stderr
    assert list(json.loads((tmp_path / "results.json").read_text())["checks"]) == ["memory", "fsdp2"]
    refused = _run("--smoke", "--only", "memory,memroy", "--output-dir", str(tmp_path), timeout=60)
    assert refused.returncode == 2
    assert "unknown check(s) ['memroy']; choose among throughput_bf16, throughput_fp16" in refused.stderr


def test_every_check_is_implemented():
    """Every check of the command has an implementation."""
    run, checks = _load("run"), _load("checks")

    assert [check.name for check in run.CHECKS] == CHECKS
    assert sorted(checks.CHECKS) == sorted(CHECKS)


SIMULATED_SYNC_DEBUG = """
import json, sys, warnings
import torch
sys.path.insert(0, sys.argv[1])
import checks

mode = {"now": "default"}
torch.cuda.set_sync_debug_mode = lambda value: mode.__setitem__("now", value)
checks.has_cuda = lambda: True  # the check's own CUDA guard; the run itself stays on the CPU
checks.SYNC_WORKLOAD = checks.TokenWorkload(
    vocab=32, width=16, depth=1, heads=2, length=8, batch_size=4, steps_per_epoch=4, epochs=2
)
clean = checks.check_sync_free("no", smoke=False)
original_loss = checks.token_cross_entropy

def syncing_loss(logits, targets):  # as a .item() in the loss would on a GPU
    if mode["now"] == "error":
        raise RuntimeError("called a synchronizing CUDA operation")
    if mode["now"] == "warn":
        warnings.warn("called a synchronizing CUDA operation")
    return original_loss(logits, targets)

checks.token_cross_entropy = syncing_loss
print(json.dumps({"clean": clean, "syncing": checks.check_sync_free("no", smoke=False)}))
"""


@pytest.mark.slow
def test_sync_check_names_syncing_steps():
    """The sync check passes a clean run, and names every step that synchronised."""
    completed = subprocess.run(
        [*launcher(1), "-c", SIMULATED_SYNC_DEBUG, str(GPU_CHECKS)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    outcomes = json.loads(completed.stdout.strip().splitlines()[-1])

    assert outcomes["clean"]["status"] == "PASS", outcomes["clean"]
    assert "8 steps under set_sync_debug_mode('error'): no sync" in outcomes["clean"]["summary"]
    syncing = outcomes["syncing"]
    assert syncing["status"] == "FAIL"
    assert "a training step synchronised at <string>:" in syncing["summary"]
    assert "syncing_loss (from pytorch_accel_trainer/" in syncing["summary"]
    # every training step, 4 per epoch, inside the window; the evaluation steps outside it
    (count,) = syncing["figures"]["syncs"].values()
    assert count == 8
    assert list(syncing["figures"]["syncs_with_non_blocking_batches"].values()) == [8]
