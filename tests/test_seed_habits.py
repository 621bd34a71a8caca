"""Issue 26: the habits of the other seed trainers' users, written as those users write them.

qurious and Dream Trainer return ``{"loss": ..., "accuracy": ...}`` from their steps (no batch size); Dream Trainer's
and Lightning's steps take ``batch_idx``; mini.trainer logs each step's records; Hezar fine-tunes a pretrained
checkpoint into a model with a new head (``init_weights_from``); Lightning and Keras users name their callback
methods ``on_train_batch_end`` or ``on_epoch_end``; mini.trainer raises when its non-finite retries run out.
"""

from __future__ import annotations

import collections
import csv
import inspect
import math
import os
import subprocess
import warnings

import pytest
import torch
from conftest import CPU_PROCESSES_ENV, launcher, linear_dataset, make_linear
from test_syncs import SYNCING_METHODS, _from_data_pipeline
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import (
    EVENTS,
    ExperimentTrackingCallback,
    NonFiniteGradientsError,
    SkipNonFiniteStepsCallback,
    TrainerCallback,
)
from pytorch_accel_trainer.callbacks.base import FASTAI_EVENT_NAMES, FOREIGN_EVENT_NAMES
from pytorch_accel_trainer.errors import CheckpointError, StopTrainingError
from pytorch_accel_trainer.state.checkpointing import SkippedWeights


def _classification_data(num_samples: int = 30, seed: int = 0) -> TensorDataset:
    """Two classes: is the point above the line y = x? (30 samples: batches of 8 leave a last batch of 6.)"""
    generator = torch.Generator().manual_seed(seed)
    points = torch.randn(num_samples, 2, generator=generator)
    return TensorDataset(points, (points[:, 1] > points[:, 0]).long())


