"""What the batch-loss hooks may take and return, as the users of other trainers write them.

A hook may return ``{"loss": ..., "accuracy": ...}`` without a batch size (qurious, Dream Trainer): the trainer counts
the batch, as it would have weighed a returned one. A hook may take ``batch_idx`` (Dream Trainer, Lightning): the
index of the batch in its epoch, also on ``trainer.batch_idx``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import classification_dataset, linear_dataset, make_linear, make_trainer
from sync_counter import count_syncs_in_steps
from torch import nn
from torch.utils.data import DataLoader, Dataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SkipNonFiniteStepsCallback, TrainerCallback


def _classifier_trainer(trainer_class, callbacks=()) -> Trainer:
    """A ``trainer_class`` of a 2-class linear classifier (nn.Linear(2, 2)), cross-entropy, SGD at lr 0.5."""
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    return make_trainer(
        model, lr=0.5, callbacks=callbacks, trainer_class=trainer_class, loss_func=nn.CrossEntropyLoss()
    )


# A batch-loss hook without batch_size: the trainer counts the batch ---------------------------------------------------


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


def test_hook_without_batch_size_counts_it():
    """A hook returning loss and accuracy but no batch_size trains as if it returned the batch size."""
    data, eval_data = classification_dataset(30), classification_dataset(14, seed=1)
    without = _classifier_trainer(QuriousStyleTrainer)
    result = without.train(data, num_epochs=2, eval_dataset=eval_data, per_device_batch_size=8)
    given = _classifier_trainer(WithBatchSize)
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


def test_batch_size_found_in_a_dict_batch():
    """The batch size is found in a dict batch and reaches the callbacks."""
    seen = SeenByCallbacks()
    trainer = _classifier_trainer(DictBatchTrainer, callbacks=[seen])
    trainer.train(DictDataset(classification_dataset(30)), num_epochs=1, per_device_batch_size=8)
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


def test_string_batch_asks_for_batch_size():
    """A batch without a tensor to count (strings) asks the hook to return batch_size."""
    model = make_linear()
    trainer = StringBatchTrainer(model, None, torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    with pytest.raises(ValueError, match=r"without 'batch_size'.*Return it: \{'loss': loss, 'batch_size': len\(y\)\}"):
        trainer.train(SentencesDataset(), num_epochs=1, per_device_batch_size=2, collate_fn=list)


def test_batch_size_makes_no_device_sync(monkeypatch):
    """Finding the batch size reads nothing back from the device."""
    trainer_class, marker, reads = count_syncs_in_steps(monkeypatch, QuriousStyleTrainer)
    trainer = _classifier_trainer(trainer_class, callbacks=[marker])
    trainer.train(classification_dataset(30), num_epochs=1, per_device_batch_size=4)
    assert trainer.num_update_steps_completed == 8 and reads == []


def test_dataloader_batches_are_counted():
    """The batches of a given DataLoader are counted too when the hook returns no batch_size."""
    dataloader = DataLoader(classification_dataset(30), batch_size=8)
    seen = SeenByCallbacks()
    trainer = _classifier_trainer(QuriousStyleTrainer, callbacks=[seen])
    trainer.train(dataloader, num_epochs=1)
    assert seen.batch_sizes == [8, 8, 8, 6]


# batch_idx in the batch-loss hooks, and trainer.batch_idx -------------------------------------------------------------


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


def test_batch_idx_is_the_index_in_the_epoch():
    """Hooks that name batch_idx receive the index of each batch in its epoch."""
    steps = StepIndices()
    trainer = _classifier_trainer(DreamStyleTrainer, callbacks=[steps])
    trainer.train(
        classification_dataset(30), num_epochs=2, eval_dataset=classification_dataset(12), per_device_batch_size=8
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


def test_index_goes_to_a_required_second_arg():
    """The index goes positionally to a second parameter, never to an optional one."""
    positional = make_trainer(make_linear(), trainer_class=PositionalIndex)
    positional.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)
    assert positional.indices == [0, 1, 2, 3]
    batch_only = make_trainer(make_linear(), trainer_class=BatchOnly)
    batch_only.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)
    plain = make_trainer(make_linear())
    plain.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)
    assert batch_only.run_history.get_latest_metric("train_loss_epoch") == plain.run_history.get_latest_metric(
        "train_loss_epoch"
    )


def test_hook_signature_is_read_once(monkeypatch):
    """The hook's signature is read once per run, not at every step."""

    class OnceTrainer(Trainer):
        def calculate_train_batch_loss(self, batch, batch_idx):
            return super().calculate_train_batch_loss(batch, batch_idx)

    reads, original = [], inspect.signature

    def counting(function, *args, **kwargs):
        if "OnceTrainer.calculate_train_batch_loss" in getattr(function, "__qualname__", ""):
            reads.append(function)
        return original(function, *args, **kwargs)

    monkeypatch.setattr(inspect, "signature", counting)
    trainer = make_trainer(make_linear(), trainer_class=OnceTrainer)
    trainer.train(linear_dataset(16), num_epochs=2, per_device_batch_size=4)
    assert trainer.num_update_steps_completed == 8 and len(reads) == 1


def test_retried_window_keeps_batch_indices():
    """A retried accumulation window passes each batch its own index again."""

    class Indices(PositionalIndex):
        def calculate_train_batch_loss(self, batch, i):
            output = super().calculate_train_batch_loss(batch, i)
            if len(self.indices) == 4:  # the 2nd window's second batch, on its first try: NaN gradients
                output["loss"] = output["loss"] * float("nan")
            return output

    trainer = make_trainer(make_linear(), callbacks=[SkipNonFiniteStepsCallback(max_retries=1)], trainer_class=Indices)
    trainer.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4, gradient_accumulation_steps=2)
    assert trainer.indices == [0, 1, 2, 3, 2, 3]  # the window (2, 3) ran again, each batch with its index
