"""Another import path of :mod:`pytorch_accel_trainer.loop.run_state` (its earlier place), kept for scripts that use it."""

import sys

from pytorch_accel_trainer.loop import run_state as _module

sys.modules[__name__] = _module