def _classifier(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(2, 2)


def _trainer(trainer_class, model=None, callbacks=(), loss_func=None, lr=0.5) -> Trainer:
    model = _classifier() if model is None else model
    loss_func = nn.CrossEntropyLoss() if loss_func is None else loss_func
    return trainer_class(model, loss_func, torch.optim.SGD(model.parameters(), lr=lr), callbacks=callbacks)


# ------------------------------------------------------------------------------------------------
# 1. A batch-loss hook without batch_size: the trainer counts the batch
# ------------------------------------------------------------------------------------------------


class QuriousStyleTrainer(Trainer):
    """qurious's ``train_step`` / ``eval_step``: ``{"loss": ..., "accuracy": ...}``, no batch size."""

    def calculate_train_batch_loss(self, batch):
        inputs, targets = batch
        outputs = self.model(inputs)
        accuracy = (outputs.argmax(dim=1) == targets).float().mean()
        return {"loss": self.loss_func(outputs, targets), "accuracy": accuracy}

    def calculate_eval_batch_loss(self, batch):
        with torch.no_grad():
            return self.calculate_train_batch_loss(batch)


class WithBatchSize(QuriousStyleTrainer):
    """The same hooks, returning the batch size as pytorch-accelerated requires."""

    def calculate_train_batch_loss(self, batch):
        return {**super().calculate_train_batch_loss(batch), "batch_size": len(batch[1])}


def test_a_hook_returning_loss_and_accuracy_without_batch_size_trains_as_if_it_returned_it():
    data, eval_data = _classification_data(30), _classification_data(14, seed=1)
    without = _trainer(QuriousStyleTrainer)
    result = without.train(data, num_epochs=2, eval_dataset=eval_data, per_device_batch_size=8)
    given = _trainer(WithBatchSize)
    expected = given.train(data, num_epochs=2, eval_dataset=eval_data, per_device_batch_size=8)
    # the last batch of 6 weighs 6, not 8: the epoch means are those of a hook that returns the batch size
    assert result.metrics == expected.metrics
    assert {"train_accuracy_epoch", "eval_accuracy_epoch"} <= set(result.metrics)
    assert result.num_samples == 60
    assert without.evaluate(eval_data)["evaluation_accuracy"] == given.evaluate(eval_data)["evaluation_accuracy"]


class SeenByCallbacks(TrainerCallback):
    def __init__(self):
        self.batch_sizes = []

    def on_train_step_end(self, trainer, batch_output, **kwargs):
        self.batch_sizes.append(batch_output["batch_size"])


class DictBatchTrainer(Trainer):
    """A Hugging Face style batch (a dict with ``labels``), and a hook that returns the loss alone."""

    def calculate_train_batch_loss(self, batch):
        return {"loss": self.loss_func(self.model(batch["inputs"]), batch["labels"])}


class DictDataset(Dataset):
    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        inputs, labels = self.dataset[index]
        return {"inputs": inputs, "labels": labels}


def test_the_batch_size_is_found_in_a_dict_batch_and_reaches_the_callbacks():
    seen = SeenByCallbacks()
    trainer = _trainer(DictBatchTrainer, callbacks=[seen])
    trainer.train(DictDataset(_classification_data(30)), num_epochs=1, per_device_batch_size=8)
    assert seen.batch_sizes == [8, 8, 8, 6]


class SentencesDataset(Dataset):
    """Batches of strings: nothing the trainer can count samples from."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return f"sentence {index}"


class StringBatchTrainer(Trainer):
    def calculate_train_batch_loss(self, batch):
        return {"loss": (self.model.weight**2).sum()}


def test_a_batch_without_a_tensor_to_count_asks_for_batch_size():
    model = make_linear()
    trainer = StringBatchTrainer(model, None, torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    with pytest.raises(ValueError, match=r"without 'batch_size'.*Return it: \{'loss': loss, 'batch_size': len\(y\)\}"):
        trainer.train(SentencesDataset(), num_epochs=1, per_device_batch_size=2, collate_fn=list)


def _count_syncs_in_steps(monkeypatch, trainer_class):
    """A trainer of (a subclass of) ``trainer_class``, and the list of syncing tensor reads made inside its steps."""
    phase, reads = {"in_step": False}, []

    class MarkStepStart(TrainerCallback):
        def on_train_step_start(self, trainer, **kwargs):
            phase["in_step"] = True

    class MarkStepsDone(trainer_class):
        def train_epoch_end(self):
            phase["in_step"] = False

    for name in SYNCING_METHODS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            if phase["in_step"] and not _from_data_pipeline():
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return MarkStepsDone, MarkStepStart(), reads


def test_finding_the_batch_size_reads_nothing_back_from_the_device(monkeypatch):
    trainer_class, marker, reads = _count_syncs_in_steps(monkeypatch, QuriousStyleTrainer)
    trainer = _trainer(trainer_class, callbacks=[marker])
    trainer.train(_classification_data(30), num_epochs=1, per_device_batch_size=4)
    assert trainer.num_update_steps_completed == 8 and reads == []


# ------------------------------------------------------------------------------------------------
# 2. batch_idx in the batch-loss hooks, and trainer.batch_idx
# ------------------------------------------------------------------------------------------------


class DreamStyleTrainer(Trainer):
    """Dream Trainer's ``training_step(self, batch, batch_idx)`` / ``validation_step(self, batch, batch_idx)``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.train_indices, self.eval_indices = [], []

    def calculate_train_batch_loss(self, batch, batch_idx):
        self.train_indices.append((batch_idx, self.batch_idx))
        inputs, targets = batch
        return {"loss": self.loss_func(self.model(inputs), targets)}

    def calculate_eval_batch_loss(self, batch, batch_idx):
        self.eval_indices.append((batch_idx, self.batch_idx))
        with torch.no_grad():
            return {"loss": self.loss_func(self.model(batch[0]), batch[1])}


class StepIndices(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_train_step_end(self, trainer, step, **kwargs):
        self.steps.append(step)


def test_hooks_that_name_batch_idx_receive_the_index_of_each_batch_in_its_epoch():
    steps = StepIndices()
    trainer = _trainer(DreamStyleTrainer, callbacks=[steps])
    trainer.train(
        _classification_data(30), num_epochs=2, eval_dataset=_classification_data(12), per_device_batch_size=8
    )
    assert trainer.train_indices == [(index, index) for index in [0, 1, 2, 3] * 2]
    assert [index for index, _ in trainer.train_indices] == steps.steps  # the step the callbacks receive
    assert trainer.eval_indices == [(index, index) for index in [0, 1] * 2]


class PositionalIndex(Trainer):
    """Lightning's habit with another name for the index: ``training_step(self, batch, i)``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.indices = []

    def calculate_train_batch_loss(self, batch, i):
        self.indices.append(i)
        return super().calculate_train_batch_loss(batch, i)  # the default hook takes it too


class BatchOnly(Trainer):
    """pytorch-accelerated's signature: the batch alone (an optional second argument is left to its default)."""

    def calculate_train_batch_loss(self, batch, scale=1.0):
        output = super().calculate_train_batch_loss(batch)
        return {**output, "loss": output["loss"] * scale}


def test_the_index_goes_positionally_to_a_second_parameter_and_never_to_an_optional_one():
    positional = make_linear_trainer(PositionalIndex)
    positional.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)
    assert positional.indices == [0, 1, 2, 3]
    batch_only = make_linear_trainer(BatchOnly)
    batch_only.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)
    plain = make_linear_trainer(Trainer)
    plain.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)
    assert batch_only.run_history.get_latest_metric("train_loss_epoch") == plain.run_history.get_latest_metric(
        "train_loss_epoch"
    )


