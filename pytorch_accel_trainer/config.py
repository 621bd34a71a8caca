"""Another import path of :mod:`pytorch_accel_trainer.cli.config` (its earlier place), kept for scripts that use it."""

import sys

from pytorch_accel_trainer.cli import config as _module

sys.modules[__name__] = _module
