"""EarlyStoppingCallback: when it stops, on scripted metrics and on tiny real runs."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import RecordingCallback, linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import EarlyStoppingCallback


class ScriptedScoreTrainer(Trainer):
    """Records the next of ``scores`` as the metric ``score`` at the end of each epoch."""

    def __init__(self, *args, scores=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.scores = list(scores)

    def training_run_epoch_end(self):
        self.run_history.update_metric("score", self.scores.pop(0))


def _run_scored(callback, scores, trainer=None):
    """Train one epoch per score; return the trainer, the epochs run and whether the run was stopped."""
    trainer = trainer or make_trainer(
        make_linear(), callbacks=[callback, RecordingCallback], trainer_class=ScriptedScoreTrainer
    )
    recorder = trainer.callback_handler.callbacks[-1]
    recorder.events.clear()
    trainer.scores = list(scores)
    trainer.train(linear_dataset(8), num_epochs=len(scores), per_device_batch_size=4)
    return trainer, recorder.events.count("on_train_epoch_start"), "on_stop_training_error" in recorder.events


def test_stops_after_patience_without_gain(capsys):
    """Stops when the improvement is not above the threshold for patience epochs."""
    callback = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.25, watch_metric="score")
    # 1.0 sets the reference; 0.5 improves; 0.375 (by 0.125) and 0.25 (by exactly 0.25) do not
    _, epochs_run, stopped = _run_scored(callback, [1.0, 0.5, 0.375, 0.25, 0.1, 0.05])
    assert (epochs_run, stopped) == (4, True)
    assert callback.best_metric == 0.5 and callback.early_stopping_patience_counter == 2
    assert "Stopping training due to no improvement after 2 epochs" in capsys.readouterr().out


def test_improvement_resets_the_counter():
    """An improvement resets the counter; greater can be better."""
    callback = EarlyStoppingCallback(2, early_stopping_threshold=None, watch_metric="score", greater_is_better=True)
    _, epochs_run, stopped = _run_scored(callback, [0.1, 0.05, 0.2, 0.2, 0.19, 0.3])
    assert (epochs_run, stopped) == (5, True)  # counter: 1 (0.05), reset (0.2), 1 (0.2), 2 (0.19)


def test_improving_run_is_not_stopped():
    callback = EarlyStoppingCallback(1, watch_metric="score")
    _, epochs_run, stopped = _run_scored(callback, [4.0, 3.0, 2.0, 1.0])
    assert (epochs_run, stopped) == (4, False)


def test_real_run_that_cannot_learn_stops():
    """A real run that cannot learn stops after patience epochs."""
    callback = EarlyStoppingCallback(early_stopping_patience=2)
    trainer = make_trainer(make_linear(), lr=0.0, callbacks=[callback])
    trainer.train(linear_dataset(16), num_epochs=10, eval_dataset=linear_dataset(8, seed=1), per_device_batch_size=4)
    losses = trainer.run_history.get_metric_values("eval_loss_epoch")
    assert len(losses) == 3 and losses[0] == losses[1] == losses[2]  # the reference, then two epochs without change


def test_unknown_watch_metric_lists_metrics():
    """An unknown watch metric is an error listing the metrics that exist."""
    trainer = make_trainer(make_linear(), callbacks=[EarlyStoppingCallback(watch_metric="val_loss")])
    with pytest.raises(
        ValueError,
        match=r"watches 'val_loss', which is not in the run history; the metrics recorded are \['train_loss_epoch'\]",
    ):
        trainer.train(linear_dataset(8), num_epochs=2, per_device_batch_size=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"early_stopping_patience": 0}, "early_stopping_patience is 0; pass a positive whole number"),
        ({"early_stopping_threshold": -1}, "early_stopping_threshold is -1; pass a non-negative number"),
        ({"watch_metric": None}, "watch_metric is None; pass the name of a run-history metric"),
    ],
)
def test_invalid_arguments_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        EarlyStoppingCallback(**kwargs)


def test_reset_on_train_second_run():
    """reset_on_train decides whether a second run starts afresh."""
    fresh = EarlyStoppingCallback(1, watch_metric="score")
    trainer, _, _ = _run_scored(fresh, [1.0, 0.5])
    assert _run_scored(fresh, [0.9, 0.8], trainer=trainer)[1:] == (2, False)  # 0.9 is the new reference

    kept = EarlyStoppingCallback(1, watch_metric="score", reset_on_train=False)
    trainer, _, _ = _run_scored(kept, [1.0, 0.5])
    assert _run_scored(kept, [0.9, 0.8], trainer=trainer)[1:] == (1, True)  # 0.9 is worse than 0.5


def test_state_survives_checkpoint_and_run():
    """The state survives a checkpoint and the next run's start."""
    first = EarlyStoppingCallback(3, watch_metric="score")
    _run_scored(first, [1.0, 0.5, 0.6, 0.55])  # best 0.5, counter 2
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert state == {"best_metric": 0.5, "early_stopping_patience_counter": 2}

    resumed = EarlyStoppingCallback(3, watch_metric="score")  # reset_on_train=True, but restored state wins
    resumed.load_state_dict(state)
    assert _run_scored(resumed, [0.7, 0.1])[1:] == (1, True)  # one more epoch without improvement
    assert _run_scored(resumed, [0.7, 0.6, 0.65])[1:] == (3, False)  # the restored state was used once
