"""The process decorators and ModelEma on 2 processes (gloo), a scenario of scenarios.py: each process writes what it
saw, for tests/test_utils.py.

The decorators are called before anything else sets Accelerate up, as in a script that prepares its data first: the
scenario runs first in its launch."""

import json
import time
from pathlib import Path

import torch
from accelerate import PartialState
from torch import nn

from pytorch_accel_trainer.utils import ModelEma, local_process_zero_first, world_process_zero_only


def rank():
    return PartialState().process_index


@local_process_zero_first
def prepare_cache(folder: Path) -> str:
    if rank() == 0:
        time.sleep(0.5)  # rank 1 would write first if it did not wait
        (folder / "cache").write_text("ready")
    with (folder / "utils.log").open("a") as file:  # both ranks append: the order of the lines is that of the calls
        file.write(f"rank {rank()}\n")
    return (folder / "cache").read_text()


@world_process_zero_only
def report():
    return f"report from rank {rank()}"


@world_process_zero_only
def fails_on_the_main_process():
    raise ValueError("boom")


def process_decorators(folder: Path) -> None:
    """Write ``folder/utils.rank<i>`` (what process ``i`` got) and ``folder/utils.log`` (the order of the calls)."""
    result = {"cache": prepare_cache(folder), "report": report(), "num_processes": PartialState().num_processes}
    try:
        fails_on_the_main_process()
    except (ValueError, RuntimeError) as error:
        result["error"] = f"{type(error).__name__}: {error}"

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(2, 1))
    ema = ModelEma(model, decay=0.5)
    with torch.no_grad():
        model.module.weight.fill_(rank() + 1.0)  # a different model on each rank, to see which one each EMA follows
    ema.update(model)
    result["ema_keys"] = sorted(ema.module.state_dict())
    result["ema_weight"] = ema.module.weight.tolist()
    result["initial_weight"] = (2 * ema.module.weight - (rank() + 1.0)).tolist()
    (folder / f"utils.rank{rank()}").write_text(json.dumps(result))
