"""Models and optimizers a trainer runs beside its own (a GAN's discriminator, a teacher, an EMA of another model).

A mixin of :class:`~pytorch_accel_trainer.trainer.Trainer`.
"""

from __future__ import annotations


class ExtraModelsMixin:
    """Registers, prepares, updates, saves and restores the extra models and optimizers of a Trainer."""
