"""The Trainer: a documented skeleton of hooks and events, run on Hugging Face Accelerate."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from numbers import Number
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Optional, Union

import torch
from accelerate import Accelerator, DistributedType
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DataLoaderConfiguration, find_batch_size, set_seed, slice_tensors
from torch.utils.data import DataLoader, IterableDataset

from pytorch_accel_trainer.callbacks import (
    CallbackHandler,
    with_limit_batches_from_env,
    LogMetricsCallback,
    MoveModulesToDeviceCallback,
    PrintProgressCallback,
    ProgressBarCallback,
    StopTrainingError,
    TerminateOnNaNCallback,
)
from pytorch_accel_trainer.distributed import ProcessAgreement, create_accelerator
from pytorch_accel_trainer.persistence import PersistenceMixin
from pytorch_accel_trainer.non_finite import NonFinitePolicy, gradients_are_finite
from pytorch_accel_trainer.preemption import SignalCatcher
from pytorch_accel_trainer.placeholders import TrainerPlaceholderValues, replace_trainer_placeholder_values
from pytorch_accel_trainer.run_config import TrainerRunConfig, count_update_steps, plan_run_length
from pytorch_accel_trainer.sharded import (
    as_plain_tensor,
    clip_gradients_by_value,
    prepare_components,
    set_deepspeed_gradient_sync,
    unwrap_distributed_model,
    validate_gradients_visible,
    validate_sharded_run,
    warn_if_sharding_was_ignored,
)
from pytorch_accel_trainer.tracking import InMemoryRunHistory, LossTracker, RunHistory
from pytorch_accel_trainer.training_state import ResumePlan, find_resumable_state
from pytorch_accel_trainer.utils import (
    batch_size_of,
    dataloader_length,
    is_mapping,
    model_output_loss,
    remove_padding,
    require_batches,
    seed_worker,
)
from pytorch_accel_trainer.validation import (
    validate_batch_output,
    validate_constructor_options,
    validate_evaluate_arguments,
    validate_train_arguments,
)

# Where Accelerate's optimizer wrapper and backward() only call torch (no gradient scaler, DeepSpeed, FSDP, XLA).
_PLAIN_TORCH_STEP_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)

_NO_TRAIN_BATCH = (
    "The training dataloader yielded no batch in this epoch, so the run could not progress: check that "
    "train_dataset yields samples on every pass (a generator-based dataset must restart)."
)
_NO_EVAL_BATCH = (
    "The evaluation dataloader yielded no batch: the evaluation dataset is empty (an iterable dataset that yields "
    "nothing, or a generator already consumed). Pass a dataset with at least one sample."
)

DEFAULT_CALLBACKS = (
    MoveModulesToDeviceCallback,
    TerminateOnNaNCallback,
    PrintProgressCallback,
    ProgressBarCallback,
    LogMetricsCallback,
)


class Trainer(PersistenceMixin):
    """Trains and evaluates a model through a fixed skeleton of overridable hooks and callback events.

    The skeleton is the pseudocode of ``docs/inside_the_trainer.md``; each hook runs, then its ``on_*``
    event. Accelerate places the model, optimizer and data on the right devices and processes, so the
    same script runs with ``python train.py`` or ``accelerate launch train.py``.

    Args:
        model: the ``torch.nn.Module`` to train.
        loss_func: called as ``loss_func(model_outputs, targets)`` by the default batch-loss hooks.
        optimizer: an optimizer over the model's parameters (``None`` for an evaluation-only trainer).
        callbacks: callback classes or instances, called in order for each event.
        run_history: where metrics are recorded; a new :class:`InMemoryRunHistory` by default.
        seed: seeds torch, numpy and ``random`` (offset by the process index) at the start of each
            ``train()``, so runs are repeatable; ``None`` leaves the random state alone. Importing the
            package never seeds anything.
        mixed_precision: ``"no"``, ``"bf16"``, ``"fp16"`` (needs a GPU: a ``ValueError`` on the CPU) or ``"fp8"``;
            ``None`` (the default) takes it from the Accelerate config or ``accelerate launch --mixed_precision``.
            Losses are logged in float32.
        torch_compile: compile the model with ``torch.compile`` for training and evaluation: ``True``, or a dict
            of ``torch.compile`` arguments (e.g. ``{"mode": "max-autotune"}``). Off by default. ``get_model()``
            and checkpoints hold the uncompiled model (no ``_orig_mod.`` keys).

    Example::

        trainer = Trainer(model, loss_func=nn.MSELoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        trainer.train(train_dataset, num_epochs=3, eval_dataset=eval_dataset, per_device_batch_size=32)
        trainer.run_history.get_latest_metric("eval_loss_epoch")
    """

    #: Always step through Accelerate's optimizer wrapper and ``Accelerator.backward``, even where they
    #: would only call torch; set it on a subclass for an optimizer that relies on the wrapper.
    always_use_accelerate_wrappers: bool = False

    def __init__(
        self,
        model: torch.nn.Module,
        loss_func: Optional[Callable],
        optimizer: Optional[torch.optim.Optimizer],
        callbacks: Iterable = DEFAULT_CALLBACKS,
        run_history: Optional[RunHistory] = None,
        seed: Optional[int] = 42,
        mixed_precision: Optional[str] = None,
        torch_compile: Union[bool, dict] = False,
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model is a {type(model).__name__}; pass a torch.nn.Module.")
        validate_constructor_options(mixed_precision, torch_compile)
        self.model = model
        self.mixed_precision = mixed_precision
        self.torch_compile = torch_compile
        self.loss_func = loss_func
        self.optimizer = optimizer
        self.seed = seed
        self._callbacks = callbacks
        self.callback_handler = self._create_callback_handler()
        self.run_history: RunHistory = run_history if run_history is not None else InMemoryRunHistory()
        self._accelerator = self._create_accelerator()
        warn_if_sharding_was_ignored(self._accelerator)
        self._train_loss_tracker = LossTracker()
        self._eval_loss_tracker = LossTracker()
        self._num_update_steps_completed = 0
        self._train_epoch_length: Optional[int] = None
        self._use_plain_torch_step = False
        self._max_num_train_steps: Optional[int] = None
        self._items_in_window: Any = 0  # num_items_in_batch summed over the accumulation window, if given
        #: In an evaluation epoch, the rows of this process's batch that are real samples when the rest only repeat
        #: samples so that every process runs the same steps (the last batch of a multi-process run); else None.
        self.eval_batch_real_rows: Optional[int] = None
        # a StopTrainingError raised by a callback: it takes effect at the next update boundary (or the end of
        # the epoch), on every process together
        self._stop_request: Optional[StopTrainingError] = None
        self._agreement = ProcessAgreement()
        #: The first micro-batch of the current training epoch: 0, or the batches already trained on when a
        #: resumed run continues an epoch (a progress bar starts there).
        self.epoch_first_step = 0
        # training state: saves asked for during a run wait for the next point between two optimizer updates
        self._in_training_run = False
        self._loop_epoch = 0
        self._save_requests: dict[Path, dict] = {}
        self._resume: Optional[ResumePlan] = None
        self.preemption_save_dir: Optional[Path] = None
        self._preemption_signal: Optional[int] = None
        self._signal_catcher: Optional[SignalCatcher] = None
        self.non_finite_policy: Optional[NonFinitePolicy] = None
        #: Keep the total norm of each update's gradients in ``last_gradient_norm`` (a device tensor, no sync),
        #: even without clipping by norm; ``ExperimentTrackingCallback`` turns it on to log it.
        self.track_gradient_norm = False
        self.last_gradient_norm: Optional[torch.Tensor] = None
        # set by train() / evaluate()
        self.create_scheduler_fn = None
        self.scheduler = None
        self.collate_fn = None
        self.train_dataset = None
        self.eval_dataset = None
        self._train_dataloader = None
        self._eval_dataloader = None
        self._train_dl_kwargs: Optional[dict] = None
        self._eval_dl_kwargs: Optional[dict] = None
        self.run_config: Optional[TrainerRunConfig] = None

        self.callback_handler.call_event("on_init_end", self)

    def _create_callback_handler(self) -> CallbackHandler:
        """Return the :class:`CallbackHandler` that calls the trainer's callbacks (with a
        ``LimitBatchesCallback`` first while the environment variable ``PT_ACC_LIMIT_BATCHES`` is set)."""
        return CallbackHandler(with_limit_batches_from_env(self._callbacks))

    def _create_accelerator(self) -> Accelerator:
        """Return the :class:`accelerate.Accelerator` that runs training; override to configure it.

        Launched on several processes on a machine without GPUs (``accelerate launch --multi_gpu`` or
        ``torchrun``), it runs one multi-process job on the CPU (gloo), where Accelerate alone would run
        independent copies of the training.

        The default shuffles with Accelerate's seedable sampler: the order of epoch ``e`` depends only on
        ``seed + e`` (``seed`` 0 when ``Trainer(seed=None)``), identical on every process, so a resumed run
        can skip to any batch by sampler offset.
        """
        data_seed = self.seed if self.seed is not None else 0
        return create_accelerator(
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=data_seed),
            mixed_precision=self.mixed_precision,
        )

    # ------------------------------------------------------------------------------------------------
    # Setup hooks
    # ------------------------------------------------------------------------------------------------

    def create_train_dataloader(self, batch_size: int, train_dl_kwargs: Optional[dict] = None) -> Iterable:
        """Return the training dataloader over ``self.train_dataset`` (before Accelerate prepares it).

        Runs once at the start of ``train()``. The default builds a :class:`~torch.utils.data.DataLoader`
        from :meth:`get_default_train_dl_kwargs`, updated with ``train_dl_kwargs`` (which wins, ``batch_size``
        included), and ``self.collate_fn``.

        Args:
            batch_size: the batch size per device.
            train_dl_kwargs: extra DataLoader arguments.

        Returns:
            Any iterable of batches; a DataLoader is sharded across processes by Accelerate.
        """
        self._train_dl_kwargs = self._merge_dataloader_kwargs(
            self.get_default_train_dl_kwargs(batch_size), train_dl_kwargs, self.train_dataset
        )
        return DataLoader(dataset=self.train_dataset, collate_fn=self.collate_fn, **self._train_dl_kwargs)

    def create_eval_dataloader(self, batch_size: int, eval_dl_kwargs: Optional[dict] = None) -> Iterable:
        """Return the evaluation dataloader over ``self.eval_dataset``; as :meth:`create_train_dataloader`."""
        self._eval_dl_kwargs = self._merge_dataloader_kwargs(
            self.get_default_eval_dl_kwargs(batch_size), eval_dl_kwargs, self.eval_dataset
        )
        return DataLoader(dataset=self.eval_dataset, collate_fn=self.collate_fn, **self._eval_dl_kwargs)

    def get_default_train_dl_kwargs(self, batch_size: int) -> dict:
        """Return the default training DataLoader arguments.

        ``num_workers`` is 0: on small in-memory data, worker processes make each step several times
        slower. Pass ``train_dataloader_kwargs={"num_workers": 4}`` for data that is costly to load;
        workers then persist across epochs and seed numpy per worker.
        """
        return {
            "shuffle": True,
            "pin_memory": torch.cuda.is_available(),
            "batch_size": batch_size,
            "num_workers": 0,
        }

    def get_default_eval_dl_kwargs(self, batch_size: int) -> dict:
        """Return the default evaluation DataLoader arguments: as for training, without shuffling."""
        return {
            "shuffle": False,
            "pin_memory": torch.cuda.is_available(),
            "batch_size": batch_size,
            "num_workers": 0,
        }

    @staticmethod
    def _merge_dataloader_kwargs(defaults: dict, overrides: Optional[dict], dataset: Any) -> dict:
        kwargs = dict(defaults)
        overrides = dict(overrides or {})
        if "sampler" in overrides or "batch_sampler" in overrides or isinstance(dataset, IterableDataset):
            kwargs.pop("shuffle", None)  # a sampler, or a stream, decides the order itself
        if "batch_sampler" in overrides:
            kwargs.pop("batch_size", None)
        kwargs.update(overrides)
        if kwargs.get("num_workers", 0) > 0:
            kwargs.setdefault("persistent_workers", True)  # workers start once, not every epoch
            kwargs.setdefault("worker_init_fn", seed_worker)
        # Data loading draws its seeds from a generator of its own, never from the global RNG, so the
        # model's randomness (dropout) does not depend on when dataloader iterators are created: with
        # persistent workers, or after a resume.
        kwargs.setdefault("generator", torch.Generator())
        return kwargs

    def create_scheduler(self) -> Any:
        """Return the learning-rate scheduler built by ``self.create_scheduler_fn(self.optimizer)``.

        Runs once in ``train()``, after the dataloaders are prepared, so that
        :class:`TrainerPlaceholderValues` in a ``functools.partial`` factory resolve to this run's values.
        The scheduler is stepped once per optimizer update, in :meth:`scheduler_step`.
        """
        factory = replace_trainer_placeholder_values(self.create_scheduler_fn, self._placeholder_values())
        return factory(self.optimizer)

    def _placeholder_values(self) -> dict:
        config = self.run_config
        return {
            TrainerPlaceholderValues.NUM_EPOCHS: config.num_epochs,
            TrainerPlaceholderValues.NUM_UPDATE_STEPS_PER_EPOCH: config.num_update_steps_per_epoch,
            TrainerPlaceholderValues.PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH: config.num_local_update_steps_per_epoch,
            TrainerPlaceholderValues.TRAIN_DATALOADER_LEN: dataloader_length(self._train_dataloader),
            TrainerPlaceholderValues.EVAL_DATALOADER_LEN: dataloader_length(self._eval_dataloader),
        }

    # ------------------------------------------------------------------------------------------------
    # Training run hooks
    # ------------------------------------------------------------------------------------------------

    def training_run_start(self) -> None:
        """Runs at the start of a training run, before ``on_training_run_start``. Default: nothing."""

    def train_epoch_start(self) -> None:
        """Runs at the start of each training epoch. Default: puts the model in training mode."""
        self.model.train()

    def calculate_train_batch_loss(self, batch) -> dict:
        """Return the loss of one training batch, with the model outputs and the batch size.

        The default runs ``self.model(batch[0])`` and ``self.loss_func(outputs, batch[1])``. A batch that is a dict
        (Hugging Face style) is passed as keyword arguments, ``self.model(**batch)``, and its targets are
        ``batch["labels"]``; without a ``loss_func``, the ``loss`` of the model output is used (transformers models
        return one when the batch has ``labels``).

        Args:
            batch: one batch from the training dataloader.

        Returns:
            A dict with ``loss`` (a scalar tensor) and ``batch_size`` (both required), ``model_outputs`` by
            convention, and any extra keys, which reach ``on_train_step_end``. Return the plain loss: the trainer
            scales it for gradient accumulation itself, and logs it unscaled. For a loss averaged over items
            other than samples (tokens), add ``num_items_in_batch``, the number of items it averages over: the
            trainer then weights each micro-batch by it, so the update is that of the item-mean over the whole
            global batch, however it is split over accumulation steps and processes.
        """
        model_outputs = self._forward(batch)
        loss = self._loss_of(model_outputs, batch)
        return {"loss": loss, "model_outputs": model_outputs, "batch_size": batch_size_of(batch)}

    def backward_step(self, loss: torch.Tensor) -> None:
        """Run the backward pass through Accelerate (which handles mixed-precision loss scaling).

        Where ``Accelerator.backward`` would only divide the loss by 1 and call ``loss.backward()`` (no gradient
        scaler, DeepSpeed or Megatron), the trainer calls ``loss.backward()`` itself: same gradients, less time.

        Args:
            loss: the loss of ``calculate_train_batch_loss``, already divided by the number of
                micro-batches in the current accumulation window.
        """
        if self._use_plain_torch_step:
            loss.backward()
        else:
            self._accelerator.backward(loss)

    def optimizer_step(self) -> None:
        """Update the parameters: ``self.optimizer.step()``. Runs once per accumulation window."""
        self.optimizer.step()

    def scheduler_step(self) -> None:
        """Step ``self.scheduler``, if there is one. Runs after each optimizer update that was not skipped."""
        if self.scheduler is not None:
            self.scheduler.step()

    def optimizer_zero_grad(self) -> None:
        """Reset the gradients: ``self.optimizer.zero_grad()``. Runs after each optimizer update."""
        self.optimizer.zero_grad()

    def train_epoch_end(self) -> None:
        """Runs at the end of each training epoch, before its loss is recorded. Default: nothing."""

    def eval_epoch_start(self) -> None:
        """Runs at the start of each evaluation epoch. Default: puts the model in evaluation mode."""
        self.model.eval()

    def calculate_eval_batch_loss(self, batch) -> dict:
        """Return the loss of one evaluation batch, computed without gradients; as :meth:`calculate_train_batch_loss`.

        In the last batch of a multi-process evaluation, Accelerate repeats a few samples so that every process
        runs the same steps; the default computes the loss over the real rows only (``eval_batch_real_rows``),
        so ``eval_loss_epoch`` equals the single-process value. ``model_outputs`` keep every row, as
        ``gather_for_metrics`` expects.
        """
        with torch.no_grad():
            model_outputs = self._forward(batch)
            loss, batch_size = self._loss_of(model_outputs, batch), batch_size_of(batch)
            real_rows = self.eval_batch_real_rows
            if real_rows is not None:  # a second forward pass over the real rows, once per evaluation
                real_batch = slice_tensors(batch, slice(0, real_rows))
                loss = self._loss_of(self._forward(real_batch), real_batch) if real_rows else torch.zeros_like(loss)
                batch_size = real_rows
        return {"loss": loss, "model_outputs": model_outputs, "batch_size": batch_size}

    def _forward(self, batch) -> Any:
        """The model's output for a batch of the default hooks: ``(inputs, targets, ...)`` or a dict of keyword arguments."""
        if is_mapping(batch):
            return self.model(**batch)
        return self.model(batch[0])

    def _loss_of(self, model_outputs, batch) -> torch.Tensor:
        """``loss_func(outputs, targets)``, or without a ``loss_func`` the loss the model returned."""
        if self.loss_func is not None:
            return self.loss_func(model_outputs, batch["labels"] if is_mapping(batch) else batch[1])
        return model_output_loss(model_outputs)

    def eval_epoch_end(self) -> None:
        """Runs at the end of each evaluation epoch, before its loss is recorded. Default: nothing."""

    def training_run_epoch_end(self) -> None:
        """Runs after the training and evaluation epochs of each training-run epoch. Default: nothing."""

    def training_run_end(self) -> None:
        """Runs at the end of a training run. Default: unwraps ``self.model`` from its distributed wrappers."""
        self.model = self._unwrap_distributed_model()

    def evaluation_run_start(self) -> None:
        """Runs at the start of an evaluation run, before ``on_evaluation_run_start``. Default: nothing."""

    def evaluation_run_end(self) -> None:
        """Runs at the end of an evaluation run. Default: unwraps ``self.model`` from its distributed wrappers."""
        self.model = self._unwrap_distributed_model()

    # ------------------------------------------------------------------------------------------------
    # Entry points
    # ------------------------------------------------------------------------------------------------

    def train(
        self,
        train_dataset,
        num_epochs: Optional[int],
        eval_dataset=None,
        per_device_batch_size: int = 8,
        max_num_train_steps: Optional[int] = None,
        gradient_accumulation_steps: int = 1,
        gradient_clip_value: Optional[Number] = None,
        create_scheduler_fn: Optional[Callable] = None,
        train_dataloader_kwargs: Optional[dict] = None,
        eval_dataloader_kwargs: Optional[dict] = None,
        reset_run_history: bool = True,
        collate_fn: Optional[Callable] = None,
        gradient_clip_norm: Optional[Number] = None,
        resume_from=None,
        allow_resume_changes: bool = False,
    ) -> None:
        """Run a training run: training epochs, each followed by an evaluation epoch if ``eval_dataset`` is given.

        Args:
            train_dataset: the training data; a dataset without ``__len__`` (iterable, streaming) works too.
            num_epochs: the number of epochs; ``None`` to stop on ``max_num_train_steps`` only.
            eval_dataset: evaluated after each training epoch when given.
            per_device_batch_size: the batch size on each process.
            max_num_train_steps: the most optimizer updates to make; whichever of this and ``num_epochs``
                comes first ends the run.
            gradient_accumulation_steps: micro-batches per optimizer update. The gradients equal those of
                one batch ``gradient_accumulation_steps`` times larger, and a partial window at the end of
                an epoch is weighted by the micro-batches it really has.
            gradient_clip_value: clip each gradient element to ``[-value, value]`` before each update.
            create_scheduler_fn: a factory ``fn(optimizer) -> scheduler``, possibly a ``functools.partial``
                holding :class:`TrainerPlaceholderValues`; a scheduler instance is refused.
            train_dataloader_kwargs: extra arguments for the training DataLoader.
            eval_dataloader_kwargs: extra arguments for the evaluation DataLoader.
            reset_run_history: start from an empty run history (``False`` continues the epoch count).
            collate_fn: the collate function of both dataloaders.
            gradient_clip_norm: clip the total gradient norm to this value before each update.
            resume_from: a training state written by :meth:`save_training_state` (or a
                ``SaveTrainingStateCallback``), or a folder of them, of which the newest complete one is used. The
                run continues exactly where that state was taken: same epoch, next batch, same RNG states. A
                folder with no state yet starts a new run (and says so); a path that does not exist is an error.
            allow_resume_changes: resume even if the world size, batch size, accumulation or dataset length
                differ from the saved run's (the continuation is then not exact).

        Example::

            trainer.train(dataset, num_epochs=10, resume_from="checkpoints")  # the same line starts or resumes
        """
        validate_train_arguments(
            train_dataset, num_epochs, eval_dataset, per_device_batch_size, max_num_train_steps,
            gradient_accumulation_steps, gradient_clip_value, gradient_clip_norm, create_scheduler_fn,
            train_dataloader_kwargs, eval_dataloader_kwargs,
        )  # fmt: skip
        if self.optimizer is None:
            raise ValueError("The trainer has no optimizer (optimizer=None): pass one to Trainer(...) to train.")
        stored_state = find_resumable_state(Path(resume_from)) if resume_from is not None else None
        self._max_num_train_steps = max_num_train_steps
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.create_scheduler_fn, self.collate_fn = create_scheduler_fn, collate_fn
        if reset_run_history:
            self.run_history.reset()
        if self.seed is not None:
            set_seed(self.seed, device_specific=True)

        self._train_dataloader = self.create_train_dataloader(per_device_batch_size, train_dataloader_kwargs)
        self._eval_dataloader, self._eval_dl_kwargs = None, None
        if eval_dataset is not None:
            self._eval_dataloader = self.create_eval_dataloader(per_device_batch_size, eval_dataloader_kwargs)
        self._prepare_model_optimizer_and_dataloaders()
        self.run_config = self._create_run_config(
            per_device_batch_size=per_device_batch_size,
            num_epochs=num_epochs,
            gradient_accumulation_steps=gradient_accumulation_steps,
            max_num_train_steps=max_num_train_steps,
            gradient_clip_value=gradient_clip_value,
            gradient_clip_norm=gradient_clip_norm,
        )
        validate_sharded_run(self._accelerator, self.run_config)
        self.scheduler = self.create_scheduler() if create_scheduler_fn is not None else None
        self._resume = self._load_resume_plan(stored_state, resume_from, allow_resume_changes)
        self._run_training()

    def evaluate(
        self,
        dataset=None,
        per_device_batch_size: int = 8,
        dataloader_kwargs: Optional[dict] = None,
        collate_fn: Optional[Callable] = None,
    ) -> None:
        """Run one evaluation epoch over ``dataset`` and record ``evaluation_loss`` in the run history.

        Unlike pytorch-accelerated, the run history is kept: the metrics of an earlier ``train()`` stay.

        Args:
            dataset: the data to evaluate; defaults to the ``eval_dataset`` (and collate function) of the last
                ``train()``.
            per_device_batch_size: the batch size on each process.
            dataloader_kwargs: extra arguments for the DataLoader.
            collate_fn: the collate function of the DataLoader.
        """
        if dataset is None:  # the last eval dataset, with its collate function unless another is given
            dataset, collate_fn = self.eval_dataset, collate_fn or self.collate_fn
        validate_evaluate_arguments(dataset, per_device_batch_size, dataloader_kwargs)
        self.eval_dataset, self.collate_fn = dataset, collate_fn
        self._train_dataloader, self._train_dl_kwargs = None, None
        self._eval_dataloader = self.create_eval_dataloader(per_device_batch_size, dataloader_kwargs)
        self._prepare_model_optimizer_and_dataloaders()
        self.run_config = self._create_run_config(
            per_device_batch_size=per_device_batch_size,
            num_epochs=1,
            gradient_accumulation_steps=1,
            max_num_train_steps=None,
            gradient_clip_value=None,
        )
        self._run_evaluation()

    # ------------------------------------------------------------------------------------------------
    # Internal setup
    # ------------------------------------------------------------------------------------------------

    def _prepare_model_optimizer_and_dataloaders(self) -> None:
        """Wrap the model, optimizer and dataloaders for the current devices and processes, via Accelerate.

        Preparing shards each DataLoader across processes, which changes its length: the run config and
        the scheduler are built after this.
        """
        self._release_previous_run()
        self.model = self._unwrap_distributed_model()  # a model left wrapped by an earlier run is wrapped once
        if isinstance(self.optimizer, AcceleratedOptimizer):
            self.optimizer = self.optimizer.optimizer
        components = [self.model, self.optimizer, self._train_dataloader, self._eval_dataloader]
        placement = [None, None, *(self._batches_need_placing(dl) for dl in components[2:])]
        components = prepare_components(self._accelerator, components, device_placement=placement)  # FSDP2-aware
        self.model, self.optimizer, self._train_dataloader, self._eval_dataloader = components
        self._use_plain_torch_step = self._accelerate_wrappers_only_call_torch()
        if self._use_plain_torch_step and isinstance(self.optimizer, AcceleratedOptimizer):
            self.optimizer = self.optimizer.optimizer
        if self.torch_compile is not False:  # True or a dict, even {}; compiled after the DDP wrapper, as torch advises
            options = self.torch_compile if isinstance(self.torch_compile, Mapping) else {}
            self.model = torch.compile(self.model, **options)

    def _batches_need_placing(self, dataloader: Any) -> bool:
        """Whether Accelerate should move each batch of ``dataloader`` to the device (``send_to_device``).

        On the CPU, batches of a map-style dataset are already where they go, and the per-batch call costs about
        5 us. Iterable datasets keep it: without it Accelerate would shard them differently (no dispatching).
        """
        return self.device.type != "cpu" or isinstance(getattr(dataloader, "dataset", None), IterableDataset)

    def _release_previous_run(self) -> None:
        """Drop Accelerate's references to what the last run prepared, so that nothing is kept or prepared twice.

        ``Accelerator.free_memory()`` does the same plus ``gc.collect()``, about 0.15 s a call (most of a small
        ``evaluate()``); it is needed only to destroy a DeepSpeed engine.
        """
        accelerator = self._accelerator
        if getattr(accelerator, "deepspeed_engine_wrapped", None) is not None:
            accelerator.free_memory()
            return
        accelerator._schedulers, accelerator._optimizers, accelerator._models, accelerator._dataloaders = [], [], [], []
        accelerator.step = 0

    def _accelerate_wrappers_only_call_torch(self) -> bool:
        """Whether Accelerate's optimizer wrapper and ``backward()`` would add nothing but time here.

        Without a gradient scaler (fp16), DeepSpeed, FSDP, Megatron, XLA or a LOMO optimizer, the wrapper's
        ``step()`` and ``zero_grad()`` and ``Accelerator.backward`` only call torch, after checks that cost about
        100 us per step on a small model (two uncached package lookups, ``inspect.signature``, a division by 1;
        ``benchmarks/``). The trainer then calls torch directly; ``tests/test_fast_path.py`` shows the result is
        bitwise identical. The optimizer state was already placed on the device by ``prepare``.
        """
        accelerator = self._accelerator
        return (
            not self.always_use_accelerate_wrappers
            and accelerator.scaler is None
            and accelerator.distributed_type in _PLAIN_TORCH_STEP_TYPES
            and not accelerator.has_lomo_optimizer
        )

    def _create_run_config(
        self,
        per_device_batch_size: int,
        num_epochs: Optional[int],
        gradient_accumulation_steps: int,
        max_num_train_steps: Optional[int],
        gradient_clip_value: Optional[Number],
        gradient_clip_norm: Optional[Number] = None,
    ) -> TrainerRunConfig:
        """Return the frozen :class:`TrainerRunConfig` of the run being started."""
        train_batch_size = (self._train_dl_kwargs or {}).get("batch_size", per_device_batch_size)
        eval_batch_size = (self._eval_dl_kwargs or {}).get("batch_size", per_device_batch_size)
        if self._train_dataloader is None:
            train_batch_size, updates_per_epoch = None, 0
        else:
            updates_per_epoch = count_update_steps(
                dataloader_length(self._train_dataloader), gradient_accumulation_steps
            )
            if updates_per_epoch == 0:
                raise ValueError(
                    f"The training dataloader has no batches on this process (dataset of {len(self.train_dataset)} "
                    f"samples, batch size {train_batch_size}, {self._accelerator.num_processes} processes, "
                    f"dataloader arguments {self._train_dl_kwargs}). Lower the batch size or drop drop_last=True."
                )
        num_epochs, max_num_train_steps = plan_run_length(num_epochs, max_num_train_steps, updates_per_epoch)
        num_processes = self._accelerator.num_processes
        return TrainerRunConfig(
            num_epochs=num_epochs,
            train_per_device_batch_size=train_batch_size,
            train_dl_kwargs=self._train_dl_kwargs,
            eval_per_device_batch_size=eval_batch_size,
            eval_dl_kwargs=self._eval_dl_kwargs,
            gradient_accumulation_steps=gradient_accumulation_steps,
            train_total_batch_size=None if train_batch_size is None else train_batch_size * num_processes * gradient_accumulation_steps,
            eval_total_batch_size=None if eval_batch_size is None else eval_batch_size * num_processes,
            num_update_steps_per_epoch=updates_per_epoch,
            num_local_update_steps_per_epoch=updates_per_epoch,
            max_num_train_steps=max_num_train_steps,
            is_local_process_zero=self._accelerator.is_local_main_process,
            is_world_process_zero=self._accelerator.is_main_process,
            is_distributed=self._accelerator.distributed_type != DistributedType.NO,
            mixed_precision=self._accelerator.mixed_precision,
            num_processes=num_processes,
            gradient_clip_value=gradient_clip_value,
            gradient_clip_norm=gradient_clip_norm,
            seed=self.seed,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------------
    # Orchestrators: the documented skeleton
    # ------------------------------------------------------------------------------------------------

    def _run_training(self) -> None:
        """Run the epochs of a training run, as in the documented pseudocode."""
        self._start_training_run_state()
        try:
            self.training_run_start()
            self.callback_handler.call_event("on_training_run_start", self)
            for epoch in self._epochs():
                self._loop_epoch = epoch
                try:
                    self._run_train_epoch(self._train_dataloader)
                    self._raise_agreed_stop()  # a callback's stop, asked for on any process in the epoch
                    if self._eval_dataloader is not None:
                        self._run_eval_epoch(self._eval_dataloader)
                    self.training_run_epoch_end()
                    self._call_event("on_training_run_epoch_end")
                    self._raise_agreed_stop()
                except StopTrainingError as error:
                    self._stop_training(error)
                    break
                self.run_history._increment_epoch()
                self._epochs_completed = epoch + 1
                self._reach_safe_point()  # between epochs: saves asked for during the epoch are taken here
                if self._reached_max_steps():
                    break  # the step limit came before the epoch limit
        finally:
            self._in_training_run = False  # from here on, saves are taken at once
            self._disable_preemption()
            self.non_finite_policy = None
        self.training_run_end()
        self.callback_handler.call_event("on_training_run_end", self)

    def _run_evaluation(self) -> None:
        """Run the single evaluation epoch of an evaluation run."""
        self.evaluation_run_start()
        self.callback_handler.call_event("on_evaluation_run_start", self)
        try:
            self._run_eval_epoch(self._eval_dataloader, is_training=False)
            self._raise_agreed_stop()
        except StopTrainingError as error:
            self._stop_training(error)
        self.evaluation_run_end()
        self.callback_handler.call_event("on_evaluation_run_end", self)

    def _run_train_epoch(self, train_dl: Iterable) -> None:
        """Run one training epoch: a step per batch, an optimizer update per accumulation window."""
        self.train_epoch_start()
        self._train_loss_tracker.reset()
        self._train_epoch_length = dataloader_length(train_dl)
        self.epoch_first_step, batches = self._epoch_batches(train_dl)  # not 0 when resuming inside an epoch
        batches = require_batches(batches, _NO_TRAIN_BATCH)
        self._call_event("on_train_epoch_start")
        first_step = self.epoch_first_step
        for step, (batch, is_last_batch) in enumerate(batches, start=first_step):
            self._call_event("on_train_step_start")
            if self._is_window_start(step):
                self._reach_safe_point(step)  # between two optimizer updates
            is_update_step = self._is_update_step(step, is_last_batch)
            self._run_train_step(batch, step, is_update_step)
            if is_update_step and not self._skip_non_finite_update(batch, step):
                self._update_parameters(step)
                if self._reached_max_steps():
                    break  # the step limit falls inside this epoch
            if is_update_step:
                self._raise_agreed_stop()  # a callback's stop, asked for on any process in this window
        self.train_epoch_end()
        self._record_epoch_loss(self._train_loss_tracker, "train_loss_epoch")
        self._call_event("on_train_epoch_end")

    def _run_train_step(self, batch, step: int, is_update_step: bool) -> None:
        """Forward and backward pass of one micro-batch; gradients sync across processes only on update steps."""
        with self._gradient_sync_context(is_update_step):  # DDP reads the flag in forward and backward
            batch_output = self.calculate_train_batch_loss(batch)
            validate_batch_output(batch_output, "calculate_train_batch_loss")
            self._train_loss_tracker.update(batch_output["loss"], self._loss_weight(batch_output))
            self._call_event("on_train_step_end", batch=batch, batch_output=batch_output, step=step)
            if not self._use_plain_torch_step:  # DeepSpeed must step only at the end of a window
                set_deepspeed_gradient_sync(self._accelerator, is_update_step)
            self.backward_step(self._scale_loss_for_accumulation(batch_output, step))

    def _update_parameters(self, step: int) -> None:
        """Clip the accumulated gradients, step the optimizer and the scheduler, and zero the gradients."""
        self._complete_partial_window(step)
        self._normalise_by_items_in_window()
        self._clip_gradients()
        self.optimizer_step()
        if not self._optimizer_step_was_skipped():  # an fp16 overflow skips the update
            self.scheduler_step()
        self.optimizer_zero_grad()
        self._num_update_steps_completed += 1

    def _run_eval_epoch(self, valid_dl: Iterable, is_training: bool = True) -> None:
        """Run one evaluation epoch and record its loss: ``eval_loss_epoch`` in training, else ``evaluation_loss``."""
        self.eval_epoch_start()
        self._eval_loss_tracker.reset()
        self._call_event("on_eval_epoch_start")
        for batch in require_batches(valid_dl, _NO_EVAL_BATCH):
            self.eval_batch_real_rows = self._real_rows_in_batch(valid_dl, batch)  # None unless samples repeat
            self._call_event("on_eval_step_start")
            batch_output = self.calculate_eval_batch_loss(batch)
            validate_batch_output(batch_output, "calculate_eval_batch_loss")
            self._eval_loss_tracker.update(batch_output["loss"], self._loss_weight(batch_output))
            self._call_event("on_eval_step_end", batch=batch, batch_output=batch_output)
        self.eval_batch_real_rows = None
        self.eval_epoch_end()
        self._record_epoch_loss(self._eval_loss_tracker, "eval_loss_epoch" if is_training else "evaluation_loss")
        self._call_event("on_eval_epoch_end")

    # ------------------------------------------------------------------------------------------------
    # Named decisions of the loop
    # ------------------------------------------------------------------------------------------------

    def _epochs(self) -> Iterable[int]:
        if self.run_config.num_epochs is None:
            return itertools.count(self._epochs_completed)  # only max_num_train_steps ends this run
        return range(self._epochs_completed, self.run_config.num_epochs)

    def _is_window_start(self, step: int) -> bool:
        """Whether micro-batch ``step`` opens an accumulation window: no gradient is pending before it."""
        return step % self.run_config.gradient_accumulation_steps == 0

    def _is_update_step(self, step: int, is_last_batch: bool) -> bool:
        """Whether the micro-batch ``step`` closes an accumulation window (or the epoch)."""
        return is_last_batch or (step + 1) % self.run_config.gradient_accumulation_steps == 0

    def _micro_batches_in_window(self, step: int) -> int:
        """The number of micro-batches in the accumulation window of ``step``, where it is known."""
        accumulation = self.run_config.gradient_accumulation_steps
        if self._train_epoch_length is None:
            return accumulation  # corrected by _complete_partial_window if the stream ends early
        window_start = step - step % accumulation
        return min(accumulation, self._train_epoch_length - window_start)

    def _scale_loss_for_accumulation(self, batch_output: dict, step: int) -> torch.Tensor:
        """The loss to back-propagate: its gradients, added over the window, are those of one large batch."""
        loss = batch_output["loss"]
        if "num_items_in_batch" in batch_output:  # summed over items here, divided by the window's total at the update
            items = batch_output["num_items_in_batch"]
            self._items_in_window = items if self._is_window_start(step) else self._items_in_window + items
            return loss * items
        micro_batches = self._micro_batches_in_window(step)  # the window's real size, also for a partial window
        return loss if micro_batches == 1 else loss / micro_batches

    def _normalise_by_items_in_window(self) -> None:
        """Divide the gradients of a window of item-weighted losses by its items, summed over every process.

        One small all-reduce per update in a multi-process run, kept on the device: no synchronisation. DDP has
        averaged the gradients over processes, hence the factor ``num_processes``.
        """
        items, self._items_in_window = self._items_in_window, 0
        if isinstance(items, int) and items == 0:
            return  # the losses of this window carry no num_items_in_batch
        validate_gradients_visible(self._accelerator, "num_items_in_batch")
        items = torch.as_tensor(items, device=self.device, dtype=torch.float32)
        if self._accelerator.num_processes > 1:
            items = self._accelerator.reduce(items, "sum") / self._accelerator.num_processes
        gradients = [p.grad for p in self.model.parameters() if p.grad is not None]
        torch._foreach_div_(gradients, items)

    def _loss_weight(self, batch_output: dict) -> Any:
        """What a batch's loss counts for in the epoch's mean: its items if given, else its samples, of which at
        most the real ones in a last evaluation batch with repeated samples."""
        if "num_items_in_batch" in batch_output:
            return batch_output["num_items_in_batch"]
        if self.eval_batch_real_rows is not None:  # a hook that returned the whole batch's size
            return min(batch_output["batch_size"], self.eval_batch_real_rows)
        return batch_output["batch_size"]

    def _real_rows_in_batch(self, dataloader: Iterable, batch) -> Optional[int]:
        """Rows of this process's batch that are real samples, or ``None`` when all are.

        To give every process the same steps, Accelerate fills the last batch of each process with samples from
        the start of the data; the real ones are the first ``remainder`` rows of all processes' batches in
        process order (what ``gather_for_metrics`` keeps). Reading it costs no collective.
        """
        if self._accelerator.num_processes == 1 or not getattr(dataloader, "end_of_dataloader", False):
            return None
        remainder = getattr(dataloader, "remainder", -1)
        if remainder <= 0:
            return None  # a whole number of global batches, or a dataloader that does not say
        rows = find_batch_size(batch)
        real_rows = min(max(remainder - self._accelerator.process_index * rows, 0), rows)
        return None if real_rows == rows else real_rows

    def _complete_partial_window(self, step: int) -> None:
        """Rescale the gradients of a partial last window of an epoch of unknown length (once per epoch)."""
        accumulation = self.run_config.gradient_accumulation_steps
        micro_batches = step % accumulation + 1
        if self._train_epoch_length is not None or micro_batches == accumulation:
            return
        gradients = [p.grad for p in self.model.parameters() if p.grad is not None]
        torch._foreach_mul_(gradients, accumulation / micro_batches)

    def _gradient_sync_context(self, is_update_step: bool):
        if is_update_step or self.run_config.gradient_accumulation_steps == 1:
            return contextlib.nullcontext()
        return self._accelerator.no_sync(self.model)

    def _skip_non_finite_update(self, batch, step: int) -> bool:
        """Under a non-finite policy, whether this window's update is skipped (weights, optimizer and scheduler
        untouched, its loss left out of the epoch's), after any retries."""
        policy = self.non_finite_policy
        if policy is None:
            return False
        retries = 0
        while not gradients_are_finite(self.model.parameters()):
            self._train_loss_tracker.load_state_dict(policy.loss_snapshot)
            self.optimizer.zero_grad(set_to_none=True)
            if retries < policy.max_retries and self.run_config.gradient_accumulation_steps == 1:
                retries += 1
                self._run_train_step(batch, step, is_update_step=True)
                continue
            policy.record_skip()
            if policy.must_stop:
                raise StopTrainingError(
                    f"Stopping training after {policy.consecutive_skips} consecutive updates with non-finite gradients"
                )
            return True
        policy.record_update()
        return False

    def _optimizer_step_was_skipped(self) -> bool:
        return self._accelerator.scaler is not None and self._accelerator.optimizer_step_was_skipped

    def _reached_max_steps(self) -> bool:
        # the user's limit, not run_config's planned total: a resume with another batch size changes the plan
        limit = self._max_num_train_steps
        return limit is not None and self._num_update_steps_completed >= limit

    def _clip_gradients(self) -> None:
        """Clip the accumulated gradients by norm and/or value, as set in ``train()``; once per update.

        Under fp16 the gradients are unscaled once, first (a second unscale in one update is an error for
        GradScaler). The total norm stays on the device, in ``last_gradient_norm``: no host-device sync.
        """
        clip_value, clip_norm = self.run_config.gradient_clip_value, self.run_config.gradient_clip_norm
        unscaled = False
        if clip_norm is not None:
            norm = self._accelerator.clip_grad_norm_(self.model.parameters(), max_norm=clip_norm)
            self.last_gradient_norm = as_plain_tensor(norm)  # FSDP2 returns a DTensor, DeepSpeed a float
            unscaled = True
        elif self.track_gradient_norm:
            self._accelerator.unscale_gradients()  # a no-op without an fp16 gradient scaler
            gradients = [p.grad for p in self.model.parameters() if p.grad is not None]
            self.last_gradient_norm = as_plain_tensor(torch.nn.utils.get_total_norm(gradients)) if gradients else None
            unscaled = True
        if clip_value is not None and unscaled:
            torch.nn.utils.clip_grad_value_(self.model.parameters(), clip_value=clip_value)
        elif clip_value is not None:
            clip_gradients_by_value(self._accelerator, self.model.parameters(), clip_value)

    def _record_epoch_loss(self, tracker: LossTracker, metric_name: str) -> None:
        average = tracker.reduce_average(lambda tensor: self._accelerator.reduce(tensor, "sum"), self.device)
        if average is not None:
            self.run_history.update_metric(metric_name, average)

    def _stop_training(self, error: StopTrainingError) -> None:
        self._stop_request = None
        self.print(error)
        self.callback_handler.call_event("on_stop_training_error", self)

    def _call_event(self, event: str, **kwargs) -> None:
        """Call a callback event of the loop. A ``StopTrainingError`` it raises is taken at the next update
        boundary or the end of the epoch, on every process at the same point, so that no process is left waiting
        in a collective for one that stopped."""
        try:
            self.callback_handler.call_event(event, self, **kwargs)
        except StopTrainingError as error:
            self._stop_request = self._stop_request or error

    def _raise_agreed_stop(self) -> None:
        """Raise the ``StopTrainingError`` a callback of any process asked for (one collective per call when
        distributed); every process must call this at the same point."""
        if self._stop_request is None and self._accelerator.num_processes == 1:
            return  # nothing to agree on
        stop_request = self._agreement.agreed_exception(self._accelerator, self._stop_request)
        if stop_request is not None:
            raise stop_request

    # ------------------------------------------------------------------------------------------------
    # Utilities
    # ------------------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device of this process, as chosen by Accelerate."""
        return self._accelerator.device

    @property
    def num_update_steps_completed(self) -> int:
        """Optimizer updates made so far in the current training run."""
        return self._num_update_steps_completed

    def get_model(self) -> torch.nn.Module:
        """Return the model without its distributed or compiled wrappers (no ``module.``/``_orig_mod.`` keys).

        Under FSDP its parameters are this process's shards: for full weights use ``save_checkpoint``,
        ``save_weights`` or ``sharded.get_full_model_state_dict`` (on every process).
        """
        return self._accelerator.unwrap_model(self.model, keep_torch_compile=False)

    def _unwrap_distributed_model(self) -> torch.nn.Module:
        # keeps the wrapper of a model the user compiled; the trainer's own (torch_compile=...) is made again by prepare
        return unwrap_distributed_model(self._accelerator, self.model, keep_torch_compile=self.torch_compile is False)

    def print(self, *args, **kwargs) -> None:
        """Print once per node, like ``print``."""
        self._accelerator.print(*args, **kwargs)

    def gather(self, tensor: torch.Tensor, padding_value: Any = None) -> torch.Tensor:
        """Concatenate ``tensor`` from every process along the first dimension.

        Args:
            tensor: the tensor of this process.
            padding_value: if given, tensors of different lengths are padded with it before gathering, and
                rows made only of it are removed afterwards; pick a value the data never holds. Without it, the
                rows Accelerate repeats in the last batch of the data are dropped, as in :meth:`gather_for_metrics`.

        Returns:
            The gathered tensor, on every process.
        """
        if padding_value is None:
            return self._accelerator.gather_for_metrics(tensor)
        tensor = self._accelerator.pad_across_processes(tensor, dim=0, pad_index=padding_value)
        return remove_padding(self._accelerator.gather(tensor), padding_value)

    def gather_for_metrics(self, data: Any) -> Any:
        """Gather ``data`` (tensors, or any picklable objects) from every process for computing metrics.

        In the last batch of the data, the rows Accelerate repeated to give every process a full batch are dropped:
        over an evaluation epoch, the gathered rows are exactly the dataset's, in the dataset's order. Every process
        must call it at the same step.
        """
        return self._accelerator.gather_for_metrics(data)
