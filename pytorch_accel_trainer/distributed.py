""":mod:`pytorch_accel_trainer.parallel.distributed` under its earlier import path, kept for the scripts that use it."""

import sys

from pytorch_accel_trainer.parallel import distributed as _module

sys.modules[__name__] = _module
