"""``predict(output_dir=URL)`` on every process of a launch: the main process, slowed down after each batch, writes
the chunks to the store; every process reads the folder back as soon as ``predict`` returns, and writes what it read
as JSON to ``OUT/rank<i>.json`` (for tests/test_predict.py).

Usage: ``predict_store.py URL OUT``, under ``accelerate launch`` with fsspec's store configured (S3: its endpoint in
``FSSPEC_S3_ENDPOINT_URL``).
"""

import json
import sys
import time
from pathlib import Path

import torch
from accelerate import PartialState
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.predictions import load_predictions


class SlowMainProcess(TrainerCallback):
    def on_predict_step_end(self, trainer, **kwargs):
        if trainer.accelerator.is_main_process:
            time.sleep(0.3)


def main(url: str, out: Path) -> None:
    model = nn.Linear(1, 1)
    with torch.no_grad():  # each sample's prediction is its id
        model.weight.fill_(1.0)
        model.bias.fill_(0.0)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[SlowMainProcess])
    ids = TensorDataset(torch.arange(13, dtype=torch.float32).unsqueeze(1))
    written = trainer.predict(ids, per_device_batch_size=2, output_dir=url, chunk_size=5)
    try:
        read = load_predictions(written)[:, 0].tolist()
    except FileNotFoundError as error:  # the folder was not complete when predict() returned
        read = str(error)
    report = {"written": str(written), "read": read}
    (out / f"rank{PartialState().process_index}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
