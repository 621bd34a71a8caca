"""SaveBestModelCallback: what it saves, when, and what the model holds after the run."""

from __future__ import annotations

import pytest
import torch
from conftest import linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveBestModelCallback, StopTrainingError, TrainerCallback


class ScoredTrainer(Trainer):
    """Records the next of ``scores`` as ``score`` at each epoch end, and keeps a copy of the weights then."""

    scores: tuple = ()  # each test sets its own list

    def training_run_epoch_end(self):
        self.run_history.update_metric("score", self.scores.pop(0))
        self.weights_by_epoch = getattr(self, "weights_by_epoch", {})
        self.weights_by_epoch[self.run_history.current_epoch] = {
            k: v.clone() for k, v in self.get_model().state_dict().items()
        }


def _train_scored(callback, scores, lr=0.1):
    trainer = make_trainer(make_linear(), lr=lr, callbacks=[callback], trainer_class=ScoredTrainer)
    trainer.scores = list(scores)
    trainer.train(linear_dataset(16), num_epochs=len(scores), per_device_batch_size=4)
    return trainer


def _assert_state_equal(actual: dict, expected: dict):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def test_saves_improvements_loads_best(tmp_path):
    """Saves each improvement, and loads the best at the end."""
    path = tmp_path / "best.pt"
    trainer = _train_scored(SaveBestModelCallback(path, watch_metric="score"), [3.0, 1.0, 2.0])
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["score"] == 1.0 and checkpoint["epoch"] == 2
    assert {"model_state_dict", "optimizer_state_dict"} <= checkpoint.keys()
    _assert_state_equal(checkpoint["model_state_dict"], trainer.weights_by_epoch[2])
    _assert_state_equal(trainer.get_model().state_dict(), trainer.weights_by_epoch[2])  # loaded back
    assert not torch.equal(trainer.weights_by_epoch[2]["weight"], trainer.weights_by_epoch[3]["weight"])


def test_greater_is_better_and_keep_last(tmp_path):
    """greater_is_better works; load_saved_checkpoint=False keeps the last weights."""
    path = tmp_path / "best.pt"
    callback = SaveBestModelCallback(
        path, watch_metric="score", greater_is_better=True, load_saved_checkpoint=False, save_optimizer=False
    )
    trainer = _train_scored(callback, [0.2, 0.9, 0.5])
    checkpoint = torch.load(path, weights_only=True)
    assert (checkpoint["score"], checkpoint["epoch"], callback.best_metric_epoch) == (0.9, 2, 2)
    assert "optimizer_state_dict" not in checkpoint
    _assert_state_equal(trainer.get_model().state_dict(), trainer.weights_by_epoch[3])


def test_watches_eval_loss_by_default(tmp_path):
    """Watches eval_loss_epoch by default, on a real run."""
    callback = SaveBestModelCallback(tmp_path / "best_model.pt")
    trainer = make_trainer(make_linear(), callbacks=[callback])
    trainer.train(linear_dataset(32), num_epochs=3, eval_dataset=linear_dataset(16, seed=1), per_device_batch_size=4)
    losses = trainer.run_history.get_metric_values("eval_loss_epoch")
    assert callback.best_metric == min(losses) and callback.best_metric_epoch == losses.index(min(losses)) + 1


def test_unknown_watch_metric_lists_metrics(tmp_path):
    """An unknown watch metric is an error listing the metrics that exist."""
    trainer = make_trainer(make_linear(), callbacks=[SaveBestModelCallback(tmp_path / "m.pt", watch_metric="accuracy")])
    with pytest.raises(
        ValueError,
        match=r"watches 'accuracy', which is not in the run history; "
        r"the metrics recorded are \['eval_loss_epoch', 'train_loss_epoch'\]",
    ):
        trainer.train(linear_dataset(8), num_epochs=1, eval_dataset=linear_dataset(4), per_device_batch_size=4)


def test_run_stopped_early_loads_nothing(tmp_path):
    """A run stopped before any epoch ended loads nothing."""

    class StopAtOnce(TrainerCallback):
        def on_train_epoch_start(self, trainer, **kwargs):
            raise StopTrainingError("stop before anything is saved")

    path = tmp_path / "never.pt"
    trainer = make_trainer(make_linear(), callbacks=[StopAtOnce, SaveBestModelCallback(path)])
    trainer.train(linear_dataset(8), num_epochs=2, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    assert not path.exists()


def test_state_dict_round_trips(tmp_path):
    """state_dict round-trips, and the restored best is kept."""
    path = tmp_path / "best.pt"
    first = SaveBestModelCallback(path, watch_metric="score")
    before = _train_scored(first, [2.0, 1.0]).weights_by_epoch[2]
    state = first.state_dict()
    assert state == {"best_metric": 1.0, "best_metric_epoch": 2}

    resumed = SaveBestModelCallback(path, watch_metric="score")  # as a resumed run would rebuild it
    resumed.load_state_dict(state)
    trainer = _train_scored(resumed, [1.5])  # worse than the restored best: nothing saved
    assert resumed.best_metric == 1.0 and torch.load(path, weights_only=True)["epoch"] == 2
    _assert_state_equal(trainer.get_model().state_dict(), before)  # the best of the first run, loaded back
