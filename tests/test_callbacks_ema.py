"""ModelEmaCallback: an EMA updated at every optimizer step, evaluated, saved, and restored from its state."""

from __future__ import annotations

import copy
import inspect
import io
from typing import ClassVar

import pytest
import torch
from conftest import linear_dataset, make_linear, make_mlp, make_trainer, regression_dataset
from sync_counter import make_sync_counting_trainer
from torch import nn
from torchmetrics import MeanSquaredError

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import (
    MetricCollectionCallback,
    ModelEmaCallback,
    SaveTrainingStateCallback,
    TrainerCallback,
)
from pytorch_accel_trainer.utils import ModelEma


class WeightsAfterEachUpdate(Trainer):
    """Keeps a copy of the weights after every optimizer update."""

    def optimizer_step(self):
        super().optimizer_step()
        self.history_of_weights = getattr(self, "history_of_weights", [])
        self.history_of_weights.append({k: v.clone() for k, v in self.get_model().state_dict().items()})


def _expected_ema(initial: dict, updates: list, decay: float) -> dict:
    ema = {k: v.clone() for k, v in initial.items()}
    for weights in updates:
        ema = {k: decay * ema[k] + (1 - decay) * weights[k] for k in ema}
    return ema


def test_ema_follows_every_optimizer_step(tmp_path):
    """The EMA follows every optimizer step, under accumulation and a partial window."""
    model = make_linear()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    callback = ModelEmaCallback(decay=0.9, evaluate_during_training=False, save_path=tmp_path / "ema.pt")
    trainer = make_trainer(model, callbacks=[callback], trainer_class=WeightsAfterEachUpdate)
    trainer.train(linear_dataset(40), num_epochs=2, per_device_batch_size=4, gradient_accumulation_steps=3)

    assert trainer.num_update_steps_completed == 8 == callback.num_updates  # 10 batches: windows of 3, 3, 3, 1
    expected = _expected_ema(initial, trainer.history_of_weights, decay=0.9)
    for name, value in callback.ema_model.module.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7)
    saved = torch.load(tmp_path / "ema.pt", weights_only=True)  # saved at each epoch end without evaluation
    assert saved["num_updates"] == 8 and "optimizer_state_dict" not in saved
    torch.testing.assert_close(saved["model_state_dict"]["weight"], expected["weight"], rtol=1e-6, atol=1e-7)


def test_ema_evaluation_prefixed_metrics(tmp_path):
    """Evaluating the EMA records prefixed metrics and leaves training unchanged."""

    def run(callbacks):
        trainer = make_trainer(make_mlp(), lr=0.05, callbacks=callbacks)
        trainer.train(
            regression_dataset(32), num_epochs=3, eval_dataset=regression_dataset(16, seed=1), per_device_batch_size=4
        )
        return trainer

    metrics = MetricCollectionCallback({"mse": MeanSquaredError()})
    callback = ModelEmaCallback(decay=0.8, save_path=tmp_path / "ema.pt", callbacks=[metrics])
    with_ema, without = run([callback]), run([])
    history = with_ema.run_history
    assert history.get_metric_values("eval_loss_epoch") == without.run_history.get_metric_values("eval_loss_epoch")
    assert history.get_metric_values("train_loss_epoch") == without.run_history.get_metric_values("train_loss_epoch")

    ema_losses = history.get_metric_values("ema_model_eval_loss_epoch")
    assert len(ema_losses) == 3 and ema_losses != history.get_metric_values("eval_loss_epoch")
    assert history.get_metric_values("ema_model_mse") == pytest.approx(ema_losses, rel=1e-5)  # its callbacks run too
    eval_x, eval_y = regression_dataset(16, seed=1).tensors
    with torch.no_grad():
        final_ema_loss = nn.functional.mse_loss(callback.ema_model(eval_x), eval_y).item()
    assert ema_losses[-1] == pytest.approx(final_ema_loss, rel=1e-5)

    assert ema_losses == sorted(ema_losses, reverse=True)  # improving, so the last EMA weights are the best
    saved = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert saved["epoch"] == 3 and saved["ema_model_eval_loss_epoch"] == ema_losses[-1]
    for name, value in callback.ema_model.module.state_dict().items():
        assert torch.equal(saved["model_state_dict"][name], value)


def test_arguments_are_the_peers():
    """The arguments are pytorch-accelerated's, in its order, with its defaults."""
    parameters = inspect.signature(ModelEmaCallback).parameters
    assert [(name, p.default) for name, p in parameters.items()] == [
        ("decay", 0.99),
        ("evaluate_during_training", True),
        ("save_path", "ema_model.pt"),
        ("watch_metric", "ema_model_eval_loss_epoch"),
        ("greater_is_better", False),
        ("model_ema", ModelEma),
        ("callbacks", ()),
    ]