def make_linear_trainer(trainer_class, callbacks=()):
    model = make_linear()
    return trainer_class(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=callbacks)


def test_the_hook_s_signature_is_read_once_not_at_every_step(monkeypatch):
    class OnceTrainer(Trainer):
        def calculate_train_batch_loss(self, batch, batch_idx):
            return super().calculate_train_batch_loss(batch, batch_idx)

    reads, original = [], inspect.signature

    def counting(function, *args, **kwargs):
        if "OnceTrainer.calculate_train_batch_loss" in getattr(function, "__qualname__", ""):
            reads.append(function)
        return original(function, *args, **kwargs)

    monkeypatch.setattr(inspect, "signature", counting)
    trainer = make_linear_trainer(OnceTrainer)
    trainer.train(linear_dataset(16), num_epochs=2, per_device_batch_size=4)
    assert trainer.num_update_steps_completed == 8 and len(reads) == 1


def test_a_retried_window_passes_each_batch_its_own_index():
    class Indices(PositionalIndex):
        def calculate_train_batch_loss(self, batch, i):
            output = super().calculate_train_batch_loss(batch, i)
            if len(self.indices) == 4:  # the 2nd window's second batch, on its first try: NaN gradients
                output["loss"] = output["loss"] * float("nan")
            return output

    trainer = make_linear_trainer(Indices, callbacks=[SkipNonFiniteStepsCallback(max_retries=1)])
    trainer.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4, gradient_accumulation_steps=2)
    assert trainer.indices == [0, 1, 2, 3, 2, 3]  # the window (2, 3) ran again, each batch with its index


# ------------------------------------------------------------------------------------------------
# 3. Each step's records in the experiment trackers, every log_every_n_steps updates
# ------------------------------------------------------------------------------------------------


class RecordsTrainer(Trainer):
    """mini.trainer's ``forward`` returns ``(loss, records)``: here the records are the hook's extra keys, a tensor
    (kept on the device) and a number (mini.trainer's ``.item()``)."""

    def calculate_train_batch_loss(self, batch, batch_idx):
        inputs, targets = batch
        outputs = self.model(inputs)
        penalty = 0.01 * (self.model.weight**2).sum()
        return {
            "loss": self.loss_func(outputs, targets) + penalty,
            "regulariser": penalty.detach(),
            "batch_number": torch.tensor(float(batch_idx)),
            "epoch_number": float(self.run_state.epoch),
        }


def _csv_rows(path) -> dict:
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    series = collections.defaultdict(dict)
    for row in rows:
        series[row["name"]][int(row["step"])] = float(row["value"])
    return series


