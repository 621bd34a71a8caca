"""Another import path of :mod:`pytorch_accel_trainer.state.training_state` (its earlier place), kept for scripts that use it."""

import sys

from pytorch_accel_trainer.state import training_state as _module

sys.modules[__name__] = _module
