"""Trains a tiny MLP under FSDP2, DDP or DeepSpeed; rank 0 writes what tests/test_fsdp.py compares.

Usage: fsdp_train.py OUTPUT_DIR MODE, MODE one of
  fsdp2          2 processes (accelerate launch --multi_gpu, ACCELERATE_USE_CPU=1): FSDP2 on the CPU over gloo.
                 Accelerate 1.15 never selects FSDP on a CPU (it falls back to DDP), so this trainer switches the
                 Accelerate state to FSDP after creating it; prepare, backward, clipping and the state-dict calls
                 are then Accelerate's and torch's real FSDP2 code, the parameters DTensor shards.
  ddp            the same run under plain 2-process DDP, the reference.
  plugin_on_cpu  2 processes given FullyShardedDataParallelPlugin the public way: the CPU fallback to DDP warns.
  deepspeed      1 process under accelerate launch --use_deepspeed --zero_stage 2 (DeepSpeed runs on the CPU
                 with one process only); accumulation and clipping must match a plain run.
  plain          1 process, no launcher: the reference for deepspeed.
"""

import json
import sys
import warnings
from pathlib import Path

import torch
from accelerate import DistributedType, PartialState
from accelerate.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.parallel.accelerate_internals import switch_to_fsdp2
from pytorch_accel_trainer.parallel.distributed import create_accelerator

NUM_EPOCHS = 3


class CpuFSDP2Trainer(Trainer):
    """A Trainer whose Accelerator runs FSDP2 on the CPU (see the module docstring)."""

    def _create_accelerator(self):
        accelerator = super()._create_accelerator()
        switch_to_fsdp2(accelerator, FullyShardedDataParallelPlugin(fsdp_version=2))
        return accelerator


class PluginTrainer(Trainer):
    """A Trainer given the FSDP plugin the documented way."""

    def _create_accelerator(self):
        return create_accelerator(
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=self.seed),
            fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
        )


class SaveTrainingStateAt(TrainerCallback):
    """Asks for a training state at one step of one epoch (taken at the next point between updates)."""

    def __init__(self, folder, epoch, step):
        self.folder, self.epoch, self.step = folder, epoch, step

    def on_train_step_end(self, trainer, step, **kwargs):
        if trainer.run_history.current_epoch == self.epoch and step == self.step:
            trainer.save_training_state(self.folder)


class RecordParameterTypes(TrainerCallback):
    """The parameter types between updates (inside a step, FSDP2 holds the root's parameters unsharded)."""

    def __init__(self):
        self.types = set()

    def on_train_epoch_end(self, trainer, **kwargs):
        self.types.update(type(parameter).__name__ for parameter in trainer.model.parameters())


def make_data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    return TensorDataset(x, (x**2).sum(dim=1, keepdim=True))


def make_trainer(trainer_class, seed, callbacks=(), with_optimizer=True):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if with_optimizer else None
    return trainer_class(model, nn.MSELoss(), optimizer, callbacks=callbacks)


def full_parameters(trainer, path: Path) -> list:
    """The trained weights as a plain model gets them: through save_weights (every process calls it)."""
    from safetensors.torch import load_file

    trainer.save_weights(path)
    state = load_file(str(path)) if trainer._accelerator.is_main_process else {}
    return torch.cat([state[name].flatten() for name in sorted(state)]).tolist() if state else []


