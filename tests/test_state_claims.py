"""The claim of a folder of training states (``state/claims.py``): one job saves into a folder at a time.

Jobs are real processes (forked by the warm launcher, ``conftest.launcher``) where two run at once; a job on another
host, or one killed, is stood for by the claim it leaves.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import CPU_PROCESSES_ENV, launcher
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state import files
from pytorch_accel_trainer.state.claims import CLAIM_NAME

#: A job of 3 epochs of 2 updates, a state after each epoch, resuming from its folder (argv: the folder, its mode, a
#: folder where the jobs meet). ``meet-a``/``meet-b``: two new runs, each waiting after the folder's check for the
#: other (or its end); ``hold``: waits before epoch 2 until ``go`` appears; ``kill``: killed before epoch 2.
_JOB = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    import torch
    from torch import nn
    from pytorch_accel_trainer import Trainer
    from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
    from pytorch_accel_trainer.errors import CheckpointError

    save_dir, mode, meeting = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])

    def wait_for(*paths):
        deadline = time.monotonic() + 120
        while not any(path.exists() for path in paths) and time.monotonic() < deadline:
            time.sleep(0.01)

    class Pause(TrainerCallback):
        def on_training_run_start(self, trainer, **kwargs):  # after SaveTrainingStateCallback checked the folder
            if mode.startswith("meet"):
                other = "meet-b" if mode == "meet-a" else "meet-a"
                (meeting / mode).touch()
                wait_for(meeting / other, meeting / f"{other}.done")

        def on_train_epoch_start(self, trainer, **kwargs):
            if trainer.run_history.current_epoch == 2 and mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if trainer.run_history.current_epoch == 2 and mode == "hold":
                print("holding", flush=True)
                wait_for(meeting / "go")

    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    callbacks = [SaveTrainingStateCallback(save_dir, save_every_n_epochs=1), Pause()]
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=callbacks)
    data = torch.utils.data.TensorDataset(torch.ones(4, 1), torch.ones(4, 1))
    try:
        trainer.train(data, num_epochs=3, per_device_batch_size=2, resume_from=save_dir)
    except CheckpointError as error:
        print(f"refused: {error}", flush=True)
        sys.exit(3)
    finally:
        (meeting / f"{mode}.done").touch()
    print("trained", trainer.num_update_steps_completed, flush=True)
    """
)


def _start_job(save_dir, mode, meeting) -> subprocess.Popen:
    return subprocess.Popen(
        [*launcher(1), "-c", _JOB, str(save_dir), mode, str(meeting)],
        env=CPU_PROCESSES_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_until_holding(job: subprocess.Popen) -> None:
    """Read the job's output up to its line saying it waits before epoch 2 (its state epoch_1 saved)."""
    for line in job.stdout:
        if line.strip() == "holding":
            return
    raise AssertionError(f"the job ended before holding (exit status {job.wait()})")


def _finish(job: subprocess.Popen) -> tuple[int, str]:
    output, _ = job.communicate(timeout=240)
    return job.returncode, output


def _states(folder) -> list[str]:
    return sorted(path.parent.name for path in folder.glob(f"*/{files.MANIFEST_NAME}"))


def _write_claim(folder, host, pid, run_id="0" * 32):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CLAIM_NAME).write_text(json.dumps({"run_id": run_id, "host": host, "pid": pid}))


class _ReadClaim(TrainerCallback):
    """Reads the folder's claim at every save asked for after an update, and once the epochs started."""

    def __init__(self, folder):
        self.folder, self.claims = folder, []

    def on_train_epoch_start(self, trainer, **kwargs):
        self.claims.append(json.loads((self.folder / CLAIM_NAME).read_text()))


def _trainer(save_dir, *extra_callbacks, **callback_kwargs):
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    callbacks = [SaveTrainingStateCallback(save_dir, save_every_n_epochs=1, **callback_kwargs), *extra_callbacks]
    return Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=callbacks)


