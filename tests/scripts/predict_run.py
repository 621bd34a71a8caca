"""Predicts every (dataset size, batch size, dataset kind) case on the processes it is launched on, then writes a
prediction folder and reads it back on every process as predict() returns (the main process slowed down as it
writes), tries a memory:// folder (refused on several processes), runs one lr_find and (with Optuna) two searches of
one trial each, every trial on all the processes (one pruned after its first epoch, one complete); writes what each
process got, as JSON, to ``<folder>/result.rank<i>.json`` (a scenario of scenarios.py, for tests/test_predict.py).

Each sample's prediction is its id (the model is the identity on a column of ids), so a prediction that drops,
repeats or reorders samples shows. A watchdog kills a case that hangs, with a traceback naming it.
"""

import faulthandler
import json
import time
from pathlib import Path

import torch
from accelerate import PartialState
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.predictions import load_predictions

SIZES, BATCH_SIZES, KINDS = range(1, 18), range(1, 5), ("map", "iterable")
CASE_TIMEOUT_S = 30


class Rows(IterableDataset):
    """An iterable dataset (no __len__) of the same rows as the map-style one."""

    def __init__(self, x):
        self.x = x

    def __iter__(self):
        return iter((row,) for row in self.x)


class Ids(Trainer):
    """Predicts a dict: the ids, and the ids times two as a tuple, to check structured outputs."""

    def calculate_predict_batch_output(self, batch):
        ids = super().calculate_predict_batch_output(batch)[:, 0]
        return {"ids": ids, "pair": (ids, 2 * ids)}


class SlowMainProcess(TrainerCallback):
    """Holds the main process back after each gathered batch, so that the others reach the end of predict() well
    before it writes the last chunk and the index: what predict() returns must be complete all the same."""

    def on_predict_step_end(self, trainer, **kwargs):
        if trainer.accelerator.is_main_process:
            time.sleep(0.5)


def predict_every_case(folder: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(0.0)
    trainer = Ids(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    state = PartialState()  # after the trainer, which sets up the processes
    cases = {}
    for size in SIZES:
        x = torch.arange(size, dtype=torch.float32).unsqueeze(1)
        for batch_size in BATCH_SIZES:
            for kind in KINDS:
                name = f"size={size} batch={batch_size} kind={kind}"
                faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
                dataset = TensorDataset(x) if kind == "map" else Rows(x)
                predicted = trainer.predict(dataset, per_device_batch_size=batch_size)
                cases[name] = {
                    "ids": predicted["ids"].tolist(),
                    "pair": [predicted["pair"][0].tolist(), predicted["pair"][1].tolist()],
                }
                faulthandler.cancel_dump_traceback_later()
    x = torch.arange(13, dtype=torch.float32).unsqueeze(1)
    in_memory = trainer.predict(TensorDataset(x), per_device_batch_size=2)
    chunks = folder / "chunks"
    trainer.callback_handler.add_callback(SlowMainProcess())
    written = trainer.predict(TensorDataset(x), per_device_batch_size=2, output_dir=chunks, chunk_size=5)
    try:  # at once, as docs/howto.md's "Get predictions" does, on every process
        loaded = load_predictions(written)
        chunked_equal = bool(
            torch.equal(loaded["ids"], in_memory["ids"]) and torch.equal(loaded["pair"][1], in_memory["pair"][1])
        )
    except FileNotFoundError as error:  # the folder was not complete when predict() returned
        chunked_equal = str(error)
    trainer.callback_handler.remove_callback(SlowMainProcess)
    state.wait_for_everyone()  # whatever happened above, the processes go on together
    try:
        trainer.predict(TensorDataset(x), output_dir=f"memory://predictions-{state.num_processes}")
        memory_store = "written"
    except ValueError as error:
        memory_store = str(error)
    data = TensorDataset(torch.randn(64, 1), torch.randn(64, 1))
    result = trainer.lr_find(data, start_lr=1e-4, end_lr=1.0, num_steps=30, per_device_batch_size=4)
    report = {
        "tune": tune_on_every_process(folder),
        "num_processes": state.num_processes,
        "cases": cases,
        "chunked_equal": chunked_equal,
        "memory_store": memory_store,
        "chunk_files": sorted(path.name for path in chunks.iterdir()),
        "lr_find": {"suggestion": result.suggestion, "losses": result.losses},
    }
    (folder / f"result.rank{state.process_index}.json").write_text(json.dumps(report))


def tune_on_every_process(folder: Path) -> dict:
    """Two searches of one trial each, each trial a job of every process: one pruned after its first epoch (the main
    process's pruner decides for all), one complete. A disagreement would leave a process waiting: the watchdog."""
    try:
        import optuna
    except ImportError:
        return {}
    from config_data.tiny import TINY_CONFIG  # tests/, on the path of scenarios.py

    from pytorch_accel_trainer.cli.tune import tune

    config = {**TINY_CONFIG, "train": {"num_epochs": 2, "per_device_batch_size": 8}}
    space = {"optimizer.init_args.lr": {"low": 0.01, "high": 0.1}}
    faulthandler.dump_traceback_later(120, exit=True)
    pruned = tune(config, space, 1, output_dir=folder / "pruned", pruner=optuna.pruners.ThresholdPruner(upper=0.0))
    complete = tune(config, space, 1, output_dir=folder / "complete")
    faulthandler.cancel_dump_traceback_later()
    if pruned.study is None:  # not the main process: it ran the trials, the main one told Optuna
        return {}
    (pruned_trial,) = pruned.study.trials
    run_config = json.loads((folder / "complete/trials/trial-0000/run_config.json").read_text())
    return {
        "pruned": [pruned_trial.state.name, list(pruned_trial.intermediate_values)],
        "complete": [complete.study.trials[0].state.name, complete.best_config is not None],
        "num_processes": run_config["num_processes"],
    }
