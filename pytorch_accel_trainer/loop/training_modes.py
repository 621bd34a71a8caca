"""The train/eval mode of each module of a model, read and put back: a frozen layer may be in evaluation mode on
purpose, so one ``module.train()`` after a pass in evaluation mode would not do."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def training_modes(module: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """The training mode of every submodule of ``module``, for :func:`restore_training_modes`."""
    return [(submodule, submodule.training) for submodule in module.modules()]


def restore_training_modes(modes: list[tuple[torch.nn.Module, bool]]) -> None:
    """Put back the modes :func:`training_modes` read, module by module (a frozen layer may be in evaluation mode on
    purpose, so one ``module.train()`` would not do)."""
    for submodule, training in modes:
        submodule.training = training


@contextlib.contextmanager
def training_modes_kept(module: torch.nn.Module) -> Iterator[None]:
    """Put back the training mode of every submodule of ``module`` on leaving the block (see
    :func:`restore_training_modes`)."""
    modes = training_modes(module)
    try:
        yield
    finally:
        restore_training_modes(modes)
