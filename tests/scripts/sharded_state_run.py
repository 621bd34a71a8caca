"""A 2-process FSDP2 run (on the CPU, as fsdp_train.py switches it on) that saves sharded training states, may be
killed in the middle of one, and resumes; tests/test_sharded_state.py compares its weights with an uninterrupted run.

Usage: sharded_state_run.py CONFIG_JSON, with
  save_dir       where the states go: a folder, or an s3:// URL (the tests' local S3 server)
  out            a folder: the final full weights are written there as <name>.safetensors (process 0)
  name           the weights' file name (default "weights")
  asynchronous   save in the background (default False)
  crash_at       a crash point's name (state/files.py: crash_point): the process that reaches it for the
                 crash_on_hit-th time (default 1) is killed with SIGKILL
  fail_rank      with crash_at: instead, only this process fails there with a full disk (OSError ENOSPC)
  reference      then an uninterrupted run in the same processes, its weights as reference.safetensors
"""

import errno
import json
import os
import signal
import sys
from pathlib import Path

from fsdp_train import CpuFSDP2Trainer, full_parameters, make_data, make_trainer

from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback
from pytorch_accel_trainer.state import files

ARGUMENTS = {"num_epochs": 3, "per_device_batch_size": 4, "gradient_clip_norm": 1.0}


def kill_at(point: str, on_hit: int, fail_rank=None) -> None:
    hits = []

    def crash(name):
        if name == point:
            hits.append(name)
            if len(hits) == on_hit and fail_rank is None:
                os.kill(os.getpid(), signal.SIGKILL)
            if len(hits) == on_hit and int(os.environ.get("RANK", "0")) == fail_rank:
                raise OSError(errno.ENOSPC, "No space left on device (a full disk, simulated)")

    files.crash_point = crash


def run(save_dir: str, asynchronous: bool, out: Path, name: str) -> None:
    callback = SaveTrainingStateCallback(save_dir, save_every_n_steps=2, max_checkpoints=2, asynchronous=asynchronous)
    trainer = make_trainer(CpuFSDP2Trainer, seed=0, callbacks=(callback,))
    trainer.train(make_data(), resume_from=save_dir, **ARGUMENTS)
    full_parameters(trainer, out / f"{name}.safetensors")


def main(config: dict) -> None:
    out = Path(config["out"])
    if config.get("crash_at"):
        kill_at(config["crash_at"], config.get("crash_on_hit", 1), config.get("fail_rank"))
    run(config["save_dir"], config.get("asynchronous", False), out, config.get("name", "weights"))
    if config.get("reference"):
        files.crash_point = lambda name: None
        run(str(out / "reference_states"), False, out, "reference")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
