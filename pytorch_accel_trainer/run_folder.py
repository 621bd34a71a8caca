""":mod:`pytorch_accel_trainer.cli.run_folder` under its earlier import path, kept for the scripts that use it."""

import sys

from pytorch_accel_trainer.cli import run_folder as _module

sys.modules[__name__] = _module
