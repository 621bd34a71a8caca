"""Real processes killed with SIGKILL, stopped with SIGTERM or SIGINT, then resumed: bitwise equal results."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

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


class Interrupted(NamedTuple):
    """A run stopped by an interruption (``stopped``: its launch), then resumed (``resumed``: the launch that resumed
    it, with others), and its uninterrupted ``reference``."""

    folder: Path
    stopped: subprocess.CompletedProcess
    stopped_wrote_out: bool
    resumed: subprocess.CompletedProcess
    result: dict
    reference: dict

    @property
    def states(self) -> Path:
        return self.folder / "states"

    def assert_resumed(self) -> None:
        assert f"Resuming from {self.states}" in self.resumed.stdout, self.resumed.stdout[-3000:]


def _stop(folder: Path, config: dict, interruption: dict, num_processes: int = 1) -> tuple:
    """The config of a run in ``folder`` and the launch of that run stopped by ``interruption``."""
    folder.mkdir()
    config = {**config, "save_dir": str(folder / "states"), "out": str(folder / "out.pt")}
    if "sample_log" in config:
        config["sample_log"] = str(folder / config["sample_log"])
    return config, _launch({**config, **interruption}, num_processes)


def _resume(stops: dict, num_processes: int = 1) -> dict:
    """Each stopped run of ``stops`` (name: its folder, config and stopped launch) resumed, then an uninterrupted run
    of its config, in one launch (resume_run.py's ``then``): each resume reads its state from its folder, as a launch
    of its own would."""
    resumes = [{**config, "reference_out": str(folder / "reference.pt")} for folder, config, _ in stops.values()]
    resumed = _launch({**resumes[0], "then": resumes[1:]}, num_processes)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {
        name: Interrupted(
            folder,
            stopped,
            stopped_wrote_out,
            resumed,
            _result(folder / "out.pt"),
            _result(folder / "reference.pt"),
        )
        for name, (folder, _, (stopped, stopped_wrote_out)) in stops.items()
    }


#: The runs of the tests below, each stopped in a launch of its own: its config and what stops it
ONE_PROCESS_CASES = {
    "sigkill-window-workers": (
        {"accumulation": 3, "shuffle": True, "num_workers": 2},
        {"kill": {"event": "train_step", "epoch": 2, "step": 5}},
    ),
    "sigkill-eval": ({"accumulation": 1, "shuffle": False}, {"kill": {"event": "eval_step", "epoch": 1, "step": 2}}),
    "sigkill-in-rename": ({"accumulation": 3, "shuffle": True}, {"crash_at": "rename"}),
    "sigkill-in-write": ({"accumulation": 1, "shuffle": True}, {"crash_at": "write:shards"}),
    "sigterm": (  # only the preemption save
        {"accumulation": 3, "shuffle": True, "save_every": 1000, "sample_log": "samples.log"},
        {"kill": {"event": "train_step", "epoch": 2, "step": 4, "signal": "SIGTERM"}},
    ),
    "second-sigint": (
        {"accumulation": 1, "shuffle": True},
        {"kill": {"event": "train_step", "epoch": 2, "step": 3, "signal": "SIGINT", "times": 2}},
    ),
}
RANDOM_KILL = {"accumulation": 3, "shuffle": True, "epochs": 6, "size": 40}


def _random_kill(folder: Path) -> tuple:
    """The config of a run in ``folder`` and its launch, killed by this test at a random time after its first
    state."""
    folder.mkdir()
    config = {**RANDOM_KILL, "save_dir": str(folder / "states"), "out": str(folder / "out.pt")}
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
    stdout, stderr = process.communicate()
    return config, subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory) -> dict:
    """The runs of ONE_PROCESS_CASES and the randomly killed one, each stopped, then all resumed in one launch."""
    base = tmp_path_factory.mktemp("interrupted")
    stops = {}
    for name, (config, interruption) in ONE_PROCESS_CASES.items():
        config, stopped = _stop(base / name, config, interruption)
        stops[name] = (base / name, config, (stopped, (base / name / "out.pt").exists()))
    config, stopped = _random_kill(base / "random")
    stops["random"] = (base / "random", config, (stopped, (base / "random" / "out.pt").exists()))
    return _resume(stops)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sigkill-window-workers", "sigkill-eval", "sigkill-in-rename", "sigkill-in-write"])
def test_sigkill_then_resume_is_bitwise_equal(one_process_runs, case):
    run = one_process_runs[case]
    assert run.stopped.returncode == -signal.SIGKILL, (run.stopped.returncode, run.stopped.stderr[-3000:])
    assert not run.stopped_wrote_out
    run.assert_resumed()
    assert_bitwise_equal(run.result, run.reference)
    assert all(verify_folder(state.folder) for state in list_complete_states(run.states))


@pytest.mark.slow
def test_random_sigkill_then_resume_bitwise(one_process_runs):
    run = one_process_runs["random"]
    assert_bitwise_equal(run.result, run.reference)


@pytest.mark.slow
def test_sigterm_saves_and_exits_143(one_process_runs):
    """SIGTERM saves and exits 143, and every sample is seen exactly once."""
    run = one_process_runs["sigterm"]
    assert run.stopped.returncode == 128 + signal.SIGTERM, run.stopped.stderr[-3000:]
    assert not run.stopped_wrote_out
    run.assert_resumed()
    assert_bitwise_equal(run.result, run.reference)
    (state,) = [s for s in list_complete_states(run.states) if s.manifest["position"]["batches_seen"] == 6]
    assert state.manifest["num_update_steps_completed"] == 4 + 2  # 4 updates in epoch 1, then steps 0-5 of epoch 2
    seen: dict = {}
    for line in (run.folder / "samples.log").read_text().splitlines():
        epoch, _, *ids = line.split()
        seen.setdefault(epoch, []).extend(int(i) for i in ids)
    assert {epoch: sorted(ids) for epoch, ids in seen.items()} == {str(e): list(range(22)) for e in (1, 2, 3)}


@pytest.mark.slow
def test_second_sigint_exits_at_once(one_process_runs):
    """A second SIGINT exits at once and keeps the last good state."""
    run = one_process_runs["second-sigint"]
    assert run.stopped.returncode in (1, -signal.SIGINT, 130), run.stopped.stderr[-3000:]
    assert not run.stopped_wrote_out
    assert "KeyboardInterrupt" in run.stopped.stderr
    run.assert_resumed()
    assert_bitwise_equal(run.result, run.reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_one_rank_killed_then_resume_bitwise(tmp_path):
    """Two processes: SIGKILL and SIGTERM to one rank, then a resume equal bit for bit."""
    config = {"accumulation": 1, "shuffle": True, "save_every": 2}
    kill = {"kill": {"event": "train_step", "epoch": 2, "step": 2, "rank": 1}}
    term = {"kill": {"event": "train_step", "epoch": 1, "step": 3, "signal": "SIGTERM", "rank": 1}}  # one rank only
    stops = {}
    for name, interruption in {"kill": kill, "term": term}.items():
        stopped_config, stopped = _stop(tmp_path / name, config, interruption, 2)
        stops[name] = (tmp_path / name, stopped_config, (stopped, (tmp_path / name / "out.pt").exists()))
    runs = _resume(stops, 2)
    for run in runs.values():
        assert run.stopped.returncode in range(1, 256) or run.stopped.returncode == -9, run.stopped.stderr[-3000:]
        assert not run.stopped_wrote_out
        run.assert_resumed()
        assert_bitwise_equal(run.result, runs["kill"].reference)  # the same uninterrupted run
    stopped = runs["term"].stopped
    assert stopped.returncode != -9
    # both processes stopped at the next update boundary (step 4 of epoch 1: 4 updates), with one saved state
    assert "Stopped by signal 15" in stopped.stdout
    assert "step_4\n" in stopped.stdout and "step_4-2" not in stopped.stdout  # the step save, taken once
    assert "checkpoint-00000004" not in stopped.stdout  # the preemption save is that same state, not a second
