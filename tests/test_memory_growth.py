"""A long run's memory stays flat: nothing a step allocates is kept for the steps after it.

The loss sums (the trainer's, the progress bar's, the trackers') and the step metrics add each step's values into one
tensor in place. Keeping references to them until a later sum held each step's loss storage, allocated among the
step's activations, which kept the CPU allocator from reusing or returning that memory: a small GPT-2 grew by about
2 MiB a step (benchmarks/memory_growth.py). Checked two ways: the live tensors counted across steps (quick, exact), and
the resident memory of a real run of a few hundred steps in a process of its own.
"""

from __future__ import annotations

import gc
import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import launcher, linear_dataset, make_linear
from torch import nn

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
from pytorch_accel_trainer.callbacks import ExperimentTrackingCallback, TrainerCallback

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The steps at which the live tensors are counted: after the first steps made what a run keeps, and near the end.
FIRST_COUNT, LAST_COUNT = 6, 60


def _live_tensors() -> int:
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))  # type(): no __class__ lookup


class CountsLiveTensors(TrainerCallback):
    """Counts the tensors alive at the start of steps ``FIRST_COUNT`` and ``LAST_COUNT``, of training and evaluation."""

    def __init__(self):
        self.counts: dict = {}
        self._steps = {"train": 0, "eval": 0}

    def _count(self, phase: str) -> None:
        self._steps[phase] += 1
        if self._steps[phase] in (FIRST_COUNT, LAST_COUNT):
            self.counts[(phase, self._steps[phase])] = _live_tensors()

    def on_train_step_start(self, trainer, **kwargs):
        self._count("train")

    def on_eval_step_start(self, trainer, **kwargs):
        self._count("eval")


class WithStepMetrics(Trainer):
    """Returns a tensor step metric and a tensor ``num_items_in_batch`` (a tensor weight) beside the loss."""

    def calculate_train_batch_loss(self, batch) -> dict:
        output = super().calculate_train_batch_loss(batch)
        error = (output["model_outputs"] - batch[1]).abs().mean().detach()
        return {**output, "abs_error": error, "num_items_in_batch": torch.tensor(batch[1].numel())}

    def calculate_eval_batch_loss(self, batch) -> dict:
        output = super().calculate_eval_batch_loss(batch)
        return {**output, "abs_error": (output["model_outputs"] - batch[1]).abs().mean()}


@pytest.mark.parametrize("trainer_class", [Trainer, WithStepMetrics])
def test_steps_keep_no_tensor(no_gc, tmp_path, trainer_class):
    """As many tensors are alive at step 60 as at step 6, in training and in evaluation, with the default callbacks
    and the trackers' callback: no sum keeps a tensor a step (each held its loss's storage)."""
    model, counter = make_linear(), CountsLiveTensors()
    tracking = ExperimentTrackingCallback(["csv"], logging_dir=tmp_path, log_every_n_steps=1000)
    callbacks = [*DEFAULT_CALLBACKS, tracking, counter]
    trainer = trainer_class(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01), callbacks=callbacks)
    trainer.train(linear_dataset(128), num_epochs=1, per_device_batch_size=2, eval_dataset=linear_dataset(128))
    counts = counter.counts
    grown = {phase: counts[(phase, LAST_COUNT)] - counts[(phase, FIRST_COUNT)] for phase in ("train", "eval")}
    assert grown == {"train": 0, "eval": 0}, f"more tensors alive at step {LAST_COUNT} than at step {FIRST_COUNT}"
    assert trainer.run_history.get_latest_metric("train_loss_epoch") > 0


@pytest.mark.slow
def test_long_run_memory_stays_flat():
    """A small GPT-2 (vocabulary 1024) trained 160 steps by the Trainer with its default callbacks, in a process of
    its own (forked from the warm launcher, as the benchmark's smoke run forks its rows): its resident memory at the
    start of each step from step 20 on stays within 40 MiB of step 20's (it grew by 131 MiB by step 160, then by
    about 2 MiB a step; a hand-written loop stays within about 10)."""
    completed = subprocess.run(
        [*launcher(1), "benchmarks/memory_growth.py", "--worker", "trainer_default", "--steps", "160"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    reads = json.loads(completed.stdout.strip().splitlines()[-1])["rss_at_step_start_mib"]
    assert len(reads) == 160
    growth = [round(read - reads[19]) for read in reads[19::20]]
    assert max(reads[19:]) - reads[19] < 40, f"MiB above step 20's, every 20 steps: {growth}"
