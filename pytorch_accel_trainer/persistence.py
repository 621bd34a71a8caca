"""The Trainer's persistence: export checkpoints, training states, resume and preemption.

A mixin of :class:`~pytorch_accel_trainer.trainer.Trainer`, kept apart so that ``trainer.py`` holds the
skeleton of a run; its methods are thin wrappers around ``checkpointing.py`` and ``training_state.py``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Iterable, Optional

import torch
from accelerate import skip_first_batches


from pytorch_accel_trainer.checkpointing import (
    MODEL_KEY,
    OPTIMIZER_KEY,
    SCHEDULER_KEY,
    build_checkpoint,
    checkpoint_extras,
    load_checkpoint_file,
    save_checkpoint_file,
)
from pytorch_accel_trainer.non_finite import NonFinitePolicy
from pytorch_accel_trainer.preemption import DEFAULT_PREEMPTION_SIGNALS, SignalCatcher
from pytorch_accel_trainer.sharded import (
    gathers_model_state,
    get_full_model_state_dict,
    get_full_optimizer_state_dict,
    holds_sharded_parameters,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
    writes_on_this_process,
)
from pytorch_accel_trainer.training_state import (
    ResumePlan,
    ResumePosition,
    find_resumable_state,
    read_training_state,
    restore_rng_state,
    write_training_state,
)
from pytorch_accel_trainer.utils import dataset_length, with_last_flag


class PersistenceMixin:
    """Saving and restoring a :class:`~pytorch_accel_trainer.trainer.Trainer`; see ``docs/training_state.md``."""

    # ------------------------------------------------------------------------------------------------
    # Training state: saves between optimizer updates, resume, preemption
    # ------------------------------------------------------------------------------------------------

    def _start_training_run_state(self) -> None:
        self._in_training_run = True
        self._save_requests = {}
        self._preemption_signal = None
        if self._resume is None:
            self._num_update_steps_completed, self._epochs_completed = 0, 0
        else:
            self._epochs_completed = self._resume.position.loop_epoch
        self.optimizer.zero_grad(set_to_none=True)  # gradients of a run stopped mid-window must not leak in

    def _epoch_batches(self, train_dl: Iterable) -> tuple[int, Iterable]:
        """Return this epoch's first step and batches: after a resume, only those not yet trained on.

        Batches already seen are skipped by sampler offset (``accelerate.skip_first_batches``), so resuming at
        step 10,000 costs about the same as at step 10.
        """
        if hasattr(train_dl, "set_epoch"):
            train_dl.set_epoch(self.run_history.current_epoch - 1)  # the shuffle order depends on seed + epoch
        resume = self._resume
        if resume is None or resume.position.loop_epoch != self._loop_epoch:
            return 0, with_last_flag(train_dl)
        first_step = resume.position.batches_seen
        if resume.position.rng_restore_point == "after_iterator":
            self._train_loss_tracker.load_state_dict(resume.train_loss_tracker)
        if first_step:
            train_dl = skip_first_batches(train_dl, first_step)
        self._restore_rng_if_due("before_iterator")
        return first_step, with_last_flag(train_dl)

    def _restore_rng_if_due(self, point: str) -> None:
        """Put back the saved RNG states where the saved run took them; this ends the resume."""
        if self._resume is not None and self._resume.position.rng_restore_point == point:
            restore_rng_state(self._resume.rng_state)
            self._resume = None

    def _reach_safe_point(self, step: Optional[int] = None) -> None:
        """Between two optimizer updates: finish a resume, take the saves asked for, stop if preempted.

        Args:
            step: the micro-batch about to run in the current epoch; ``None`` between epochs.
        """
        self._restore_rng_if_due("after_iterator")
        if self.non_finite_policy is not None:  # what the epoch's loss goes back to if this window is skipped
            tracker = self._train_loss_tracker.state_dict()
            self.non_finite_policy.loss_snapshot = {
                key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in tracker.items()
            }
        saved_to = set()
        if self._save_requests:
            requests, self._save_requests = self._save_requests, {}
            for parent, request in requests.items():
                self._write_training_state(parent, self._current_position(step), **request)
                saved_to.add(parent)
        self._exit_if_preempted(step, saved_to)

    def _current_position(self, step: Optional[int]) -> ResumePosition:
        if step is None:  # between epochs, or outside a run
            return ResumePosition(self._epochs_completed, 0, "before_iterator")
        return ResumePosition(self._loop_epoch, step, "after_iterator")

    def _run_facts(self) -> dict:
        """The settings a resumed run must share with the saved one to continue it exactly."""
        config = self.run_config
        return {
            "world_size": self._accelerator.num_processes,
            "per_device_batch_size": None if config is None else config.train_per_device_batch_size,
            "gradient_accumulation_steps": None if config is None else config.gradient_accumulation_steps,
            "train_dataset_length": None if self.train_dataset is None else dataset_length(self.train_dataset),
        }

    def _write_training_state(self, parent: Path, position: ResumePosition, kinds=("rolling",), checkpoint_kwargs=None, max_rolling=None) -> Path:  # fmt: skip
        folder = write_training_state(self, parent, position, self._run_facts(), kinds, checkpoint_kwargs, max_rolling)
        self.print(f"Saved training state {folder}")
        return folder

    def _load_resume_plan(self, stored_state, resume_from, allow_changes: bool) -> Optional[ResumePlan]:
        if resume_from is None:
            return None
        if stored_state is None:
            self.print(f"resume_from={str(resume_from)!r} holds no training state yet: starting a new run.")
            return None
        plan = read_training_state(self, stored_state, self._run_facts(), allow_changes)
        self.print(f"Resuming from {stored_state.folder} (after {self._num_update_steps_completed} optimizer updates)")
        return plan

    def _exit_if_preempted(self, step: Optional[int], saved_to: set) -> None:
        signal_number = self._agreed_preemption_signal()
        if not signal_number:
            return
        if self.preemption_save_dir is not None and self.preemption_save_dir not in saved_to:
            self._write_training_state(self.preemption_save_dir, self._current_position(step))
        self.print(f"Stopped by signal {signal_number}: the training state is saved; exiting with code {128 + signal_number}.")
        sys.exit(128 + signal_number)

    def _agreed_preemption_signal(self) -> Optional[int]:
        """The preemption signal any process received; every process leaves at the same step."""
        if self.preemption_save_dir is None:
            return self._preemption_signal
        (signal_number,) = self._agreement.any_process(self._accelerator, self._preemption_signal or 0)
        return signal_number or None  # one small host-side collective per update window, no device sync

    def skip_non_finite_steps(self, max_consecutive_skips: Optional[int] = None, max_retries: int = 0) -> NonFinitePolicy:
        """For the rest of this training run, skip each optimizer update whose gradients are not finite.

        A skipped update leaves the weights, the optimizer and the scheduler untouched, and its loss out of
        ``train_loss_epoch``. Checking reads one flag back from the device per optimizer update (never per
        micro-batch); the default run, without a policy, reads nothing. ``SkipNonFiniteStepsCallback`` calls
        this in ``on_training_run_start`` and records the skips in the run history.

        Args:
            max_consecutive_skips: stop the run after this many skipped updates in a row (``None``: never).
            max_retries: first re-run the step this many times (without gradient accumulation only).
        """
        self.non_finite_policy = NonFinitePolicy(max_consecutive_skips=max_consecutive_skips, max_retries=max_retries)
        return self.non_finite_policy

    def enable_preemption(self, save_dir, signals: Iterable[int] = DEFAULT_PREEMPTION_SIGNALS) -> None:
        """For the rest of this training run, on one of ``signals``: finish the current optimizer update, save
        a training state under ``save_dir``, and exit with code ``128 + signal``; a second SIGINT exits at once.

        With several processes, a signal received by any one of them stops all of them at the same step.
        ``SaveTrainingStateCallback`` calls this in ``on_training_run_start``.
        """
        self._disable_preemption()
        self.preemption_save_dir = Path(save_dir)
        self._signal_catcher = SignalCatcher(signals, self.request_preemption)
        self._signal_catcher.install()

    def _disable_preemption(self) -> None:
        if self._signal_catcher is not None:
            self._signal_catcher.uninstall()
        self._signal_catcher, self.preemption_save_dir = None, None

    def request_preemption(self, signal_number: int) -> None:
        """Ask the run to save and exit with code ``128 + signal_number`` at the next point between updates.

        Safe to call from a signal handler; ``SaveTrainingStateCallback`` does it for SIGTERM, SIGINT and SIGUSR1.
        """
        self._preemption_signal = signal_number

    def save_training_state(self, output_dir, checkpoint_kwargs: Optional[dict] = None, kinds=("rolling",), max_checkpoints: Optional[int] = None) -> Optional[Path]:  # fmt: skip
        """Save everything needed to continue this run exactly, as a new folder under ``output_dir``.

        The state holds the model (safetensors), optimizer, scheduler, gradient scaler, every RNG of every
        process, the position in the epoch, the step and epoch counters, the run history, each callback's
        ``state_dict()`` and ``checkpoint_kwargs``. It is written crash-safely (see ``training_state.py``) and
        never overwrites an existing state. Every process must call this.

        During a training run the save waits for the next point between two optimizer updates (a save asked
        for inside an accumulation window is taken when the window closes) and returns ``None``; outside a
        run it is taken at once.

        Args:
            output_dir: the folder that holds the states (``output_dir/checkpoint-<updates>``).
            checkpoint_kwargs: extra tensors or plain values to store.
            kinds: ``"rolling"`` (pruned beyond ``max_checkpoints``), ``"permanent"`` (kept forever) and/or
                ``"best"`` (only the newest is kept).
            max_checkpoints: keep at most this many rolling states in ``output_dir``.

        Returns:
            The new state's folder, or ``None`` when it will be taken at the next point between updates.
        """
        parent = Path(output_dir)
        if not self._in_training_run:
            return self._write_training_state(parent, self._current_position(None), kinds, checkpoint_kwargs, max_checkpoints)
        request = self._save_requests.setdefault(parent, {"kinds": set(), "checkpoint_kwargs": {}, "max_rolling": max_checkpoints})
        request["kinds"].update(kinds)
        request["checkpoint_kwargs"].update(checkpoint_kwargs or {})
        return None

    def load_training_state(self, input_dir) -> dict:
        """Load a training state (or the newest in a folder of them) into the model, optimizer, scheduler,
        run history and callbacks, outside a training run; to continue a run, use ``train(resume_from=...)``.

        Returns:
            The ``checkpoint_kwargs`` saved with it.
        """
        stored = find_resumable_state(Path(input_dir))
        if stored is None:
            raise FileNotFoundError(f"{str(input_dir)!r} holds no training state: pass a folder written by save_training_state.")
        return read_training_state(self, stored, None, allow_changes=True).checkpoint_kwargs

    # ------------------------------------------------------------------------------------------------
    # Export checkpoints
    # ------------------------------------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_path,
        checkpoint_kwargs: Optional[dict] = None,
        save_optimizer: bool = True,
        save_scheduler: bool = True,
        save_per_node: bool = True,
    ) -> None:
        """Save the model (and optimizer, scheduler, extra values) as one file, atomically.

        The file loads with ``torch.load(weights_only=True)``; ``checkpoint_kwargs`` values must be tensors
        or plain Python values. Every process must call this. Under FSDP the weights and the optimizer state are
        gathered whole (the names and shapes of the plain model; torch's plain optimizer format) and the main
        process alone writes; under DeepSpeed pass ``save_optimizer=False`` (its state is in DeepSpeed's format).

        Args:
            save_path: the file to write, e.g. ``"model.pt"``.
            checkpoint_kwargs: extra values to store, returned by :meth:`load_checkpoint`.
            save_optimizer: include the optimizer state.
            save_scheduler: include the scheduler state, if there is a scheduler.
            save_per_node: write once per machine; ``False`` writes on the main process only (as does a run
                under FSDP or DeepSpeed ZeRO-3, where only the main process receives the gathered weights).
        """
        scheduler = self.scheduler if save_scheduler else None
        optimizer_state = None
        if save_optimizer and self.optimizer is not None:  # gathered under FSDP: every process takes part
            optimizer_state = get_full_optimizer_state_dict(self._accelerator, self.model, self.optimizer)
        checkpoint = build_checkpoint(
            model_state=self._full_model_state_dict(),  # a collective under FSDP: every process gathers
            optimizer_state=optimizer_state,
            scheduler_state=scheduler.state_dict() if scheduler is not None else None,
            checkpoint_kwargs=checkpoint_kwargs,
        )
        self._accelerator.wait_for_everyone()
        if writes_on_this_process(self._accelerator, save_per_node):
            save_checkpoint_file(checkpoint, save_path)
        self._accelerator.wait_for_everyone()

    def save_weights(self, save_path) -> None:
        """Save the model's weights alone as a safetensors file, atomically; every process must call this.

        The file holds no code and no pickle: load it with ``safetensors.torch.load_model(model, save_path)``.
        Under FSDP the full weights are gathered to the main process first.
        """
        from safetensors.torch import save_file, save_model

        gathered = self._gathered_model_state_dict()  # None unless sharded; a collective then
        self._accelerator.wait_for_everyone()
        if self._accelerator.is_main_process:
            path = Path(save_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.name}.tmp")
            if gathered is None:
                save_model(self.get_model(), str(temporary))
            else:
                save_file(gathered, str(temporary))
            temporary.replace(path)
        self._accelerator.wait_for_everyone()

    def _full_model_state_dict(self) -> dict:
        """The plain model's state dict; under FSDP / ZeRO-3 gathered to the main process (``{}`` elsewhere)."""
        if gathers_model_state(self._accelerator):
            return get_full_model_state_dict(self._accelerator, self.model)
        return self.get_model().state_dict()

    def _gathered_model_state_dict(self) -> Optional[dict]:
        """Under FSDP / DeepSpeed, the full weights for safetensors (own storage each; ``{}`` where the gathered
        weights do not reach); else ``None``: the unwrapped model is saved directly, tied weights once."""
        if not gathers_model_state(self._accelerator):
            return None
        return {name: tensor.contiguous().clone() for name, tensor in self._full_model_state_dict().items()}

    def load_checkpoint(self, checkpoint_path, load_optimizer: bool = True, load_scheduler: bool = True) -> dict:
        """Load a file written by :meth:`save_checkpoint` into the model, and the optimizer and scheduler.

        Args:
            checkpoint_path: the checkpoint file.
            load_optimizer: load the optimizer state, if the file has one.
            load_scheduler: load the scheduler state, if the file has one and the trainer has a scheduler.

        Returns:
            The extra values saved with ``checkpoint_kwargs``.
        """
        self._accelerator.wait_for_everyone()
        checkpoint = load_checkpoint_file(checkpoint_path)
        if holds_sharded_parameters(self._accelerator):  # every process loads the full weights into its shard
            load_full_model_state_dict(self._accelerator, self.model, checkpoint[MODEL_KEY])
        else:
            self.get_model().load_state_dict(checkpoint[MODEL_KEY])
        if load_optimizer and OPTIMIZER_KEY in checkpoint:
            if self.optimizer is None:
                raise ValueError(
                    f"{checkpoint_path!r} holds an optimizer state but the trainer has no optimizer: pass one to "
                    "Trainer(...), or load_checkpoint(..., load_optimizer=False)."
                )
            load_full_optimizer_state_dict(self._accelerator, self.model, self.optimizer, checkpoint[OPTIMIZER_KEY])
        if load_scheduler and SCHEDULER_KEY in checkpoint:
            if self.scheduler is None:
                warnings.warn(
                    f"{checkpoint_path!r} holds a scheduler state, but the trainer has no scheduler yet (it is "
                    "created by train()), so it was not loaded. Pass load_scheduler=False to silence this.",
                    stacklevel=2,
                )
            else:
                self.scheduler.load_state_dict(checkpoint[SCHEDULER_KEY])
        return checkpoint_extras(checkpoint)
