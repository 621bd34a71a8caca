"""Every training state knows its run: two runs never mix in one folder, and resume_from says what it found
(issue 24, findings 1 to 3)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import regression_dataset
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.state.training_state import MANIFEST_NAME, CheckpointError


class DieAtEpoch(Exception):
    """Stands for the process dying."""


class DieAt(TrainerCallback):
    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, **kwargs):
        if trainer.run_history.current_epoch == self.epoch:
            raise DieAtEpoch()


def _trainer(save_dir, lr, die_at=None, **callback_kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    callbacks = [SaveTrainingStateCallback(save_dir, save_every_n_epochs=1, **callback_kwargs)]
    if die_at is not None:
        callbacks.append(DieAt(die_at))
    return Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=lr), callbacks=callbacks)


def _train(trainer, resume_from=None, num_epochs=6):
    trainer.train(regression_dataset(8), num_epochs=num_epochs, per_device_batch_size=2, resume_from=resume_from)


def _manifests(folder):
    return {path.parent.name: json.loads(path.read_text()) for path in folder.glob(f"*/{MANIFEST_NAME}")}


def test_a_new_run_refuses_a_folder_with_another_runs_states_before_any_step(tmp_path):
    ck = tmp_path / "ck"
    _train(_trainer(ck, lr=0.1, max_checkpoints=3))  # run A
    a_states = _manifests(ck)
    assert sorted(a_states) == ["epoch_5", "epoch_6", "final"]
    assert len({manifest["run_id"] for manifest in a_states.values()}) == 1  # each state names its run
    trainer_b = _trainer(ck, lr=0.5, max_checkpoints=3)
    weights_before = trainer_b.model.weight.detach().clone()
    with pytest.raises(
        CheckpointError,
        match=(
            r"(?s)ck holds training states of another run \(epoch_5, epoch_6, final \(run [0-9a-f]{32}\)\), and this "
            r"run is a new run \(no state resumed\).*another folder.*resume_from=.*ck'.*allow_other_runs=True"
        ),
    ):
        _train(trainer_b)
    assert torch.equal(trainer_b.model.weight, weights_before)  # refused before any step
    assert _manifests(ck) == a_states


def test_two_runs_kept_apart_in_one_folder_prune_and_resume_their_own_states(tmp_path, capsys):
    """Issue 24, finding 1: run B in run A's folder (allowed explicitly), with max_checkpoints, dies in epoch 4;
    its resume continues B (B's learning rate, B's update count), and neither run prunes the other's states."""
    ck = tmp_path / "ck"
    _train(_trainer(ck, lr=0.1, max_checkpoints=3))  # run A: 6 epochs of 4 updates
    a_states = _manifests(ck)
    with pytest.raises(DieAtEpoch):
        _train(_trainer(ck, lr=0.5, die_at=4, max_checkpoints=3, allow_other_runs=True))  # run B
    states = _manifests(ck)
    b_states = {name: manifest for name, manifest in states.items() if name not in a_states}
    assert sorted(b_states) == ["epoch_1", "epoch_2", "epoch_3"]  # not pruned for A's later ones
    assert {name: states[name] for name in a_states} == a_states  # A's untouched
    (b_run,) = {manifest["run_id"] for manifest in b_states.values()}
    assert (ck / "latest").read_text().strip() == "epoch_3"
    capsys.readouterr()
    resumed = _trainer(ck, lr=0.3, max_checkpoints=3, allow_other_runs=True)
    with pytest.warns(UserWarning, match=r"also holds the states of other runs \(epoch_5, epoch_6, final"):
        _train(resumed, resume_from=ck, num_epochs=4)
    assert f"Resuming from {ck / 'epoch_3'} (after 12 optimizer updates), run {b_run}" in capsys.readouterr().out
    assert resumed.optimizer.param_groups[0]["lr"] == 0.5  # B's optimizer state, not A's (0.1)
    assert resumed.num_update_steps_completed == 16
    states = _manifests(ck)
    assert {name: states[name] for name in a_states} == a_states  # B's pruning left A's states alone
    assert sorted(name for name in states if states[name]["run_id"] == b_run) == ["epoch_3", "epoch_4", "final-2"]


