"""A small training run that loses a process (or a whole node) in torchrun's first attempt and finishes in the
restarted one.

Usage: torchrun --nproc_per_node 2 --max-restarts 2 restart_run.py CONFIG_JSON (tests/test_restarts.py).

CONFIG:

- ``save_dir``: the training states, also ``resume_from``;
- ``out``: the final weights and optimizer state and the number of updates, written by the main process;
- ``kill``: in the first attempt only, ``{"epoch", "step", "how"}`` and either ``"rank"`` (that process) or
  ``"node"`` (the processes whose environment has ``RESTART_RUN_NODE`` set to it). ``how``: ``"sigkill"``,
  ``"exit"`` (``os._exit(1)``) or ``"node"`` (SIGKILL to torchrun's agent, then to the process: a machine lost;
  the agent's pid is read from the file ``agent_pid_file``, as the agent of a warm process is not its parent);
- ``allow_resume_changes``: passed to ``train()``, to resume on fewer processes;
- ``reference_out``: after its run, the attempt that finishes trains again from scratch in the same processes,
  uninterrupted, and writes that run's result there, to compare with.

Each process prints the restart count of the attempt that finished its run (``finished in attempt N``).
"""

import json
import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.parallel.restarts import get_restart_count


class LoseProcess(TrainerCallback):
    """Ends one process (or its node) abruptly at a chosen step of a chosen epoch, in torchrun's first attempt only."""

    def __init__(self, point):
        self.point = point

    def _is_chosen(self, trainer) -> bool:
        if "node" in self.point:
            return os.environ.get("RESTART_RUN_NODE") == self.point["node"]
        return trainer.accelerator.process_index == self.point["rank"]

    def on_train_step_end(self, trainer, step, **kwargs):
        point = self.point
        if point is None or get_restart_count() != 0 or not self._is_chosen(trainer):
            return
        if (trainer.run_history.current_epoch, step) != (point["epoch"], point["step"]):
            return
        if point["how"] == "exit":
            os._exit(1)
        if point["how"] == "node":
            with open(point["agent_pid_file"]) as agent_pid:
                os.kill(int(agent_pid.read()), signal.SIGKILL)  # torchrun's agent: it started this process
        os.kill(os.getpid(), signal.SIGKILL)


def dataset():
    """y = 2x + 3 (with a little noise), 24 samples: 6 updates per epoch on 2 processes with batches of 2."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(24, 1, generator=generator)
    return TensorDataset(x, 2 * x + 3 + 0.1 * torch.randn(24, 1, generator=generator))


def run(save_dir, out, kill=None, resume=True, allow_resume_changes=False):
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    callbacks = [SaveTrainingStateCallback(save_dir, save_every_n_steps=2, max_checkpoints=2), LoseProcess(kill)]
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.05), callbacks=callbacks)
    trainer.train(
        dataset(),
        num_epochs=3,
        per_device_batch_size=2,
        resume_from=save_dir if resume else None,
        allow_resume_changes=allow_resume_changes,
    )
    result = {
        "model": trainer.get_model().state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "updates": trainer.num_update_steps_completed,
    }
    if trainer.run_config.is_world_process_zero:
        torch.save(result, out)


def main(config):
    run(config["save_dir"], config["out"], config.get("kill"), True, config.get("allow_resume_changes", False))
    sys.stdout.write(f"finished in attempt {get_restart_count()}\n")  # one write: every process prints this line
    sys.stdout.flush()
    if config.get("reference_out"):
        run(f"{config['save_dir']}_reference", config["reference_out"], resume=False)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
