"""A careless user's mistakes with the Python API, each caught before any work with one clear error, and files
written as a user expects (issue 24, findings 7 and 9 to 12)."""

from __future__ import annotations

import os
import stat

import pytest
import safetensors.torch
import torch
from conftest import StreamDataset, regression_dataset
from torch import nn
from torch.utils.data import DataLoader

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import (
    EarlyStoppingCallback,
    NonFiniteLossError,
    SaveTrainingStateCallback,
    TerminateOnNaNCallback,
)
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


def test_weights_and_states_follow_the_umask_like_every_other_file(tmp_path, umask_027):
    trainer = _trainer([SaveTrainingStateCallback(tmp_path / "states"), RunFolderCallback(tmp_path, "run")])
    trainer.train(regression_dataset(4), num_epochs=1, per_device_batch_size=2)
    trainer.save_weights(tmp_path / "weights.safetensors")
    written = [
        tmp_path / "weights.safetensors",
        tmp_path / "run" / "model.safetensors",
        tmp_path / "states" / "final" / "model.safetensors",
        tmp_path / "states" / "final" / "optimizer.pt",
        tmp_path / "run" / "run_config.json",
    ]
    assert {path.name: _mode(path) for path in written} == {path.name: 0o640 for path in written}


def test_save_paths_of_the_wrong_kind_are_clear_errors_and_leave_no_temporary(tmp_path, monkeypatch):
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


def test_files_that_are_no_checkpoint_are_named_for_what_they_are(tmp_path):
    trainer = _trainer()
    (tmp_path / "random.pt").write_bytes(bytes(range(7, 207)))
    with pytest.raises(ValueError, match=r"random.pt' is not a file written by torch.save \(random bytes"):
        trainer.load_checkpoint(tmp_path / "random.pt")
    trainer.save_weights(tmp_path / "run" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors' is a safetensors file .*load_model\(model, path\)"):
        trainer.load_checkpoint(tmp_path / "run" / "model.safetensors")
    with pytest.raises(IsADirectoryError, match=r"run' is a folder, not a checkpoint file \(its model.safetensors"):
        trainer.load_checkpoint(tmp_path / "run")


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x):
        return {"logits": self.linear(x)}


def test_mistakes_found_before_the_first_batch(tmp_path):
    trainer = _trainer([EarlyStoppingCallback()])
    before = trainer.model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"EarlyStoppingCallback watches 'eval_loss_epoch', .* no eval_dataset"):
        trainer.train(regression_dataset(8), num_epochs=2, per_device_batch_size=2)
    with pytest.raises(ValueError, match=r"SaveTrainingStateCallback watches 'eval_loss_epoch'"):
        _trainer([SaveTrainingStateCallback(tmp_path, watch_metric="eval_loss_epoch")]).train(
            regression_dataset(8), num_epochs=2, per_device_batch_size=2
        )
    eval_loader = DataLoader(regression_dataset(3), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match=r"eval_dataset has 3 samples, fewer than one batch \(4\).*drop_last=True"):
        trainer.train(regression_dataset(8), num_epochs=2, eval_dataset=eval_loader, per_device_batch_size=2)
    x, y = regression_dataset(8).tensors
    with pytest.raises(
        TypeError, match=r"train_dataset is a tuple of 2 tensors of 8 rows, not a dataset.*TensorDataset"
    ):
        trainer.train((x, y), num_epochs=1)
    with pytest.raises(TypeError, match=r"train_dataset is a dict of tensors \(x, y\), not a dataset"):
        trainer.train({"x": x, "y": y}, num_epochs=1)
    assert torch.equal(trainer.model.weight, before)  # nothing trained
    dict_trainer = _trainer(model=DictModel())
    with pytest.raises(TypeError, match=r"failed on the model's output, a dict with keys \['logits'\], not a tensor"):
        dict_trainer.train(regression_dataset(8), num_epochs=1, per_device_batch_size=2)


def test_a_stream_without_a_step_limit_is_warned_about_at_the_start():
    with pytest.warns(UserWarning, match=r"StreamDataset\) has no length.*an infinite stream trains forever.*max_num"):
        _trainer().train(StreamDataset(regression_dataset(4)), num_epochs=1, per_device_batch_size=2)


def test_a_run_folder_keeps_no_non_finite_weights_and_stays_inside_output_dir(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"run_name is '../escaped': it must be one plain folder name"):
        RunFolderCallback(tmp_path, "../escaped")
    trainer = _trainer([TerminateOnNaNCallback(), RunFolderCallback(tmp_path, "nan")], lr=1e30)
    with pytest.raises(NonFiniteLossError):
        trainer.train(regression_dataset(8), num_epochs=1, per_device_batch_size=2)
    assert not (tmp_path / "nan" / "model.safetensors").exists()
    assert "model.safetensors was not written: the model's weights are NaN or infinite" in capsys.readouterr().out
