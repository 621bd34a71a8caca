"""What a resume checks against the run it continues: hyperparameters, targets already reached, a manifest that
disagrees, state names the folder needs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import CPU_PROCESSES_ENV, launcher, load_module_from, regression_dataset
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.errors import CheckpointError

RESUME_RUN_SCRIPT = Path(__file__).parent / "scripts" / "resume_run.py"
resume_run = load_module_from(RESUME_RUN_SCRIPT, "resume_run")


def _trainer(lr=0.05, callbacks=None, **optimizer_kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, **{"momentum": 0.9, **optimizer_kwargs})
    return Trainer(model, nn.MSELoss(), optimizer, **({} if callbacks is None else {"callbacks": callbacks}))


def _train(trainer, **kwargs):
    return trainer.train(regression_dataset(8), per_device_batch_size=2, **kwargs)


def _saved_state(tmp_path, lr=0.05, num_epochs=1, scheduler=None, **optimizer_kwargs):
    trainer = _trainer(lr, **optimizer_kwargs)
    _train(trainer, num_epochs=num_epochs, create_scheduler_fn=scheduler)
    trainer.save_training_state(tmp_path / "st")
    return tmp_path / "st"


class _Halving:
    """A scheduler that sets no ``initial_lr`` (as ``ReduceLROnPlateau``): it halves the learning rate each step."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        for group in self.optimizer.param_groups:
            group["lr"] /= 2

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


def _step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _lambda_lr(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda updates: 1 / (updates + 1))


class _SetHyperparameters(TrainerCallback):
    """Sets hyperparameters of every group as the run starts: a resume that trains with changed values by hand."""

    def __init__(self, **values):
        self.values = values

    def on_training_run_start(self, trainer, **kwargs):
        for group in trainer.optimizer.param_groups:
            group.update(self.values)


@pytest.mark.parametrize(
    ("key", "given", "pattern"),
    [
        ("lr", {"lr": 0.5}, r"param_groups\[0\]\['lr'\]: saved 0\.05, now 0\.5"),
        ("momentum", {"momentum": 0.5}, r"param_groups\[0\]\['momentum'\]: saved 0\.9, now 0\.5"),
        ("weight_decay", {"weight_decay": 0.1}, r"param_groups\[0\]\['weight_decay'\]: saved 0, now 0\.1"),
        ("nesterov", {"nesterov": True}, r"param_groups\[0\]\['nesterov'\]: saved False, now True"),
    ],
)
def test_resume_refuses_a_changed_hyperparameter(tmp_path, key, given, pattern):
    state = _saved_state(tmp_path)
    trainer = _trainer(**given)
    with pytest.raises(CheckpointError, match=rf"(?s)set up differently.*{pattern}.*allow_resume_changes=True"):
        _train(trainer, num_epochs=2, resume_from=state)
    assert trainer.run_state.num_update_steps_completed == 0  # refused before anything was loaded


def test_resume_ignores_the_optimizer_implementation_flags(tmp_path):
    state = _saved_state(tmp_path)
    _train(_trainer(foreach=True), num_epochs=2, resume_from=state)


def test_resume_with_changes_allowed_trains_with_the_given_hyperparameters(tmp_path, capsys):
    state = _saved_state(tmp_path)
    trainer = _trainer(lr=0.5, momentum=0.5)
    _train(trainer, num_epochs=2, resume_from=state, allow_resume_changes=True)
    assert "optimizer param_groups[0]['lr']: saved 0.05, now 0.5" in capsys.readouterr().out
    assert [(group["lr"], group["momentum"]) for group in trainer.optimizer.param_groups] == [(0.5, 0.5)]
    by_hand = _trainer(callbacks=[_SetHyperparameters(lr=0.5, momentum=0.5)])
    _train(by_hand, num_epochs=2, resume_from=state)  # the saved values, then the given ones set before training
    assert torch.equal(trainer.model.weight, by_hand.model.weight)
    as_saved = _trainer()
    _train(as_saved, num_epochs=2, resume_from=state)
    assert not torch.equal(trainer.model.weight, as_saved.model.weight)


