# Copyright © 2021 Chris Hughes
# Vendored from pytorch-accelerated 0.1.61, docs/trainer.rst (the literal block at line 37), under the Apache License 2.0
# (https://www.apache.org/licenses/LICENSE-2.0). tests/test_peer_docs.py runs it after the names the snippet takes
# as given (tests/peer_docs/prelude.py). Changed here, nothing else: `pytorch_accelerated` is renamed to
# `pytorch_accel_trainer`, and trailing whitespace is dropped.
# fmt: off
# ruff: noqa
from functools import Partial

from torch.optim import lr_scheduler

create_scheduler_fn = partial(lr_scheduler.StepLR, step_size=7, gamma=0.1)
