""":mod:`pytorch_accel_trainer.finetuning` under its earlier import path, kept for the scripts that use it."""

import sys

from pytorch_accel_trainer import finetuning as _module

sys.modules[__name__] = _module
