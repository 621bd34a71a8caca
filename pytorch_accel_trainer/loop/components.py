"""The model, loss function and optimizer a ``Trainer`` is given, and its other constructor options: the checks that
refuse, before the first step, what could not train (a class for a loss function, an optimizer that misses trainable
parameters, an option of the wrong type)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer

from pytorch_accel_trainer.parallel.distributed import validate_accelerator_options


def validate_constructor_options(
    mixed_precision: Any, torch_compile: Any, seed: Any = None, loss_func: Any = None, accelerator_kwargs: Any = None
) -> None:
    """Check the ``Trainer`` options that are not the model, optimizer or callbacks."""
    _validate_seed(seed)
    _validate_loss_func(loss_func)
    validate_accelerator_options(mixed_precision, accelerator_kwargs)
    if not isinstance(torch_compile, (bool, Mapping)):
        raise TypeError(
            f"torch_compile={torch_compile!r} is not valid: pass True, False, or a dict of torch.compile arguments "
            "such as {'mode': 'reduce-overhead'}."
        )


def _validate_seed(seed: Any) -> None:
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int):  # random.seed refuses numpy integers
        raise TypeError(
            f"seed={seed!r} is a {type(seed).__name__}, not an int: pass a whole number such as seed=42 (int(value) "
            "converts a numpy integer), or seed=None to leave the random state alone."
        )
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} is out of range: numpy takes seeds from 0 to 2**32 - 1; pass e.g. seed=42.")


def _validate_loss_func(loss_func: Any) -> None:
    if loss_func is None:
        return
    if isinstance(loss_func, type):
        name = loss_func.__name__
        prefix = "nn." if loss_func.__module__.startswith("torch.nn") else ""
        raise TypeError(
            f"loss_func={prefix}{name} is a class, not a loss function: pass an instance, loss_func={prefix}{name}() "
            "(the trainer calls loss_func(model_outputs, targets))."
        )


def validate_model_and_loss(model: Any, loss_func: Any) -> None:
    """Check, where Accelerate prepares them, that the model is a module and the loss function callable.

    Not in ``Trainer.__init__``: as in pytorch-accelerated, a subclass that prepares its own components (or a test)
    may hold stand-ins until then.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model is a {type(model).__name__}; pass a torch.nn.Module.")
    if loss_func is not None and not callable(loss_func):
        raise TypeError(
            f"loss_func={loss_func!r} is not callable: pass a function called as loss_func(model_outputs, targets), "
            "e.g. nn.MSELoss(), or None to use the loss the model returns."
        )


def validate_optimizer_parameters(optimizer: Any, model: torch.nn.Module) -> None:
    """Refuse an optimizer that lacks trainable parameters of ``model``: they would never be updated.

    A parameter with ``requires_grad=False`` need not be held (``GradualUnfreezingCallback`` adds the ones it
    unfreezes), and the optimizer may hold more than the model's (a second model a subclass updates with it; a
    second model with its own optimizer is registered with ``add_model``). An optimizer prepared by an earlier run is
    not checked again: DeepSpeed holds flattened copies of the parameters. Compares parameter identities on the host:
    no device work.
    """
    if isinstance(optimizer, AcceleratedOptimizer) or not hasattr(optimizer, "param_groups"):
        return  # prepared by an earlier run, when it was checked; or not a torch optimizer
    held = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
    trainable = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    missing = [name for name, parameter in trainable if id(parameter) not in held]
    if not missing:
        return
    optimizer_name = type(optimizer).__name__
    if len(missing) == len(trainable):
        raise ValueError(
            f"optimizer={optimizer_name} holds 0 of the model's {len(trainable)} trainable parameters, so training "
            "would never change the model (the loss would stay flat). Build the optimizer from model.parameters() of "
            f"the model you pass to Trainer, e.g. {optimizer_name}(model.parameters(), ...), not from another model "
            "or a copy of it."
        )
    names = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    raise ValueError(
        f"optimizer={optimizer_name} holds {len(trainable) - len(missing)} of the model's {len(trainable)} trainable "
        f"parameters: {len(missing)} would get gradients but never be updated ({names}). Build the optimizer from "
        "model.parameters(), or freeze the parameters you do not want to train (parameter.requires_grad_(False), or "
        "pytorch_accel_trainer.finetuning.ModelFreezer) so that they need no gradient either."
    )