def test_resume_with_a_scheduler_compares_the_initial_learning_rate(tmp_path):
    state = _saved_state(tmp_path, scheduler=_step_lr)
    trainer = _trainer()
    _train(trainer, num_epochs=2, resume_from=state, create_scheduler_fn=_step_lr)  # the decayed lr is no change
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**8)
    with pytest.raises(CheckpointError, match=r"(?s)'initial_lr'\]: saved 0\.05, now 0\.5"):
        _train(_trainer(lr=0.5), num_epochs=2, resume_from=state, create_scheduler_fn=_step_lr)


@pytest.mark.parametrize(
    "scheduler",
    [
        lambda optimizer: torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=8),
        lambda optimizer: torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=0.01, max_lr=0.1, step_size_up=3),
        _Halving,
    ],
    ids=["OneCycleLR", "CyclicLR", "without_initial_lr"],
)
def test_resume_with_a_scheduler_ignores_what_it_moves(tmp_path, scheduler):
    state = _saved_state(tmp_path, scheduler=scheduler)
    _train(_trainer(), num_epochs=2, resume_from=state, create_scheduler_fn=scheduler)


@pytest.mark.parametrize(
    ("scheduler", "expected_lr"),
    [(_step_lr, 0.5 * 0.5**8), (_lambda_lr, 0.5 / 9)],
    ids=["StepLR", "LambdaLR"],
)
def test_resume_with_changes_allowed_rescales_the_schedule(tmp_path, scheduler, expected_lr):
    state = _saved_state(tmp_path, scheduler=scheduler)
    trainer = _trainer(lr=0.5)
    _train(trainer, num_epochs=2, resume_from=state, create_scheduler_fn=scheduler, allow_resume_changes=True)
    group = trainer.optimizer.param_groups[0]
    assert (group["initial_lr"], trainer.scheduler.base_lrs) == (0.5, [0.5])
    assert group["lr"] == pytest.approx(expected_lr)


def test_resume_past_num_epochs_is_refused(tmp_path):
    state = _saved_state(tmp_path, num_epochs=3)
    with pytest.raises(CheckpointError, match=r"(?s)3 epochs.*num_epochs=2"):
        _train(_trainer(), num_epochs=2, resume_from=state)


def test_resume_past_max_num_train_steps_is_refused(tmp_path):
    state = _saved_state(tmp_path, num_epochs=2)  # 8 updates
    with pytest.raises(CheckpointError, match=r"(?s)8 optimizer updates.*max_num_train_steps=5"):
        _train(_trainer(), num_epochs=3, max_num_train_steps=5, resume_from=state)


def test_resume_of_a_finished_run_loads_it_and_says_there_is_nothing_left(tmp_path, capsys):
    state = _saved_state(tmp_path, num_epochs=2)
    finished = _trainer()
    _train(finished, num_epochs=2)
    capsys.readouterr()
    trainer = _trainer()
    result = _train(trainer, num_epochs=2, resume_from=state)
    assert f"nothing left to train: {state / 'checkpoint-00000008'} already trained 2 epochs (num_epochs=2)" in (
        capsys.readouterr().out
    )
    assert result.nothing_left_to_train and not result.stopped_early
    assert (result.num_epochs, result.num_update_steps) == (0, 8)
    assert torch.equal(trainer.model.weight, finished.model.weight)


def test_resume_at_max_num_train_steps_makes_no_further_update(tmp_path, capsys):
    state = _saved_state(tmp_path, num_epochs=2)  # 8 updates
    result = _train(_trainer(), num_epochs=3, max_num_train_steps=8, resume_from=state)
    assert "already made 8 optimizer updates (max_num_train_steps=8)" in capsys.readouterr().out
    assert result.nothing_left_to_train and result.num_update_steps == 8


