"""Step metrics on 2 processes (a scenario of scenarios.py, for tests/test_step_metrics.py): each sample's index as a
metric, and one metric only process 1 returns."""

import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer


class IndexTrainer(Trainer):
    def calculate_train_batch_loss(self, batch):
        output = super().calculate_train_batch_loss((batch[0], batch[1]))
        output["index"] = batch[2].float().mean()  # weighted by batch size: the epoch mean is the mean index
        if self.accelerator.process_index == 1:
            output["rank1_only"] = 1.0
        return output

    def calculate_eval_batch_loss(self, batch):
        output = super().calculate_eval_batch_loss((batch[0], batch[1]))
        rows = batch[2] if self.eval_batch_real_rows is None else batch[2][: self.eval_batch_real_rows]
        output["index"] = rows.float().mean() if len(rows) else 0.0
        return output


def dataset(size):
    x = torch.randn(size, 2, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(dim=1, keepdim=True), torch.arange(size))


def mean_over_samples(folder: Path) -> None:
    """Train one epoch and evaluate; the main process writes the epoch means to ``folder/result.json``."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    trainer = IndexTrainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01), callbacks=())
    trainer.train(dataset(24), num_epochs=1, eval_dataset=dataset(10), per_device_batch_size=4)
    if trainer.accelerator.is_main_process:
        names = ("train_index_epoch", "train_rank1_only_epoch", "eval_index_epoch")
        means = {name: trainer.run_history.get_metric_values(name) for name in names}
        (folder / "result.json").write_text(json.dumps(means))
