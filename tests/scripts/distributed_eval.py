"""Evaluates every (dataset size, batch size, dataset kind) case on 1 or 2 processes (a scenario of scenarios.py);
writes what each process saw, for tests/test_distributed_eval.py.

Each case is bounded by a watchdog: a case that hangs kills the process with a traceback naming the case.
"""

import faulthandler
import json
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import MetricCollectionCallback, TrainerCallback

SIZES, BATCH_SIZES, KINDS = range(1, 18), range(1, 5), ("map", "iterable")
CASE_TIMEOUT_S = 30


class Rows(IterableDataset):
    """An iterable dataset (no __len__) of the same rows as the map-style one."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))


class GatherRows(TrainerCallback):
    """Gathers the sample ids of every evaluation batch, with gather and gather_for_metrics."""

    def on_eval_epoch_start(self, trainer, **kwargs):
        self.gathered, self.gathered_for_metrics, self.gathered_padded = [], [], []

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        self.gathered.append(trainer.gather(batch[0][:, 0]))
        self.gathered_padded.append(trainer.gather(batch[0][:, 0], padding_value=-1))  # ids are never -1
        self.gathered_for_metrics.append(trainer.gather_for_metrics(batch_output["model_outputs"][:, 0]))


def data(size):
    ids = torch.arange(size, dtype=torch.float32)
    x = torch.stack([ids, torch.sin(ids)], dim=1)
    y = torch.cos(ids).unsqueeze(1) * 3
    return x, y


def evaluate_every_case(folder: Path) -> None:
    """Write ``folder/result.rank<i>.json``: what process ``i`` gathered in each case, and what was expected."""
    from torchmetrics import MeanAbsoluteError

    model = nn.Linear(2, 1)
    with torch.no_grad():  # outputs[:, 0] is the sample id, so gathered outputs can be checked row by row
        model.weight.copy_(torch.tensor([[1.0, 0.5]]))
        model.bias.zero_()
    gather_rows = GatherRows()
    metrics = MetricCollectionCallback(
        {"mae": MeanAbsoluteError()}, lambda batch, out: (out["model_outputs"], batch[1])
    )
    trainer = Trainer(model, nn.MSELoss(), optimizer=None, callbacks=[gather_rows, metrics])
    results = {}
    for kind in KINDS:
        for size in SIZES:
            for batch_size in BATCH_SIZES:
                name = f"{kind} size={size} batch={batch_size}"
                faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
                print(name, file=sys.stderr, flush=True)
                x, y = data(size)
                dataset = TensorDataset(x, y) if kind == "map" else Rows(x, y)
                trainer.evaluate(dataset, per_device_batch_size=batch_size)
                faulthandler.cancel_dump_traceback_later()
                outputs = model(x).detach()
                results[name] = {
                    "gathered": torch.cat(gather_rows.gathered).tolist(),
                    "gathered_for_metrics": torch.cat(gather_rows.gathered_for_metrics).tolist(),
                    "gathered_padded": torch.cat(gather_rows.gathered_padded).tolist(),
                    "evaluation_loss": trainer.run_history.get_latest_metric("evaluation_loss"),
                    "mae": trainer.run_history.get_latest_metric("mae"),
                    "expected_loss": nn.functional.mse_loss(outputs, y).item(),
                    "expected_mae": (outputs - y).abs().mean().item(),
                    "expected_rows": outputs[:, 0].tolist(),
                }
    state = PartialState()
    result = {"num_processes": state.num_processes, "cases": results}
    (folder / f"result.rank{state.process_index}.json").write_text(json.dumps(result))