def run_sharded(output: Path, trainer_class) -> dict:
    data = make_data()
    arguments = {"num_epochs": NUM_EPOCHS, "per_device_batch_size": 4, "gradient_clip_norm": 1.0}
    types = RecordParameterTypes()
    trainer = make_trainer(
        trainer_class, seed=0, callbacks=(SaveTrainingStateAt(output / "states", epoch=2, step=1), types)
    )
    trainer.train(data, eval_dataset=data, **arguments)  # each epoch ends with an evaluation
    result = {
        "distributed_type": trainer._accelerator.distributed_type.value,
        "parameter_types": sorted(types.types),
        "train_loss": trainer.run_history.get_metric_values("train_loss_epoch"),
        "parameters": full_parameters(trainer, output / "weights.safetensors"),
        "gradient_norm_type": type(trainer.last_gradient_norm).__name__,
    }
    trainer.save_checkpoint(output / "model.pt")
    trainer.load_checkpoint(output / "model.pt")  # the full weights back into the shards: nothing changes
    result["parameters_after_load"] = full_parameters(trainer, output / "reloaded.safetensors")

    resumed = make_trainer(trainer_class, seed=1)  # other initial weights: the state must overwrite them
    # with an eval set, train() runs its first batch through the model before it loads the state: FSDP2 leaves the
    # root's parameters unsharded after that forward pass, and the state must load all the same
    resumed.train(data, eval_dataset=data, resume_from=output / "states", **arguments)
    result["resumed_parameters"] = full_parameters(resumed, output / "resumed.safetensors")

    # a second run of the same trainer prepares again; clipping by value alone; then an evaluation
    trainer.train(data, num_epochs=1, per_device_batch_size=4, gradient_clip_value=0.5)
    trainer.evaluate(data, per_device_batch_size=4)
    result["second_run_parameters"] = full_parameters(trainer, output / "second.safetensors")
    result["evaluation_loss"] = trainer.run_history.get_latest_metric("evaluation_loss")
    trainer.load_checkpoint(output / "model.pt")  # right after an evaluation
    result["parameters_loaded_after_evaluation"] = full_parameters(trainer, output / "after_evaluation.safetensors")

    evaluator = make_trainer(trainer_class, seed=0, with_optimizer=False)  # an evaluation-only trainer
    evaluator.load_checkpoint(output / "model.pt", load_optimizer=False)
    evaluator.evaluate(data, per_device_batch_size=4)
    result["evaluator_loss"] = evaluator.run_history.get_latest_metric("evaluation_loss")
    return result


def run_plugin_on_cpu(output: Path) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(PluginTrainer, seed=0)
    trainer.train(make_data(), num_epochs=1, per_device_batch_size=4)
    return {
        "distributed_type": trainer._accelerator.distributed_type.value,
        "warnings": [str(warning.message) for warning in caught if "FSDP" in str(warning.message)],
    }


def run_single_process(output: Path, accumulation: int, clip_norm) -> dict:
    trainer = make_trainer(Trainer, seed=0)
    trainer.train(
        make_data(),
        num_epochs=2,
        per_device_batch_size=8 // accumulation,
        gradient_accumulation_steps=accumulation,
        gradient_clip_norm=clip_norm,
    )
    engine = getattr(trainer._accelerator, "deepspeed_engine_wrapped", None)
    return {
        "distributed_type": trainer._accelerator.distributed_type.value,
        "updates": trainer.num_update_steps_completed,
        "deepspeed_steps": None if engine is None else engine.engine.global_steps,
        "train_loss": trainer.run_history.get_metric_values("train_loss_epoch"),
        "parameters": full_parameters(trainer, output / f"weights-{accumulation}.safetensors"),
    }


def run_deepspeed_or_plain(output: Path) -> dict:
    result = {"runs": [run_single_process(output, accumulation, clip_norm=1.0) for accumulation in (1, 2)]}
    if result["runs"][0]["distributed_type"] == DistributedType.DEEPSPEED.value:
        errors = {}
        for name, arguments in {
            "clip_norm_unset": {"gradient_clip_norm": None},
            "clip_value": {"gradient_clip_norm": 1.0, "gradient_clip_value": 0.5},
        }.items():
            try:
                make_trainer(Trainer, seed=0).train(make_data(), num_epochs=1, per_device_batch_size=8, **arguments)
            except ValueError as error:
                errors[name] = str(error)
        trainer = make_trainer(Trainer, seed=0)
        trainer.train(make_data(), num_epochs=1, per_device_batch_size=8, gradient_clip_norm=1.0)
        for name, call in {
            "checkpoint_with_optimizer": lambda: trainer.save_checkpoint(output / "model.pt"),
            "second_train": lambda: trainer.train(make_data(), num_epochs=1, per_device_batch_size=8),
        }.items():
            try:
                call()
            except ValueError as error:
                errors[name] = str(error)
        result["errors"] = errors
    return result


def main(output: Path, mode: str) -> None:
    if mode in ("fsdp2", "ddp"):
        result = run_sharded(output, CpuFSDP2Trainer if mode == "fsdp2" else Trainer)
    elif mode == "plugin_on_cpu":
        result = run_plugin_on_cpu(output)
    else:
        result = run_deepspeed_or_plain(output)
    if PartialState().is_main_process:
        (output / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
