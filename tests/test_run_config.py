"""The pure arithmetic of the run length."""

from __future__ import annotations

import dataclasses

import pytest

from pytorch_accel_trainer.run_config import TrainerRunConfig, count_update_steps, plan_run_length

PYTORCH_ACCELERATED_FIELDS = {
    "num_epochs",
    "train_per_device_batch_size",
    "train_dl_kwargs",
    "eval_per_device_batch_size",
    "eval_dl_kwargs",
    "gradient_accumulation_steps",
    "train_total_batch_size",
    "eval_total_batch_size",
    "num_update_steps_per_epoch",
    "num_local_update_steps_per_epoch",
    "max_num_train_steps",
    "is_local_process_zero",
    "is_world_process_zero",
    "is_distributed",
    "mixed_precision",
    "gradient_clip_value",
    "num_processes",
}


@pytest.mark.parametrize(("batches", "accumulation", "expected"), [(10, 1, 10), (10, 4, 3), (8, 4, 2), (None, 2, None)])
def test_count_update_steps_partial_window(batches, accumulation, expected):
    assert count_update_steps(batches, accumulation) == expected


@pytest.mark.parametrize(
    ("num_epochs", "max_steps", "per_epoch", "expected"),
    [
        (3, None, 10, (3, 30)),
        (3, 25, 10, (3, 25)),
        (3, 50, 10, (3, 30)),
        (None, 25, 10, (3, 25)),
        (5, 10, 10, (1, 10)),
        (2, None, None, (2, None)),
        (None, 7, None, (None, 7)),
    ],
)
def test_plan_run_length_first_limit_wins(num_epochs, max_steps, per_epoch, expected):
    assert plan_run_length(num_epochs, max_steps, per_epoch) == expected


def test_run_config_has_every_peer_field():
    """TrainerRunConfig has every field of pytorch-accelerated's run config."""
    assert PYTORCH_ACCELERATED_FIELDS <= {field.name for field in dataclasses.fields(TrainerRunConfig)}
