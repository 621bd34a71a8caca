"""A small, fully random training run (shuffle, dropout, scheduler) that a test kills and resumes.

Usage: python resume_run.py CONFIG_JSON. Writes the final model, optimizer, scheduler and history to
CONFIG["out"] with torch.save, so the test can compare an interrupted-and-resumed run bit for bit with an
uninterrupted one. CONFIG["then"]: a list of further configs, run after it in the same processes.
"""

import functools
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.state import files, training_state


class IndexedDataset(Dataset):
    """y = f(x) with the sample index, so that the samples each step sees can be logged."""

    def __init__(self, size):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 6, generator=generator)
        self.y = torch.sin(self.x).sum(dim=1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index], index


class IndexedTrainer(Trainer):
    def calculate_train_batch_loss(self, batch):
        xb, yb, _ = batch
        outputs = self.model(xb)
        return {"loss": self.loss_func(outputs, yb), "model_outputs": outputs, "batch_size": yb.size(0)}

    def calculate_eval_batch_loss(self, batch):
        with torch.no_grad():
            return self.calculate_train_batch_loss(batch)


class Kill(TrainerCallback):
    """Kills this process with SIGKILL (or sends it another signal) at a chosen point of the run."""

    def __init__(self, point):
        self.point = point  # {"event": ..., "epoch": ..., "step": ..., "signal": ...}
        self.eval_steps = 0

    def _maybe(self, trainer, event, step=None):
        point = self.point
        if point is None or point["event"] != event or trainer.run_history.current_epoch != point["epoch"]:
            return
        if step is not None and step != point["step"]:
            return
        if point.get("rank") is not None and point["rank"] != trainer._accelerator.process_index:
            return
        for _ in range(point.get("times", 1)):
            os.kill(os.getpid(), getattr(signal, point.get("signal", "SIGKILL")))

    def on_train_step_end(self, trainer, step, **kwargs):
        self._maybe(trainer, "train_step", step)

    def on_eval_step_end(self, trainer, **kwargs):
        self._maybe(trainer, "eval_step", self.eval_steps)
        self.eval_steps += 1

    def on_eval_epoch_start(self, trainer, **kwargs):
        self.eval_steps = 0


class LogSamples(TrainerCallback):
    def __init__(self, path):
        self.path = path

    def on_train_step_end(self, trainer, batch, **kwargs):
        with open(self.path, "a") as handle:
            ids = " ".join(str(int(i)) for i in batch[2])
            handle.write(f"{trainer.run_history.current_epoch} {trainer.num_update_steps_completed} {ids}\n")


def main(config):
    if config.get("weight_changed_out"):
        run_weight_changed_beside_save(config)
        return
    run(config)
    if config.get("then_resume_from"):  # then again from one of the states it saved, to its end
        state = f"{config['save_dir']}/{config['then_resume_from']}"
        run({**config, "resume_from": state, "save_dir": f"{config['save_dir']}_again", "out": config["again_out"]})
    if config.get("reference_out"):  # then an uninterrupted run in the same processes, to compare with
        reference = {**config, "save_dir": f"{config['save_dir']}_reference", "out": config["reference_out"]}
        run({**reference, "sample_log": None})
    if config.get("time_budget_out"):
        run_out_of_time(config["time_budget_out"])
    for then in config.get("then", ()):  # then other configs in the same processes, one after the other
        main(then)


class SlowUpdates(TrainerCallback):
    def on_optimizer_step_end(self, trainer, **kwargs):
        time.sleep(0.05)


def run_out_of_time(out):
    """A run whose time budget process 1 alone finds spent (it has 1 s, process 0 an hour): each process writes
    where and why it stopped to ``out`` + ``.<rank>.json``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    trainer = IndexedTrainer(
        model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01), callbacks=[SlowUpdates()]
    )
    rank = trainer.accelerator.process_index
    result = trainer.train(IndexedDataset(64), num_epochs=3, per_device_batch_size=2, max_time=1.0 if rank else 3600)
    summary = {
        "updates": result.num_update_steps,
        "stop_reason": result.stop_reason,
        "by_time_budget": trainer.run_state.stopped_by_time_budget,
    }
    Path(f"{out}.{rank}.json").write_text(json.dumps(summary))


class ChangesWeightInForward(IndexedTrainer):
    """On process ``rank`` only, changes the first layer's weight in place in the forward pass after update 3: between
    an asynchronous save and the next update."""

    rank = 1

    def calculate_train_batch_loss(self, batch):
        if self.num_update_steps_completed == 3 and self.accelerator.process_index == self.rank:
            with torch.no_grad():
                self.get_model()[0].weight.add_(0.0)
        return super().calculate_train_batch_loss(batch)


def run_weight_changed_beside_save(config):
    """Asynchronous saves after each update, and one process changing a weight beside the save of update 3: each
    process writes what ``train()`` raised and after which update to ``weight_changed_out`` + ``.<rank>.json``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    saves = SaveTrainingStateCallback(config["save_dir"], save_every_n_steps=1, asynchronous=True)
    trainer = ChangesWeightInForward(model, nn.MSELoss(), torch.optim.AdamW(model.parameters()), callbacks=[saves])
    try:
        trainer.train(IndexedDataset(32), num_epochs=1, per_device_batch_size=2)
        raised = None
    except Exception as error:
        raised = f"{type(error).__name__}: {error}"
    summary = {"raised": raised, "updates": trainer.num_update_steps_completed}
    Path(f"{config['weight_changed_out']}.{trainer.accelerator.process_index}.json").write_text(json.dumps(summary))


def run(config):
    if config.get("crash_at"):
        crash_at = config["crash_at"]

        hits = []

        def crash(name):  # die in the middle of a save, once earlier states exist (or at the point's Nth time)
            if name != crash_at:
                return
            hits.append(name)
            if config.get("crash_on_hit"):
                if len(hits) == config["crash_on_hit"]:
                    os.kill(os.getpid(), signal.SIGKILL)
            elif len(training_state.list_complete_states(Path(config["save_dir"]))) >= 2:
                os.kill(os.getpid(), signal.SIGKILL)

        files.crash_point = crash
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    callbacks = [
        SaveTrainingStateCallback(
            config["save_dir"],
            save_every_n_steps=config.get("save_every", 1),
            max_checkpoints=3,
            asynchronous=config.get("asynchronous", False),
        ),
        Kill(config.get("kill")),
    ]
    if config.get("sample_log"):
        callbacks.append(LogSamples(config["sample_log"]))
    trainer = IndexedTrainer(model, nn.MSELoss(), optimizer, callbacks=callbacks)
    scheduler = None
    if config.get("scheduler", True):
        scheduler = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.8)
    trainer.train(
        IndexedDataset(config.get("size", 22)),
        num_epochs=config.get("epochs", 3),
        eval_dataset=IndexedDataset(8),
        per_device_batch_size=2,
        gradient_accumulation_steps=config.get("accumulation", 1),
        create_scheduler_fn=scheduler,
        train_dataloader_kwargs={"shuffle": config.get("shuffle", True), "num_workers": config.get("num_workers", 0)},
        resume_from=config.get("resume_from", config["save_dir"]),
    )
    result = {
        "model": trainer.get_model().state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "history": trainer.run_history.state_dict(),
        "updates": trainer.num_update_steps_completed,
    }
    if trainer.run_config.is_world_process_zero:
        torch.save(result, config["out"])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
