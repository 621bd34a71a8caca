# Copyright © 2021 Chris Hughes
# Vendored from pytorch-accelerated 0.1.61, docs/schedulers.rst (the literal block at line 75), under the Apache License 2.0
# (https://www.apache.org/licenses/LICENSE-2.0). tests/test_peer_docs.py runs it after the names the snippet takes
# as given (tests/peer_docs/prelude.py). Changed here, nothing else: `pytorch_accelerated` is renamed to
# `pytorch_accel_trainer`, and trailing whitespace is dropped.
# fmt: off
# ruff: noqa
from pytorch_accel_trainer.schedulers import StatefulSchedulerBase

class MilestoneLrScheduler(StatefulSchedulerBase):
    def __init__(
        self, optimizer, gamma=0.5, epoch_milestones=(2, 4, 5), num_steps_per_epoch=100
    ):
        super().__init__(optimizer, param_group_field="lr")
        self.milestones = set(
            (num_steps_per_epoch * milestone for milestone in epoch_milestones)
        )
        self.gamma = gamma

    def get_updated_values(self, num_updates: int):
        if num_updates in self.milestones:
            lr_values = [
                group[self.param_group_field] for group in self.optimizer.param_groups
            ]
            updated_lrs = [lr * self.gamma for lr in lr_values]
            return updated_lrs
