"""No host-device synchronisation on ordinary training steps with the default callbacks."""

from __future__ import annotations

import collections
import sys

import pytest
import torch
from conftest import linear_dataset, make_linear

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback

SYNCING_METHODS = ("item", "__bool__", "tolist", "cpu", "__float__", "__int__", "numpy")


def _from_data_pipeline() -> bool:
    """Whether the caller is torch's sampler or collation: host-side tensors by design, never a device sync."""
    frame = sys._getframe(2)
    while frame is not None:
        if "torch/utils/data/" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


def test_no_sync_outside_check_interval(monkeypatch):
    """Two hundred steps make no sync outside the check interval and the epoch end."""
    syncs: collections.Counter = collections.Counter()
    phase = {"now": "setup"}

    class StepMarker(TrainerCallback):
        def on_train_step_start(self, trainer, **kwargs):
            phase["now"] = phase.get("next_step", 0)
            phase["next_step"] = phase["now"] + 1

    class MarkingTrainer(Trainer):
        def train_epoch_end(self):
            phase["now"] = "epoch_end"

    for name in SYNCING_METHODS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            if not _from_data_pipeline():
                syncs[phase["now"]] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)

    model = make_linear()
    trainer = MarkingTrainer(
        model,
        torch.nn.MSELoss(),
        torch.optim.SGD(model.parameters(), lr=0.01),
        callbacks=[StepMarker, *DEFAULT_CALLBACKS],
    )
    trainer.train(linear_dataset(800), num_epochs=1, per_device_batch_size=4)

    assert trainer.num_update_steps_completed == 200
    checked_steps = {99, 199}  # TerminateOnNaNCallback reads its flag every 100 steps, by design
    ordinary = {step: count for step, count in syncs.items() if isinstance(step, int) and step not in checked_steps}
    assert ordinary == {}
    assert 1 <= syncs["epoch_end"] <= 3
    assert all(syncs[step] == 1 for step in checked_steps)


@pytest.mark.parametrize("max_time", [None, 3600], ids=["no-budget", "time-budget"])
def test_with_no_callbacks_no_step_syncs_at_all(monkeypatch, max_time):
    calls = []
    for name in SYNCING_METHODS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            if not _from_data_pipeline():
                calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    model = make_linear()
    trainer = Trainer(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01), callbacks=())
    trainer.train(
        linear_dataset(400), num_epochs=1, per_device_batch_size=2, gradient_accumulation_steps=2, max_time=max_time
    )
    assert trainer.num_update_steps_completed == 100
    assert calls == ["tolist"]  # the one read of the epoch's loss; a time budget reads a clock, no tensor
