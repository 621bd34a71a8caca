"""Checkpoints of a Warmup-Stable-Decay run: a training state before each decay, a model export after it.

Ported from pytorch-accelerated 0.1.61's ``WSDCheckpointCallback`` (``pytorch_accelerated/callbacks.py``,
Apache-2.0, Copyright 2022 Chris Hughes); see ``docs/schedulers.md`` for what changed.
"""

from __future__ import annotations

import warnings
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.parallel.sharded import inner_optimizer, state_module
from pytorch_accel_trainer.run_config import get_run_config
from pytorch_accel_trainer.state.checkpointing import SCHEDULER_KEY
from pytorch_accel_trainer.state.folder import load_trainer_file
from pytorch_accel_trainer.state.manager import ResumePlan, find_resumable_state
from pytorch_accel_trainer.state.parts import ModelState, OptimizerState, Processes, Stateful, load_sharded
from pytorch_accel_trainer.state.storage import CHECKPOINTS, Destination, local_path

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer

PRE_DECAY = "wsd_pre_decay"
POST_DECAY = "wsd_post_decay"


class WSDCheckpointCallback(TrainerCallback):
    """Saves the checkpoints of a ``WSDLrScheduler`` run, and starts a continuation from one of them.

    For each period of the schedule (one, or ``num_checkpoints``), right after the optimizer update that
    completes its stable phase (``pre_decay_step`` updates), a **training state** is asked for under
    ``save_dir/checkpoint_<step>_wsd_pre_decay/`` (``Trainer.save_training_state``, taken before the next
    batch: weights, optimizer, scheduler, RNG states), from which a longer run can continue (WSD). Right
    after the update that ends the period, a **model export** is written to
    ``save_dir/checkpoint_<step>_wsd_post_decay.pt`` (``Trainer.save_checkpoint``), ready to use or to
    continue from (WSD-S). Steps count optimizer updates, not batches.

    With ``initial_checkpoint``, the run starts from a checkpoint of an earlier run: its weights and
    optimizer state are loaded at ``on_training_run_start`` and the scheduler, which must be created with
    ``is_continuation_from_checkpoint=True``, continues the saved schedule's shape over this run's length
    (``WSDLrScheduler.load_state_dict_for_continuation``). A run resumed with ``train(resume_from=...)``
    already holds it, so it is not loaded again.

    Args:
        save_dir: the folder of the checkpoints, created if needed.
        save_optimizer: include the optimizer state in the post-decay exports.
        save_scheduler: include the scheduler state in the post-decay exports.
        initial_checkpoint: a pre-decay training-state folder (or a folder of them, the newest is used) or a
            post-decay ``.pt`` export to start from; ``None`` to start from the model as it is.

    Example::

        from pytorch_accel_trainer.callbacks.wsd import WSDCheckpointCallback
        from pytorch_accel_trainer.schedulers import WSDLrScheduler

        trainer = Trainer(model, loss_func, optimizer, callbacks=[WSDCheckpointCallback("wsd_checkpoints")])
        trainer.train(train_dataset, num_epochs=10, create_scheduler_fn=WSDLrScheduler.create_scheduler_fn())
    """

    def __init__(
        self,
        save_dir: str | Path = "checkpoints",
        save_optimizer: bool = True,
        save_scheduler: bool = True,
        initial_checkpoint: str | Path | None = None,
    ):
        for name, value in (("save_optimizer", save_optimizer), ("save_scheduler", save_scheduler)):
            if not isinstance(value, bool):
                raise TypeError(f"WSDCheckpointCallback({name}={value!r}): pass True or False.")
        self.save_dir = local_path(save_dir)  # ~ and $VARIABLES expanded, as a shell would
        self.save_optimizer = save_optimizer
        self.save_scheduler = save_scheduler
        self.initial_checkpoint = local_path(initial_checkpoint) if initial_checkpoint is not None else None
        self.last_checkpoint_step: int | None = None
        self.checkpoint_steps: set | None = None
        self.decay_fraction: float | None = None
        self.decay_info: list[dict] | None = None  # the schedule's periods, read at each run start
        self.save_dir.mkdir(parents=True, exist_ok=True)

    def writes_to(self) -> tuple[Destination, ...]:
        """``save_dir``: the post-decay exports, and the pre-decay states this callback loads back itself (not the
        run's states to resume from)."""
        return (Destination(self.save_dir, CHECKPOINTS, "WSDCheckpointCallback(save_dir=...)"),)

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        scheduler: Any = trainer.scheduler  # any scheduler with the methods that _validate_wsd_scheduler checks
        _validate_wsd_scheduler(scheduler)
        resuming = isinstance(trainer.run_state.resume, ResumePlan)  # train(resume_from=...) found a state
        if self.initial_checkpoint is not None and not resuming:
            self._load_initial_checkpoint(trainer, self.initial_checkpoint)
        # read after the initial checkpoint, whose saved schedule may change the periods
        self.decay_info = scheduler.get_decay_info()
        self.checkpoint_steps = set(scheduler.get_checkpoint_steps())
        self.decay_fraction = scheduler.decay_phase_ratio
        _warn_if_the_run_ends_first(trainer, max(self.checkpoint_steps))
        if not resuming:
            self._save_due(trainer, 0)  # a decay that starts with the run (decay_phase_ratio=1)

    def on_train_step_end(
        self, trainer: Trainer, batch: Any = None, batch_output: dict | None = None, step: int = 0, **kwargs
    ):
        """Nothing: pytorch-accelerated checked for checkpoints here, at the batch after an update; this
        trainer takes a save asked for here only after the batch's own update, so the checks run in
        :meth:`on_optimizer_step_end`. Kept, taking the base class's arguments and ``step``, for subclasses that
        call it."""

    def on_optimizer_step_end(self, trainer: Trainer, num_update_steps_completed: int | None = None, **kwargs):
        if num_update_steps_completed is None:  # called by hand without it: the trainer's count
            num_update_steps_completed = trainer.num_update_steps_completed
        self._save_due(trainer, num_update_steps_completed)

    def on_training_run_end(self, trainer: Trainer, **kwargs):
        """Write the export of a run that ended at the end of a period without writing it (a run resumed from a
        state taken after its last update makes no update that would)."""
        done = trainer.num_update_steps_completed
        if done != self.last_checkpoint_step and any(info["period_end"] == done for info in self.decay_info or ()):
            self._save_post_decay(trainer, done)

    def _save_due(self, trainer: Trainer, num_updates: int) -> None:
        for info in self.decay_info or ():  # None before the first run start: no period yet
            if num_updates == info["pre_decay_step"]:
                trainer.print(f"\nWSD Lr Scheduler entering decay phase at step {num_updates}")
                self._save_pre_decay(trainer, num_updates)
            if num_updates == info["period_end"]:
                self._save_post_decay(trainer, num_updates)

    def _metadata(self, trainer: Trainer, step: int, checkpoint_type: str) -> dict:
        return {
            "step": step,
            "checkpoint_type": checkpoint_type,
            "total_steps": get_run_config(trainer).max_num_train_steps,
            "decay_fraction": self.decay_fraction,
            "timestamp": datetime.now().isoformat(),
        }

    def _save_pre_decay(self, trainer: Trainer, step: int) -> None:
        """Ask for a training state, taken before the next batch (every process calls this)."""
        folder = self.save_dir / f"checkpoint_{step}_{PRE_DECAY}"
        trainer.save_training_state(folder, checkpoint_kwargs=self._metadata(trainer, step, PRE_DECAY))
        self.last_checkpoint_step = step
        trainer.print(f"Saving {PRE_DECAY} training state at step {step} in {folder}")

    def _save_post_decay(self, trainer: Trainer, step: int) -> None:
        """Write the model export now (every process calls this)."""
        path = self.save_dir / f"checkpoint_{step}_{POST_DECAY}.pt"
        trainer.save_checkpoint(
            path,
            checkpoint_kwargs=self._metadata(trainer, step, POST_DECAY),
            save_optimizer=self.save_optimizer,
            save_scheduler=self.save_scheduler,
        )
        self.last_checkpoint_step = step
        trainer.print(f"Saved {POST_DECAY} checkpoint at step {step} in {path}")

    def _load_initial_checkpoint(self, trainer: Trainer, path: Path) -> None:
        scheduler: Any = trainer.scheduler  # checked by _validate_wsd_scheduler
        if not path.exists():
            raise FileNotFoundError(
                f"WSDCheckpointCallback(initial_checkpoint={str(path)!r}): no such file or folder. Pass a "
                f"checkpoint_<step>_{PRE_DECAY} folder or a checkpoint_<step>_{POST_DECAY}.pt file, or None."
            )
        if not getattr(scheduler, "is_continuation_from_checkpoint", False):
            raise ValueError(
                f"WSDCheckpointCallback(initial_checkpoint={str(path)!r}) continues an earlier WSD run, but the "
                "scheduler was not created for a continuation: pass create_scheduler_fn=WSDLrScheduler."
                "create_scheduler_fn(is_continuation_from_checkpoint=True). To resume an interrupted run exactly, "
                "use train(resume_from=...) instead."
            )
        trainer.print(f"\nLoading checkpoint from {path}")
        if path.is_dir():
            metadata, scheduler_state = _load_weights_and_optimizer_of_state(trainer, path)
        else:
            metadata = trainer.load_checkpoint(path, load_scheduler=False)
            scheduler_state = metadata.get(SCHEDULER_KEY)
        if scheduler_state is not None:
            getattr(scheduler, "load_state_dict_for_continuation", scheduler.load_state_dict)(scheduler_state)
        self.last_checkpoint_step = metadata.get("step")
        checkpoint_type = metadata.get("checkpoint_type", PRE_DECAY if path.is_dir() else POST_DECAY)
        trainer.print(f"Loaded {checkpoint_type} checkpoint from step {self.last_checkpoint_step}")


