"""Freeze and unfreeze groups of layers of a model, for fine-tuning: pytorch-accelerated's ``finetuning`` module.

The implementation lives in :mod:`pytorch_accel_trainer.freezing`; both modules hold the same objects, so
``finetuning.ModelFreezer is freezing.ModelFreezer``.

Example::

    from pytorch_accel_trainer.finetuning import ModelFreezer

    freezer = ModelFreezer(model)
    freezer.freeze()  # every layer group but the last
"""

from pytorch_accel_trainer.freezing import BN_MODULES, Layer, LayerGroup, ModelFreezer, _module_is_batch_norm

__all__ = ["BN_MODULES", "Layer", "LayerGroup", "ModelFreezer", "_module_is_batch_norm"]