def _train(trainer, resume_from=None, num_epochs=2):
    data = torch.utils.data.TensorDataset(torch.ones(4, 1), torch.ones(4, 1))
    return trainer.train(data, num_epochs=num_epochs, per_device_batch_size=2, resume_from=resume_from)


def test_two_new_runs_started_at_once_one_is_refused(tmp_path):
    """Two new runs into one folder, each past the folder's check before the other saves anything: one is refused
    before any step, naming the other job; the folder holds one run's states, never interleaved (no ``-2``)."""
    ck, meeting = tmp_path / "ck", tmp_path / "meeting"
    meeting.mkdir()
    jobs = [_start_job(ck, mode, meeting) for mode in ("meet-a", "meet-b")]
    (first, first_output), (second, second_output) = (_finish(job) for job in jobs)
    assert sorted([first, second]) == [0, 3], first_output[-3000:] + second_output[-3000:]
    refused = first_output if first == 3 else second_output
    assert f"refused: {ck} is the folder of training states of another job (run " in refused
    assert f"on host {socket.gethostname()}), which " in refused
    assert "Give each job its own save_dir" in refused and "stop the other job" in refused
    assert _states(ck) == ["epoch_1", "epoch_2", "epoch_3", "final"]
    assert len({json.loads((ck / name / files.MANIFEST_NAME).read_text())["run_id"] for name in _states(ck)}) == 1
    assert not (ck / CLAIM_NAME).exists()  # released as the run ended


def test_second_job_resuming_the_folder_while_the_first_runs_is_refused(tmp_path):
    """A second copy of a job (a requeue while the first still runs) is refused before any step, naming the first
    job's host, process and run; the first job goes on and finishes, its states untouched by the second."""
    ck, meeting = tmp_path / "ck", tmp_path / "meeting"
    meeting.mkdir()
    first = _start_job(ck, "hold", meeting)
    try:
        _wait_until_holding(first)
        claim = json.loads((ck / CLAIM_NAME).read_text())
        (run_id,) = {json.loads((ck / name / files.MANIFEST_NAME).read_text())["run_id"] for name in _states(ck)}
        assert claim == {"run_id": run_id, "host": socket.gethostname(), "pid": claim["pid"]}
        second = _trainer(ck)
        with pytest.raises(
            CheckpointError,
            match=(
                rf"{ck} is the folder of training states of another job \(run {run_id}, process {claim['pid']} on "
                rf"host {socket.gethostname()}\), which holds it: .* own save_dir .*stop the other job first"
            ),
        ):
            _train(second, resume_from=ck, num_epochs=3)
        assert second.num_update_steps_completed == 2  # the state's loaded (reading only), no update
        assert _states(ck) == ["epoch_1"]
        (meeting / "go").touch()
        returncode, output = _finish(first)
    finally:
        first.kill()
    assert returncode == 0 and "trained 6" in output, output[-3000:]
    assert _states(ck) == ["epoch_1", "epoch_2", "epoch_3", "final"]


def test_job_whose_folder_was_taken_over_stops_at_its_next_save(tmp_path):
    """A job whose claim another job took over (a copy of it requeued on another node) stops at its next save with a
    CheckpointError naming that job, writing nothing beside its states."""
    ck, meeting = tmp_path / "ck", tmp_path / "meeting"
    meeting.mkdir()
    first = _start_job(ck, "hold", meeting)
    try:
        _wait_until_holding(first)
        _write_claim(ck, "another-node", 4242, "1" * 32)  # the copy on another node took the folder over
        (meeting / "go").touch()
        returncode, output = _finish(first)
    finally:
        first.kill()
    assert returncode == 3, output[-3000:]
    assert (
        f"refused: {ck} was taken over by another job (run {'1' * 32}, process 4242 on host another-node) since this "
        "run claimed it: two jobs save training states into one folder. This run stops without writing its state "
        "epoch_2 beside that job's (its earlier states are intact)."
    ) in output
    assert _states(ck) == ["epoch_1"]
    assert json.loads((ck / CLAIM_NAME).read_text())["host"] == "another-node"  # the other job's claim is left


