"""Learning-rate schedulers stepped once per optimizer update: cosine annealing and Warmup-Stable-Decay.

Ported from pytorch-accelerated 0.1.61's ``pytorch_accelerated.schedulers`` (Apache-2.0, Copyright 2022 Chris
Hughes); see ``docs/schedulers.md``.
"""

from pytorch_accel_trainer.schedulers.cosine_scheduler import CosineLrScheduler
from pytorch_accel_trainer.schedulers.scheduler_base import (
    SchedulerArgumentError,
    SchedulerBase,
    StatefulSchedulerBase,
    create_stepped_once,
)
from pytorch_accel_trainer.schedulers.wsd_scheduler import WSDLrScheduler, estimate_checkpoint_steps

__all__ = [
    "CosineLrScheduler",
    "SchedulerArgumentError",
    "SchedulerBase",
    "StatefulSchedulerBase",
    "WSDLrScheduler",
    "create_stepped_once",
    "estimate_checkpoint_steps",
]
