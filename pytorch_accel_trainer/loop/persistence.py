"""The Trainer's public saving and loading methods: export checkpoints, weights, training states and preemption.

:class:`PersistenceMixin`, thin wrappers around ``state/checkpointing.py`` (the one-file export) and
``state/manager.py`` (``TrainingStates``, the owner of the training states, handed the trainer's parts from
``trainer_parts.py``); it holds no state of its own and calls none of the Trainer's private methods (the extra
models' entries come from functions of ``extra_models.py``). What the loop does with training states (resume, and
at its safe points the saves asked for and preemption) is in ``safe_points.py``; the checks before the first batch of
where a run writes are in ``destinations.py``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, cast

import torch

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.loop.extra_models import (
    extra_checkpoint_entries,
    load_extra_checkpoint_entries,
    validate_extra_checkpoint_entries,
)
from pytorch_accel_trainer.loop.run_state import RunState
from pytorch_accel_trainer.loop.safe_points import write_state
from pytorch_accel_trainer.loop.trainer_parts import read_training_state
from pytorch_accel_trainer.parallel.sharded import (
    gathers_model_state,
    get_full_model_state_dict,
    get_full_optimizer_state_dict,
    holds_sharded_parameters,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
    writes_on_this_process,
)
from pytorch_accel_trainer.state.checkpointing import (
    MODEL_KEY,
    OPTIMIZER_KEY,
    SCHEDULER_KEY,
    SKIPPED_WEIGHTS_KEY,
    SkippedWeights,
    build_checkpoint,
    compare_model_states,
    load_checkpoint_file,
    save_checkpoint_file,
    validate_some_weights_fit,
    without_wrapper_prefixes,
)
from pytorch_accel_trainer.state.files import follow_umask, validate_state_name
from pytorch_accel_trainer.state.manager import TrainingStates, validate_save_dir
from pytorch_accel_trainer.state.parts import Processes
from pytorch_accel_trainer.state.preemption import DEFAULT_PREEMPTION_SIGNALS, SignalCatcher
from pytorch_accel_trainer.state.storage import (
    Location,
    as_location,
    is_url,
    local_file_to_read,
    local_file_to_write,
)

if TYPE_CHECKING:
    from accelerate import Accelerator

    from pytorch_accel_trainer.parallel.distributed import ProcessAgreement
    from pytorch_accel_trainer.run_config import TrainerRunConfig
    from pytorch_accel_trainer.trainer import Trainer


class PersistenceMixin:
    """Saving and restoring a :class:`~pytorch_accel_trainer.trainer.Trainer`; see ``docs/training_state.md``."""

    # What the mixin reads from the Trainer, which sets each of them (declared for type checkers).
    model: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    scheduler: Any
    extra_models: dict
    extra_optimizers: dict
    run_state: RunState
    run_config: Optional[TrainerRunConfig]
    process_agreement: ProcessAgreement
    if TYPE_CHECKING:

        @property
        def accelerator(self) -> Accelerator: ...

        def get_model(self, keep_torch_compile: bool = False) -> torch.nn.Module: ...

        def print(self, *args: Any, **kwargs: Any) -> None: ...

    # ------------------------------------------------------------------------------------------------
    # Training state: saves between optimizer updates, resume, preemption
    # ------------------------------------------------------------------------------------------------

    def enable_preemption(self, save_dir, signals: Iterable[int] = DEFAULT_PREEMPTION_SIGNALS) -> None:
        """For the rest of this training run, on one of ``signals``: finish the current optimizer update, save
        a training state under ``save_dir``, and exit with code ``128 + signal``; a second SIGINT exits at once.

        With several processes, a signal received by any one of them stops all of them at the same step.
        ``SaveTrainingStateCallback`` calls this in ``on_training_run_start``.
        """
        state = self.run_state
        state.end_preemption()  # handlers of an earlier call are put back first
        signal_catcher = SignalCatcher(signals, self.request_preemption)
        state.start_preemption(as_location(save_dir), signal_catcher)
        signal_catcher.install()

    def request_preemption(self, signal_number: int) -> None:
        """Ask the run to save and exit with code ``128 + signal_number`` at the next point between updates.

        Safe to call from a signal handler; ``SaveTrainingStateCallback`` does it for SIGTERM, SIGINT and SIGUSR1.
        """
        self.run_state.receive_preemption_signal(signal_number)

    def save_training_state(
        self,
        output_dir,
        checkpoint_kwargs: Optional[dict] = None,
        kinds=("rolling",),
        max_checkpoints: Optional[int] = None,
        asynchronous: bool = False,
        name: Optional[str] = None,
        allow_other_runs: bool = False,
    ) -> Optional[Location]:
        """Save everything needed to continue this run exactly, as a new folder under ``output_dir``.

        The state holds the model (safetensors), optimizer, scheduler, gradient scaler, every RNG of every
        process, the position in the epoch, the step and epoch counters, the run history, each callback's
        ``state_dict()``, ``checkpoint_kwargs``, and each extra model of :meth:`add_model` and its optimizer (a file
        each). It is written crash-safely (see ``state/folder.py``) and
        never overwrites an existing state. Every process must call this.

        During a training run the save waits for the next point between two optimizer updates (a save asked
        for inside an accumulation window is taken when the window closes) and returns ``None``; outside a
        run it is taken at once.

        Args:
            output_dir: the folder that holds the states (``output_dir/checkpoint-<updates>``); pass it, or the state's
                own folder, to ``train(resume_from=...)``. An object-storage URL (``"s3://bucket/states"``) works too.
            checkpoint_kwargs: extra tensors or plain values to store.
            kinds: ``"rolling"`` (pruned beyond ``max_checkpoints``), ``"permanent"`` (kept forever) and/or
                ``"best"`` (only the newest is kept).
            max_checkpoints: keep at most this many rolling states in ``output_dir``.
            name: the state's folder name, e.g. ``"epoch_5"`` (``-2``, ``-3``... is added when it is taken: a state is
                never overwritten); by default ``checkpoint-<updates>``. Blank, ``latest``, ``manifest.json`` and
                names starting with ``.`` are kept by the folder for itself (``ValueError``).
            asynchronous: during a run, stall the loop only while each process copies its part of the state to host
                memory, and write it on a background thread of each process (any number of processes, FSDP
                included); the next save and the end of ``train()`` wait for it and raise its error. Inside an epoch
                the parameters and the optimizer's state are copied beside the next forward and backward passes:
                change them in place only in ``optimizer_step()`` or after it, else that save fails at the next update
                (``CheckpointError``; see "Asynchronous saves" in ``docs/training_state.md``). Outside a run the save
                is synchronous, and under DeepSpeed too (its engine writes its own files; warned once).
            allow_other_runs: save even though ``output_dir`` holds the states of another run (by default an
                error: see "Run identity" in ``docs/training_state.md``); this run's pruning and ``latest`` keep to
                its own states.

        Returns:
            The new state's folder (its URL in a store), or ``None`` when it will be taken at the next point between
            updates.

        Raises:
            RuntimeError: no ``train()`` has started yet, so there is no run to continue.
            ValueError: a ``name`` the folder keeps.
            CheckpointError: ``output_dir`` holds another run's states (and not ``allow_other_runs``), or another
                live job saves into it (its claim: see "Run identity" in ``docs/training_state.md``).
            NotADirectoryError: ``output_dir`` is a file.
        """
        if self.run_state.options is None:
            raise RuntimeError(
                "save_training_state() saves a training run to continue it (its position, optimizer, RNG states), but "
                "this trainer has not run train() yet. Call it during or after train(); to save the weights alone, "
                "use save_checkpoint(save_path) or save_weights(save_path)."
            )
        parent = as_location(output_dir)
        validate_save_dir(
            parent, self.run_state, allow_other_runs, processes=Processes.of_accelerator(self.accelerator)
        )
        if name is not None:
            validate_state_name(name)
        if not self.run_state.in_training_run:
            return write_state(
                cast("Trainer", self),
                parent,
                self.run_state.position(None),
                kinds,
                checkpoint_kwargs,
                max_checkpoints,
                name=name,
            )
        self.run_state.request_save(parent, kinds, checkpoint_kwargs, max_checkpoints, asynchronous, name)
        return None

    def load_training_state(self, input_dir) -> dict:
        """Load a training state (or the newest in a folder of them) into the model, optimizer, scheduler,
        run history and callbacks, outside a training run; to continue a run, use ``train(resume_from=...)``.

        Returns:
            The ``checkpoint_kwargs`` saved with it.
        """
        stored = TrainingStates(Processes.of_accelerator(self.accelerator)).find(input_dir)
        if stored is None:
            raise FileNotFoundError(
                f"{str(input_dir)!r} holds no training state: pass a folder written by save_training_state."
            )
        plan = read_training_state(cast("Trainer", self), stored, None, allow_changes=True)
        self.run_state.load_update_count(plan.num_update_steps_completed)
        return plan.checkpoint_kwargs

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
        """Save the model (and optimizer, scheduler, extra models of ``add_model``, extra values) as one file,
        atomically.

        The file loads with ``torch.load(weights_only=True)``; ``checkpoint_kwargs`` values must be tensors
        or plain Python values. Every process must call this. Under FSDP the weights and the optimizer state are
        gathered whole (the names and shapes of the plain model; torch's plain optimizer format) and the main
        process alone writes; under DeepSpeed pass ``save_optimizer=False`` (its state is in DeepSpeed's format).

        Args:
            save_path: the file to write, e.g. ``"model.pt"``.
            checkpoint_kwargs: extra values to store, returned by :meth:`load_checkpoint`.
            save_optimizer: include the optimizer state (and those of the extra models, under
                ``extra_optimizer_state_dicts``; their weights are under ``extra_model_state_dicts``).
            save_scheduler: include the scheduler state, if there is a scheduler.
            save_per_node: write once per machine; ``False`` writes on the main process only (as does a run
                under FSDP or DeepSpeed ZeRO-3, where only the main process receives the gathered weights).
        """
        scheduler = self.scheduler if save_scheduler else None
        optimizer_state = None
        if save_optimizer and self.optimizer is not None:  # gathered under FSDP: every process takes part
            optimizer_state = get_full_optimizer_state_dict(self.accelerator, self.model, self.optimizer)
        checkpoint = build_checkpoint(
            model_state=self._full_model_state_dict(),  # a collective under FSDP: every process gathers
            optimizer_state=optimizer_state,
            scheduler_state=scheduler.state_dict() if scheduler is not None else None,
            checkpoint_kwargs=checkpoint_kwargs,
            extra_states=extra_checkpoint_entries(  # the models of add_model, if any
                self.accelerator, self.extra_models, self.extra_optimizers, save_optimizer
            ),
        )
        self.accelerator.wait_for_everyone()
        if writes_on_this_process(self.accelerator, save_per_node and not is_url(save_path)):  # a store: once
            with local_file_to_write(save_path) as local_path:  # a URL: written here, then uploaded in one piece
                save_checkpoint_file(checkpoint, local_path)
        self.accelerator.wait_for_everyone()

    def save_weights(self, save_path) -> None:
        """Save the model's weights alone as a safetensors file, atomically; every process must call this.

        The file holds no code and no pickle: load it with ``safetensors.torch.load_model(model, save_path)``.
        Under FSDP the full weights are gathered to the main process first.
        """
        from safetensors.torch import save_file, save_model

        path = as_location(save_path)
        if isinstance(path, Path) and path.is_dir():
            raise IsADirectoryError(
                f"save_weights({str(save_path)!r}): a folder; pass the file to write, e.g. "
                f"{str(path / 'model.safetensors')!r}."
            )
        gathered = self._gathered_model_state_dict()  # None unless sharded; a collective then
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            with local_file_to_write(save_path) as path:  # a URL: written here, then uploaded in one piece
                path.parent.mkdir(parents=True, exist_ok=True)
                temporary = path.with_name(f".{path.name}.tmp")
                try:
                    if gathered is None:
                        save_model(self.get_model(), str(temporary))
                    else:
                        save_file(gathered, str(temporary))
                    follow_umask(temporary)  # safetensors creates its file with mode 0600
                    temporary.replace(path)
                finally:
                    temporary.unlink(missing_ok=True)  # left only by a failed save
        self.accelerator.wait_for_everyone()

    def _full_model_state_dict(self) -> dict:
        """The plain model's state dict; under FSDP / ZeRO-3 gathered to the main process (``{}`` elsewhere)."""
        if gathers_model_state(self.accelerator):
            return get_full_model_state_dict(self.accelerator, self.model)
        return self.get_model().state_dict()

    def _gathered_model_state_dict(self) -> Optional[dict]:
        """Under FSDP / DeepSpeed, the full weights for safetensors (own storage each; ``{}`` where the gathered
        weights do not reach); else ``None``: the unwrapped model is saved directly, tied weights once."""
        if not gathers_model_state(self.accelerator):
            return None
        return {name: tensor.contiguous().clone() for name, tensor in self._full_model_state_dict().items()}

    def load_checkpoint(
        self, checkpoint_path, load_optimizer: bool = True, load_scheduler: bool = True, strict: bool = True
    ) -> dict:
        """Load a file written by :meth:`save_checkpoint` into the model, and the optimizer and scheduler.

        The extra models of :meth:`add_model` (and their optimizers) are loaded too; the file must hold exactly those
        registered, or a ``ValueError`` names both sets before anything is loaded.

        Args:
            checkpoint_path: the checkpoint file.
            load_optimizer: load the optimizer state (and the extra models' optimizer states), if the file has one.
            load_scheduler: load the scheduler state, if the file has one and the trainer has a scheduler.
            strict: every weight of the file must fit the model, with the same names and shapes, or nothing is
                loaded and a :class:`~pytorch_accel_trainer.errors.CheckpointError` (a ``RuntimeError``) names the
                entries that differ. ``False`` loads the weights that fit and skips the others, for fine-tuning from a
                checkpoint with a new head: it warns with the list of what it skipped (shapes that differ, names of
                one side only; the model keeps its own values for them), returns it in the checkpoint under
                ``"skipped_weights"`` (a :class:`~pytorch_accel_trainer.state.checkpointing.SkippedWeights`), and
                then loads no optimizer state, which belongs to the model the file was saved from.

        Returns:
            The checkpoint, as pytorch-accelerated returns it: the extra values saved with ``checkpoint_kwargs`` at
            its top level, next to ``model_state_dict`` (and ``optimizer_state_dict``, ``scheduler_state_dict``).

        Example::

            checkpoint = trainer.load_checkpoint("pretrained.pt", strict=False)  # a model with a new head
            checkpoint["skipped_weights"].mismatched_shapes  # {"head.weight": ((10, 64), (3, 64)), ...}
        """
        self.accelerator.wait_for_everyone()
        with local_file_to_read(checkpoint_path) as local_path:  # a URL: downloaded once, here
            checkpoint = load_checkpoint_file(local_path)
        validate_extra_checkpoint_entries(  # before anything is loaded
            checkpoint, checkpoint_path, load_optimizer, self.extra_models, self.extra_optimizers
        )
        skipped = self._load_model_state(checkpoint[MODEL_KEY], checkpoint_path, strict)
        if load_optimizer and OPTIMIZER_KEY in checkpoint and not skipped:
            if self.optimizer is None:
                raise ValueError(
                    f"{checkpoint_path!r} holds an optimizer state but the trainer has no optimizer: pass one to "
                    "Trainer(...), or load_checkpoint(..., load_optimizer=False)."
                )
            load_full_optimizer_state_dict(self.accelerator, self.model, self.optimizer, checkpoint[OPTIMIZER_KEY])
        if load_scheduler and SCHEDULER_KEY in checkpoint:
            if self.scheduler is None:
                warnings.warn(
                    f"{checkpoint_path!r} holds a scheduler state, but the trainer has no scheduler yet (it is "
                    "created by train()), so it was not loaded. Pass load_scheduler=False to silence this.",
                    stacklevel=2,
                )
            else:
                self.scheduler.load_state_dict(checkpoint[SCHEDULER_KEY])
        load_extra_checkpoint_entries(
            checkpoint, load_optimizer, self.accelerator, self.extra_models, self.extra_optimizers
        )
        if not strict:
            checkpoint[SKIPPED_WEIGHTS_KEY] = skipped
        if skipped:
            optimizer_note = (
                " The optimizer state was not loaded: it belongs to the model the file was saved from."
                if load_optimizer and OPTIMIZER_KEY in checkpoint
                else ""
            )
            warnings.warn(
                f"load_checkpoint({str(checkpoint_path)!r}, strict=False) did not load every weight of the file into "
                f"the model; skipped: {skipped.describe()}.{optimizer_note} The list is in the returned "
                "checkpoint['skipped_weights'].",
                stacklevel=2,
            )
        return checkpoint

    def _load_model_state(self, file_state: dict, checkpoint_path, strict: bool) -> SkippedWeights:
        """Load a checkpoint's model state into the model: all of it (``strict``), or the entries that fit; return
        what was skipped."""
        if holds_sharded_parameters(self.accelerator):  # every process loads the full weights into its shard
            if not strict:
                raise NotImplementedError(
                    "load_checkpoint(..., strict=False) is not supported under FSDP, tensor parallelism or DeepSpeed "
                    "ZeRO-3, where each process holds a shard of the model. Load the weights that fit into the plain "
                    "model before Trainer(...): state = torch.load(path, weights_only=True)['model_state_dict'], then "
                    "model.load_state_dict(<the entries of state whose shapes fit>, strict=False)."
                )
            load_full_model_state_dict(self.accelerator, self.model, file_state)
            return SkippedWeights()
        model = self.get_model()
        model_state = model.state_dict()
        file_state = without_wrapper_prefixes(model_state, file_state)  # saved from a DDP or compiled model
        skipped = compare_model_states(model_state, file_state)
        validate_some_weights_fit(model_state, file_state, skipped, checkpoint_path)  # strict=False or not
        if skipped and strict:
            raise CheckpointError(
                f"{str(checkpoint_path)!r} does not fit the model, so nothing was loaded: {skipped.describe()}. To "
                "fine-tune from it with another head (or other layers), load the weights that fit: "
                "load_checkpoint(path, strict=False) skips these, says which, and keeps the model's own values."
            )
        fitting = {name: value for name, value in file_state.items() if name not in skipped.mismatched_shapes}
        model.load_state_dict(fitting, strict=strict)
        return skipped
