"""A run stopped inside an epoch (the step limit, a StopTrainingError, a signal, the time budget) and then extended
continues exactly: the state saved at the stop holds the next batch, and the resumed run ends bit for bit where an
uninterrupted run ends."""

from __future__ import annotations

import functools
import signal
import time

import pytest
import torch
from conftest import assert_bitwise_equal, regression_dataset
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, StopTrainingError, TrainerCallback
from pytorch_accel_trainer.state.training_state import list_complete_states

#: 24 samples, batches of 2, windows of 2 micro-batches: 6 updates per epoch; the extended run ends inside epoch 3.
UPDATES_PER_EPOCH, TOTAL_UPDATES = 6, 15


class StopAtUpdate(TrainerCallback):
    """Stops the run after update ``update`` (a callback's ``StopTrainingError``)."""

    def __init__(self, update):
        self.update = update

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        if num_update_steps_completed == self.update:
            raise StopTrainingError(f"stopped after update {self.update}")


class SignalAtUpdate(StopAtUpdate):
    """Asks the run to save and exit after update ``update``, as SIGUSR1 from a cluster does."""

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        if num_update_steps_completed == self.update:
            trainer.request_preemption(signal.SIGUSR1)


class StopAtEpochEnd(TrainerCallback):
    """Stops the run as its first epoch ends, after its evaluation (as early stopping does)."""

    def on_training_run_epoch_end(self, trainer, **kwargs):
        raise StopTrainingError("enough epochs")


def _run(save_dir, max_num_train_steps=TOTAL_UPDATES, stop=None, resume=True, save_at_end=True, **train_kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    callbacks = [SaveTrainingStateCallback(save_dir, save_at_end=save_at_end)] + ([stop] if stop is not None else [])
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=callbacks)
    result = trainer.train(
        regression_dataset(24),
        num_epochs=5,
        eval_dataset=regression_dataset(6, seed=1),
        per_device_batch_size=2,
        gradient_accumulation_steps=2,
        max_num_train_steps=max_num_train_steps,
        create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.8),
        resume_from=save_dir if resume else None,
        **train_kwargs,
    )
    return trainer, result


def _end_state(trainer):
    return {
        "model": trainer.get_model().state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "updates": trainer.num_update_steps_completed,
        "epoch": trainer.run_history.current_epoch,
        "train_loss": trainer.run_history.get_latest_metric("train_loss_epoch"),
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer, _ = _run(tmp_path_factory.mktemp("uninterrupted"), resume=False)
    return _end_state(trainer)


def _saved_position(save_dir):
    return list_complete_states(save_dir)[-1].manifest["position"]


def test_a_step_limit_inside_an_epoch_then_a_higher_one_continues_exactly(tmp_path, uninterrupted):
    trainer, result = _run(tmp_path, max_num_train_steps=4)
    assert result.num_update_steps == 4 and not result.stopped_early
    assert trainer.run_history.current_epoch == 2  # the cut-short epoch counts in the history, as pytorch-accelerated
    assert _saved_position(tmp_path) == {"loop_epoch": 0, "batches_seen": 8, "rng_restore_point": "after_iterator"}
    resumed, _ = _run(tmp_path)
    assert_bitwise_equal(_end_state(resumed), uninterrupted)


def test_a_stop_training_error_inside_an_epoch_resumes_at_the_next_batch(tmp_path, uninterrupted):
    _, result = _run(tmp_path, stop=StopAtUpdate(9))
    assert result.num_update_steps == 9 and result.stopped_early and result.stop_reason == "stopped after update 9"
    assert _saved_position(tmp_path) == {"loop_epoch": 1, "batches_seen": 6, "rng_restore_point": "after_iterator"}
    resumed, _ = _run(tmp_path)
    assert_bitwise_equal(_end_state(resumed), uninterrupted)


def test_a_stop_after_an_epoch_resumes_at_the_next_epoch(tmp_path, uninterrupted):
    _run(tmp_path, stop=StopAtEpochEnd())
    assert _saved_position(tmp_path) == {"loop_epoch": 1, "batches_seen": 0, "rng_restore_point": "before_iterator"}
    resumed, _ = _run(tmp_path)
    assert_bitwise_equal(_end_state(resumed), uninterrupted)


def test_a_signal_inside_an_epoch_saves_the_next_batch_and_resumes_exactly(tmp_path, uninterrupted):
    with pytest.raises(SystemExit) as exit_info:
        _run(tmp_path, stop=SignalAtUpdate(8))
    assert exit_info.value.code == 128 + signal.SIGUSR1
    assert _saved_position(tmp_path) == {"loop_epoch": 1, "batches_seen": 4, "rng_restore_point": "after_iterator"}
    resumed, _ = _run(tmp_path)
    assert_bitwise_equal(_end_state(resumed), uninterrupted)


class SlowUpdates(TrainerCallback):
    """Makes each update take at least ``seconds``, and notes when each one ended."""

    def __init__(self, seconds):
        self.seconds, self.ended_at = seconds, []

    def on_optimizer_step_end(self, trainer, **kwargs):
        time.sleep(self.seconds)
        self.ended_at.append(time.monotonic())


def test_the_time_budget_stops_before_it_is_spent_and_the_saved_state_resumes_exactly(tmp_path, uninterrupted, capsys):
    slow = SlowUpdates(0.05)
    started = time.monotonic()
    _, result = _run(tmp_path, stop=slow, max_time=0.6, save_at_end=False)
    assert 0 < result.num_update_steps < TOTAL_UPDATES and result.stopped_early
    assert slow.ended_at[-1] - started < 0.6  # no update ran past the budget
    assert result.stop_reason.startswith("Time budget max_time=0.6 (0.6 s) nearly spent")
    resume_line = f"to continue, run the same train(...) with resume_from={str(tmp_path)!r}"
    assert resume_line in result.stop_reason and resume_line in capsys.readouterr().out
    (state,) = list_complete_states(tmp_path)  # saved although save_at_end=False: the run can be continued
    assert state.folder.name == "final" and state.manifest["num_update_steps_completed"] == result.num_update_steps
    resumed, _ = _run(tmp_path)
    assert_bitwise_equal(_end_state(resumed), uninterrupted)
