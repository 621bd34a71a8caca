"""On a CUDA GPU: fp16 and bf16 training with the default callbacks, every ordinary step under
``torch.cuda.set_sync_debug_mode("error")`` (any host-device synchronisation in a step raises).

Run on a machine with a GPU:  python benchmarks/gpu_checks/fp16_sync_free.py [fp16|bf16|no]
Each precision needs a fresh process (Accelerate sets the precision once per process).
Prints one line per check and exits non-zero if one fails; on a machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback


class SyncsAreErrorsInSteps(TrainerCallback):
    """Turns host-device synchronisations into errors from the start of each step; ``train_epoch_end`` turns
    them back on before the epoch's one read (the loss)."""

    def on_train_step_start(self, trainer, **kwargs):
        torch.cuda.set_sync_debug_mode("error")


class EpochEndOutsideSteps(Trainer):
    def train_epoch_end(self):
        torch.cuda.set_sync_debug_mode("default")


def main(precision: str) -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 0
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=generator)
    y = (x[:, :8] ** 2).sum(dim=1, keepdim=True)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))
    trainer = EpochEndOutsideSteps(
        model,
        nn.MSELoss(),
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        callbacks=(SyncsAreErrorsInSteps, *DEFAULT_CALLBACKS),
        mixed_precision=precision,
    )
    trainer.train(
        TensorDataset(x, y),
        num_epochs=3,
        eval_dataset=TensorDataset(x[:512], y[:512]),
        per_device_batch_size=64,
        train_dataloader_kwargs={"pin_memory": True},
    )
    losses = trainer.run_history.get_metric_values("train_loss_epoch")
    ok = losses[-1] < losses[0] and trainer.run_config.mixed_precision == precision
    scaler = trainer._accelerator.scaler
    print(f"{precision}: losses {losses}, scaler {'on' if scaler is not None else 'off'}, sync-free steps: yes")
    print("PASS" if ok else "FAIL: the loss did not go down or the precision was not applied")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "fp16"))
