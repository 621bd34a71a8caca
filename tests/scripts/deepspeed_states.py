"""Training states under DeepSpeed ZeRO 1, 2 and 3 (1 or 2 processes); writes what tests/test_fsdp.py checks.

Usage (under accelerate launch --use_deepspeed --zero_stage S, 1 or 2 processes): deepspeed_states.py OUTPUT_DIR STAGES
(``1,2,3``). DeepSpeed's engine can be created again in one process: each stage resets Accelerate's state and runs
with ``ACCELERATE_DEEPSPEED_ZERO_STAGE`` set to it, so one launch (one DeepSpeed import) covers every stage. For each:

- an uninterrupted run of N updates, saving a training state after K of them (``states``);
- a fresh trainer (other initial weights) resumed from that state and trained to the end: its final weights must
  equal the uninterrupted run's, bit for bit;
- a state saved after the run, consolidated (``consolidate``, DeepSpeed's fp32 weights, no process group): equal to
  the live weights;
- a copy of the mid-run state with one byte of DeepSpeed's optimizer file changed: refused;
- the previous stage's state resumed under this stage: refused (naming DeepSpeed's universal checkpoints);
- a background save (``asynchronous=True``): written at once, with one warning.
"""

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
from accelerate.state import AcceleratorState, PartialState
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.state.consolidate import full_weights

#: 2 epochs of 4 updates of 8 samples (on 2 processes, 4 samples each)
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))  # not PartialState(): the trainer sets the processes up
ARGUMENTS = {"num_epochs": 2, "per_device_batch_size": 8 // WORLD_SIZE, "gradient_clip_norm": 1.0}


class SaveAt(TrainerCallback):
    """Asks for a training state after one update of one epoch (optionally in the background)."""

    def __init__(self, folder, epoch, step, asynchronous=False):
        self.folder, self.epoch, self.step, self.asynchronous = folder, epoch, step, asynchronous

    def on_train_step_end(self, trainer, step, **kwargs):
        if trainer.run_history.current_epoch == self.epoch and step == self.step:
            trainer.save_training_state(self.folder, asynchronous=self.asynchronous)


def make_data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    return TensorDataset(x, (x**2).sum(dim=1, keepdim=True))


def make_trainer(seed, callbacks=()):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return Trainer(model, nn.MSELoss(), optimizer, callbacks=callbacks)


def live_weights(trainer) -> dict:
    """The full weights as a plain model has them (under ZeRO-3 gathered from the partitions first)."""
    import deepspeed

    module = trainer._accelerator.deepspeed_engine_wrapped.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):  # a no-op below stage 3
        return {name: tensor.detach().float().clone() for name, tensor in module.state_dict().items()}


def error_of(call) -> str:
    try:
        call()
    except Exception as error:  # the test checks which error and what it says
        return f"{type(error).__name__}: {error}"
    return "no error"


def run_stage(output: Path, stage: int, previous_states) -> dict:
    AcceleratorState._reset_state(reset_partial_state=False)  # the next Trainer's Accelerator reads the new stage
    os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = str(stage)
    data = make_data()
    states = output / f"stage{stage}" / "states"
    full = make_trainer(0, callbacks=(SaveAt(states, epoch=1, step=2),))
    full.train(data, **ARGUMENTS)
    expected = live_weights(full)
    final_states = output / f"stage{stage}" / "final"
    final_state = full.save_training_state(final_states)
    consolidated = full_weights(final_state)
    mid_state = sorted(states.glob("checkpoint-*"))[0]

    resumed = make_trainer(1)
    resumed.train(data, resume_from=mid_state, **ARGUMENTS)
    got = live_weights(resumed)

    damaged = output / f"stage{stage}" / "damaged"
    if PartialState().is_main_process:
        shutil.copytree(mid_state, damaged / mid_state.name)
        optimizer_file = sorted((damaged / mid_state.name).glob("*optim_states.pt"))[-1]  # the last process's
        data_bytes = bytearray(optimizer_file.read_bytes())
        data_bytes[len(data_bytes) // 2] ^= 0xFF
        optimizer_file.write_bytes(bytes(data_bytes))
    PartialState().wait_for_everyone()
    damaged_error = error_of(lambda: make_trainer(2).train(data, resume_from=damaged, **ARGUMENTS))
    other_stage_error = (
        None
        if previous_states is None
        else error_of(lambda: make_trainer(2).train(data, resume_from=previous_states, **ARGUMENTS))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        background = output / f"stage{stage}" / "background"
        make_trainer(0, callbacks=(SaveAt(background, epoch=1, step=1, asynchronous=True),)).train(data, **ARGUMENTS)
    return {
        "files": sorted(path.name for path in mid_state.iterdir()),
        "resume_bit_equal": sorted(expected) == sorted(got) and all(torch.equal(expected[n], got[n]) for n in got),
        "resume_max_difference": max((expected[n] - got[n]).abs().max().item() for n in got),
        "consolidated_bit_equal": sorted(consolidated) == sorted(expected)
        and all(torch.equal(consolidated[n], expected[n]) for n in expected),
        "consolidated_names": sorted(consolidated),
        "damaged_error": damaged_error,
        "other_stage_error": other_stage_error,
        "background_warnings": [str(w.message) for w in caught if "synchronously" in str(w.message)],
        "background_states": len(list(background.glob("checkpoint-*"))),
        "train_loss": full.run_history.get_metric_values("train_loss_epoch"),
        "weights": torch.cat([expected[name].flatten() for name in sorted(expected)]).tolist(),
    }, mid_state


def main(output: Path, stages: list) -> None:
    result, previous = {}, None
    for stage in stages:
        result[stage], previous = run_stage(output, stage, previous)
    result["num_processes"] = PartialState().num_processes
    if PartialState().is_main_process:
        (output / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(stage) for stage in sys.argv[2].split(",")])
