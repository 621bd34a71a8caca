"""Another import path of :mod:`pytorch_accel_trainer.cli.run_folder` (its earlier place), kept for scripts that use it."""

import sys

from pytorch_accel_trainer.cli import run_folder as _module

sys.modules[__name__] = _module
