"""StepBasedEvaluationCallback and LimitEvalStepsCallback on tiny real runs."""

from __future__ import annotations

import pytest
import torch
from conftest import RecordingCallback, linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer.callbacks import (
    LimitEvalStepsCallback,
    StepBasedEvaluationCallback,
    TrainerCallback,
    is_intermediate_evaluation,
)

TRAIN, EVAL = linear_dataset(64), linear_dataset(32, seed=1)  # 16 and 8 batches of 4


def _train(callbacks, num_epochs=2, **kwargs):
    trainer = make_trainer(make_linear(), lr=0.05, callbacks=callbacks)
    trainer.train(TRAIN, num_epochs=num_epochs, eval_dataset=EVAL, per_device_batch_size=4, **kwargs)
    return trainer


def test_evaluates_every_n_updates():
    """Evaluates every n updates, without changing training or the epoch metrics."""
    with_steps = _train([StepBasedEvaluationCallback(eval_every_n_steps=5)])
    plain = _train([])
    history = with_steps.run_history
    # updates 5, 10, 15 in epoch 1 (16 is the epoch's end) and 20, 25, 30 in epoch 2
    assert len(history.get_metric_values("intermediate_eval_loss_epoch")) == 6
    for name in ("train_loss_epoch", "eval_loss_epoch"):
        assert history.get_metric_values(name) == plain.run_history.get_metric_values(name)
    assert torch.equal(with_steps.get_model().weight, plain.get_model().weight)


def test_intermediate_loss_after_nth_update():
    """The intermediate loss is that of the model after the nth update."""
    history = _train([StepBasedEvaluationCallback(eval_every_n_steps=5)]).run_history
    after_five = make_trainer(make_linear(), lr=0.05, callbacks=[])
    after_five.train(TRAIN, num_epochs=1, eval_dataset=EVAL, per_device_batch_size=4, max_num_train_steps=5)
    after_five.evaluate(EVAL, per_device_batch_size=4)
    first = history.get_metric_values("intermediate_eval_loss_epoch")[0]
    assert first == pytest.approx(after_five.run_history.get_latest_metric("evaluation_loss"), rel=1e-6)


def test_interval_counts_optimizer_updates():
    """The interval counts optimizer updates, and the training mode is restored."""
    modes, intermediate = [], []

    class Probe(TrainerCallback):
        def on_train_step_end(self, trainer, **kwargs):
            modes.append(trainer.model.training)

        def on_eval_epoch_start(self, trainer, **kwargs):
            intermediate.append(is_intermediate_evaluation(trainer))

    _train([StepBasedEvaluationCallback(eval_every_n_steps=3), Probe()], gradient_accumulation_steps=2)
    # 8 updates per epoch: evaluations after updates 3 and 6, then the epoch's own, in each epoch
    assert intermediate == [True, True, False, True, True, True, False]  # then updates 9, 12 and 15: the count runs on
    assert all(modes)


def test_epoch_events_say_is_intermediate():
    """The evaluation epoch events say is_intermediate, as in pytorch-accelerated."""
    flags = []

    class PeerStyle(TrainerCallback):  # pytorch-accelerated's LimitEvalStepsCallback reads it this way
        def on_eval_epoch_start(self, trainer, is_intermediate=False, **kwargs):
            flags.append(("start", is_intermediate, is_intermediate_evaluation(trainer)))

        def on_eval_epoch_end(self, trainer, is_intermediate=False, **kwargs):
            flags.append(("end", is_intermediate, is_intermediate_evaluation(trainer)))

        def on_eval_step_end(self, trainer, batch, batch_output):  # no **kwargs: the step events get no flag
            pass

    trainer = _train([StepBasedEvaluationCallback(eval_every_n_steps=10), PeerStyle()], num_epochs=1)
    assert flags == [("start", True, True), ("end", True, True), ("start", False, False), ("end", False, False)]
    trainer.evaluate(EVAL, per_device_batch_size=4)
    assert flags[-2:] == [("start", False, False), ("end", False, False)]


def test_intermediate_evaluation_events():
    """An intermediate evaluation fires the evaluation events between two steps."""
    recorder = RecordingCallback()
    _train([StepBasedEvaluationCallback(eval_every_n_steps=15), recorder], num_epochs=1)
    step_ends = [i for i, event in enumerate(recorder.events) if event == "on_train_step_end"]
    step_starts = [i for i, event in enumerate(recorder.events) if event == "on_train_step_start"]
    between = recorder.events[step_ends[14] + 1 : step_starts[15]]  # after the 15th batch, before the 16th
    assert between == [
        "on_optimizer_step_end",
        "on_eval_epoch_start",
        *["on_eval_step_start", "on_eval_step_end"] * 8,
        "on_eval_epoch_end",
    ]


def test_needs_eval_dataset_and_interval():
    """Needs an eval_dataset and a positive interval."""
    trainer = make_trainer(make_linear(), callbacks=[StepBasedEvaluationCallback(2)])
    with pytest.raises(
        ValueError,
        match=r"StepBasedEvaluationCallback evaluates during training, but train\(\) was given no eval_dataset",
    ):
        trainer.train(TRAIN, num_epochs=1, per_device_batch_size=4)
    with pytest.raises(ValueError, match="eval_every_n_steps is 0; pass a positive whole number"):
        StepBasedEvaluationCallback(0)


def _eval_steps_per_epoch(recorder) -> list:
    counts = []
    for event in recorder.events:
        if event == "on_eval_epoch_start":
            counts.append(0)
        elif event == "on_eval_step_start":
            counts[-1] += 1
    return counts


def test_limit_eval_steps_default():
    """LimitEvalStepsCallback limits intermediate evaluations only, by default."""
    recorder = RecordingCallback()
    _train([LimitEvalStepsCallback(2), StepBasedEvaluationCallback(8), recorder], num_epochs=1)
    assert _eval_steps_per_epoch(recorder) == [2, 8]  # after update 8; then the full epoch evaluation


def test_limit_eval_steps_every_evaluation():
    """LimitEvalStepsCallback can limit every evaluation, evaluate() included."""
    recorder = RecordingCallback()
    trainer = _train(
        [LimitEvalStepsCallback(3, limit_intermediate_only=False), StepBasedEvaluationCallback(8), recorder],
        num_epochs=1,
    )
    trainer.evaluate(EVAL, per_device_batch_size=4)
    assert _eval_steps_per_epoch(recorder) == [3, 3, 3]
    assert len(trainer._eval_dataloader) == 8  # the full dataloader is back after the run
