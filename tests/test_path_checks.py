"""Paths and files given to the trainer: a path of the wrong kind or a file that is no checkpoint gets one clear
error, before anything is written; the files it writes follow the umask and never hold NaN weights."""

from __future__ import annotations

import os
import stat

import pytest
import safetensors.torch
import torch
from conftest import make_linear, make_trainer, regression_dataset
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import NonFiniteLossError, SaveTrainingStateCallback, TerminateOnNaNCallback
from pytorch_accel_trainer.cli.run_folder import RunFolderCallback


def _trainer(callbacks=(), lr=0.1, model=None):
    torch.manual_seed(0)
    model = model or nn.Linear(4, 1)
    return Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=lr), callbacks=list(callbacks))


@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    yield
    os.umask(previous)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("layout", ["one_file", "sharded"])
def test_written_files_follow_the_umask(tmp_path, request, umask_027, layout):
    """Weights, training states (of either layout) and the run folder's files follow the umask like every other
    file."""
    if layout == "sharded":
        request.getfixturevalue("sharded_layout")
    trainer = _trainer([SaveTrainingStateCallback(tmp_path / "states"), RunFolderCallback(tmp_path, "run")])
    trainer.train(regression_dataset(4), num_epochs=1, per_device_batch_size=2)
    trainer.save_weights(tmp_path / "weights.safetensors")
    state = tmp_path / "states" / "final"
    written = [
        tmp_path / "weights.safetensors",
        tmp_path / "run" / "model.safetensors",
        *([state / "parts.pt"] if layout == "one_file" else [state / "__0_0.distcp", state / ".metadata"]),
        state / "trainer_state.pt",
        state / "rank_00000.pt",
        state / "manifest.json",
        tmp_path / "run" / "run_config.json",
    ]
    modes = {str(path.relative_to(tmp_path)): _mode(path) for path in written}
    assert modes == {str(path.relative_to(tmp_path)): 0o640 for path in written}


def test_save_paths_of_the_wrong_kind(tmp_path, monkeypatch):
    """A save path of the wrong kind is a clear error; a failed write leaves no temporary file."""
    trainer = _trainer()
    trainer.train(regression_dataset(4), num_epochs=1, per_device_batch_size=2)
    (tmp_path / "afile.txt").write_text("notes")
    with pytest.raises(NotADirectoryError, match=r"afile.txt' is a file, not a folder of training states: pass a"):
        trainer.save_training_state(tmp_path / "afile.txt")
    (tmp_path / "a_directory").mkdir()
    with pytest.raises(IsADirectoryError, match=r"save_weights\('.*a_directory'\): a folder; pass the file to write"):
        trainer.save_weights(tmp_path / "a_directory")

    def fail_midway(model, filename, *args, **kwargs):  # stands for a disk that fills up during the write
        with open(filename, "wb") as handle:
            handle.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_model", fail_midway)
    with pytest.raises(OSError, match="No space left"):
        trainer.save_weights(tmp_path / "model.safetensors")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a_directory", "afile.txt"]


def test_non_checkpoint_files_are_named(tmp_path):
    """A file that is no checkpoint is named for what it is: random bytes, safetensors, a folder."""
    trainer = _trainer()
    (tmp_path / "random.pt").write_bytes(bytes(range(7, 207)))
    with pytest.raises(ValueError, match=r"random.pt' is not a file written by torch.save \(random bytes"):
        trainer.load_checkpoint(tmp_path / "random.pt")
    trainer.save_weights(tmp_path / "run" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors' is a safetensors file .*load_model\(model, path\)"):
        trainer.load_checkpoint(tmp_path / "run" / "model.safetensors")
    with pytest.raises(IsADirectoryError, match=r"run' is a folder, not a checkpoint file \(its model.safetensors"):
        trainer.load_checkpoint(tmp_path / "run")


def test_save_training_state_before_train(tmp_path):
    """save_training_state before any train() says to train first, or to save the weights alone."""
    trainer = make_trainer(make_linear())
    with pytest.raises(
        RuntimeError,
        match=r"this trainer has not run train\(\) yet. Call it during or after train\(\); to save the weights alone, "
        r"use save_checkpoint\(save_path\) or save_weights\(save_path\)",
    ):
        trainer.save_training_state(tmp_path / "states")
    assert not (tmp_path / "states").exists()


def test_run_folder_name_and_nan_weights(tmp_path, capsys):
    """A run folder stays inside output_dir, and keeps no NaN or infinite weights."""
    with pytest.raises(ValueError, match=r"run_name is '../escaped': it must be one plain folder name"):
        RunFolderCallback(tmp_path, "../escaped")
    trainer = _trainer([TerminateOnNaNCallback(), RunFolderCallback(tmp_path, "nan")], lr=1e30)
    with pytest.raises(NonFiniteLossError):
        trainer.train(regression_dataset(8), num_epochs=1, per_device_batch_size=2)
    assert not (tmp_path / "nan" / "model.safetensors").exists()
    assert "model.safetensors was not written: the model's weights are NaN or infinite" in capsys.readouterr().out