def test_model_ema_keeps_the_average(tmp_path):
    """ModelEma is the class that keeps the average."""

    class CountingEma(ModelEma):
        made_from: ClassVar[list] = []

        def __init__(self, model, decay):
            super().__init__(model, decay=decay)
            self.made_from.append((model, decay))
            self.updates = 0

        def update(self, model):
            self.updates += 1
            super().update(model)

    model = make_linear()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    callback = ModelEmaCallback(0.9, False, tmp_path / "ema.pt", "ema_model_eval_loss_epoch", False, CountingEma)
    trainer = make_trainer(model, callbacks=[callback], trainer_class=WeightsAfterEachUpdate)
    trainer.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)
    assert isinstance(callback.ema_model, CountingEma) and CountingEma.made_from == [(trainer.get_model(), 0.9)]
    assert callback.ema_model.updates == callback.num_updates == 4
    expected = _expected_ema(initial, trainer.history_of_weights, decay=0.9)
    for name, value in callback.ema_model.module.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match="model_ema is a str; pass a class such as ModelEma"):
        ModelEmaCallback(model_ema="ModelEma")


def test_evaluating_needs_an_eval_dataset():
    """Evaluating during training needs an eval_dataset."""
    trainer = make_trainer(make_linear(), callbacks=[ModelEmaCallback()])
    with pytest.raises(
        ValueError, match="ModelEmaCallback evaluates during training, but train\\(\\) was given no eval_dataset"
    ):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)


@pytest.mark.parametrize("decay", [0, 1, 1.5, "0.9"])
def test_decay_must_be_between_zero_and_one(decay):
    with pytest.raises(ValueError, match=f"decay is {decay!r}; pass a number between 0 and 1"):
        ModelEmaCallback(decay=decay)


def test_state_round_trips_weights_only(tmp_path):
    """The state round-trips through a weights_only checkpoint, and seeds the next run."""
    first = ModelEmaCallback(decay=0.5, evaluate_during_training=False, save_path=tmp_path / "a.pt")
    make_trainer(make_linear(), callbacks=[first]).train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert state["num_updates"] == 4 and set(state["ema_state_dict"]) == {"weight", "bias"}

    seen_at_start = {}

    class SnapshotAtStart(TrainerCallback):
        def on_training_run_start(self, trainer, **kwargs):
            seen_at_start.update(copy.deepcopy(resumed.ema_model.module.state_dict()))

    resumed = ModelEmaCallback(decay=0.5, evaluate_during_training=False, save_path=tmp_path / "b.pt")
    resumed.load_state_dict(state)
    make_trainer(make_linear(seed=3), callbacks=[resumed, SnapshotAtStart]).train(
        linear_dataset(16), num_epochs=1, per_device_batch_size=4
    )
    for name, value in state["ema_state_dict"].items():
        assert torch.equal(seen_at_start[name], value)  # the EMA resumed, not restarted from the new model
    assert resumed.num_updates == 8


def test_the_ema_update_makes_no_host_device_sync(monkeypatch, tmp_path):
    callback = ModelEmaCallback(decay=0.9, evaluate_during_training=False, save_path=tmp_path / "ema.pt")
    trainer, reads = make_sync_counting_trainer(monkeypatch, make_linear(), callbacks=[callback])
    trainer.train(linear_dataset(64), num_epochs=1, per_device_batch_size=4)
    assert callback.num_updates == 16 and reads == []


class Crash(Exception):
    """Stands for the process dying mid-run."""


class CrashAtStep(TrainerCallback):
    def __init__(self, epoch, step):
        self.epoch, self.step = epoch, step

    def on_train_step_end(self, trainer, step, **kwargs):
        if (trainer.run_history.current_epoch, step) == (self.epoch, self.step):
            raise Crash()


def test_resumed_run_ends_with_same_ema(tmp_path):
    """A crashed run resumed from its training state ends with the same EMA."""

    def run(save_dir, crash=None):
        ema = ModelEmaCallback(decay=0.7, save_path=tmp_path / f"{save_dir}.pt")
        saving = SaveTrainingStateCallback(tmp_path / save_dir, save_every_n_steps=2, save_on_signals=())
        trainer = make_trainer(make_mlp(), lr=0.05, callbacks=[ema, saving, *([crash] if crash else [])])
        trainer.train(
            regression_dataset(16),
            num_epochs=3,
            eval_dataset=regression_dataset(8, seed=1),
            per_device_batch_size=4,
            resume_from=tmp_path / save_dir,
        )
        return ema, trainer.run_history

    uninterrupted, history = run("straight")
    with pytest.raises(Crash):
        run("crashed", crash=CrashAtStep(epoch=2, step=3))  # the last state is from after update 6
    resumed, resumed_history = run("crashed")
    assert resumed.num_updates == uninterrupted.num_updates == 12
    for name, value in uninterrupted.ema_model.module.state_dict().items():
        assert torch.equal(resumed.ema_model.module.state_dict()[name], value), name
    assert resumed_history.get_metric_values("ema_model_eval_loss_epoch") == history.get_metric_values(
        "ema_model_eval_loss_epoch"
    )
    assert (resumed.best_metric, resumed.best_metric_epoch) == (
        uninterrupted.best_metric,
        uninterrupted.best_metric_epoch,
    )
