"""A run stopped in the middle of its second epoch on 2 processes under FSDP2 (or on 1, the plain model), then
resumed on another number of processes (FSDP2 again, or DDP with ``ddp``; on one process the plain model).

    ACCELERATE_USE_CPU=1 accelerate launch --num_processes 2 resize_run.py OUTPUT_DIR first 2
    ACCELERATE_USE_CPU=1 accelerate launch --num_processes N resize_run.py OUTPUT_DIR resume N   # or python, N = 1
    ACCELERATE_USE_CPU=1 accelerate launch --num_processes N resize_run.py OUTPUT_DIR resume N ddp

Every sample carries its id (its index in the dataset), and each process records the ids of every batch it trained,
per epoch of the run history, in the order it trained them: ``OUTPUT_DIR/ids_<phase>_rank<r>.json`` holds
``{"<epoch>": [[ids of batch 0], [ids of batch 1], ...]}``. tests/test_resume_resize.py checks them.

- ``first`` (2 processes, or 1): a run of 2 epochs stopped by ``max_num_train_steps`` after STOP_AFTER_BATCHES updates
  of epoch 2 (one batch per update), then ``trainer.save_training_state(OUTPUT_DIR/states)`` after ``train()`` returned:
  a state taken outside a run is taken at once, at the position where the run stopped, the next batch not trained on
  (docs/training_state.md, "Resuming"). Then, in the same processes, an uninterrupted run of the same set-up, whose
  ids are ``ids_reference_rank<r>.json``: what a 2-process resume must train.
- ``resume`` (NPROC processes): ``train(..., resume_from=OUTPUT_DIR/states, allow_resume_changes=True)`` trains the
  rest of epoch 2 (``ids_resume_rank<r>.json``). With another number of processes than the state's, a first attempt
  without ``allow_resume_changes`` comes before it, in the same processes (one launch fewer): what it raised on each
  process goes to ``strict_rank<r>.json`` (``{"raised": false}`` if it trained instead) and to stderr. The model's
  full weights as the resume loaded them, before its first update, go to ``loaded.pt`` (process 0).

A launch that hangs (a process waiting for one that raised) ends after SCRIPT_TIMEOUT_S with every thread's traceback
on stderr.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
from fsdp_train import CpuFSDP2Trainer
from torch import nn
from torch.utils.data import Dataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback

NUM_SAMPLES = 64  # 2 processes x batches of 4: 8 updates per epoch
PER_DEVICE_BATCH_SIZE = 4
NUM_EPOCHS = 2
STOP_AFTER_BATCHES = 3  # updates of epoch 2 made before the stop (per process: 2 x 3 x 4 = 24 samples trained)
SEED = 42
SCRIPT_TIMEOUT_S = 150


class IdDataset(Dataset):
    """``(x, y, id)``: 4 features, a linear target, and the sample's index."""

    def __init__(self, size: int = NUM_SAMPLES):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 4, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True) + 1.0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index], index


class IdTrainer(Trainer):
    """The default loss, on ``(x, y)`` of an ``(x, y, ids)`` batch (on several processes: DDP)."""

    def calculate_train_batch_loss(self, batch):
        x, y, _ = batch
        outputs = self.model(x)
        return {"loss": self.loss_func(outputs, y), "model_outputs": outputs, "batch_size": y.size(0)}


class FSDP2IdTrainer(CpuFSDP2Trainer, IdTrainer):
    """:class:`IdTrainer` under FSDP2, switched on on the CPU by tests/scripts/fsdp_train.py's trainer."""


#: How several processes train: ``fsdp2`` (the default) or ``ddp``; one process runs the plain model.
PARALLEL = {"mode": "fsdp2"}


class RecordLoaded(TrainerCallback):
    """The model's full weights as the resume loaded them, before the first update: ``path`` (process 0)."""

    def __init__(self, path: Path):
        self.path = path

    def on_training_run_start(self, trainer, **kwargs):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True)  # every process takes part in gathering FSDP2's shards
        weights = get_model_state_dict(trainer.model, options=options)
        if trainer.accelerator.is_main_process:
            torch.save(weights, self.path)


class RecordIds(TrainerCallback):
    """The ids of every batch trained, per epoch of the run history (``on_train_step_end``: the batch's loss is
    computed and its backward pass follows; with one batch per update no step is cut short)."""

    def __init__(self):
        self.ids: dict = {}

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        epoch = str(trainer.run_history.current_epoch)
        self.ids.setdefault(epoch, []).append([int(i) for i in batch[2].tolist()])


def make_trainer(callbacks: list) -> IdTrainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1 and PARALLEL["mode"] == "fsdp2"
    trainer_class = FSDP2IdTrainer if sharded else IdTrainer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return trainer_class(model, nn.MSELoss(), optimizer, callbacks=callbacks, seed=SEED)


def train(recorder: RecordIds, *more_callbacks, **kwargs) -> IdTrainer:
    trainer = make_trainer([recorder, *more_callbacks])
    trainer.train(IdDataset(), num_epochs=NUM_EPOCHS, per_device_batch_size=PER_DEVICE_BATCH_SIZE, **kwargs)
    return trainer


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value))


def first(output_dir: Path, rank: int, num_processes: int) -> None:
    recorder = RecordIds()
    updates_per_epoch = NUM_SAMPLES // (PER_DEVICE_BATCH_SIZE * num_processes)
    trainer = train(recorder, max_num_train_steps=updates_per_epoch + STOP_AFTER_BATCHES)
    trainer.save_training_state(output_dir / "states")  # outside a run: at once, at the next batch not trained on
    write_json(output_dir / f"ids_first_rank{rank}.json", recorder.ids)
    reference = RecordIds()
    train(reference)  # uninterrupted
    write_json(output_dir / f"ids_reference_rank{rank}.json", reference.ids)


def resume(output_dir: Path, rank: int, num_processes: int) -> None:
    from pytorch_accel_trainer.state.training_state import list_complete_states

    states = output_dir / "states"
    if num_processes != list_complete_states(states)[-1].manifest["world_size"]:
        attempt = RecordIds()
        try:
            train(attempt, resume_from=states)
        except Exception as error:  # what each process says, compared by the test
            print(f"expected, without allow_resume_changes: {type(error).__name__}: {error}", file=sys.stderr)
            strict = {"raised": True, "type": type(error).__name__, "message": str(error)}
        else:
            strict = {"raised": False, "ids": attempt.ids}
        write_json(output_dir / f"strict_rank{rank}.json", strict)
    recorder = RecordIds()
    train(recorder, RecordLoaded(output_dir / "loaded.pt"), resume_from=states, allow_resume_changes=True)
    write_json(output_dir / f"ids_resume_rank{rank}.json", recorder.ids)


def main(output_dir: Path, phase: str, num_processes: int, parallel: str = "fsdp2") -> None:
    faulthandler.dump_traceback_later(SCRIPT_TIMEOUT_S, exit=True)
    # from the launcher's environment: Accelerate's state is set up by the trainers, as in a user's script
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != num_processes:
        raise SystemExit(f"launched on {world_size} processes, but NPROC is {num_processes}")
    if parallel not in ("fsdp2", "ddp"):
        raise SystemExit(f"PARALLEL is 'fsdp2' or 'ddp', not {parallel!r}")
    PARALLEL["mode"] = parallel
    if phase == "first":
        first(output_dir, rank, num_processes)
    elif phase == "resume":
        resume(output_dir, rank, num_processes)
    else:
        raise SystemExit(f"PHASE is 'first' or 'resume', not {phase!r}")
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