def test_claim_of_a_killed_job_is_taken(tmp_path, capsys):
    """A job killed anywhere leaves its claim; the next job on this host takes it (its process is gone) and resumes
    its state; a folder holding only such a claim is an empty folder: a new run."""
    ck, meeting = tmp_path / "ck", tmp_path / "meeting"
    meeting.mkdir()
    returncode, output = _finish(_start_job(ck, "kill", meeting))
    assert returncode != 0 and _states(ck) == ["epoch_1"], output[-3000:]
    assert json.loads((ck / CLAIM_NAME).read_text())["host"] == socket.gethostname()  # left by the killed job
    resumed = _trainer(ck)
    _train(resumed, resume_from=ck, num_epochs=3)
    assert resumed.num_update_steps_completed == 6
    assert _states(ck) == ["epoch_1", "epoch_2", "epoch_3", "final"]
    assert not (ck / CLAIM_NAME).exists()

    empty = tmp_path / "empty"
    _write_claim(empty, socket.gethostname(), _gone_pid())
    capsys.readouterr()
    _train(_trainer(empty), resume_from=empty)
    assert f"resume_from={str(empty)!r} holds no training state yet: starting a new run." in capsys.readouterr().out
    assert _states(empty) == ["epoch_1", "epoch_2", "final"]


def _gone_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_claim_from_another_host_is_taken_over_with_a_line(tmp_path, capsys):
    """A claim of another host (a job requeued on another node after a crash: its process cannot be checked) is
    taken over, and one line names the previous holder."""
    ck = tmp_path / "ck"
    _write_claim(ck, "another-node", 4242, "1" * 32)
    reader = _ReadClaim(ck)
    _train(_trainer(ck, reader))
    out = capsys.readouterr().out
    assert (
        f"Took over {ck} from run {'1' * 32}, process 4242 on host another-node, whose liveness cannot be checked "
        "from here: if that job still runs, it stops at its next save."
    ) in out
    assert reader.claims[0]["pid"] == os.getpid() and reader.claims[0]["host"] == socket.gethostname()
    assert _states(ck) == ["epoch_1", "epoch_2", "final"]
    assert not (ck / CLAIM_NAME).exists()


def test_two_train_calls_in_one_script_keep_the_folder(tmp_path):
    """The second ``train()`` of a script (training the head, then the whole model; or a resume) takes the folder
    its first one claimed: this process's claim, whatever its run."""
    ck = tmp_path / "ck"
    reader = _ReadClaim(ck)
    trainer = _trainer(ck, reader)
    _train(trainer)
    _write_claim(ck, socket.gethostname(), os.getpid(), "2" * 32)  # as if the first run were still under way
    _train(trainer, resume_from=ck, num_epochs=3)
    assert trainer.num_update_steps_completed == 6
    first_run, second_run = reader.claims[0]["run_id"], reader.claims[-1]["run_id"]
    assert first_run == second_run and {claim["pid"] for claim in reader.claims} == {os.getpid()}
    assert _states(ck) == ["epoch_1", "epoch_2", "epoch_3", "final", "final-2"]
    assert not (ck / CLAIM_NAME).exists()


def test_a_save_after_train_claims_the_folder_for_itself(tmp_path):
    """A save outside the run (``save_training_state`` after ``train()``) claims a free folder for itself alone, and
    is refused in a folder another live job of this host holds."""
    trainer = _trainer(tmp_path / "ck")
    _train(trainer, num_epochs=1)
    other = tmp_path / "other"
    assert trainer.save_training_state(other).name == "checkpoint-00000002"
    assert not (other / CLAIM_NAME).exists()
    held = tmp_path / "held"
    _write_claim(held, socket.gethostname(), os.getppid())  # a live process of this host that is not this one
    with pytest.raises(CheckpointError, match=rf"{held} is the folder of training states of another job"):
        trainer.save_training_state(held)
    assert _states(held) == []


