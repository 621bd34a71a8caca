"""Freeze and unfreeze groups of layers of a model, for fine-tuning.

pytorch-accelerated's ``finetuning`` module (``pytorch_accel_trainer.finetuning`` is kept as another name for it).
The API follows pytorch-accelerated 0.1.61's
``finetuning.py`` (Apache-2.0, Copyright (C) 2021 Chris Hughes).
"""

from __future__ import annotations

from collections import defaultdict, namedtuple
from typing import Any

from torch import nn

#: The batch-norm layers, left trainable by ``freeze()`` unless ``freeze_batch_norms``: ``BatchNorm1d/2d/3d``,
#: their lazy forms and ``SyncBatchNorm``.
BN_MODULES = (nn.modules.batchnorm._BatchNorm,)

#: A module that is an attribute (a child) of the model, with its index as ``(from the start, from the end)``.
LayerGroup = namedtuple("LayerGroup", ["layer_group_idx", "module", "is_frozen"])
#: A module that holds parameters itself (or has no children), with the index of its layer group.
Layer = namedtuple("Layer", ["layer_group_idx", "module", "is_frozen"])


class ModelFreezer:
    """Freezes and unfreezes layer groups of a model, as pytorch-accelerated's ``ModelFreezer``.

    A *layer group* is a child module of the model (an attribute such as ``backbone`` or ``head``), indexed
    from 0, or from -1 for the last. A *layer* is a module inside a group that holds parameters itself, or
    that has no children. Freezing sets ``requires_grad=False`` on the layers' own parameters; batch-norm
    layers are left trainable unless ``freeze_batch_norms`` is set. Creating a freezer unfreezes every
    parameter of the model: freeze and unfreeze through it from then on.

    To fine-tune with a learning-rate scheduler, create the optimizer over *all* the model's parameters,
    frozen ones included: a parameter without a gradient is skipped by the optimizer, so unfreezing it
    later only makes it train, and the scheduler, built for the optimizer's parameter groups, stays valid.
    :class:`~pytorch_accel_trainer.callbacks.GradualUnfreezingCallback` unfreezes groups at given epochs.

    Args:
        model: the model, whose child modules are the layer groups.
        freeze_batch_norms: also freeze (and unfreeze) batch-norm layers.

    Example::

        freezer = ModelFreezer(model)
        freezer.freeze()                  # every layer group but the last
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        trainer = Trainer(model, loss_func, optimizer)
        trainer.train(train_dataset, num_epochs=2)
        freezer.unfreeze()                # every layer group
        trainer.train(train_dataset, num_epochs=3)
    """

    def __init__(self, model: nn.Module, freeze_batch_norms: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model is a {type(model).__name__}; pass a torch.nn.Module.")
        groups = list(model.children())
        if not groups:
            raise ValueError(
                f"The model ({type(model).__name__}) has no child modules, so it has no layer groups to freeze: "
                "wrap its layers in attributes or an nn.Sequential."
            )
        self.model = model
        self.freeze_batch_norms = freeze_batch_norms
        self.num_groups = len(groups)
        self._groups = groups
        self._layers = [(index, layer) for index, group in enumerate(groups) for layer in _layers_of(group)]
        self._layers_kept_in_eval: dict[int, nn.Module] = {}
        model.requires_grad_(True)

    @property
    def freeze_bn(self) -> bool:
        """pytorch-accelerated's name of ``freeze_batch_norms``."""
        return self.freeze_batch_norms

    @freeze_bn.setter
    def freeze_bn(self, value: bool) -> None:
        self.freeze_batch_norms = value

    def get_layer_groups(self) -> list[LayerGroup]:
        """Return every layer group; one is frozen when any of its parameters is."""
        return [
            LayerGroup((index, index - self.num_groups), group, any(not p.requires_grad for p in group.parameters()))
            for index, group in enumerate(self._groups)
        ]

    def get_layers(self) -> list[Layer]:
        """Return every layer; one without parameters counts as frozen when it is in eval mode."""
        layers = []
        for index, layer in self._layers:
            parameters = list(layer.parameters(recurse=False))
            is_frozen = any(not p.requires_grad for p in parameters) if parameters else not layer.training
            layers.append(Layer((index, index - self.num_groups), layer, is_frozen))
        return layers

    def get_trainable_parameters(self) -> list[nn.Parameter]:
        """Return the parameters that are not frozen."""
        return [parameter for parameter in self.model.parameters() if parameter.requires_grad]

    def freeze(self, from_index: int = 0, to_index: int = -2, set_modules_as_eval: bool = False) -> None:
        """Freeze the layer groups from ``from_index`` to ``to_index``, both included (all but the last by default).

        Args:
            from_index: the first group to freeze.
            to_index: the last group to freeze.
            set_modules_as_eval: also put the frozen layers in eval mode (batch-norm statistics and dropout
                fixed). ``model.train()``, which the trainer calls each epoch, undoes it: call
                :meth:`set_frozen_layers_to_eval` after it, as ``GradualUnfreezingCallback`` can.
        """
        self._set_frozen(from_index, to_index, frozen=True, change_mode=set_modules_as_eval)

    def unfreeze(self, from_index: int = -1, to_index: int = 0, set_modules_as_training: bool = True) -> dict:
        """Unfreeze the layer groups from ``from_index`` to ``to_index``, both included (all by default).

        Args:
            from_index: one end of the range of groups to unfreeze.
            to_index: the other end.
            set_modules_as_training: also put the unfrozen layers in training mode.

        Returns:
            ``{group_index: {"params": [...]}}`` with the parameters that were frozen, for each group that
            had some: ready for ``optimizer.add_param_group`` where the optimizer does not hold them yet.
        """
        return self._set_frozen(from_index, to_index, frozen=False, change_mode=set_modules_as_training)

    def set_frozen_layers_to_eval(self) -> None:
        """Put the layers frozen with ``set_modules_as_eval=True`` back in eval mode, after a ``model.train()``."""
        for layer in self._layers_kept_in_eval.values():
            layer.eval()

    def _convert_idxs(self, from_idx: int, to_idx: int) -> tuple[int, int]:
        """The positions (from 0) of the groups ``from_idx`` and ``to_idx``, the smaller first."""
        first, last = sorted((self._to_position(from_idx), self._to_position(to_idx)))
        return first, last

    def _set_frozen(self, from_index: int, to_index: int, frozen: bool, change_mode: bool) -> dict:
        first, last = self._convert_idxs(from_index, to_index)
        changed = defaultdict(list)
        for group_index, layer in self._layers:
            if not first <= group_index <= last:
                continue
            if _module_is_batch_norm(layer) and not self.freeze_batch_norms:
                continue  # batch norms stay trainable and keep their mode
            parameters = [p for p in layer.parameters(recurse=False) if p.requires_grad == frozen]
            for parameter in parameters:
                parameter.requires_grad_(not frozen)
            changed[group_index].extend(parameters)
            if frozen and change_mode:
                self._layers_kept_in_eval[id(layer)] = layer
            elif not frozen:
                self._layers_kept_in_eval.pop(id(layer), None)
            if change_mode:
                layer.train(not frozen)
        return {index: {"params": parameters} for index, parameters in changed.items() if parameters}

    def _to_position(self, index: Any) -> int:
        if isinstance(index, bool) or not isinstance(index, int) or not -self.num_groups <= index < self.num_groups:
            raise IndexError(
                f"Layer group index {index!r} is out of range: the model has {self.num_groups} layer groups, so pass "
                f"an index from {-self.num_groups} to {self.num_groups - 1}."
            )
        return index % self.num_groups


def _module_is_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a batch-norm layer (see :data:`BN_MODULES`)."""
    return isinstance(module, BN_MODULES)


def _layers_of(group: nn.Module) -> list[nn.Module]:
    """The modules of ``group`` that hold parameters themselves or have no children, in order."""
    return [
        module
        for module in group.modules()
        if next(module.children(), None) is None or next(module.parameters(recurse=False), None) is not None
    ]
