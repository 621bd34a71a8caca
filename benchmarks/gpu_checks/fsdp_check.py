"""Checks the Trainer under Accelerate's real FSDP (v1 and v2) and DeepSpeed on CUDA GPUs; exits non-zero on a failure.

The CPU test suite (``tests/test_fsdp.py``) covers FSDP2 by switching Accelerate's state on gloo, and DeepSpeed with
one process; what only GPUs show is checked here: FSDP1 (which Accelerate cannot set up on a CPU), the launcher
flags, NCCL, mixed precision, and DeepSpeed ZeRO-3 over several processes. Each run trains a small MLP with
``gradient_clip_norm``, saves a mid-run training state and resumes it, exports ``save_checkpoint`` /
``save_weights``, and writes ``result.json``; ``--compare`` then checks the runs against each other.

Usage (from the repository root, on a machine with N >= 1 CUDA GPUs; 2 or more shard for real)::

    OUT=/tmp/gpu_checks
    accelerate launch --multi_gpu --num_processes N benchmarks/gpu_checks/fsdp_check.py $OUT/ddp
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes N benchmarks/gpu_checks/fsdp_check.py $OUT/fsdp2
    accelerate launch --use_fsdp --fsdp_version 1 --fsdp_state_dict_type FULL_STATE_DICT --num_processes N \\
        benchmarks/gpu_checks/fsdp_check.py $OUT/fsdp1
    accelerate launch --use_deepspeed --zero_stage 3 --zero3_save_16bit_model true --gradient_clipping 1.0 \\
        --num_processes N benchmarks/gpu_checks/fsdp_check.py $OUT/zero3
    python benchmarks/gpu_checks/fsdp_check.py --compare $OUT/ddp $OUT/fsdp2 $OUT/fsdp1 $OUT/zero3

With 1 GPU use ``--num_processes 1`` (``--multi_gpu`` dropped for the reference run): the code paths run, nothing is
sharded. DeepSpeed runs save and resume the training state too (DeepSpeed's engine writes its part) and skip
``load_checkpoint`` of the optimizer and the second ``train()``, which DeepSpeed does not allow. To smoke-test this
file itself on a CPU (DDP over gloo), set ``FSDP_CHECK_ALLOW_CPU=1`` and ``ACCELERATE_USE_CPU=1``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import DistributedType, PartialState
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback

NUM_EPOCHS = 3
BATCH_SIZE = 8
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # NCCL reductions need not add in the order DDP does


class SaveTrainingStateAt(TrainerCallback):
    """Asks for a training state at one step of one epoch (taken at the next point between updates)."""

    def __init__(self, folder: Path, epoch: int, step: int):
        self.folder, self.epoch, self.step = folder, epoch, step

    def on_train_step_end(self, trainer, step, **kwargs):
        if trainer.run_history.current_epoch == self.epoch and step == self.step:
            trainer.save_training_state(self.folder)


class RecordParameterTypes(TrainerCallback):
    """The parameter types at each training epoch's end, before its evaluation: between updates. After a forward pass
    with no backward (an evaluation, such as the one that ends a run), FSDP2 holds the root's parameters unsharded,
    as plain ``Parameter``; inside a step too."""

    def __init__(self):
        self.types: set = set()

    def on_train_epoch_end(self, trainer, **kwargs):
        self.types.update(type(parameter).__name__ for parameter in trainer.model.parameters())


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    return TensorDataset(x, torch.sin(x).sum(dim=1, keepdim=True))


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def make_trainer(seed: int, callbacks=()) -> Trainer:
    model = make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Trainer(model, nn.MSELoss(), optimizer, callbacks=callbacks)


def exported_parameters(trainer: Trainer, path: Path) -> list:
    """The trained weights as a plain model gets them: via save_weights (every process calls it)."""
    from safetensors.torch import load_file

    trainer.save_weights(path)
    state = load_file(str(path)) if trainer._accelerator.is_main_process else {}
    return torch.cat([state[name].float().flatten() for name in sorted(state)]).tolist() if state else []


def check_export(output: Path) -> list:
    """Problems with the exported files, seen from a fresh plain model on the CPU (main process only)."""
    from safetensors.torch import load_model

    problems = []
    checkpoint = torch.load(output / "model.pt", weights_only=True)
    plain = make_model(seed=1)
    expected = {name: tuple(tensor.shape) for name, tensor in plain.state_dict().items()}
    got = {name: tuple(tensor.shape) for name, tensor in checkpoint["model_state_dict"].items()}
    if got != expected:
        problems.append(f"checkpoint keys/shapes {got} differ from the plain model's {expected}")
    else:
        plain.load_state_dict(checkpoint["model_state_dict"])
    if "optimizer_state_dict" in checkpoint:
        optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        try:
            optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        except (ValueError, KeyError, RuntimeError) as error:
            problems.append(f"the optimizer state does not load into a plain AdamW: {error}")
    try:
        load_model(make_model(seed=1), str(output / "weights.safetensors"))
    except RuntimeError as error:
        problems.append(f"weights.safetensors does not load into a plain model: {error}")
    return problems


def run(output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    data = make_data()
    arguments = {"num_epochs": NUM_EPOCHS, "per_device_batch_size": BATCH_SIZE, "gradient_clip_norm": 1.0}
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    types = RecordParameterTypes()
    trainer = make_trainer(seed=0, callbacks=(types, SaveTrainingStateAt(output / "states", epoch=2, step=3)))
    trainer.train(data, eval_dataset=data, **arguments)
    accelerator = trainer._accelerator
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    result = {
        "distributed_type": accelerator.distributed_type.value,
        "fsdp_version": accelerator.state.fsdp_plugin.fsdp_version if fsdp else None,
        "num_processes": accelerator.num_processes,
        "parameter_types": sorted(types.types),
        "get_model_type": type(trainer.get_model()).__name__,
        "train_loss": trainer.run_history.get_metric_values("train_loss_epoch"),
        "eval_loss": trainer.run_history.get_metric_values("eval_loss_epoch"),
        "gradient_norm_type": type(trainer.last_gradient_norm).__name__,
        "parameters": exported_parameters(trainer, output / "weights.safetensors"),
    }
    trainer.save_checkpoint(output / "model.pt", save_optimizer=not deepspeed)
    resumed = make_trainer(seed=1)  # under DeepSpeed: its engine's state, written by DeepSpeed into the state
    resumed.train(data, eval_dataset=data, resume_from=output / "states", **arguments)
    result["resumed_parameters"] = exported_parameters(resumed, output / "resumed.safetensors")
    if not deepspeed:  # DeepSpeed: no optimizer in the checkpoint, no second train() of one Trainer
        trainer.load_checkpoint(output / "model.pt")
        result["parameters_after_load"] = exported_parameters(trainer, output / "reloaded.safetensors")
        trainer.train(data, num_epochs=1, per_device_batch_size=BATCH_SIZE, gradient_clip_value=0.5)
        trainer.evaluate(data, per_device_batch_size=BATCH_SIZE)
        result["evaluation_loss"] = trainer.run_history.get_latest_metric("evaluation_loss")
    if accelerator.is_main_process:
        result["export_problems"] = check_export(output)
        (output / "result.json").write_text(json.dumps(result))


def compare(folders: list) -> int:
    """Print each run's checks and its distance to the first (the DDP reference); return the number of failures."""
    results = {Path(folder).name: json.loads((Path(folder) / "result.json").read_text()) for folder in folders}
    reference_name, reference = next(iter(results.items()))
    failures = 0
    for name, result in results.items():
        checks = {
            "loss goes down": result["train_loss"][-1] < result["train_loss"][0],
            "export loads into a plain model": not result["export_problems"],
            "gradient norm is a plain tensor": result["gradient_norm_type"] == "Tensor",
        }
        if "resumed_parameters" in result:
            checks["resume equals the uninterrupted run"] = result["resumed_parameters"] == result["parameters"]
        if "parameters_after_load" in result:
            checks["load_checkpoint changes nothing"] = result["parameters_after_load"] == result["parameters"]
        if name != reference_name:
            close = torch.allclose(
                torch.tensor(result["parameters"]), torch.tensor(reference["parameters"]), **TOLERANCE
            )
            checks[f"parameters match {reference_name}"] = close
        for check, passed in checks.items():
            failures += not passed
            print(f"{name:>8}  {'ok  ' if passed else 'FAIL'}  {check}")
        details = f"{result['distributed_type']}, parameters {result['parameter_types']}"
        print(f"{name:>8}  {details}, export problems {result['export_problems']}")
    return failures


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(1 if compare(sys.argv[2:]) else 0)
    if not torch.cuda.is_available() and os.environ.get("FSDP_CHECK_ALLOW_CPU") != "1":  # 1: smoke-test this file
        sys.exit("fsdp_check.py needs CUDA GPUs; on the CPU run tests/test_fsdp.py (see docs/fsdp_deepspeed.md).")
    run(Path(sys.argv[1]))
    PartialState().destroy_process_group()