def test_a_new_run_has_something_left_to_train(tmp_path):
    assert not _train(_trainer(), num_epochs=1).nothing_left_to_train


@pytest.fixture(scope="module")
def two_process_states(tmp_path_factory):
    """The training states of a 2-process run of tests/scripts/resume_run.py (one per update, and the final one)."""
    folder = tmp_path_factory.mktemp("two_process_states")
    saved = _launch_resume_run({"save_dir": str(folder / "states"), "out": str(folder / "out.pt"), "size": 8}, 2)
    assert saved.returncode == 0, saved.stderr[-3000:]
    return folder / "states"


def _launch_resume_run(config, num_processes):
    command = [*launcher(num_processes), str(RESUME_RUN_SCRIPT), json.dumps({"epochs": 1, **config})]
    return subprocess.run(command, env=CPU_PROCESSES_ENV, capture_output=True, text=True, timeout=240)


def _with_edited_manifest(two_process_states, tmp_path, world_size, also=()):
    """A copy of ``two_process_states`` whose newest state's manifest says ``world_size`` (its files untouched), and
    ``also`` (``"files"``: no longer lists process 1's file; ``"run_facts"``: its run's settings say the same);
    returns the folder of states and the edited state."""
    states = shutil.copytree(two_process_states, tmp_path / "states")
    edited = max((path for path in states.iterdir() if (path / "manifest.json").is_file()), key=_update_count)
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["world_size"] = world_size
    if "files" in also:
        del manifest["files"]["rank_00001.pt"]
    if "run_facts" in also:
        manifest["run_facts"]["world_size"] = world_size
    (edited / "manifest.json").write_text(json.dumps(manifest))
    return states, edited


def _update_count(state):
    manifest = json.loads((state / "manifest.json").read_text())
    return manifest["num_update_steps_completed"], state.name == "final"


@pytest.mark.distributed
def test_state_lookup_skips_a_manifest_whose_world_size_disagrees_with_its_rank_files(two_process_states, tmp_path):
    states, edited = _with_edited_manifest(two_process_states, tmp_path, world_size=1)
    config = {"save_dir": str(states), "out": str(tmp_path / "out.pt"), "epochs": 2, "size": 8}
    resumed = _launch_resume_run(config, 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Skipped a damaged training state (resuming from {states}" in resumed.stderr
    assert "world_size is 1; it must be the number of rank files listed (2)" in resumed.stderr
    assert "Resuming from" in resumed.stdout and f"Resuming from {edited} " not in resumed.stdout


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("also", "problem"),
    [
        ((), "world_size is 1; it must be the number of rank files listed (2)"),
        (("files",), "damaged manifest: world_size is 1, but its run_facts say 2"),
        (("files", "run_facts"), "trainer_state.pt: saved by 2 process(es), but manifest.json says 1; it was altered"),
    ],
    ids=["rank_files", "manifest_run_facts", "trainer_file"],
)
def test_resume_refuses_a_named_state_whose_manifest_world_size_was_edited(two_process_states, tmp_path, also, problem):
    """The resume on 1 process (this one: resume_run.py's run, as its launch on 1 process runs it) is refused."""
    _, edited = _with_edited_manifest(two_process_states, tmp_path, 1, also)
    config = {"save_dir": str(tmp_path / "new"), "out": str(tmp_path / "out.pt"), "resume_from": str(edited)}
    with pytest.raises(CheckpointError, match=re.escape(problem)):
        resume_run.run({**config, "epochs": 2, "size": 8})
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("name", ["manifest.json", "  ", "latest", ".tmp-x"])
def test_save_training_state_refuses_a_name_the_folder_needs(tmp_path, name):
    trainer = _trainer()
    _train(trainer, num_epochs=1)
    with pytest.raises(ValueError, match="name"):
        trainer.save_training_state(tmp_path / "st", name=name)
