""":mod:`pytorch_accel_trainer.loop.run_state` under its earlier import path, kept for the scripts that use it."""

import sys

from pytorch_accel_trainer.loop import run_state as _module

sys.modules[__name__] = _module