class Regularisers(TrainerCallback):
    def __init__(self):
        self.values = []

    def on_train_step_end(self, trainer, batch_output, **kwargs):
        self.values.append(batch_output["regulariser"].item())


def test_the_csv_tracker_logs_the_hooks_records_every_n_updates(tmp_path):
    regularisers = Regularisers()
    tracking = ExperimentTrackingCallback(["csv"], logging_dir=tmp_path, run_name="run", log_every_n_steps=2)
    trainer = make_linear_trainer(RecordsTrainer, callbacks=[regularisers, tracking])
    trainer.train(linear_dataset(32), num_epochs=2, per_device_batch_size=4)  # 8 updates per epoch
    series = _csv_rows(tmp_path / "run" / "metrics.csv")
    steps = list(range(2, 17, 2))
    assert list(series["train_batch_number_step"]) == steps
    # the mean over the interval's two batches: indices (0, 1), (2, 3), ... in each epoch
    assert list(series["train_batch_number_step"].values()) == [0.5, 2.5, 4.5, 6.5] * 2
    assert list(series["train_epoch_number_step"].values()) == [0.0] * 4 + [1.0] * 4
    for step in steps:
        interval = regularisers.values[step - 2 : step]
        assert series["train_regulariser_step"][step] == pytest.approx(sum(interval) / 2, rel=1e-6)
    # the epoch means are still recorded, and logged at each epoch's end
    assert series["train_batch_number_epoch"] == {8: 3.5, 16: 3.5}
    assert list(series["train_loss_step"]) == steps


def test_logging_the_records_reads_nothing_back_during_steps(monkeypatch, tmp_path):
    trainer_class, marker, reads = _count_syncs_in_steps(monkeypatch, RecordsTrainer)
    tracking = ExperimentTrackingCallback(["csv"], logging_dir=tmp_path, run_name="run", log_every_n_steps=1)
    trainer = make_linear_trainer(trainer_class, callbacks=[marker, tracking])
    trainer.train(linear_dataset(32), num_epochs=1, per_device_batch_size=4)
    assert len(_csv_rows(tmp_path / "run" / "metrics.csv")["train_regulariser_step"]) == 8 and reads == []


def test_a_record_only_some_batches_return_is_the_mean_of_those_and_more_records_than_slots_fit(tmp_path):
    class Sometimes(Trainer):
        def calculate_train_batch_loss(self, batch, batch_idx):
            output = super().calculate_train_batch_loss(batch)
            extra = {f"metric_{index:02d}": torch.tensor(float(index)) for index in range(20)}  # more than 16 slots
            if batch_idx % 2 == 1:
                extra["odd_only"] = torch.tensor(float(batch_idx))
            return {**output, **extra}

    tracking = ExperimentTrackingCallback(["csv"], logging_dir=tmp_path, run_name="run", log_every_n_steps=4)
    trainer = make_linear_trainer(Sometimes, callbacks=[tracking])
    trainer.train(linear_dataset(32), num_epochs=1, per_device_batch_size=4)
    series = _csv_rows(tmp_path / "run" / "metrics.csv")
    assert series["train_odd_only_step"] == {4: 2.0, 8: 6.0}  # (1 + 3) / 2 and (5 + 7) / 2
    assert series["train_metric_19_step"] == {4: 19.0, 8: 19.0}


# ------------------------------------------------------------------------------------------------
# 4. Fine-tuning from a checkpoint with a new head (Hezar's init_weights_from)
# ------------------------------------------------------------------------------------------------


def _backbone_and_head(num_classes: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, num_classes))


def _pretrained_checkpoint(tmp_path):
    pretrained = _backbone_and_head(num_classes=10, seed=0)
    trainer = _trainer(Trainer, model=pretrained, callbacks=(), lr=0.3)  # the file's optimizer state has lr 0.3
    trainer.train(_classification_data(16), num_epochs=1, per_device_batch_size=8)
    path = tmp_path / "pretrained.pt"
    trainer.save_checkpoint(path)
    return path, trainer.get_model()


