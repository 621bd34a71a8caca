"""Real processes killed with SIGKILL, stopped with SIGTERM or SIGINT, then resumed: bitwise equal results."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import CPU_PROCESSES_ENV, assert_bitwise_equal, launcher, real_launcher

from pytorch_accel_trainer.state.training_state import list_complete_states, verify_folder

SCRIPT = Path(__file__).parent / "scripts" / "resume_run.py"


def _command(config, num_processes, launch=launcher):
    return [*launch(num_processes), str(SCRIPT), json.dumps(config)]


def _launch(config, num_processes=1, timeout=240, launch=launcher):
    """The run of ``config``, forked from the warm launcher (which ends the other processes of a launch when one dies,
    as torchrun does); ``launch=real_launcher`` for a run this test kills from outside."""
    return subprocess.run(
        _command(config, num_processes, launch), env=CPU_PROCESSES_ENV, capture_output=True, text=True, timeout=timeout
    )


def _result(path):
    return torch.load(path, weights_only=True)


def _interrupted_then_resumed(
    tmp_path, config, interruption, num_processes=1, expected_codes=(-signal.SIGKILL,), reference=True
):
    """The results of a run stopped by ``interruption`` then resumed, and (``reference``) of an uninterrupted run with
    the same config, which the resumed processes start once they are done: one launch fewer than a run of its own."""
    folder = tmp_path / "interrupted"
    folder.mkdir()
    config = {**config, "save_dir": str(folder / "states"), "out": str(folder / "out.pt")}
    # a process that stops itself stops as well forked; on several processes the launcher ends the others
    stopped = _launch({**config, **interruption}, num_processes)
    assert stopped.returncode in expected_codes, (stopped.returncode, stopped.stderr[-3000:])
    assert not (folder / "out.pt").exists()
    reference_out = {"reference_out": str(tmp_path / "reference.pt")} if reference else {}
    resumed = _launch({**config, **reference_out}, num_processes)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout
    uninterrupted = _result(tmp_path / "reference.pt") if reference else None
    return _result(folder / "out.pt"), uninterrupted, folder / "states", stopped


CASES = [
    ({"accumulation": 3, "shuffle": True, "num_workers": 2}, {"kill": {"event": "train_step", "epoch": 2, "step": 5}}),
    ({"accumulation": 1, "shuffle": False}, {"kill": {"event": "eval_step", "epoch": 1, "step": 2}}),
    ({"accumulation": 3, "shuffle": True}, {"crash_at": "rename"}),
    ({"accumulation": 1, "shuffle": True}, {"crash_at": "write:shards"}),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "interruption"),
    CASES,
    ids=["sigkill-window-workers", "sigkill-eval", "sigkill-in-rename", "sigkill-in-write"],
)
def test_sigkill_then_resume_is_bitwise_equal(tmp_path, config, interruption):
    resumed, reference, states, _ = _interrupted_then_resumed(tmp_path, config, interruption)
    assert_bitwise_equal(resumed, reference)
    assert all(verify_folder(state.folder) for state in list_complete_states(states))


@pytest.mark.slow
def test_random_sigkill_then_resume_bitwise(tmp_path):
    config = {"accumulation": 3, "shuffle": True, "epochs": 6, "size": 40}
    folder = tmp_path / "random"
    folder.mkdir()
    config = {**config, "save_dir": str(folder / "states"), "out": str(folder / "out.pt")}
    process = subprocess.Popen(  # killed by this test: a real launch, which dies with the kill
        _command(config, 1, real_launcher),
        env=CPU_PROCESSES_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started = time.monotonic()
    while not list_complete_states(folder / "states") if (folder / "states").exists() else True:
        time.sleep(0.01)
        assert time.monotonic() - started < 120 and process.poll() is None, "the run never saved a state"
    time.sleep(random.Random(os.getpid()).uniform(0.0, 0.5))
    process.kill()
    process.communicate()
    resumed = _launch({**config, "reference_out": str(folder / "reference.pt")})  # then an uninterrupted run
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise_equal(_result(folder / "out.pt"), _result(folder / "reference.pt"))


@pytest.mark.slow
def test_sigterm_saves_and_exits_143(tmp_path):
    """SIGTERM saves and exits 143, and every sample is seen exactly once."""
    config = {"accumulation": 3, "shuffle": True, "save_every": 1000}  # only the preemption save
    log = tmp_path / "samples.log"
    interruption = {"kill": {"event": "train_step", "epoch": 2, "step": 4, "signal": "SIGTERM"}, "sample_log": str(log)}
    resumed, reference, states, stopped = _interrupted_then_resumed(
        tmp_path, {**config, "sample_log": str(log)}, interruption, expected_codes=(128 + signal.SIGTERM,)
    )
    assert_bitwise_equal(resumed, reference)
    (state,) = [s for s in list_complete_states(states) if s.manifest["position"]["batches_seen"] == 6]
    assert state.manifest["num_update_steps_completed"] == 4 + 2  # 4 updates in epoch 1, then steps 0-5 of epoch 2
    seen: dict = {}
    for line in log.read_text().splitlines():
        epoch, _, *ids = line.split()
        seen.setdefault(epoch, []).extend(int(i) for i in ids)
    assert {epoch: sorted(ids) for epoch, ids in seen.items()} == {str(e): list(range(22)) for e in (1, 2, 3)}


@pytest.mark.slow
def test_second_sigint_exits_at_once(tmp_path):
    """A second SIGINT exits at once and keeps the last good state."""
    config = {"accumulation": 1, "shuffle": True}
    interruption = {"kill": {"event": "train_step", "epoch": 2, "step": 3, "signal": "SIGINT", "times": 2}}
    resumed, reference, _, stopped = _interrupted_then_resumed(
        tmp_path, config, interruption, expected_codes=(1, -signal.SIGINT, 130)
    )
    assert "KeyboardInterrupt" in stopped.stderr
    assert_bitwise_equal(resumed, reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_one_rank_killed_then_resume_bitwise(tmp_path):
    """Two processes: SIGKILL and SIGTERM to one rank, then a resume equal bit for bit."""
    config = {"accumulation": 1, "shuffle": True, "save_every": 2}
    kill = {"kill": {"event": "train_step", "epoch": 2, "step": 2, "rank": 1}}
    (tmp_path / "kill").mkdir()
    resumed, reference, _, _ = _interrupted_then_resumed(
        tmp_path / "kill", config, kill, 2, expected_codes=tuple(range(1, 256)) + (-9,)
    )
    assert_bitwise_equal(resumed, reference)
    term = {"kill": {"event": "train_step", "epoch": 1, "step": 3, "signal": "SIGTERM", "rank": 1}}  # one rank only
    (tmp_path / "term").mkdir()
    resumed, _, _, stopped = _interrupted_then_resumed(
        tmp_path / "term", config, term, 2, expected_codes=tuple(range(1, 256)), reference=False
    )
    assert_bitwise_equal(resumed, reference)
    # both processes stopped at the next update boundary (step 4 of epoch 1: 4 updates), with one saved state
    assert "Stopped by signal 15" in stopped.stdout
    assert "step_4\n" in stopped.stdout and "step_4-2" not in stopped.stdout  # the step save, taken once
    assert "checkpoint-00000004" not in stopped.stdout  # the preemption save is that same state, not a second
