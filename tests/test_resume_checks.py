"""What a resume checks against the run it continues: hyperparameters, targets already reached, a manifest that
disagrees, state names the folder needs."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import regression_dataset
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.errors import CheckpointError


def _trainer(lr=0.05):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))


def _train(trainer, **kwargs):
    return trainer.train(regression_dataset(8), per_device_batch_size=2, **kwargs)


def _saved_state(tmp_path, lr=0.05, num_epochs=1, scheduler=None):
    trainer = _trainer(lr)
    _train(trainer, num_epochs=num_epochs, create_scheduler_fn=scheduler)
    trainer.save_training_state(tmp_path / "st")
    return tmp_path / "st"


def test_resume_refuses_a_changed_learning_rate(tmp_path):
    state = _saved_state(tmp_path, lr=0.05)
    with pytest.raises(CheckpointError, match=r"(?s)lr.*0\.05.*0\.5.*allow_resume_changes"):
        _train(_trainer(lr=0.5), num_epochs=2, resume_from=state)


def test_resume_with_changes_allowed_trains_with_the_given_learning_rate(tmp_path):
    state = _saved_state(tmp_path, lr=0.05)
    trainer = _trainer(lr=0.5)
    _train(trainer, num_epochs=2, resume_from=state, allow_resume_changes=True)
    assert [group["lr"] for group in trainer.optimizer.param_groups] == [0.5]
    same = _trainer(lr=0.05)
    _train(same, num_epochs=2, resume_from=state)
    assert not torch.equal(trainer.model.weight, same.model.weight)


def test_resume_with_a_scheduler_compares_the_initial_learning_rate(tmp_path):
    step_lr = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # noqa: E731
    state = _saved_state(tmp_path, lr=0.05, scheduler=step_lr)
    trainer = _trainer(lr=0.05)
    _train(trainer, num_epochs=2, resume_from=state, create_scheduler_fn=step_lr)  # the decayed lr is no change
    with pytest.raises(CheckpointError, match=r"(?s)0\.05.*0\.5"):
        _train(_trainer(lr=0.5), num_epochs=2, resume_from=state, create_scheduler_fn=step_lr)


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


def test_resume_refuses_a_manifest_whose_world_size_disagrees_with_its_files(tmp_path):
    state = _saved_state(tmp_path)
    folder = next(path for path in state.iterdir() if path.is_dir() and not path.name.startswith("."))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["world_size"] = 2
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError):
        _train(_trainer(), num_epochs=2, resume_from=folder)


@pytest.mark.parametrize("name", ["manifest.json", "  ", "latest", ".tmp-x"])
def test_save_training_state_refuses_a_name_the_folder_needs(tmp_path, name):
    trainer = _trainer()
    _train(trainer, num_epochs=1)
    with pytest.raises(ValueError, match="name"):
        trainer.save_training_state(tmp_path / "st", name=name)
