"""DataLoaders where datasets are expected: a DataLoader trains as its dataset would, keeps its own collate function
and batch size, resumes exactly, and is sharded over processes."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitwise_equal, make_mlp, make_trainer, regression_dataset
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback


def test_dataloader_trains_as_its_dataset():
    """A DataLoader trains exactly as its dataset with the same arguments (the same seeded shuffle)."""
    by_dataset = make_trainer(make_mlp())
    by_dataset.train(regression_dataset(20), num_epochs=3, eval_dataset=regression_dataset(9), per_device_batch_size=4)
    by_loader = make_trainer(make_mlp())
    by_loader.train(
        DataLoader(regression_dataset(20), batch_size=4, shuffle=True),
        num_epochs=3,
        eval_dataset=DataLoader(regression_dataset(9), batch_size=4),
    )
    assert_bitwise_equal(by_loader.model.state_dict(), by_dataset.model.state_dict())  # same seeded shuffle order
    assert by_loader.run_history.get_metric_values("eval_loss_epoch") == by_dataset.run_history.get_metric_values(
        "eval_loss_epoch"
    )
    assert (
        by_loader.run_config.train_per_device_batch_size == 4 and by_loader.run_config.num_update_steps_per_epoch == 5
    )


def test_dataloader_keeps_its_collate_fn():
    """A DataLoader keeps its own collate function and batch size."""
    sizes = []

    def collate(samples):
        sizes.append(len(samples))
        return torch.utils.data.default_collate(samples)

    trainer = make_trainer(make_mlp())
    trainer.train(DataLoader(regression_dataset(12), batch_size=5, collate_fn=collate), num_epochs=1)
    assert sizes == [5, 5, 2]
    result = trainer.evaluate(DataLoader(regression_dataset(6), batch_size=6, collate_fn=collate))
    assert sizes[-1] == 6 and set(result) == {"evaluation_loss"}
    assert trainer.evaluate() == result  # the evaluation DataLoader of the last evaluate() is the default


def test_dataloader_run_resumes_bitwise(tmp_path):
    """A run on a DataLoader resumes bit for bit from a state inside an epoch."""

    class SaveAtUpdate3(TrainerCallback):
        def on_optimizer_step_end(self, trainer, num_update_steps_completed=0, **kwargs):
            if num_update_steps_completed == 3:
                trainer.save_training_state(tmp_path, name="mid")

    def loader():
        return DataLoader(regression_dataset(20), batch_size=4, shuffle=True)

    full = make_trainer(make_mlp(), callbacks=[SaveAtUpdate3()])
    full.train(loader(), num_epochs=2)
    resumed = make_trainer(make_mlp(seed=5))
    resumed.train(loader(), num_epochs=2, resume_from=tmp_path / "mid")
    assert_bitwise_equal(resumed.model.state_dict(), full.model.state_dict())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("dataloader_shards")
def test_two_processes_shard_a_dataloader(one_process_scenarios, two_process_scenarios):
    """Two processes shard a DataLoader and train as one process on the global batch."""
    single = one_process_scenarios.read_json("dataloader_shards")  # batches of 8
    double = two_process_scenarios.read_json("dataloader_shards")  # batches of 4 on each process
    assert double["indices_seen"] == 16 and double["distinct_per_epoch"] == [16, 16]  # each sample once per epoch
    assert double["weights"] == pytest.approx(single["weights"], rel=1e-5, abs=1e-6)
    assert double["num_samples"] == single["num_samples"] == 32


class OwnDataloaders(Trainer):
    """An override of the dataloader hooks that builds its own batches of 4 and 3, whatever train() is given."""

    def create_train_dataloader(self, batch_size, train_dl_kwargs=None):
        return DataLoader(self.train_dataset, batch_size=4, shuffle=True)

    def create_eval_dataloader(self, batch_size, eval_dl_kwargs=None):
        return DataLoader(self.eval_dataset, batch_sampler=BatchSampler(SequentialSampler(self.eval_dataset), 3, False))


def test_the_run_config_reads_the_batch_size_of_the_prepared_dataloader():
    """The run config's per-device batch size is the prepared dataloader's: 4 for an override of
    create_train_dataloader with batches of 4, not the default 8, nor a stale 16 from an earlier run of the default
    hook with 16."""
    model = nn.Linear(4, 1)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01), callbacks=())
    trainer.train(regression_dataset(32), num_epochs=1, per_device_batch_size=16)
    assert trainer.run_config.train_per_device_batch_size == 16
    trainer.__class__ = OwnDataloaders  # the same trainer, its hooks overridden since its last run
    trainer.train(regression_dataset(32), num_epochs=1, eval_dataset=regression_dataset(9))
    config = trainer.run_config
    assert (config.train_per_device_batch_size, config.train_total_batch_size, config.train_dl_kwargs) == (4, 4, None)
    assert (config.eval_per_device_batch_size, config.eval_total_batch_size, config.num_update_steps_per_epoch) == (
        3,
        3,
        8,
    )
    fresh = OwnDataloaders(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01), callbacks=())
    fresh.train(regression_dataset(32), num_epochs=1)
    assert fresh.run_config.train_per_device_batch_size == 4
