"""Two "machines" on localhost: two torchrun agents (--nnodes 2, one process each) over gloo on the CPU.

From two working folders (two machines with local disks) a run that keeps training states is refused on every node
before the first batch, naming the folder and the fixes; from one shared folder it trains, survives a SIGKILL of one
node's process and resumes to the weights of an uninterrupted run, bit for bit. The agents are torchrun's own; their
processes are forked warm with the environment each agent gives them (``torchrun_with_warm_processes``).
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Optional

import pytest
import torch
from conftest import CPU_PROCESSES_ENV, S3_ENV, assert_bitwise_equal, torchrun_with_warm_processes

from pytorch_accel_trainer.state.training_state import list_complete_states

SCRIPT = Path(__file__).parent / "scripts" / "resume_run.py"
#: a small run: 22 samples, 2 processes, batches of 2: 6 updates per epoch, 3 epochs
CONFIG = {"accumulation": 1, "shuffle": True, "save_every": 2, "save_dir": "states"}

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch_two_nodes(config: dict, folders: list, timeout: int = 240, env: Optional[dict] = None) -> list:
    """Start node 0 and node 1 at once, each from its own working folder; return each one's (code, stdout, stderr)."""
    port = _free_port()
    nodes = [
        subprocess.Popen(
            [
                *torchrun_with_warm_processes(
                    *("--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1"),
                    *("--master_addr", "127.0.0.1", "--master_port", str(port)),
                ),
                str(SCRIPT),
                json.dumps(config),
            ],
            cwd=folder,
            env=env or CPU_PROCESSES_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, folder in enumerate(folders)
    ]
    try:
        outputs = [node.communicate(timeout=timeout) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    return [(node.returncode, out, err) for node, (out, err) in zip(nodes, outputs)]


def test_local_folders_stop_every_node(tmp_path):
    """From two local folders, every node stops before the first batch, naming the fixes."""
    folders = [tmp_path / "machine_a", tmp_path / "machine_b"]
    for folder in folders:
        folder.mkdir()
    results = _launch_two_nodes({**CONFIG, "out": str(tmp_path / "out.pt")}, folders)
    for code, _, stderr in results:
        assert code != 0
        assert "SharedFolderError" in stderr and "'states' (training states of SaveTrainingStateCallback" in stderr
        assert "on node 1" in stderr and "a filesystem every node mounts" in stderr and "'s3://bucket/states'" in stderr
    assert all(list_complete_states(folder / "states") == [] for folder in folders)  # nothing trained, nothing saved
    assert not (tmp_path / "out.pt").exists()


def test_shared_folder_sigkill_then_resume(tmp_path):
    """From one shared folder, a SIGKILL of one node then a resume equals an uninterrupted run."""
    config = {**CONFIG, "out": str(tmp_path / "out.pt")}
    kill = {"kill": {"event": "train_step", "epoch": 2, "step": 2, "rank": 1}}
    killed = _launch_two_nodes({**config, **kill}, [tmp_path] * 2)
    assert all(code != 0 for code, _, _ in killed) and not (tmp_path / "out.pt").exists()
    assert [state.folder.name for state in list_complete_states(tmp_path / "states")] == ["step_4", "step_6", "step_8"]
    # resumed, then in the same processes an uninterrupted run, then a run that process 1's time budget stops
    resumed = _launch_two_nodes(
        {**config, "reference_out": str(tmp_path / "reference.pt"), "time_budget_out": str(tmp_path / "budget")},
        [tmp_path] * 2,
    )
    assert [code for code, _, _ in resumed] == [0, 0], resumed[0][2][-3000:] + resumed[1][2][-3000:]
    assert "Resuming from" in resumed[0][1]
    assert_bitwise_equal(
        torch.load(tmp_path / "out.pt", weights_only=True), torch.load(tmp_path / "reference.pt", weights_only=True)
    )
    stops = [json.loads((tmp_path / f"budget.{rank}.json").read_text()) for rank in range(2)]
    assert stops[0]["updates"] == stops[1]["updates"] < 48  # both at the same update, before the 3 epochs' 48
    assert stops[0]["by_time_budget"] and stops[1]["by_time_budget"]
    assert stops[0]["stop_reason"] == stops[1]["stop_reason"]  # the same result on every process
    assert stops[0]["stop_reason"].startswith("Time budget") and stops[0]["stop_reason"].endswith("(on process 1)")


def test_local_folders_with_object_storage(tmp_path, s3_endpoint):
    """From two local folders, states in object storage save and resume exactly."""
    folders = [tmp_path / "machine_a", tmp_path / "machine_b"]
    for folder in folders:
        folder.mkdir()
    env = {**CPU_PROCESSES_ENV, **S3_ENV, "FSSPEC_S3_ENDPOINT_URL": s3_endpoint}
    config = {
        **CONFIG,
        "save_dir": "s3://states-bucket/two-machines",
        "out": str(tmp_path / "out.pt"),
        "then_resume_from": "step_16",  # saved by both machines, each its process's part, inside the last epoch
        "again_out": str(tmp_path / "again.pt"),
    }
    results = _launch_two_nodes(config, folders, env=env)
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    assert "Resuming from s3://states-bucket/two-machines/step_16 (after 16 optimizer updates)" in results[0][1]
    assert_bitwise_equal(
        torch.load(tmp_path / "again.pt", weights_only=True), torch.load(tmp_path / "out.pt", weights_only=True)
    )
