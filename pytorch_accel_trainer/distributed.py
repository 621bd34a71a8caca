"""Another import path of :mod:`pytorch_accel_trainer.parallel.distributed` (its earlier place), kept for scripts that use it."""

import sys

from pytorch_accel_trainer.parallel import distributed as _module

sys.modules[__name__] = _module