def test_a_state_saved_before_runs_had_an_identity_still_resumes_and_counts_as_another_run(tmp_path, capsys):
    ck = tmp_path / "ck"
    _train(_trainer(ck, lr=0.1), num_epochs=2)
    for path in ck.glob(f"*/{MANIFEST_NAME}"):  # as an earlier version wrote them
        manifest = json.loads(path.read_text())
        del manifest["run_id"]
        path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"\(no run identity: saved by an earlier version\)"):
        _train(_trainer(ck, lr=0.1), num_epochs=3)
    trainer = _trainer(ck, lr=0.1)
    _train(trainer, resume_from=ck, num_epochs=3)
    assert f"Resuming from {ck / 'final'} (after 8 optimizer updates)" in capsys.readouterr().out
    assert trainer.num_update_steps_completed == 12


def test_resume_from_says_what_it_found(tmp_path, capsys):
    """Issue 24, finding 2: only an absent or empty folder starts a new run; a run folder means its states."""
    trainer = _trainer(tmp_path / "ck", lr=0.1)
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("not a state")
    with pytest.raises(CheckpointError, match=r"resume_from='.*stray' holds notes.txt but no training state"):
        _train(trainer, resume_from=stray)
    link = tmp_path / "link"
    link.symlink_to(stray)
    with pytest.raises(CheckpointError, match="holds notes.txt but no training state"):
        _train(trainer, resume_from=link)
    run_folder = tmp_path / "runs" / "x"
    _train(_trainer(run_folder / "training_states", lr=0.1), num_epochs=1)
    (run_folder / "config.yaml").write_text("model: {}\n")
    resumed = _trainer(run_folder / "training_states", lr=0.1)
    _train(resumed, resume_from=run_folder, num_epochs=2)
    assert f"from {run_folder / 'training_states' / 'final'} (after 4 optimizer updates" in capsys.readouterr().out
    assert resumed.num_update_steps_completed == 8
    empty = tmp_path / "empty"
    empty.mkdir()
    _train(_trainer(empty, lr=0.1), resume_from=empty, num_epochs=1)
    assert "empty' holds no training state yet: starting a new run." in capsys.readouterr().out


def test_an_older_state_whose_manifest_was_edited_is_skipped_not_fatal(tmp_path):
    """Issue 24, finding 3: a manifest edited to look newer than its files is a damaged state, skipped as
    docs/training_state.md says, and the newest good state is resumed."""
    ck = tmp_path / "ck"
    _train(_trainer(ck, lr=0.1, save_at_end=False), num_epochs=2)
    path = ck / "epoch_1" / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["num_update_steps_completed"] = 999
    path.write_text(json.dumps(manifest))
    trainer = _trainer(ck, lr=0.1, save_at_end=False)
    with pytest.warns(UserWarning, match=r"(?s)Skipped a damaged training state \(resuming from .*epoch_2\).*epoch_1"):
        _train(trainer, resume_from=ck, num_epochs=3)
    assert trainer.num_update_steps_completed == 12


def test_a_second_train_call_of_the_same_callback_is_not_refused(tmp_path, capsys):
    """Progressive unfreezing: one script, one trainer and callback, train() twice without resume_from."""
    ck = tmp_path / "ck"
    trainer = _trainer(ck, lr=0.1)
    _train(trainer, num_epochs=1)
    _train(trainer, num_epochs=2)
    runs = {name: manifest["run_id"] for name, manifest in _manifests(ck).items()}
    assert sorted(runs) == ["epoch_1", "epoch_1-2", "epoch_2", "final", "final-2"]
    assert runs["epoch_1"] == runs["final"] != runs["epoch_1-2"] == runs["epoch_2"] == runs["final-2"]
    capsys.readouterr()
    with pytest.warns(UserWarning, match=r"also holds the states of other runs \(epoch_1, final \(run"):
        _train(_trainer(ck, lr=0.1), resume_from=ck, num_epochs=3)  # the second call's run, saved last
    assert (
        f"Resuming from {ck / 'final-2'} (after 8 optimizer updates), run {runs['final-2']}" in capsys.readouterr().out
    )
