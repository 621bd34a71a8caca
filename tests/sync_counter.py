"""Counts host-device synchronising tensor reads made during training steps (a helper, not a test module)."""

from __future__ import annotations

import torch
from conftest import make_trainer
from test_syncs import SYNCING_METHODS, _from_data_pipeline

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback


def make_sync_counting_trainer(monkeypatch, model, callbacks=(), **kwargs) -> tuple:
    """Return ``(trainer, reads)``: ``reads`` collects every syncing tensor read made inside a training step.

    A step runs from ``on_train_step_start`` until the next one, or until ``train_epoch_end`` for the last.
    """
    phase = {"in_step": False}

    class MarkStepStart(TrainerCallback):
        def on_train_step_start(self, trainer, **kwargs):
            phase["in_step"] = True

    class MarkStepsDone(Trainer):
        def train_epoch_end(self):
            phase["in_step"] = False

    reads: list = []
    for name in SYNCING_METHODS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            if phase["in_step"] and not _from_data_pipeline():
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    trainer = make_trainer(model, callbacks=[MarkStepStart, *callbacks], trainer_class=MarkStepsDone, **kwargs)
    return trainer, reads
