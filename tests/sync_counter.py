"""Counts host-device synchronising tensor reads made during training steps (a helper, not a test module)."""

from __future__ import annotations

import torch
from conftest import make_trainer
from test_syncs import SYNCING_METHODS, _from_data_pipeline

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback


def count_syncs_in_steps(monkeypatch, trainer_class=Trainer) -> tuple:
    """Return ``(subclass, marker, reads)``: a subclass of ``trainer_class`` and a callback to pass to it, and the
    list that collects every syncing tensor read made inside a training step.

    A step runs from ``on_train_step_start`` until the next one, or until ``train_epoch_end`` for the last.
    """
    phase = {"in_step": False}

    class MarkStepStart(TrainerCallback):
        def on_train_step_start(self, trainer, **kwargs):
            phase["in_step"] = True

    class MarkStepsDone(trainer_class):
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
    return MarkStepsDone, MarkStepStart(), reads


def make_sync_counting_trainer(monkeypatch, model, callbacks=(), trainer_class=Trainer, **kwargs) -> tuple:
    """Return ``(trainer, reads)``: a ``trainer_class`` of ``model`` (conftest's make_trainer), and the list that
    collects every syncing tensor read made inside a training step (see count_syncs_in_steps)."""
    counting_class, marker, reads = count_syncs_in_steps(monkeypatch, trainer_class)
    trainer = make_trainer(model, callbacks=[marker, *callbacks], trainer_class=counting_class, **kwargs)
    return trainer, reads
