"""Unfreeze layer groups of a model at given epochs, for fine-tuning."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.run_config import get_run_config

if TYPE_CHECKING:
    from pytorch_accel_trainer.finetuning import ModelFreezer
    from pytorch_accel_trainer.trainer import Trainer


class GradualUnfreezingCallback(TrainerCallback):
    """Unfreezes layer groups of a :class:`~pytorch_accel_trainer.finetuning.ModelFreezer` at given epochs.

    At the start of each training epoch listed in ``unfreeze_at_epochs``, the layer groups from the given
    index to the last are unfrozen (``{3: -2, 5: 0}``: the last two groups at epoch 3, all at epoch 5;
    epochs are ``trainer.run_history.current_epoch``, from 1). Unfrozen parameters that the optimizer already
    holds simply start training, so a scheduler stays valid: create the optimizer over all the model's
    parameters. Those it does not hold are added as one new parameter group with
    ``new_param_group_kwargs`` (e.g. ``{"lr": 1e-4}``); that is refused when there is a scheduler, which
    would not know the new group.

    Distributed data parallel only synchronises the gradients of parameters that required them when the
    model was wrapped (at the start of ``train()``), so with several processes unfreezing within a run
    is refused: unfreeze between two ``train()`` calls instead.

    Args:
        freezer: the ``ModelFreezer`` of the trained model, with the groups frozen as training should start.
        unfreeze_at_epochs: ``{epoch: from_index}``: the groups from ``from_index`` to the last are unfrozen
            at the start of ``epoch``.
        new_param_group_kwargs: options of the parameter group added for parameters the optimizer lacks.
        keep_frozen_layers_in_eval: put the layers frozen with ``set_modules_as_eval=True`` back in eval mode
            at the start of each epoch, after ``train_epoch_start`` put the whole model in training mode.

    Example::

        freezer = ModelFreezer(model)
        freezer.freeze(set_modules_as_eval=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # frozen parameters included
        unfreezing = GradualUnfreezingCallback(freezer, {3: -3, 5: 0}, keep_frozen_layers_in_eval=True)
        trainer = Trainer(model, loss_func, optimizer, callbacks=(*DEFAULT_CALLBACKS, unfreezing))
    """

    def __init__(
        self,
        freezer: "ModelFreezer",
        unfreeze_at_epochs: Mapping[int, int],
        new_param_group_kwargs: Optional[dict] = None,
        keep_frozen_layers_in_eval: bool = False,
    ):
        _validate_unfreeze_at_epochs(unfreeze_at_epochs)
        self.freezer = freezer
        self.unfreeze_at_epochs = dict(unfreeze_at_epochs)
        self.new_param_group_kwargs = dict(new_param_group_kwargs or {})
        self.keep_frozen_layers_in_eval = keep_frozen_layers_in_eval

    def on_training_run_start(self, trainer: "Trainer", **kwargs):
        self._validate_run(trainer)

    def on_train_epoch_start(self, trainer: "Trainer", **kwargs):
        epoch, optimizer = trainer.run_history.current_epoch, trainer.optimizer  # train() refuses no optimizer
        if epoch in self.unfreeze_at_epochs and optimizer is not None:
            unfrozen = self.freezer.unfreeze(from_index=self.unfreeze_at_epochs[epoch], to_index=-1)
            held = _parameter_ids(optimizer)
            missing = [p for group in unfrozen.values() for p in group["params"] if id(p) not in held]
            if missing:
                optimizer.add_param_group({"params": missing, **self.new_param_group_kwargs})
            trainer.print(f"\nUnfroze layer groups {sorted(unfrozen)} at the start of epoch {epoch}")
        if self.keep_frozen_layers_in_eval:
            self.freezer.set_frozen_layers_to_eval()

    def _validate_run(self, trainer: "Trainer") -> None:
        """Refuse, before the first step, a schedule that could not be applied correctly in this run."""
        model_parameters = {id(p) for p in trainer.get_model().parameters()}
        if not {id(p) for p in self.freezer.model.parameters()} <= model_parameters:
            raise ValueError(
                "GradualUnfreezingCallback's freezer holds another model than the trainer's: create the ModelFreezer "
                "from the model given to Trainer(...)."
            )
        upcoming = sorted(epoch for epoch in self.unfreeze_at_epochs if epoch >= trainer.run_history.current_epoch)
        if upcoming and get_run_config(trainer).is_distributed:
            raise ValueError(
                f"GradualUnfreezingCallback would unfreeze at epochs {upcoming} of a distributed run, but distributed "
                "data parallel only synchronises the gradients of parameters that were trainable when train() "
                "started. Unfreeze between train() calls instead (freezer.unfreeze(), then train() again)."
            )
        frozen = [p for p in self.freezer.model.parameters() if not p.requires_grad]
        held = _parameter_ids(trainer.optimizer)
        if upcoming and trainer.scheduler is not None and any(id(p) not in held for p in frozen):
            raise ValueError(
                "GradualUnfreezingCallback would add the parameters it unfreezes to the optimizer as a new group, "
                "which the learning-rate scheduler does not know. Create the optimizer over all of model.parameters() "
                "(frozen ones have no gradient, so the optimizer skips them until they are unfrozen)."
            )


def _parameter_ids(optimizer) -> set:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def _validate_unfreeze_at_epochs(unfreeze_at_epochs: Mapping) -> None:
    if not isinstance(unfreeze_at_epochs, Mapping):
        raise TypeError(
            f"unfreeze_at_epochs is a {type(unfreeze_at_epochs).__name__}; pass a dict {{epoch: from_index}}, "
            "e.g. {3: -2, 5: 0}."
        )
    for epoch, index in unfreeze_at_epochs.items():
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"unfreeze_at_epochs has the epoch {epoch!r}; epochs are whole numbers from 1.")
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(
                f"unfreeze_at_epochs[{epoch}] is {index!r}; pass the index of the first layer group to unfreeze, "
                "e.g. -2 for the last two groups."
            )
