"""Device and precision chosen in code: Trainer(cpu=True), accelerator_kwargs, other trainers' precision names."""

from __future__ import annotations

import subprocess

import pytest
import torch
from accelerate.utils import ProjectConfiguration
from conftest import launcher, linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer.parallel.distributed import MIXED_PRECISION_ALIASES, mixed_precision_name


def test_cpu_true_sets_accelerate_up():
    """Trainer(cpu=True) sets Accelerate up for the CPU, from code."""
    code = (
        "import torch\n"
        "from accelerate import PartialState\n"
        "from pytorch_accel_trainer import Trainer\n"
        "model = torch.nn.Linear(1, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "trainer = Trainer(model, torch.nn.MSELoss(), optimizer, callbacks=(), cpu=True)\n"
        "assert PartialState()._cpu is True and trainer.device.type == 'cpu', PartialState()._cpu\n"
    )  # a fresh process (forked from the warm launcher): Accelerate's state is set up once per process
    completed = subprocess.run([*launcher(1), "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]


def test_create_accelerator_cpu_true():
    """``create_accelerator(cpu=True)`` works from code: ``cpu`` reaches Accelerator once."""
    from pytorch_accel_trainer.parallel.distributed import create_accelerator

    accelerator = create_accelerator(cpu=True)
    assert accelerator.device.type == "cpu"


def test_cpu_true_after_gpu_set_up(monkeypatch):
    """On a GPU machine, a Trainer(cpu=True) after one on the GPU: Accelerate refuses the CPU (it fixes the device once
    per process), and the error names the device, not the mixed precision. The GPU is faked by this process's
    recorded device; Accelerate's own check refuses it."""
    from accelerate.state import PartialState

    from pytorch_accel_trainer.parallel.distributed import create_accelerator

    make_trainer(make_linear())  # the process is set up (on the CPU here)
    monkeypatch.setitem(PartialState._shared_state, "device", torch.device("meta"))  # as if on a GPU
    with pytest.raises(ValueError) as raised:
        create_accelerator(cpu=True)
    assert str(raised.value) == (
        "Trainer(cpu=True) asks for the CPU, but Accelerate already set this process up on meta, and cannot change the "
        "device once set. Make the first Trainer (or Accelerator) of the process the one with cpu=True, or run the "
        "whole script on the CPU (`accelerate launch --cpu script.py`, or ACCELERATE_USE_CPU=1)."
    )


def test_accelerator_kwargs_reach_the_accelerator(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=False)
    trainer = make_trainer(
        make_linear(), accelerator_kwargs={"project_config": config, "step_scheduler_with_optimizer": False}
    )
    assert trainer.accelerator.project_dir == str(tmp_path)
    assert trainer.accelerator.step_scheduler_with_optimizer is False
    assert trainer.accelerator.dataloader_config.use_seedable_sampler  # the trainer's own arguments are kept


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"mixed_precision": "bf16"},
            r"accelerator_kwargs sets 'mixed_precision', which the trainer sets itself: "
            r"use Trainer\(mixed_precision=...\)",
        ),
        ({"cpu": True}, r"accelerator_kwargs sets 'cpu', which the trainer sets itself: use Trainer\(cpu=True\)"),
        ({"gradient_accumulation_steps": 2}, r"use train\(gradient_accumulation_steps=...\)"),
        (
            {"log_witth": "tensorboard"},
            r"accelerator_kwargs has \['log_witth'\], which accelerate.Accelerator does not take; "
            r"it takes \[.*'log_with'",
        ),
    ],
)
def test_bad_accelerator_kwargs_are_refused(kwargs, message):
    """accelerator_kwargs the trainer sets, or Accelerate lacks, are refused with the fix."""
    with pytest.raises(ValueError, match=message):
        make_trainer(make_linear(), accelerator_kwargs=kwargs)
    with pytest.raises(TypeError, match=r"accelerator_kwargs=\['cpu'\] is not valid: pass a dict"):
        make_trainer(make_linear(), accelerator_kwargs=["cpu"])


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("full", "no"),
        ("FP32", "no"),
        ("32-true", "no"),
        ("bf16-mixed", "bf16"),
        ("bfloat16", "bf16"),
        ("16-mixed", "fp16"),
        ("no", "no"),
    ],
)
def test_other_precision_names_map(name, expected):
    """Other trainers' precision names map to Accelerate's."""
    assert mixed_precision_name(name) == expected
    assert set(MIXED_PRECISION_ALIASES.values()) <= {"no", "bf16", "fp16"}


def test_full_precision_and_unknown_name():
    """Hezar's full precision trains in float32; an unknown name is refused with the choices."""
    trainer = make_trainer(make_linear(), mixed_precision="full")
    assert trainer.mixed_precision == "no"
    trainer.train(linear_dataset(8), num_epochs=1)
    assert trainer.run_config.mixed_precision == "no"
    with pytest.raises(
        ValueError,
        match=r"mixed_precision='tf32' is not valid: choose one of \('no', 'bf16', 'fp16', 'fp8'\) "
        r"\(or a name of another trainer for them: \[.*'full'",
    ):
        make_trainer(make_linear(), mixed_precision="tf32")


def test_deepspeed_on_cpu_processes_gets_the_gloo_backend(monkeypatch):
    """Under DeepSpeed on a machine without an accelerator, Accelerate is given the gloo backend (not cpu=True, which
    runs DDP); a handler with its default backend (nccl, GPUs only) gets gloo, one with another backend is kept."""
    from accelerate.utils import InitProcessGroupKwargs

    from pytorch_accel_trainer.parallel.distributed import _deepspeed_asked, _with_gloo_backend

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert _deepspeed_asked({})
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    assert not _deepspeed_asked({})  # Accelerate runs DDP there: the CPU backend as for any launch
    assert [handler.backend for handler in _with_gloo_backend(None)] == ["gloo"]
    assert [handler.backend for handler in _with_gloo_backend([InitProcessGroupKwargs(timeout=None)])] == ["gloo"]
    assert [handler.backend for handler in _with_gloo_backend([InitProcessGroupKwargs(backend="ccl")])] == ["ccl"]
