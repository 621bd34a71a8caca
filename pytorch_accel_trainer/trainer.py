"""The Trainer: a documented skeleton of hooks and events, run on Hugging Face Accelerate."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Optional, Union

import torch
from accelerate import PartialState
from accelerate.utils import set_seed, slice_tensors
from torch.utils.data import DataLoader

from pytorch_accel_trainer.callbacks import (  # noqa: F401  (CallbackHandler, LIMIT_BATCHES_ENV_VAR, LimitBatchesCallback: importable from here, as in pytorch-accelerated)
    LIMIT_BATCHES_ENV_VAR,
    CallbackHandler,
    LimitBatchesCallback,
    LogMetricsCallback,
    MoveModulesToDeviceCallback,
    PrintProgressCallback,
    ProgressBarCallback,
    TerminateOnNaNCallback,
)
from pytorch_accel_trainer.errors import StopTrainingError
from pytorch_accel_trainer.loop import accumulation, persistence
from pytorch_accel_trainer.loop.accessors import TrainerUtilitiesMixin
from pytorch_accel_trainer.loop.batches import (
    NO_EVAL_BATCH,
    batch_loss,
    batch_size_for,
    dataset_and_dataloader,
    forward_batch,
    given_dataloader_kwargs,
    loss_weight,
    merge_dataloader_kwargs,
    real_rows_in_batch,
    with_own_generator_and_checked_collate,
)
from pytorch_accel_trainer.loop.extra_models import ExtraModelsMixin
from pytorch_accel_trainer.loop.persistence import PersistenceMixin
from pytorch_accel_trainer.loop.preparation import SetupMixin
from pytorch_accel_trainer.loop.run_state import RunState, TrainResult
from pytorch_accel_trainer.loop.support import LoopSupportMixin
from pytorch_accel_trainer.parallel.distributed import ProcessAgreement
from pytorch_accel_trainer.parallel.sharded import (
    set_deepspeed_gradient_sync,
    validate_sharded_run,
    warn_if_sharding_was_ignored,
)
from pytorch_accel_trainer.placeholders import TrainerPlaceholderValues, replace_trainer_placeholder_values  # noqa: F401  (importable from here, as in pytorch-accelerated)
from pytorch_accel_trainer.run_config import OptionalNumber, TrainerRunConfig, TrainOptions
from pytorch_accel_trainer.schedulers.timm import TimmSchedulerMixin
from pytorch_accel_trainer.tracking import (
    InMemoryRunHistory,
    LossTracker,
    RunHistory,
    StepMetricsTracker,
    metric_counts,
    metrics_recorded_since,
)
from pytorch_accel_trainer.utils import (  # noqa: F401  (remove_padding, worker_init_fn: importable from here, as in pytorch-accelerated)
    batch_size_of,
    dataloader_length,
    remove_padding,
    require_batches,
    with_last_flag,
    worker_init_fn,
)
from pytorch_accel_trainer.validation import (
    mixed_precision_name,
    validate_batch_output,
    validate_constructor_options,
    validate_datasets,
    validate_evaluate_arguments,
    validate_first_eval_batch,
    validate_given_dataloaders,
    validate_loss_requires_grad,
    validate_optimizer_parameters,
    warn_if_schedule_is_in_epochs,
)

DEFAULT_CALLBACKS = (
    MoveModulesToDeviceCallback,
    TerminateOnNaNCallback,
    PrintProgressCallback,
    ProgressBarCallback,
    LogMetricsCallback,
)


class Trainer(SetupMixin, LoopSupportMixin, ExtraModelsMixin, PersistenceMixin, TrainerUtilitiesMixin):
    """Trains and evaluates a model through a fixed skeleton of overridable hooks and callback events.

    The skeleton is the pseudocode of ``docs/inside_the_trainer.md``; each hook runs, then its ``on_*``
    event. Accelerate places the model, optimizer and data on the right devices and processes, so the
    same script runs with ``python train.py`` or ``accelerate launch train.py``. The other factory hooks are
    in ``setup.py``, saving and loading in ``persistence.py``, events, stops and clipping around the hooks in
    ``loop_support.py``, and the utilities that hooks and callbacks use
    (``gather``, ``get_model``, ``run_extra_eval_epoch``, ...) in ``accessors.py``.

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
            Other trainers' names are taken too (``"full"``/``"fp32"`` are ``"no"``, ``"bf16-mixed"`` is ``"bf16"``,
            ``"16-mixed"`` is ``"fp16"``). Losses are logged in float32.
        torch_compile: compile the model with ``torch.compile`` for training and evaluation: ``True``, or a dict
            of ``torch.compile`` arguments (e.g. ``{"mode": "max-autotune"}``). Off by default. ``get_model()``
            and checkpoints hold the uncompiled model (no ``_orig_mod.`` keys).
        cpu: run on the CPU even where a GPU is available, from code (as ``accelerate launch --cpu``).
        accelerator_kwargs: more arguments for :class:`accelerate.Accelerator` (``kwargs_handlers``,
            ``project_dir``, ``fsdp_plugin``, ...); those the trainer sets from its own arguments are refused.

    Example::

        trainer = Trainer(model, loss_func=nn.MSELoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        trainer.train(train_dataset, num_epochs=3, eval_dataset=eval_dataset, per_device_batch_size=32)
        trainer.run_history.get_latest_metric("eval_loss_epoch")
    """

    #: Always step through Accelerate's optimizer wrapper and ``Accelerator.backward``, even where they
    #: would only call torch; set it on a subclass for an optimizer that relies on the wrapper.
    always_use_accelerate_wrappers: bool = False
    #: The events of this subclass's own (``on_my_event``), beyond the trainer's: a callback may define them and
    #: ``self.callback_handler.call_event("on_my_event", self)`` calls them (see docs/callbacks.md).
    callback_events: tuple = ()

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
        cpu: bool = False,
        accelerator_kwargs: Optional[dict] = None,
    ):
        validate_constructor_options(mixed_precision, torch_compile, seed, loss_func, accelerator_kwargs)
        self.model = model
        self.mixed_precision = mixed_precision_name(mixed_precision)
        self.cpu = cpu
        self.accelerator_kwargs = dict(accelerator_kwargs or {})
        self.torch_compile = torch_compile
        self.loss_func = loss_func
        self.optimizer = optimizer
        #: Models and optimizers trained beside ``model`` and ``optimizer``, by name (see :meth:`add_model`).
        self.extra_models: dict = {}
        self.extra_optimizers: dict = {}
        self.seed = seed
        self._callbacks = callbacks
        self.callback_handler = self._create_callback_handler()
        self.run_history: RunHistory = run_history if run_history is not None else InMemoryRunHistory()
        self._accelerator = self._create_accelerator()
        warn_if_sharding_was_ignored(self._accelerator)
        #: The state of the current (or last) training run: counters, epoch position, accumulation window, the
        #: saves, stop and preemption asked for, the resume plan (see :class:`~pytorch_accel_trainer.loop.run_state.RunState`).
        self.run_state = RunState()
        #: Agrees a decision taken on one process with every process (one small host-side collective).
        self.process_agreement = ProcessAgreement()
        self._eval_loss_tracker = LossTracker()
        self._eval_step_metrics = StepMetricsTracker()
        #: Whether ``backward_step`` and the optimizer call torch directly, where Accelerate's wrappers would only
        #: call torch (set by each preparation; see ``always_use_accelerate_wrappers``).
        self.calls_torch_directly = False
        #: In an evaluation epoch, the rows of this process's batch that are real samples when the rest only repeat
        #: samples so that every process runs the same steps (the last batch of a multi-process run); else None.
        self.eval_batch_real_rows: Optional[int] = None
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
        #: The prepared dataloaders of the current run; a callback may replace one (e.g. by a slice) at
        #: ``on_training_run_start`` and put it back at ``on_training_run_end``.
        self.train_dataloader: Optional[Iterable] = None
        self.eval_dataloader: Optional[Iterable] = None
        self._train_dl_kwargs: Optional[dict] = None
        self._given_train_dataloader: Optional[DataLoader] = None  # a DataLoader train() received, used as it is
        self._given_eval_dataloader: Optional[DataLoader] = None
        self._eval_dl_kwargs: Optional[dict] = None
        self.run_config: Optional[TrainerRunConfig] = None

        self.callback_handler.call_event("on_init_end", self)

    # ------------------------------------------------------------------------------------------------
    # Hooks (the other factories, create_scheduler and get_default_*_dl_kwargs, are in setup.py)
    # ------------------------------------------------------------------------------------------------

    def create_train_dataloader(self, batch_size: int, train_dl_kwargs: Optional[dict] = None) -> Iterable:
        """Return the training dataloader over ``self.train_dataset`` (before Accelerate prepares it).

        Runs once at the start of ``train()``. The default builds a :class:`~torch.utils.data.DataLoader`
        from :meth:`get_default_train_dl_kwargs`, updated with ``train_dl_kwargs`` (which wins, ``batch_size``
        included), and ``self.collate_fn`` (wrapped so that a ``None`` batch is a clear ``TypeError``). The
        DataLoader draws its shuffle order and worker seeds from a generator of its own, not the global RNG.

        Args:
            batch_size: the batch size per device.
            train_dl_kwargs: extra DataLoader arguments.

        Returns:
            Any iterable of batches; a DataLoader is sharded across processes by Accelerate.
        """
        if self._given_train_dataloader is not None:  # train() received a DataLoader: Accelerate prepares it as it is
            self._train_dl_kwargs = given_dataloader_kwargs(self._given_train_dataloader)
            return self._given_train_dataloader
        self._train_dl_kwargs = merge_dataloader_kwargs(
            self.get_default_train_dl_kwargs(batch_size), train_dl_kwargs, self.train_dataset
        )
        dataloader = DataLoader(dataset=self.train_dataset, collate_fn=self.collate_fn, **self._train_dl_kwargs)
        return with_own_generator_and_checked_collate(dataloader, self.collate_fn)

    def create_eval_dataloader(self, batch_size: int, eval_dl_kwargs: Optional[dict] = None) -> Iterable:
        """Return the evaluation dataloader over ``self.eval_dataset``; as :meth:`create_train_dataloader`."""
        if self._given_eval_dataloader is not None:
            self._eval_dl_kwargs = given_dataloader_kwargs(self._given_eval_dataloader)
            return self._given_eval_dataloader
        self._eval_dl_kwargs = merge_dataloader_kwargs(
            self.get_default_eval_dl_kwargs(batch_size), eval_dl_kwargs, self.eval_dataset
        )
        dataloader = DataLoader(dataset=self.eval_dataset, collate_fn=self.collate_fn, **self._eval_dl_kwargs)
        return with_own_generator_and_checked_collate(dataloader, self.collate_fn)

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
        model_outputs = forward_batch(self.model, batch)
        loss = batch_loss(self.loss_func, model_outputs, batch)
        return {"loss": loss, "model_outputs": model_outputs, "batch_size": batch_size_of(batch)}

    def backward_step(self, loss: torch.Tensor) -> None:
        """Run the backward pass through Accelerate (which handles mixed-precision loss scaling).

        Where ``Accelerator.backward`` would only divide the loss by 1 and call ``loss.backward()`` (no gradient
        scaler, DeepSpeed or Megatron), the trainer calls ``loss.backward()`` itself: same gradients, less time.

        Args:
            loss: the loss of ``calculate_train_batch_loss``, already divided by the number of
                micro-batches in the current accumulation window.
        """
        if not loss.requires_grad:  # an attribute read, no sync: a detached loss would train nothing
            validate_loss_requires_grad(loss, self.model)
        if self.calls_torch_directly:
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
            model_outputs = forward_batch(self.model, batch)
            loss, batch_size = batch_loss(self.loss_func, model_outputs, batch), batch_size_of(batch)
            real_rows = self.eval_batch_real_rows
            if real_rows is not None:  # a second forward pass over the real rows, once per evaluation
                real_batch = slice_tensors(batch, slice(0, real_rows))
                loss = (
                    batch_loss(self.loss_func, forward_batch(self.model, real_batch), real_batch)
                    if real_rows
                    else torch.zeros_like(loss)
                )
                batch_size = real_rows
        return {"loss": loss, "model_outputs": model_outputs, "batch_size": batch_size}

    def eval_epoch_end(self) -> None:
        """Runs at the end of each evaluation epoch, before its loss is recorded. Default: nothing."""

    def training_run_epoch_end(self) -> None:
        """Runs after the training and evaluation epochs of each training-run epoch. Default: nothing."""

    def training_run_end(self) -> None:
        """Runs at the end of a training run. Default: unwraps ``self.model`` and the extra models (``add_model``)."""
        self.model = self._unwrap_distributed_model()
        self._unwrap_extra_models()

    def evaluation_run_start(self) -> None:
        """Runs at the start of an evaluation run, before ``on_evaluation_run_start``. Default: nothing."""

    def evaluation_run_end(self) -> None:
        """Runs at the end of an evaluation run. Default: unwraps ``self.model`` and the extra models."""
        self.model = self._unwrap_distributed_model()
        self._unwrap_extra_models()

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
        gradient_clip_value: OptionalNumber = None,
        create_scheduler_fn: Optional[Callable] = None,
        train_dataloader_kwargs: Optional[dict] = None,
        eval_dataloader_kwargs: Optional[dict] = None,
        reset_run_history: bool = True,
        collate_fn: Optional[Callable] = None,
        gradient_clip_norm: OptionalNumber = None,
        resume_from=None,
        allow_resume_changes: bool = False,
        scheduler_interval: str = "step",
    ) -> TrainResult:
        """Run a training run: training epochs, each followed by an evaluation epoch if ``eval_dataset`` is given.

        Args:
            train_dataset: the training data; a dataset without ``__len__`` (iterable, streaming) works too. A
                ``DataLoader`` is used as it is (its batch size, sampler, workers and collate function), prepared by
                Accelerate like the trainer's own: sharded across processes, shuffled from the trainer's seed, resumable.
            num_epochs: the number of epochs; ``None`` to stop on ``max_num_train_steps`` only.
            eval_dataset: evaluated after each training epoch when given; a dataset or a ``DataLoader``.
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
            scheduler_interval: ``"step"`` steps the scheduler after each optimizer update (its ``T_max``, ``step_size``
                or ``total_steps`` then count updates); ``"epoch"`` steps it once per epoch, after the evaluation epoch,
                for schedules written in epochs (``CosineAnnealingLR(T_max=num_epochs)``, ``StepLR(step_size=10)``).

        Returns:
            A :class:`~pytorch_accel_trainer.loop.run_state.TrainResult`: the metrics the run recorded (latest values),
            the best value of a monitoring callback, epochs, updates, samples, wall time and samples per second.

        Example::

            trainer.train(dataset, num_epochs=10, resume_from="checkpoints")  # the same line starts or resumes
        """
        validate_datasets(train_dataset, eval_dataset)
        validate_given_dataloaders(
            (train_dataset, eval_dataset),
            ("train_dataset", "eval_dataset", "train_dataloader_kwargs", "eval_dataloader_kwargs"),
            per_device_batch_size,
            (train_dataloader_kwargs, eval_dataloader_kwargs),
            collate_fn,
        )
        train_dataset, self._given_train_dataloader = dataset_and_dataloader(train_dataset)
        eval_dataset, self._given_eval_dataloader = dataset_and_dataloader(eval_dataset)
        per_device_batch_size = batch_size_for(self._given_train_dataloader, per_device_batch_size)
        options = TrainOptions(
            num_epochs=num_epochs,
            per_device_batch_size=per_device_batch_size,
            max_num_train_steps=max_num_train_steps,
            gradient_accumulation_steps=gradient_accumulation_steps,
            gradient_clip_value=gradient_clip_value,
            gradient_clip_norm=gradient_clip_norm,
            create_scheduler_fn=create_scheduler_fn,
            collate_fn=collate_fn,
            train_dataloader_kwargs=train_dataloader_kwargs,
            eval_dataloader_kwargs=eval_dataloader_kwargs,
            reset_run_history=reset_run_history,
            resume_from=resume_from,
            allow_resume_changes=allow_resume_changes,
            scheduler_interval=scheduler_interval,
        )
        if self.optimizer is None:
            raise ValueError("The trainer has no optimizer (optimizer=None): pass one to Trainer(...) to train.")
        if isinstance(self.model, torch.nn.Module):  # a stand-in model is refused where Accelerate prepares it
            validate_optimizer_parameters(
                self.optimizer, self.model
            )  # none of the model's trainable parameters missing
        stored_state = persistence.find_state_to_resume(Path(resume_from)) if resume_from is not None else None
        self.run_state = RunState(options=options)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.create_scheduler_fn, self.collate_fn = create_scheduler_fn, collate_fn
        if reset_run_history:
            self.run_history.reset()
        if self.seed is not None:
            set_seed(
                self.seed + PartialState().process_index
            )  # Accelerate's device_specific=True, from the process state

        self.train_dataloader = self.create_train_dataloader(per_device_batch_size, train_dataloader_kwargs)
        self.eval_dataloader, self._eval_dl_kwargs = None, None
        if eval_dataset is not None:
            self.eval_dataloader = self.create_eval_dataloader(per_device_batch_size, eval_dataloader_kwargs)
        self._prepare_model_optimizer_and_dataloaders()
        self.run_config = self._create_run_config(options)
        validate_sharded_run(self._accelerator, self.run_config)
        self._check_eval_batch_size()  # says whether the last evaluation batch repeats samples
        validate_first_eval_batch(self)  # one eval batch through the model now, not after a training epoch
        self.scheduler = self.create_scheduler()  # None without a create_scheduler_fn, unless overridden
        warn_if_schedule_is_in_epochs(self.scheduler, self.run_config, scheduler_interval)
        self._load_resume_plan(stored_state)
        self._run_training()
        return self._create_train_result()

    def evaluate(
        self,
        dataset=None,
        per_device_batch_size: int = 8,
        dataloader_kwargs: Optional[dict] = None,
        collate_fn: Optional[Callable] = None,
    ) -> dict:
        """Run one evaluation epoch over ``dataset`` and record ``evaluation_loss`` in the run history.

        Unlike pytorch-accelerated, the run history is kept: the metrics of an earlier ``train()`` stay.

        Args:
            dataset: the data to evaluate, or a DataLoader over it (used as it is); defaults to the ``eval_dataset`` (and
                collate function) of the last ``train()``.
            per_device_batch_size: the batch size on each process.
            dataloader_kwargs: extra arguments for the DataLoader.
            collate_fn: the collate function of the DataLoader.

        Returns:
            The metrics this evaluation recorded, by name (``evaluation_loss``, ``evaluation_<name>`` for each step
            metric, and what callbacks recorded), each a number.
        """
        if dataset is None and self._given_eval_dataloader is not None:  # the DataLoader of the last train()
            dataset = self._given_eval_dataloader
        elif dataset is None:  # the last eval dataset, with its collate function unless another is given
            dataset, collate_fn = self.eval_dataset, collate_fn or self.collate_fn
        validate_evaluate_arguments(dataset, per_device_batch_size, dataloader_kwargs)
        validate_given_dataloaders(
            (dataset, None),
            ("dataset", None, "dataloader_kwargs", None),
            per_device_batch_size,
            (dataloader_kwargs, None),
            collate_fn,
        )
        (self.eval_dataset, self._given_eval_dataloader), self.collate_fn = dataset_and_dataloader(dataset), collate_fn
        per_device_batch_size = batch_size_for(self._given_eval_dataloader, per_device_batch_size)
        self.train_dataloader, self._train_dl_kwargs = None, None
        self.eval_dataloader = self.create_eval_dataloader(per_device_batch_size, dataloader_kwargs)
        self._prepare_model_optimizer_and_dataloaders()
        self.run_config = self._create_run_config(
            TrainOptions(num_epochs=1, per_device_batch_size=per_device_batch_size)
        )
        self._check_eval_batch_size()
        counts = metric_counts(self.run_history)
        self._run_evaluation()
        return metrics_recorded_since(self.run_history, counts)

    # ------------------------------------------------------------------------------------------------
    # Orchestrators: the documented skeleton
    # ------------------------------------------------------------------------------------------------

    def _run_training(self) -> None:
        """Run the epochs of a training run, as in the documented pseudocode."""
        state = self.run_state
        state.in_training_run = True  # from here on, saves wait for a point between two updates
        state.start_epochs(metric_counts(self.run_history))  # for the TrainResult
        self.optimizer.zero_grad(set_to_none=True)  # gradients of a run stopped mid-window must not leak in
        try:
            self.training_run_start()
            self.callback_handler.call_event("on_training_run_start", self)
            for epoch in self._epochs():
                state.epoch = epoch
                try:
                    self._run_train_epoch(self.train_dataloader)
                    self._raise_agreed_stop()  # a callback's stop, asked for on any process in the epoch
                    if self.eval_dataloader is not None:
                        self._run_eval_epoch(self.eval_dataloader)
                    if self._steps_scheduler_per_epoch():
                        self.scheduler_step()  # scheduler_interval="epoch": once, after the epoch's evaluation
                    self.training_run_epoch_end()
                    self._call_event("on_training_run_epoch_end")
                    self._raise_agreed_stop()
                except StopTrainingError as error:
                    self._stop_training(error)
                    break
                self.run_history._increment_epoch()
                state.epoch = epoch + 1
                persistence.reach_safe_point(self)  # between epochs: saves asked for during the epoch are taken here
                if state.reached_max_steps():
                    break  # the step limit came before the epoch limit
            if state.save_requests:  # asked for after the last update of a run stopped mid-epoch
                persistence.take_requested_saves(self)
        finally:
            state.in_training_run = False  # from here on, saves are taken at once
            persistence.end_saves_and_preemption(self)  # a save in the background is complete (or its error raised)
            state.non_finite_policy = None
        self.training_run_end()
        self.callback_handler.call_event("on_training_run_end", self)

    def _run_evaluation(self) -> None:
        """Run the single evaluation epoch of an evaluation run."""
        self.evaluation_run_start()
        self.callback_handler.call_event("on_evaluation_run_start", self)
        try:
            self._run_eval_epoch(self.eval_dataloader, is_training=False)
            self._raise_agreed_stop()
        except StopTrainingError as error:
            self._stop_training(error)
        self.evaluation_run_end()
        self.callback_handler.call_event("on_evaluation_run_end", self)

    def _run_train_epoch(self, train_dl: Iterable) -> None:
        """Run one training epoch: a step per batch, an optimizer update per accumulation window."""
        state = self.run_state
        self.train_epoch_start()
        state.train_loss_tracker.reset()
        state.train_step_metrics.reset()
        state.train_epoch_length = dataloader_length(train_dl)
        state.epoch_first_step, batches = self._epoch_batches(train_dl)  # not 0 when resuming inside an epoch
        self._call_event("on_train_epoch_start")
        for step, (batch, is_last_batch) in enumerate(batches, start=state.epoch_first_step):
            self._call_event("on_train_step_start")
            if self._is_window_start(step):
                persistence.reach_safe_point(self, step)  # between two optimizer updates
            is_update_step = state.step_closes_window = self._is_update_step(step, is_last_batch)
            self._perform_forward_and_backward_passes(batch, step)
            if is_update_step and not self._retry_or_skip_non_finite_update(batch, step):
                self._update_parameters(step)
                if state.reached_max_steps():
                    break  # the step limit falls inside this epoch
            if is_update_step:
                self._raise_agreed_stop()  # a callback's stop, asked for on any process in this window
        self.train_epoch_end()
        self._record_epoch_loss(state.train_loss_tracker, "train_loss_epoch")
        self._record_step_metrics(state.train_step_metrics, "train_{}_epoch")
        self._call_event("on_train_epoch_end")

    def _perform_forward_and_backward_passes(self, batch, step: int, is_retry: bool = False) -> None:
        """Forward and backward pass of one micro-batch (pytorch-accelerated's name and arguments); gradients sync
        across processes only on the step that closes an accumulation window (``run_state.step_closes_window``)."""
        accumulation_steps, is_update_step = (
            self.run_config.gradient_accumulation_steps,
            self.run_state.step_closes_window,
        )
        with accumulation.gradient_sync_context(self._accelerator, self.model, is_update_step, accumulation_steps):
            batch_output = self.calculate_train_batch_loss(batch)  # DDP reads the no_sync flag in forward and backward
            validate_batch_output(batch_output, "calculate_train_batch_loss")
            weight = loss_weight(batch_output, None)
            self.run_state.train_loss_tracker.update(batch_output["loss"], weight)
            self.run_state.train_step_metrics.update(batch_output, weight)  # accuracy etc.: averaged like the loss
            if not is_retry:  # a step re-run for non-finite gradients has had its event, and its samples counted
                self.run_state.samples_seen += batch_output["batch_size"]
                if self.run_state.non_finite_policy is not None:  # kept for a retry of the window
                    self.run_state.non_finite_policy.remember_micro_batch(batch, step, self._is_window_start(step))
                self._call_event("on_train_step_end", batch=batch, batch_output=batch_output, step=step)
            if not self.calls_torch_directly:  # DeepSpeed must step only at the end of a window
                set_deepspeed_gradient_sync(self._accelerator, is_update_step)
            loss = accumulation.scale_loss_for_accumulation(batch_output, step, accumulation_steps, self.run_state)
            self.backward_step(loss)

    def _update_parameters(self, step: int) -> None:
        """Clip the accumulated gradients, step the optimizer and the scheduler, and zero the gradients."""
        state, accumulation_steps = self.run_state, self.run_config.gradient_accumulation_steps
        accumulation.complete_partial_window(step, accumulation_steps, state, self.model)
        accumulation.normalise_by_items_in_window(state, self._accelerator, self.model)
        self._clip_gradients()
        self.optimizer_step()
        if (
            not self._optimizer_step_was_skipped() and not self._steps_scheduler_per_epoch()
        ):  # an fp16 overflow skips the update
            self.scheduler_step()
        self.optimizer_zero_grad()
        state.num_update_steps_completed += 1
        self._call_event(
            "on_optimizer_step_end", step=step, num_update_steps_completed=state.num_update_steps_completed
        )

    def _run_eval_epoch(self, valid_dl: Iterable, is_training: bool = True) -> None:
        """Run one evaluation epoch and record its loss: ``eval_loss_epoch`` in training, else ``evaluation_loss``."""
        self.eval_epoch_start()
        self._eval_loss_tracker.reset()
        self._eval_step_metrics.reset()
        self._call_event("on_eval_epoch_start")
        for step, batch in enumerate(require_batches(valid_dl, NO_EVAL_BATCH)):
            self.eval_batch_real_rows = real_rows_in_batch(
                valid_dl, batch, self._accelerator
            )  # None unless samples repeat
            self._call_event("on_eval_step_start")
            batch_output = self.calculate_eval_batch_loss(batch)
            validate_batch_output(batch_output, "calculate_eval_batch_loss")
            weight = loss_weight(batch_output, self.eval_batch_real_rows)
            self._eval_loss_tracker.update(batch_output["loss"], weight)
            self._eval_step_metrics.update(batch_output, weight)
            self._call_event("on_eval_step_end", batch=batch, batch_output=batch_output, step=step)
        self.eval_batch_real_rows = None
        self.eval_epoch_end()
        self._record_epoch_loss(self._eval_loss_tracker, "eval_loss_epoch" if is_training else "evaluation_loss")
        self._record_step_metrics(self._eval_step_metrics, "eval_{}_epoch" if is_training else "evaluation_{}")
        self._call_event("on_eval_epoch_end")

    # ------------------------------------------------------------------------------------------------
    # Named decisions and helpers of the loop
    # ------------------------------------------------------------------------------------------------

    def _steps_scheduler_per_epoch(self) -> bool:
        return self.run_state.options.scheduler_interval == "epoch"

    def _is_window_start(self, step: int) -> bool:
        """Whether micro-batch ``step`` opens an accumulation window: no gradient is pending before it."""
        return step % self.run_config.gradient_accumulation_steps == 0

    def _is_update_step(self, step: int, is_last_batch: bool) -> bool:
        """Whether the micro-batch ``step`` closes an accumulation window (or the epoch)."""
        return is_last_batch or (step + 1) % self.run_config.gradient_accumulation_steps == 0


class TrainerWithTimmScheduler(TimmSchedulerMixin, Trainer):
    """A :class:`Trainer` that steps a `timm scheduler <https://timm.fast.ai/schedulers>`_ as timm expects:
    ``step_update(num_updates=n)`` after each update (``n``: the run's updates), ``step(epoch)`` after each epoch."""