def test_a_checkpoint_into_a_model_with_another_head_is_refused_naming_the_keys(tmp_path):
    path, _ = _pretrained_checkpoint(tmp_path)
    model = _backbone_and_head(num_classes=3, seed=1)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    trainer = _trainer(Trainer, model=model)
    with pytest.raises(CheckpointError, match=r"2\.weight \(file \(10, 8\), model \(3, 8\)\).*strict=False"):
        trainer.load_checkpoint(path)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())  # nothing loaded


def test_fine_tuning_with_a_new_head_loads_the_backbone_says_what_it_skipped_and_trains(tmp_path):
    path, pretrained = _pretrained_checkpoint(tmp_path)
    model = _backbone_and_head(num_classes=3, seed=1)
    head_before = model[2].weight.clone()
    trainer = _trainer(Trainer, model=model)
    with pytest.warns(UserWarning, match=r"skipped: shapes differ: 2\.weight.*optimizer state was not loaded"):
        checkpoint = trainer.load_checkpoint(path, strict=False)
    skipped = checkpoint["skipped_weights"]
    assert skipped == SkippedWeights(mismatched_shapes={"2.weight": ((10, 8), (3, 8)), "2.bias": ((10,), (3,))})
    assert torch.equal(model[0].weight, pretrained[0].weight) and torch.equal(model[0].bias, pretrained[0].bias)
    assert torch.equal(model[2].weight, head_before)  # the new head keeps its own initialisation
    assert trainer.optimizer.param_groups[0]["lr"] == 0.5  # the old model's optimizer state was not loaded
    result = trainer.train(_classification_data(30), num_epochs=2, per_device_batch_size=8)
    assert math.isfinite(result.metrics["train_loss_epoch"])


