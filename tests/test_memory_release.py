"""Nothing of a finished step is kept while the next one runs: its batch, outputs and loss dict are released once
the step's events have fired, so the peak memory is one step's, as in a hand-written loop.

Proved with weak references taken in the step and read at the start of the next forward pass; the garbage collector
is off during the runs, so what is gone was freed by its last reference going away, as CPython frees tensors.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from conftest import linear_dataset, make_linear
from torch import nn

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback


class WatchedOutputs(Trainer):
    """Takes weak references to each step's outputs, loss and batch; before each forward pass, records which of
    the previous step's are still alive."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.previous: list = []
        self.alive_at_forward: list = []

    def _watch(self, batch, batch_output: dict) -> None:
        self.previous = [weakref.ref(batch_output["model_outputs"]), weakref.ref(batch_output["loss"])]
        self.previous += [weakref.ref(tensor) for tensor in batch]

    def _check_previous(self, phase: str) -> None:
        self.alive_at_forward.append((phase, [ref() is not None for ref in self.previous]))

    def calculate_train_batch_loss(self, batch) -> dict:
        self._check_previous("train")
        batch_output = super().calculate_train_batch_loss(batch)
        self._watch(batch, batch_output)
        return batch_output

    def calculate_eval_batch_loss(self, batch) -> dict:
        self._check_previous("eval")
        batch_output = super().calculate_eval_batch_loss(batch)
        self._watch(batch, batch_output)
        return batch_output


class ReadsTheOutputs(TrainerCallback):
    """A callback that uses the outputs in the step events, as callbacks may; it keeps nothing."""

    def __init__(self):
        self.rows = 0

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        self.rows += batch_output["model_outputs"].shape[0]

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        self.rows += batch_output["model_outputs"].shape[0]


def _assert_previous_steps_released(trainer: WatchedOutputs, phases: set) -> None:
    checks = [(phase, alive) for phase, alive in trainer.alive_at_forward if alive]  # the first step has none
    assert {phase for phase, _ in checks} == phases
    kept = [(index, phase, alive) for index, (phase, alive) in enumerate(checks) if any(alive)]
    assert not kept, f"a finished step's outputs, loss or batch were alive at the next forward pass: {kept}"


@pytest.mark.parametrize("accumulation", [1, 3])
def test_steps_release_what_they_made(no_gc, accumulation):
    """Training and evaluation steps release what they made."""
    model = make_linear()
    callbacks = [*DEFAULT_CALLBACKS, ReadsTheOutputs()]
    trainer = WatchedOutputs(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=callbacks)
    trainer.train(
        linear_dataset(40),
        num_epochs=2,
        per_device_batch_size=4,
        eval_dataset=linear_dataset(20),
        gradient_accumulation_steps=accumulation,
    )
    _assert_previous_steps_released(trainer, {"train", "eval"})
    assert trainer.callback_handler.callbacks[-1].rows == 2 * (40 + 20)  # the callback saw every step's outputs


def test_evaluate_releases_each_step(no_gc):
    model = make_linear()
    trainer = WatchedOutputs(model, nn.MSELoss(), None, callbacks=[*DEFAULT_CALLBACKS, ReadsTheOutputs()])
    trainer.evaluate(linear_dataset(24), per_device_batch_size=4)
    _assert_previous_steps_released(trainer, {"eval"})


def test_extra_model_outputs_are_released(no_gc):
    """A step with an extra model releases both models' outputs."""

    class WithCritic(WatchedOutputs):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            critic = nn.Linear(1, 1)
            self.add_model("critic", critic, torch.optim.SGD(critic.parameters(), lr=0.01))
            self.critic_outputs: list = []

        def calculate_train_batch_loss(self, batch) -> dict:
            self.alive_at_forward.append(("critic", [ref() is not None for ref in self.critic_outputs]))
            critic_output = self.extra_models["critic"](batch[0])
            self.critic_outputs = [weakref.ref(critic_output)]
            self.update_extra_model("critic", nn.functional.mse_loss(critic_output, batch[1]))
            del critic_output
            return super().calculate_train_batch_loss(batch)

    model = make_linear()
    trainer = WithCritic(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    trainer.train(linear_dataset(24), num_epochs=1, per_device_batch_size=4, gradient_accumulation_steps=2)
    _assert_previous_steps_released(trainer, {"train", "critic"})


class WatchedAtBackward(Trainer):
    """Records, as each backward pass starts, whether the step's outputs (and the dict that held them) are alive."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outputs: list = []
        self.alive_at_backward: list = []

    def calculate_train_batch_loss(self, batch) -> dict:
        batch_output = super().calculate_train_batch_loss(batch)
        self.outputs = [weakref.ref(batch_output["model_outputs"])]
        return batch_output

    def backward_step(self, loss):
        self.alive_at_backward.append([ref() is not None for ref in self.outputs])
        super().backward_step(loss)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_outputs_released_before_backward(no_gc, accumulation):
    """As in ``loss_func(model(x), y).backward()``: once the step's events have had them, the outputs are dropped and
    the graph keeps only what its backward needs. For a cross-entropy over a language model's logits that is the
    difference between one and two logits tensors alive at the backward pass (benchmarks: workload logits_train)."""
    model = nn.Sequential(nn.Linear(1, 8), nn.Flatten(0, -1))  # a view as the last op: the graph keeps no output
    loss_func = nn.CrossEntropyLoss()
    trainer = WatchedAtBackward(
        model,
        lambda logits, target: loss_func(logits.view(-1, 8), target.long().view(-1) % 8),
        torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[*DEFAULT_CALLBACKS, ReadsTheOutputs()],
    )
    trainer.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4, gradient_accumulation_steps=accumulation)
    assert trainer.alive_at_backward == [[False]] * 4
    assert trainer.callback_handler.callbacks[-1].rows == 16 * 8  # the step event still had them