def test_rename_race_with_another_job_is_its_error(tmp_path, monkeypatch):
    """When another job took the folder over and wrote a state of the same name as the save renames its temporary
    (the race of two copies of one job), the save fails with the claim's CheckpointError, not a raw OSError."""
    ck = tmp_path / "ck"

    def race(point):
        if point == "rename":  # the other job took over and sealed its own epoch_1 first
            (ck / "epoch_1").mkdir()
            (ck / "epoch_1" / "its file").touch()
            _write_claim(ck, "another-node", 4242, "1" * 32)

    monkeypatch.setattr(files, "crash_point", race)
    with pytest.raises(CheckpointError, match=r"was taken over by another job \(run 1{32}, process 4242") as error:
        _train(_trainer(ck), num_epochs=1)
    assert isinstance(error.value.__context__, OSError)


#: A 2-process job (argv: its folder of states): its first run finds the folder claimed by another live job, then,
#: once that job's claim is gone, it trains one epoch; each process says what it saw.
_TWO_PROCESSES = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    import torch
    from torch import nn
    from pytorch_accel_trainer import Trainer
    from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
    from pytorch_accel_trainer.errors import CheckpointError

    save_dir = Path(sys.argv[1])

    class ReadClaim(TrainerCallback):
        def on_train_epoch_start(self, trainer, **kwargs):
            claim = json.loads((save_dir / ".claim").read_text())
            sys.stdout.write(f"rank {trainer.accelerator.process_index} pid {os.getpid()} claim {claim['pid']}\\n")
            sys.stdout.flush()  # one write: the other process's lines never land inside it

    def create_trainer():
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        callbacks = [SaveTrainingStateCallback(save_dir, save_every_n_epochs=1), ReadClaim()]
        return Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=callbacks)

    data = torch.utils.data.TensorDataset(torch.ones(8, 1), torch.ones(8, 1))
    refused = create_trainer()
    try:
        refused.train(data, num_epochs=1, per_device_batch_size=2)
    except CheckpointError as error:
        print(f"rank {refused.accelerator.process_index} refused: {error}", flush=True)
    refused.accelerator.wait_for_everyone()
    if refused.accelerator.is_main_process:
        (save_dir / ".claim").unlink()  # the other job ended
    refused.accelerator.wait_for_everyone()
    trainer = create_trainer()
    trainer.train(data, num_epochs=1, per_device_batch_size=2)
    print(f"rank {trainer.accelerator.process_index} trained {trainer.num_update_steps_completed}", flush=True)
    """
)


@pytest.mark.distributed
def test_main_process_claims_for_every_process(tmp_path):
    """In a job of 2 processes the main process claims the folder; a claim of another live job refuses every process
    together (none left waiting in a collective), each naming the other job."""
    ck = tmp_path / "ck"
    _write_claim(ck, socket.gethostname(), os.getpid(), "1" * 32)  # this test's process: a live job of this host
    result = subprocess.run(
        [*launcher(2), "-c", _TWO_PROCESSES, str(ck)],
        env=CPU_PROCESSES_ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        assert (
            f"rank {rank} refused: {ck} is the folder of training states of another job (run {'1' * 32}, process "
            f"{os.getpid()} on host {socket.gethostname()}), which holds it"
        ) in result.stdout
        assert f"rank {rank} trained 2" in result.stdout
    seen = {rank: (pid, claim) for rank, pid, claim in re.findall(r"rank (\d) pid (\d+) claim (\d+)", result.stdout)}
    assert seen["0"][0] == seen["0"][1]  # the main process's claim
    assert seen["1"][1] == seen["0"][1] != seen["1"][0]  # not process 1's own
    assert _states(ck) == ["epoch_1", "final"]
    assert not (ck / CLAIM_NAME).exists()