def test_keys_on_one_side_only_are_listed_and_a_fitting_file_loads_silently(tmp_path):
    path, pretrained = _pretrained_checkpoint(tmp_path)
    torch.manual_seed(2)
    deeper = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 10), nn.Tanh(), nn.Linear(10, 4))
    trainer = _trainer(Trainer, model=deeper)
    with pytest.warns(UserWarning, match=r"not in the file \(the model keeps its own\): 4\.weight, 4\.bias"):
        skipped = trainer.load_checkpoint(path, strict=False)["skipped_weights"]
    assert skipped.missing_keys == ["4.weight", "4.bias"] and not skipped.mismatched_shapes
    smaller = _trainer(Trainer, model=nn.Sequential(nn.Linear(2, 8)))
    with pytest.warns(UserWarning, match=r"not in the model \(ignored\): 2\.weight, 2\.bias"):
        assert smaller.load_checkpoint(path, strict=False)["skipped_weights"].unexpected_keys == ["2.weight", "2.bias"]
    same = _trainer(Trainer, model=_backbone_and_head(num_classes=10, seed=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint = same.load_checkpoint(path, strict=False)
    assert not checkpoint["skipped_weights"] and same.optimizer.param_groups[0]["lr"] == 0.3  # all fits: all loaded
    assert torch.equal(same.get_model()[2].weight, pretrained[2].weight)


# ------------------------------------------------------------------------------------------------
# 5. Other trainers' names for the events
# ------------------------------------------------------------------------------------------------


class DreamCallback(TrainerCallback):
    """Dream Trainer's (and Lightning's) callback, as its docs write it."""

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        pass


class KerasCallback(TrainerCallback):
    def on_epoch_end(self, trainer, **kwargs):
        pass


def test_a_callback_with_another_trainers_event_name_is_refused_naming_the_event():
    lightning = r"'on_train_batch_end', which is Lightning's.*here the event is 'on_train_step_end'"
    with pytest.raises(ValueError, match=lightning):
        make_linear_trainer(Trainer, callbacks=[DreamCallback()])
    keras = r"'on_epoch_end', which is Keras's.*here the event is 'on_training_run_epoch_end'"
    with pytest.raises(ValueError, match=keras):
        make_linear_trainer(Trainer, callbacks=[KerasCallback])

    class Backward(TrainerCallback):
        def on_after_backward(self, trainer):
            pass

    with pytest.raises(ValueError, match=r"does not fire \(no event: override the trainer's backward_step hook\)"):
        make_linear_trainer(Trainer, callbacks=[Backward])


def test_a_declared_custom_event_of_a_foreign_name_is_allowed_and_fired():
    class FiresEpochEnd(Trainer):
        callback_events = ("on_epoch_end",)

        def training_run_epoch_end(self):
            self.callback_handler.call_event("on_epoch_end", self)

    class Counts(TrainerCallback):
        calls = 0

        def on_epoch_end(self, trainer, **kwargs):
            Counts.calls += 1

    trainer = make_linear_trainer(FiresEpochEnd, callbacks=[Counts()])
    trainer.train(linear_dataset(8), num_epochs=2, per_device_batch_size=4)
    assert Counts.calls == 2


def test_a_fastai_event_name_warns_at_registration():
    class FastaiStyle(TrainerCallback):
        def after_batch(self):
            pass

    fastai = r"'after_batch', which is fastai's name.*here the event is 'on_train_step_end'"
    with pytest.warns(UserWarning, match=fastai):
        make_linear_trainer(Trainer, callbacks=[FastaiStyle()])


def test_every_foreign_name_maps_to_an_event_or_says_what_to_do_and_no_name_is_ours():
    for name, (whose, here) in FOREIGN_EVENT_NAMES.items():
        assert name not in EVENTS and whose.endswith("'s")
        assert here in EVENTS or here.startswith("no event: "), name
    assert set(FASTAI_EVENT_NAMES.values()) <= set(EVENTS)


# ------------------------------------------------------------------------------------------------
# 6. Retries that run out: skip, stop, or raise
# ------------------------------------------------------------------------------------------------


class MiniTrainerStyle(Trainer):
    """A NaN loss on batch 2 of the first epoch, whatever the retries (a bad sample, not a transient overflow)."""

    def calculate_train_batch_loss(self, batch, batch_idx):
        output = super().calculate_train_batch_loss(batch)
        if batch_idx == 2 and self.run_state.epoch == 0:
            output["loss"] = output["loss"] * float("nan")
        return output


class StopEvents(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_stop_training_error(self, trainer, **kwargs):
        self.events.append("stop")

    def on_training_run_end(self, trainer, **kwargs):
        self.events.append("run_end")


def test_exhausted_retries_raise_once_the_run_has_ended_when_asked(capsys):
    events = StopEvents()
    callbacks = [SkipNonFiniteStepsCallback(max_retries=3, on_exhausted="raise"), events]
    trainer = make_linear_trainer(MiniTrainerStyle, callbacks=callbacks)
    before = [parameter.clone() for parameter in trainer.model.parameters()]
    with pytest.raises(NonFiniteGradientsError, match=r"update 3 \(epoch 1, batch 2\) were not finite after 3 retries"):
        trainer.train(linear_dataset(32), num_epochs=2, per_device_batch_size=4)
    assert isinstance(NonFiniteGradientsError("x"), RuntimeError)  # mini.trainer raises a RuntimeError
    assert events.events == ["stop", "run_end"]  # every callback ended the run first
    assert trainer.num_update_steps_completed == 2 and all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert "on_exhausted='raise'" in capsys.readouterr().out


def test_exhausted_retries_stop_the_run_or_skip_the_update_and_the_result_says_which(capsys):
    with pytest.raises(ValueError, match=r"max_consecutive_skips=1 counts skipped updates.*on_exhausted='stop'"):
        SkipNonFiniteStepsCallback(max_consecutive_skips=1, on_exhausted="stop")
    stopped = make_linear_trainer(MiniTrainerStyle, callbacks=[SkipNonFiniteStepsCallback(on_exhausted="stop")])
    result = stopped.train(linear_dataset(32), num_epochs=2, per_device_batch_size=4)
    assert result.stopped_early and result.num_update_steps == 2 and result.non_finite_updates_skipped == 1
    assert "were not finite after 0 retries (on_exhausted='stop')" in result.stop_reason
    skipped = make_linear_trainer(MiniTrainerStyle, callbacks=[SkipNonFiniteStepsCallback(max_retries=2)])
    result = skipped.train(linear_dataset(32), num_epochs=2, per_device_batch_size=4)
    assert not result.stopped_early and result.stop_reason is None
    assert result.non_finite_updates_skipped == 1 and result.num_update_steps == 15
    assert "Skipped 1 optimizer update whose gradients were not finite" in capsys.readouterr().out


def test_the_choice_is_checked_and_the_trainers_own_policy_takes_it():
    with pytest.raises(ValueError, match=r"on_exhausted='error' is not valid: choose between 'skip'"):
        SkipNonFiniteStepsCallback(on_exhausted="error")

    class RaisesOnExhaustion(MiniTrainerStyle):
        def training_run_start(self):
            self.skip_non_finite_steps(max_retries=1, on_exhausted="raise")

    trainer = make_linear_trainer(RaisesOnExhaustion)
    with pytest.raises(NonFiniteGradientsError):
        trainer.train(linear_dataset(32), num_epochs=1, per_device_batch_size=4)
    assert not issubclass(NonFiniteGradientsError, StopTrainingError)


# ------------------------------------------------------------------------------------------------
# 7. train()'s arguments after pytorch-accelerated's: its positional calls keep working
# ------------------------------------------------------------------------------------------------


def test_resume_from_keeps_pytorch_accelerated_s_position(tmp_path):
    trainer = make_linear_trainer(Trainer)
    # pytorch-accelerated 0.1.61's order, resume_from thirteenth: a folder with no state yet starts a new run
    arguments = (linear_dataset(8), 1, None, 4, None, 1, None, None, None, None, True, None, tmp_path)
    trainer.train(*arguments)
    assert trainer.run_state.options.resume_from == tmp_path and trainer.run_state.options.gradient_clip_norm is None


def test_a_given_dataloader_without_batch_size_in_the_hook_is_counted_too():
    dataloader = DataLoader(_classification_data(30), batch_size=8)
    seen = SeenByCallbacks()
    trainer = _trainer(QuriousStyleTrainer, callbacks=[seen])
    trainer.train(dataloader, num_epochs=1)
    assert seen.batch_sizes == [8, 8, 8, 6]


RECORDS_ON_TWO_PROCESSES_SCRIPT = """
import sys

import torch
from conftest import linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import ExperimentTrackingCallback


class RankRecords(Trainer):
    def calculate_train_batch_loss(self, batch, batch_idx):
        output = super().calculate_train_batch_loss(batch)
        rank = self.accelerator.process_index
        records = {"rank": torch.tensor(float(rank))}
        if rank == 1:
            records["rank_one_only"] = 7.0  # a record only one process returns: still logged
        return {**output, **records}


tracking = ExperimentTrackingCallback(["csv"], logging_dir=sys.argv[1], run_name="run", log_every_n_steps=2)
trainer = make_trainer(make_linear(), callbacks=[tracking], trainer_class=RankRecords)
trainer.train(linear_dataset(32), num_epochs=1, per_device_batch_size=4)
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_on_two_processes_the_records_are_averaged_over_both_and_one_process_s_record_is_logged(tmp_path):
    script = tmp_path / "records.py"
    script.write_text(RECORDS_ON_TWO_PROCESSES_SCRIPT)
    tests = os.path.dirname(__file__)  # for conftest's tiny model and data
    env = {**CPU_PROCESSES_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    command = [*launcher(2), str(script), str(tmp_path / "logs")]
    completed = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-3000:]
    series = _csv_rows(tmp_path / "logs" / "run" / "metrics.csv")
    assert series["train_rank_step"] == {2: 0.5, 4: 0.5}  # 4 updates per process: the mean of ranks 0 and 1
    assert series["train_rank_one_only_step"] == {2: 7.0, 4: 7.0}
