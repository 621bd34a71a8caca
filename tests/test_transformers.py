"""Hugging Face transformers models: dict batches, the model's own loss, and a loss_func on the logits.

The models are built from tiny configs (hidden size 32, 2 layers, a vocabulary of 100): nothing is downloaded.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
from pytorch_accel_trainer.callbacks import MetricCollectionCallback

VOCAB_SIZE, SEQUENCE_LENGTH = 100, 8


def make_bert(seed: int = 0) -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQUENCE_LENGTH,
        num_labels=2,
    )
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(config)


def make_gpt2(seed: int = 0) -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=SEQUENCE_LENGTH,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def token_dataset(num_samples: int = 64, seed: int = 0, with_labels: bool = True) -> list[dict]:
    """Sequences of low token ids (label 0) or high ones (label 1), some padded: a list of dicts, as HF datasets give.

    The default collate stacks them into a dict batch of tensors.
    """
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(num_samples):
        label = index % 2
        input_ids = torch.randint(1, VOCAB_SIZE // 2, (SEQUENCE_LENGTH,), generator=generator) + label * (
            VOCAB_SIZE // 2
        )
        length = int(torch.randint(SEQUENCE_LENGTH // 2, SEQUENCE_LENGTH + 1, (), generator=generator))
        attention_mask = (torch.arange(SEQUENCE_LENGTH) < length).long()
        sample = {"input_ids": input_ids * attention_mask, "attention_mask": attention_mask}
        if with_labels:
            sample["labels"] = torch.tensor(label)
        samples.append(sample)
    return samples


def repeated_token_dataset(num_samples: int = 32, seed: int = 0) -> list[dict]:
    """Sequences of one repeated token, with ``labels`` = ``input_ids``: a causal language model learns to repeat it."""
    tokens = torch.randint(0, VOCAB_SIZE, (num_samples, 1), generator=torch.Generator().manual_seed(seed))
    input_ids = tokens.expand(num_samples, SEQUENCE_LENGTH)
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids} for ids in input_ids]


def _train_bert(loss_func, num_epochs: int = 3, callbacks=()) -> Trainer:
    model = make_bert()
    trainer = Trainer(
        model, loss_func=loss_func, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), callbacks=callbacks
    )
    trainer.train(
        token_dataset(), num_epochs=num_epochs, eval_dataset=token_dataset(32, seed=1), per_device_batch_size=8
    )
    return trainer


def _mean_model_loss(model: torch.nn.Module, samples: list[dict]) -> float:
    """The model's own loss averaged over every sample, computed by hand in one batch."""
    batch = torch.utils.data.default_collate(samples)
    model.eval()
    with torch.no_grad():
        return model(**batch).loss.item()


def test_classifier_trains_on_its_own_loss(capsys):
    """A classifier trains on the loss it returns, with the default callbacks and a metric."""
    accuracy = MetricCollectionCallback({"accuracy": MulticlassAccuracy(num_classes=2)})  # logits and labels by default
    trainer = _train_bert(loss_func=None, callbacks=(accuracy, *DEFAULT_CALLBACKS))

    train_losses = trainer.run_history.get_metric_values("train_loss_epoch")
    eval_losses = trainer.run_history.get_metric_values("eval_loss_epoch")
    assert len(train_losses) == len(eval_losses) == 3
    assert train_losses[-1] < 0.5 * train_losses[0]
    assert eval_losses[-1] < 0.5 * eval_losses[0]
    assert trainer.run_history.get_latest_metric("accuracy") > 0.9
    output = capsys.readouterr().out  # the default callbacks coped with dict batches and ModelOutputs
    assert "eval_loss_epoch" in output and "accuracy" in output


def test_evaluate_averages_the_models_loss():
    """evaluate records the mean of the model's own loss."""
    trainer = _train_bert(loss_func=None, num_epochs=1)
    eval_samples = token_dataset(20, seed=2)  # 20 = 8 + 8 + 4: a short last batch, weighted by its size

    trainer.evaluate(eval_samples, per_device_batch_size=8)

    expected = _mean_model_loss(trainer.get_model(), eval_samples)
    assert trainer.run_history.get_latest_metric("evaluation_loss") == pytest.approx(expected, rel=1e-5)


def test_loss_func_on_logits_equals_own_loss():
    """A loss_func on the logits trains exactly as the model's own loss."""

    def cross_entropy_on_logits(outputs, labels):  # targets of a dict batch are batch["labels"]
        return F.cross_entropy(outputs.logits, labels)

    own_loss = _train_bert(loss_func=None, num_epochs=2)
    explicit = _train_bert(loss_func=cross_entropy_on_logits, num_epochs=2)

    for metric in ("train_loss_epoch", "eval_loss_epoch"):
        assert explicit.run_history.get_metric_values(metric) == pytest.approx(
            own_loss.run_history.get_metric_values(metric), rel=1e-5
        )
    torch.testing.assert_close(explicit.get_model().state_dict(), own_loss.get_model().state_dict())


def test_causal_lm_trains_on_its_own_loss():
    model = make_gpt2()
    trainer = Trainer(model, loss_func=None, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), callbacks=())

    trainer.train(repeated_token_dataset(), num_epochs=3, per_device_batch_size=8)  # the model shifts the labels

    losses = trainer.run_history.get_metric_values("train_loss_epoch")
    assert losses[0] > losses[1] > losses[2]
    assert losses[-1] < 0.85 * losses[0]


@pytest.mark.parametrize("entry_point", ["train", "evaluate"])
def test_no_loss_and_no_loss_func_is_an_error(entry_point):
    """A model returning no loss, without a loss_func, is a clear error."""
    model = make_bert()
    trainer = Trainer(model, loss_func=None, optimizer=torch.optim.AdamW(model.parameters()), callbacks=())
    unlabelled = token_dataset(16, with_labels=False)  # no "labels": transformers models then return no loss

    with pytest.raises(
        ValueError,
        match=(
            r"^loss_func is None and the model output \(a SequenceClassifierOutput\) has no 'loss'\. "
            r"Pass Trainer\(loss_func=\.\.\.\), or return a loss from the model"
        ),
    ):
        if entry_point == "train":
            trainer.train(unlabelled, num_epochs=1)
        else:
            trainer.evaluate(unlabelled)