def _validate_wsd_scheduler(scheduler) -> None:
    missing = [name for name in ("get_checkpoint_steps", "get_decay_info") if not hasattr(scheduler, name)]
    if missing:
        raise ValueError(
            f"WSDCheckpointCallback needs a scheduler with {' and '.join(missing)}(), but the trainer's scheduler is "
            f"{type(scheduler).__name__}: pass create_scheduler_fn=WSDLrScheduler.create_scheduler_fn(...) to train()."
        )


def _warn_if_the_run_ends_first(trainer: Trainer, last_checkpoint: int) -> None:
    """Warn when the run makes fewer updates than the schedule: its last decay would never happen."""
    run_length = get_run_config(trainer).max_num_train_steps
    if run_length is not None and run_length < last_checkpoint:
        warnings.warn(
            f"The WSD schedule ends at update {last_checkpoint} but this run stops after {run_length} updates, so its "
            "last decay and checkpoint will not happen. With max_num_train_steps, create the scheduler with "
            "total_steps equal to it: functools.partial(create_stepped_once, WSDLrScheduler, total_steps=...).",
            stacklevel=2,
        )


def _load_weights_and_optimizer_of_state(trainer: Trainer, path: Path) -> tuple:
    """Load a training state's weights and optimizer state into the trainer; return its ``checkpoint_kwargs``
    and its scheduler state (``None`` without one).

    Unlike ``Trainer.load_training_state``, this leaves the run's counters, history and callbacks alone: a
    continuation is a new run that starts from the saved weights.
    """
    stored = find_resumable_state(path)  # verified against its checksums
    if stored is None:
        raise FileNotFoundError(f"{str(path)!r} holds no training state: pass a folder written by save_training_state.")
    module = state_module(trainer.accelerator, trainer.model, trainer.get_model())
    parts: dict[str, Stateful] = {
        "model": ModelState(module),
        "optimizer": OptimizerState(module, inner_optimizer(trainer.optimizer)),
    }
    shared = load_trainer_file(stored)
    load_sharded(stored, shared, parts, Processes.of_accelerator(trainer.accelerator))
    return shared["checkpoint_kwargs"], shared["scheduler"]
