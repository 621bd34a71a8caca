""":mod:`pytorch_accel_trainer.state.training_state` under its earlier import path, kept for the scripts that use it."""

import sys

from pytorch_accel_trainer.state import training_state as _module

sys.modules[__name__] = _module
