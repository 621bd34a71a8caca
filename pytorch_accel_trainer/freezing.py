"""Another import path of :mod:`pytorch_accel_trainer.finetuning` (its earlier place), kept for scripts that use it."""

import sys

from pytorch_accel_trainer import finetuning as _module

sys.modules[__name__] = _module
