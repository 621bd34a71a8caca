"""The Trainer: a skeleton of overridable hooks and callback events, run on Hugging Face Accelerate.

In the order a run calls them: construction; ``train()`` (setup hooks, preparation, epochs, the training step and
the update); the evaluation epoch; ``evaluate()``; ``predict()``; ``lr_find()``; how events fire and stops are
agreed; the loop's named decisions; what hooks and callbacks use. The step's other parts are in ``loop/``.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union, cast

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DataLoaderConfiguration, set_seed, slice_tensors
from torch.utils.data import DataLoader

from pytorch_accel_trainer.callbacks import (  # noqa: F401  (importable from here, as in pytorch-accelerated)
    LIMIT_BATCHES_ENV_VAR,
    CallbackHandler,
    LimitBatchesCallback,
    LogMetricsCallback,
    MoveModulesToDeviceCallback,
    PrintProgressCallback,
    ProgressBarCallback,
    TerminateOnNaNCallback,
    get_default_callbacks,
    with_limit_batches_from_env,
)
from pytorch_accel_trainer.callbacks.base import EVENTS, overrides, validate_callback_list
from pytorch_accel_trainer.data import (
    dataloader_length,
    dataset_length,
    validate_datasets,
    validate_eval_batches_exist,
    validate_given_dataloaders,
    warn_if_endless,
)
from pytorch_accel_trainer.errors import StopTrainingError
from pytorch_accel_trainer.loop import accumulation, destinations, safe_points
from pytorch_accel_trainer.loop.batches import (
    NO_EVAL_BATCH,
    NO_TRAIN_BATCH,
    BatchIndexArguments,
    batch_loss,
    batch_size_for,
    batch_size_of,
    batches_need_placing,
    build_dataloader,
    call_batch_hook,
    dataset_and_dataloader,
    end_dataloader_workers,
    forward_batch,
    numbered_batches,
    real_rows_in_batch,
    require_batches,
    validate_loss_requires_grad,
)
from pytorch_accel_trainer.loop.components import (
    validate_constructor_options,
    validate_model_and_loss,
    validate_optimizer_parameters,
)
from pytorch_accel_trainer.loop.extra_models import (
    ExtraModelsMixin,
    store_prepared_extras,
    unwrap_extras,
    unwrapped_extras,
    validate_model_on_device,
)
from pytorch_accel_trainer.loop.first_eval_batch import check_first_eval_batch
from pytorch_accel_trainer.loop.lr_find import (
    LrFinderResult,
    LrSweep,
    TrainerSnapshot,
    endless_batches,
    validate_lr_find_arguments,
)
from pytorch_accel_trainer.loop.non_finite import NonFinitePolicy
from pytorch_accel_trainer.loop.persistence import PersistenceMixin
from pytorch_accel_trainer.loop.recording import create_train_result, record_epoch_values
from pytorch_accel_trainer.loop.run_state import RunState, TrainResult, validate_not_in_training_run
from pytorch_accel_trainer.loop.stream_position import (
    StreamPositions,
    batches_every_process_has,
    keeps_position,
    prepare_own_part,
    reads_own_part,
    stateful_dataloaders,
    validate_stream_split,
    validate_stream_state,
)
from pytorch_accel_trainer.loop.time_budget import create_time_budget, training_state_bytes
from pytorch_accel_trainer.loop.trainer_parts import run_facts
from pytorch_accel_trainer.loop.training_modes import training_modes_kept
from pytorch_accel_trainer.parallel.distributed import (
    ProcessAgreement,
    create_accelerator,
    mixed_precision_name,
    print_on_node,
    release_prepared,
    wrappers_only_call_torch,
)
from pytorch_accel_trainer.parallel.layout import gather_for_metrics_by_rank, keep_model_group_leaders, layout_of
from pytorch_accel_trainer.parallel.sharded import (
    apply_transformers_tensor_parallel_plan,
    holds_dtensor_parameters,
    parameter_names_by_id,
    prepare_components,
    record_tensor_parallel_size,
    set_deepspeed_gradient_sync,
    swap_optimizer_parameters,
    unwrap_distributed_model,
    validate_sharded_run,
    warn_if_sharding_was_ignored,
)
from pytorch_accel_trainer.parallel.shared_folders import check_folders_are_shared
from pytorch_accel_trainer.placeholders import (  # noqa: F401  (public here)
    TrainerPlaceholderValues,
    placeholder_values,
    replace_trainer_placeholder_values,
    resolve_placeholders,
)
from pytorch_accel_trainer.predictions import (
    PredictionCollector,
    PredictionWriter,
    predict_batches,
    prediction_structure,
    to_cpu,
    validate_predict_arguments,
    validate_prediction_folder,
    validate_prediction_output,
    validate_same_structure,
)
from pytorch_accel_trainer.run_config import (
    OptionalNumber,
    TrainerRunConfig,
    TrainOptions,
    build_run_config,
    get_run_config,
    validate_evaluate_arguments,
)
from pytorch_accel_trainer.schedulers.scheduler_base import warn_if_schedule_is_in_epochs
from pytorch_accel_trainer.schedulers.timm import TimmSchedulerMixin
from pytorch_accel_trainer.state.async_save import saver as background_saver
from pytorch_accel_trainer.state.files import StoredState
from pytorch_accel_trainer.state.manager import TrainingStates
from pytorch_accel_trainer.state.parts import Processes
from pytorch_accel_trainer.tracking import (
    InMemoryRunHistory,
    LossTracker,
    RunHistory,
    StepMetricsTracker,
    metric_counts,
    metrics_recorded_since,
)
from pytorch_accel_trainer.utils import remove_padding, worker_init_fn  # noqa: F401  (public here)

#: The callbacks a ``Trainer`` gets by default, in calling order (``callbacks.get_default_callbacks()``).
DEFAULT_CALLBACKS = get_default_callbacks()

#: The events followed by a point where every process can stop together: a ``StopTrainingError`` a callback raises
#: in one of them is held until that point (see ``Trainer._call_event``); in any other event it is raised at once.
AGREED_STOP_EVENTS = frozenset(EVENTS) - {
    "on_init_end",
    "on_training_run_start",
    "on_training_run_end",
    "on_evaluation_run_start",
    "on_evaluation_run_end",
    "on_stop_training_error",
    "on_predict_run_start",
    "on_predict_step_end",
    "on_predict_run_end",
}


#: The context of a micro-batch whose gradients sync (or need no sync): one instance, reused by every step.
_SYNCING = contextlib.nullcontext()


def _takes_is_update_step(function: Callable) -> bool:
    """Whether ``function``, a ``_perform_forward_and_backward_passes``, takes ``is_update_step`` (read once, as the
    trainer is constructed; pytorch-accelerated's override takes ``(batch, step)``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: called with (batch, step) only
        return False
    return any(
        parameter.name == "is_update_step" or parameter.kind is parameter.VAR_KEYWORD for parameter in parameters
    )


class Trainer(ExtraModelsMixin, PersistenceMixin):
    """Trains and evaluates a model through a fixed skeleton of overridable hooks and callback events.

    Each hook runs, then its ``on_*`` event, in the order of ``docs/inside_the_trainer.md``. Accelerate places the
    model, optimizer and data, so the same script runs with ``python train.py`` or ``accelerate launch train.py``.

    Args:
        model: the ``torch.nn.Module`` to train.
        loss_func: called as ``loss_func(model_outputs, targets)`` by the default batch-loss hooks.
        optimizer: an optimizer over the model's parameters (``None`` for an evaluation-only trainer).
        callbacks: callback classes or instances, called in order for each event.
        run_history: where metrics are recorded; a new :class:`InMemoryRunHistory` by default.
        seed: seeds torch, numpy and ``random`` (plus the process index) as each ``train()`` starts; ``None``: never.
        mixed_precision: ``"no"``, ``"bf16"``, ``"fp16"`` (GPU only), ``"fp8"`` or an alias (``"fp32"``,
            ``"bf16-mixed"``, ``"16-mixed"``, ...); ``None`` takes it from the Accelerate config.
        torch_compile: ``True``, or a dict of ``torch.compile`` arguments: compile the model (checkpoints: uncompiled).
        cpu: run on the CPU even where a GPU is available (as ``accelerate launch --cpu``).
        accelerator_kwargs: more arguments for :class:`accelerate.Accelerator` (``kwargs_handlers``,
            ``project_dir``, ``fsdp_plugin``, ...); those the trainer sets from its own arguments are refused.

    Raises:
        ValueError: an unknown ``mixed_precision`` or ``accelerator_kwargs`` name; ``"fp16"`` on the CPU.
        TypeError: ``callbacks``, ``torch_compile``, ``loss_func`` or ``accelerator_kwargs`` of the wrong type.

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
        # None for an evaluation-only trainer, which train() and lr_find() refuse (see _training_optimizer)
        self.optimizer: torch.optim.Optimizer = optimizer  # type: ignore[assignment]
        #: Models and optimizers trained beside ``model`` and ``optimizer``, by name (see :meth:`add_model`).
        self.extra_models: dict = {}
        self.extra_optimizers: dict = {}
        self.seed = seed
        self._callbacks = callbacks
        self.callback_handler = self._create_callback_handler()
        self.run_history: RunHistory = run_history if run_history is not None else InMemoryRunHistory()
        self._accelerator = self._create_accelerator()
        warn_if_sharding_was_ignored(self._accelerator)
        #: The state of the current (or last) training run (:class:`~pytorch_accel_trainer.loop.run_state.RunState`).
        self.run_state = RunState()
        #: Agrees a decision taken on one process with every process (one small host-side collective).
        self.process_agreement = ProcessAgreement()
        #: Whether ``backward_step`` and the optimizer call torch directly (set by each preparation).
        self.calls_torch_directly = False
        #: Keep each update's gradient norm in ``last_gradient_norm`` (a device tensor, no sync), even without clipping.
        self.track_gradient_norm = False
        self.last_gradient_norm: Optional[torch.Tensor] = None
        # set by train() / evaluate()
        self.create_scheduler_fn: Optional[Callable] = None
        self.scheduler: Any = None
        self.collate_fn: Optional[Callable] = None
        self.train_dataset: Any = None
        self.eval_dataset: Any = None
        #: The prepared dataloaders of the run; a callback may replace one (a slice) for the run and put it back.
        self.train_dataloader: Optional[Iterable] = None
        self.eval_dataloader: Optional[Iterable] = None
        #: The prepared dataloader of the running ``predict()`` (``None`` outside one), e.g. for a progress bar.
        self.predict_dataloader: Optional[Iterable] = None
        self._train_dl_kwargs: Optional[dict] = None
        self._given_train_dataloader: Optional[DataLoader] = None  # a DataLoader train() received, used as it is
        self._given_eval_dataloader: Optional[DataLoader] = None
        self._eval_dl_kwargs: Optional[dict] = None
        self.run_config: Optional[TrainerRunConfig] = None
        # What the step's overridable methods accept, read here once, so that the step calls them as they are: whether
        # the forward and backward passes take the window flag, and how each batch hook takes the batch index.
        self._passes_take_window_flag = _takes_is_update_step(self._perform_forward_and_backward_passes)
        self._batch_index_arguments = BatchIndexArguments.of(self)

        self._call_event("on_init_end")

    # --- Construction: the callback handler and the Accelerator ---------------------------------------

    def _create_callback_handler(self) -> CallbackHandler:
        """Return the :class:`CallbackHandler` that calls the trainer's callbacks (with a
        ``LimitBatchesCallback`` added while the environment variable ``PT_ACC_LIMIT_BATCHES`` is set)."""
        validate_callback_list(self._callbacks)  # a single callback where a list is expected is a TypeError
        return CallbackHandler(with_limit_batches_from_env(self._callbacks), events=self.callback_events)

    def _create_accelerator(self) -> Accelerator:
        """Return the :class:`accelerate.Accelerator` that runs training; override to configure it.

        Runs once, in ``__init__``. The default shuffles with Accelerate's seedable sampler (epoch ``e`` ordered by
        ``seed + e``, so a resumed run skips to any batch: keep it in an override), copies batches to CUDA with
        ``non_blocking=True`` (no host wait per step) and runs a multi-process launch without GPUs on the CPU (gloo).
        """
        data_seed = self.seed if self.seed is not None else 0
        dataloader_config = DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=data_seed, non_blocking=torch.cuda.is_available()
        )
        options = {"dataloader_config": dataloader_config}
        options.update(self.accelerator_kwargs)
        return create_accelerator(mixed_precision=self.mixed_precision, cpu=self.cpu, **options)

    # --- A training run: train(), then its setup hooks, preparation and loop, in the order they run ---

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
        resume_from=None,
        gradient_clip_norm: OptionalNumber = None,
        allow_resume_changes: bool = False,
        scheduler_interval: str = "step",
        max_time=None,
        max_time_save_dir=None,
        stream_split: str = "main_process",
        check_first_eval_batch: bool = True,
    ) -> TrainResult:
        """Run a training run: training epochs, each followed by an evaluation epoch if ``eval_dataset`` is given.

        Args:
            train_dataset: a dataset (with or without ``__len__``), or a ``DataLoader`` used as it is.
            num_epochs: the number of epochs; ``None`` to stop on ``max_num_train_steps`` only.
            eval_dataset: evaluated after each training epoch when given; a dataset or a ``DataLoader``.
            per_device_batch_size: the batch size on each process.
            max_num_train_steps: the most optimizer updates; whichever of this and ``num_epochs`` comes first ends.
            gradient_accumulation_steps: micro-batches per optimizer update.
            gradient_clip_value: clip each gradient element to ``[-value, value]`` before each update.
            create_scheduler_fn: a factory ``fn(optimizer) -> scheduler``, e.g. a ``partial`` holding placeholders.
            train_dataloader_kwargs: extra arguments for the training DataLoader.
            eval_dataloader_kwargs: extra arguments for the evaluation DataLoader.
            reset_run_history: start from an empty run history (``False`` continues the epoch count).
            collate_fn: the collate function of both dataloaders.
            resume_from: a training state, or a folder of them (the newest complete one is used), to continue
                exactly; a path that does not exist, or an empty folder, starts a new run.
            gradient_clip_norm: clip the total gradient norm to this value before each update.
            allow_resume_changes: resume even if the world size, batch size, accumulation, dataset length or an
                optimizer hyperparameter changed; the hyperparameters given win over the saved ones.
            scheduler_interval: ``"step"`` steps the scheduler after each optimizer update; ``"epoch"`` once per
                epoch, after the evaluation epoch, for schedules written in epochs.
            max_time: a time budget from the start of ``train()``: seconds, ``"DD:HH:MM:SS"`` or ``"HH:MM:SS"``, a
                ``datetime.timedelta`` or a dict of its arguments. Every process stops at the same update before it
                is spent, a training state is saved and ``TrainResult.stop_reason`` says why; no sync of its own.
            max_time_save_dir: a folder where a run stopped by ``max_time`` also saves a training state.
            stream_split: who reads a training stream (an ``IterableDataset``) on several processes:
                ``"main_process"`` reads every process's batches and sends them out (Accelerate's
                ``dispatch_batches``); ``"dataset"``, for a stream that splits itself between the processes
                (``datasets.distributed.split_dataset_by_node``, WebDataset's ``split_by_node``, or
                ``torch.distributed.get_rank()`` in ``__iter__``), has each process read its own part, and ends
                each epoch when the shortest part ends.
            check_first_eval_batch: before the first training batch, run the default ``calculate_eval_batch_loss``
                on the eval dataset's first samples (one forward pass, under ``no_grad``, leaving no trace), so that
                an eval set that does not fit the model fails at once rather than after a training epoch; ``False``
                skips that pass.

        Returns:
            A :class:`~pytorch_accel_trainer.loop.run_state.TrainResult`: the metrics the run recorded (latest values),
            the best value of a monitoring callback, epochs, updates, samples, wall time and samples per second.

        Raises:
            ValueError: an invalid argument, before any work starts; the message names the fix.
            TypeError: an argument of the wrong type (a scheduler instance for ``create_scheduler_fn``).
            CheckpointError: ``resume_from`` holds files but no training state of this trainer, one saved by a run
                set up differently (unless ``allow_resume_changes``), or one that trained past ``num_epochs`` or
                ``max_num_train_steps``.

        Example::

            trainer.train(dataset, num_epochs=10, resume_from="checkpoints")  # the same line starts or resumes
        """
        options = self._checked_train_options(locals())
        stored_state = (
            TrainingStates(Processes.of_accelerator(self._accelerator)).find(options.resume_from)
            if options.resume_from is not None
            else None
        )
        safe_points.validate_resume_target(stored_state, options.num_epochs, options.max_num_train_steps)
        self._start_training_run(train_dataset, eval_dataset, options)
        self._load_resume_plan(stored_state, options)
        try:
            self._run_training()
        finally:
            end_dataloader_workers(self.train_dataloader, self.eval_dataloader)
        watched_metric = self.callback_handler.watched_metric()
        return create_train_result(self.run_state, get_run_config(self), self.run_history, watched_metric)

    def _training_state_bytes(self) -> Optional[int]:
        """The size of this process's part of a training state, for the time budget; ``None`` before the first update
        (the optimizer's state appears then)."""
        if self.run_state.num_update_steps_completed == 0:
            return None
        return training_state_bytes(self.model, self.optimizer)

    def _checked_train_options(self, arguments: dict) -> TrainOptions:
        """``train()``'s ``arguments`` (its ``locals()``) as :class:`TrainOptions`, checked before any preparation."""
        train_dataset, eval_dataset = arguments["train_dataset"], arguments["eval_dataset"]
        validate_datasets(train_dataset, eval_dataset)
        validate_given_dataloaders(
            (train_dataset, eval_dataset),
            ("train_dataset", "eval_dataset", "train_dataloader_kwargs", "eval_dataloader_kwargs"),
            arguments["per_device_batch_size"],
            (arguments["train_dataloader_kwargs"], arguments["eval_dataloader_kwargs"]),
            arguments["collate_fn"],
        )
        train_dataset, given_dataloader = dataset_and_dataloader(train_dataset)
        warn_if_endless(train_dataset, arguments["max_num_train_steps"])
        options = TrainOptions.from_arguments(
            arguments,
            per_device_batch_size=batch_size_for(given_dataloader, arguments["per_device_batch_size"]),
            **destinations.train_locations(arguments),  # ~ and $VARIABLES expanded; a mangled URL refused
        )
        optimizer = self._training_optimizer  # an evaluation-only trainer has none: an error now
        if isinstance(self.model, torch.nn.Module):  # a stand-in model is refused where Accelerate prepares it
            validate_optimizer_parameters(optimizer, self.model)
        destinations.validate_stores_reach_every_process(
            self.callback_handler, options, self._accelerator.num_processes
        )
        destinations.validate_destinations_can_be_written(self._accelerator, self.callback_handler, options)
        check_folders_are_shared(
            self._accelerator, destinations.folders_shared_by_nodes(self.callback_handler, options)
        )
        return options

    def _start_training_run(self, train_dataset: Any, eval_dataset: Any, options: TrainOptions) -> None:
        """Set up the run of ``options`` up to its first epoch, then check what only the prepared run shows."""
        time_budget = create_time_budget(  # the main process's estimate of a first save is enough: it stops all
            options,
            self.callback_handler,
            self._accelerator.is_main_process,
            self._training_state_bytes,
        )
        self.run_state = RunState(options=options, time_budget=time_budget)
        self.train_dataset, self._given_train_dataloader = dataset_and_dataloader(train_dataset)
        self.eval_dataset, self._given_eval_dataloader = dataset_and_dataloader(eval_dataset)
        self.create_scheduler_fn, self.collate_fn = options.create_scheduler_fn, options.collate_fn
        if options.reset_run_history:
            self.run_history.reset()
        if self.seed is not None:  # Accelerate's device_specific=True, by data-parallel rank: a tensor-parallel
            set_seed(self.seed + layout_of(self._accelerator).dp_rank)  # group draws the same numbers
        batch_size = options.per_device_batch_size
        self._train_dl_kwargs = None  # an earlier run's: set again by the default create_train_dataloader only
        self.train_dataloader = self.create_train_dataloader(batch_size, options.train_dataloader_kwargs)
        self.eval_dataloader, self._eval_dl_kwargs = None, None
        if self.eval_dataset is not None:
            self.eval_dataloader = self.create_eval_dataloader(batch_size, options.eval_dataloader_kwargs)
        self._prepare_model_optimizer_and_dataloaders()
        self.run_config = self._create_run_config(options)
        validate_sharded_run(self._accelerator, self.run_config)
        self._check_eval_batch_size()
        validate_eval_batches_exist(self.eval_dataloader)  # an eval set smaller than one batch, with drop_last
        # one eval batch through the model now, not after a training epoch; a calculate_eval_batch_loss of the user's
        # may keep state (metrics) that one extra batch would change: its first evaluation step is the check
        if options.check_first_eval_batch and not overrides(self, "calculate_eval_batch_loss"):
            check_first_eval_batch(self)
        self.scheduler = self.create_scheduler()
        warn_if_schedule_is_in_epochs(self.scheduler, self.run_config, options.scheduler_interval)

    def create_train_dataloader(self, batch_size: int, train_dl_kwargs: Optional[dict] = None) -> Iterable:
        """Return the training dataloader over ``self.train_dataset`` (before Accelerate prepares it).

        Runs once, at the start of ``train()``. The default returns a ``DataLoader`` given to ``train()`` as it is,
        else one from :meth:`get_default_train_dl_kwargs` updated with ``train_dl_kwargs``, and ``self.collate_fn``.

        Args:
            batch_size: the batch size per device.
            train_dl_kwargs: extra DataLoader arguments.

        Returns:
            Any iterable of batches; a DataLoader is sharded across processes by Accelerate.
        """
        defaults = self.get_default_train_dl_kwargs(batch_size)
        dataloader, self._train_dl_kwargs = build_dataloader(
            self.train_dataset, self._given_train_dataloader, defaults, train_dl_kwargs, self.collate_fn
        )
        return dataloader

    def create_eval_dataloader(self, batch_size: int, eval_dl_kwargs: Optional[dict] = None) -> Iterable:
        """Return the evaluation dataloader over ``self.eval_dataset``; as :meth:`create_train_dataloader`."""
        defaults = self.get_default_eval_dl_kwargs(batch_size)
        dataloader, self._eval_dl_kwargs = build_dataloader(
            self.eval_dataset, self._given_eval_dataloader, defaults, eval_dl_kwargs, self.collate_fn
        )
        return dataloader

    def get_default_train_dl_kwargs(self, batch_size: int) -> dict:
        """Return the default training DataLoader arguments, for :meth:`create_train_dataloader`. ``num_workers`` is 0:
        on small in-memory data, workers make each step several times slower."""
        return {
            "shuffle": True,
            "pin_memory": torch.cuda.is_available(),
            "batch_size": batch_size,
            "num_workers": 0,
            "worker_init_fn": worker_init_fn,
        }

    def get_default_eval_dl_kwargs(self, batch_size: int) -> dict:
        """Return the default evaluation DataLoader arguments: as for training, without shuffling."""
        return {
            "shuffle": False,
            "pin_memory": torch.cuda.is_available(),
            "batch_size": batch_size,
            "num_workers": 0,
            "worker_init_fn": worker_init_fn,
        }

    def _prepare_model_optimizer_and_dataloaders(self) -> None:
        """Wrap the model, optimizer and dataloaders for the current devices and processes, via Accelerate.

        Runs in ``train()`` and ``evaluate()``, before the run config and the scheduler (sharding changes each
        DataLoader's length). Overriding :meth:`_prepare_model_and_optimizer` or :meth:`_prepare_dataloaders` makes
        Accelerate prepare the halves in two calls; DeepSpeed needs one: override this method there.
        """
        validate_model_and_loss(self.model, self.loss_func)  # here, not in __init__: a subclass may prepare its own
        release_prepared(self.accelerator)  # nothing of an earlier run is kept or prepared twice
        if overrides(self, "_prepare_model_and_optimizer") or overrides(self, "_prepare_dataloaders"):
            self._prepare_model_and_optimizer()
            self._prepare_dataloaders()
        else:
            self._prepare(model_and_optimizer=True, dataloaders=True)  # one call, as DeepSpeed needs

    def _prepare_model_and_optimizer(self) -> None:
        """Wrap the model and optimizer via Accelerate (and compile the model, with ``torch_compile``)."""
        self._prepare(model_and_optimizer=True, dataloaders=False)

    def _prepare_dataloaders(self) -> None:
        """Wrap the dataloaders via Accelerate: shard them across processes, and place their batches."""
        self._prepare(model_and_optimizer=False, dataloaders=True)

    def _prepare(self, model_and_optimizer: bool, dataloaders: bool) -> None:
        """Prepare the model and optimizer (with the extra models of ``add_model``) and/or the dataloaders."""
        if model_and_optimizer:
            self.model = self._unwrap_distributed_model()  # a model left wrapped by an earlier run is wrapped once
            if isinstance(self.optimizer, AcceleratedOptimizer):
                self.optimizer = self.optimizer.optimizer
            if self._needs_tensor_parallel_plan():
                self.model = self._model_split_for_tensor_parallel()
        components: list[Any] = [self.model, self.optimizer] if model_and_optimizer else [None, None]
        components += [self.train_dataloader, self.eval_dataloader] if dataloaders else [None, None]
        placement = [None, None, *(batches_need_placing(dl, self.device) for dl in components[2:])]
        # the extra models (add_model) in the same call: Accelerate places them and their optimizers together
        extras = (
            unwrapped_extras(self.accelerator, self.extra_models, self.extra_optimizers) if model_and_optimizer else []
        )
        # a stream that can say where it is keeps its position where each process reads its own stream (one
        # process, or stream_split="dataset"); Accelerate's dispatching (the main process reads for all) replays it
        own_part, reads_own = None, dataloaders and self._reads_own_stream_part(self.train_dataloader)
        stateful = dataloaders and keeps_position(self.train_dataloader)
        stateful = stateful and (reads_own or self.accelerator.num_processes == 1)
        if dataloaders:
            self._validate_train_stream(stateful)
        if reads_own:
            own_part, components[2] = prepare_own_part(self.accelerator, self.train_dataloader, stateful), None
        with stateful_dataloaders(self.accelerator, stateful):  # Accelerate builds them as StatefulDataLoader
            components = prepare_components(
                self.accelerator, components + extras, device_placement=placement + [None] * len(extras)
            )
        if dataloaders:
            self.train_dataloader = components[2] if own_part is None else own_part
            self.eval_dataloader = components[3]
            self.run_state.stream_positions = StreamPositions() if stateful else None
        if not model_and_optimizer:
            return
        self.model, self.optimizer = components[:2]
        # where Accelerate's optimizer wrapper and backward() would only call torch, call torch (100 us a step)
        self.calls_torch_directly = not self.always_use_accelerate_wrappers and wrappers_only_call_torch(
            self.accelerator
        )
        if self.calls_torch_directly and isinstance(self.optimizer, AcceleratedOptimizer):
            self.optimizer = self.optimizer.optimizer
        store_prepared_extras(self.extra_models, self.extra_optimizers, components[4:], self.calls_torch_directly)
        if self.torch_compile is not False:  # True or a dict, even {}; compiled after the DDP wrapper, as torch advises
            options = self.torch_compile if isinstance(self.torch_compile, Mapping) else {}
            self.model = cast(torch.nn.Module, torch.compile(self.model, **options))

    def parallelize_model(self, model: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        """Split ``model`` across the tensor-parallel processes of ``device_mesh`` and return it; override it for a
        model that is not a transformers model.

        Runs once per Trainer, before the first preparation (in ``train()``, ``evaluate()`` or ``predict()``), only
        under a ``ParallelismConfig`` with ``tp_size > 1``, and only when no parameter of the model is a ``DTensor``
        yet (a model split before the Trainer is kept as it is). The default applies a transformers model's own
        tensor-parallel plan (``model.tp_plan``) on ``device_mesh["tp"]`` and raises a ``ValueError`` for any other
        model. The trainer then points the optimizer at the new parameters, by name; FSDP2 shards the result over
        the data-parallel dimensions.

        Args:
            model: the model, not yet prepared.
            device_mesh: Accelerate's device mesh (``accelerator.torch_device_mesh``), with a ``"tp"`` dimension.

        Returns:
            The model, its split layers holding ``DTensor`` parameters.

        Example::

            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            class MlpTrainer(Trainer):
                def parallelize_model(self, model, device_mesh):
                    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
                    return parallelize_module(model, device_mesh["tp"], plan)
        """
        return apply_transformers_tensor_parallel_plan(model, device_mesh)

    def _needs_tensor_parallel_plan(self) -> bool:
        """Whether the layout splits layers (``tp_size > 1``) and the model is not split yet."""
        return layout_of(self._accelerator).tp > 1 and not holds_dtensor_parameters(self.model)

    def _model_split_for_tensor_parallel(self) -> torch.nn.Module:
        """Return the model split by :meth:`parallelize_model`, the optimizer pointed at its new parameters by name."""
        names_by_id = parameter_names_by_id(self.model)
        model = self.parallelize_model(self.model, self._accelerator.torch_device_mesh)
        swap_optimizer_parameters([self.optimizer], names_by_id, model)
        if not self._accelerator.is_fsdp2:  # tensor parallel alone: Accelerate's prepare asks the model its tp size
            record_tensor_parallel_size(model, layout_of(self._accelerator).tp)
        return model

    def _validate_train_stream(self, stateful: bool) -> None:
        """Refuse, before the training stream is read, a stream read the wrong way for how it splits itself, or
        (``stateful``: its position is kept in training states) whose ``state_dict()`` a state could not keep."""
        options = self.run_state.options
        split = None if options is None else options.stream_split
        validate_stream_split(self.train_dataloader, split, layout_of(self.accelerator).dp_size)
        if stateful:
            validate_stream_state(cast(Any, self.train_dataloader).dataset)

    def _create_run_config(self, options: Optional[TrainOptions] = None, **train_arguments) -> TrainerRunConfig:
        """Return the frozen :class:`TrainerRunConfig` of the run being started, on the prepared dataloaders, from
        its :class:`TrainOptions` or ``train()``'s arguments by keyword (``num_epochs=``, ...)."""
        if options is None:
            options = TrainOptions(**train_arguments)
        dataloaders, kwargs = (
            (self.train_dataloader, self.eval_dataloader),
            (self._train_dl_kwargs, self._eval_dl_kwargs),
        )
        return build_run_config(options, self._accelerator, dataloaders, kwargs, self.train_dataset, self.seed)

    def _check_eval_batch_size(self) -> None:
        """Warn when the last evaluation batch of a multi-process run repeats samples, which per-process tensors
        collected in a hook hold (the evaluation loss, ``gather`` and ``gather_for_metrics`` count each sample once)."""
        config = get_run_config(self)
        length = dataset_length(self.eval_dataset)
        if length is None or not config.is_distributed or not config.eval_total_batch_size:
            return  # one process, or a stream of unknown length: no sample is repeated
        repeated = -length % config.eval_total_batch_size
        if repeated:
            warnings.warn(
                f"The evaluation dataset has {length} samples and the evaluation batch of all processes together is "
                f"{config.eval_total_batch_size}, so the last batch repeats {repeated} samples to keep the processes "
                "in step. The loss, gather() and gather_for_metrics() count each sample once; per-process tensors "
                "collected in your own hooks hold the repeats (use eval_batch_real_rows to drop them). A batch size "
                "that divides the dataset avoids it.",
                stacklevel=2,
            )

    def create_scheduler(self) -> Any:
        """Return the scheduler ``self.create_scheduler_fn(self.optimizer)`` builds, or ``None`` without a factory.

        Runs once in ``train()``, after the dataloaders are prepared, so that :class:`TrainerPlaceholderValues`
        resolve to this run's values; stored as ``self.scheduler``. An override is called even without a factory.
        """
        if self.create_scheduler_fn is None:
            return None
        values = placeholder_values(self.run_config, self.train_dataloader, self.eval_dataloader)
        return resolve_placeholders(self.create_scheduler_fn, values)(self.optimizer)

    def _load_resume_plan(self, stored_state: Optional[StoredState], options: TrainOptions) -> None:
        """Load the training state to resume from, if any, and start the run state at its position."""
        facts = run_facts(self)  # taken once: every state the run saves holds them
        plan = safe_points.load_resume_plan(
            self, stored_state, options.resume_from, facts, options.allow_resume_changes
        )
        self.run_state.begin_resume(plan, safe_points.create_run_id(self, plan), facts)

    def _run_training(self) -> None:
        """Run the epochs of a training run, as in the documented pseudocode."""
        state = self.run_state
        # from here on, saves wait for a point between two updates
        state.start_epochs(metric_counts(self.run_history), self.run_history.current_epoch)
        self._training_optimizer.zero_grad(set_to_none=True)  # gradients of a run stopped mid-window must not leak in
        try:
            self.training_run_start()
            self._call_event("on_training_run_start")
            for epoch in self._epochs():
                state.epoch = epoch
                try:
                    # train() set it; a callback may replace it (a slice), never by None
                    self._run_train_epoch(cast(Iterable, self.train_dataloader))
                    self._raise_agreed_stop("epoch_trained")  # a callback's stop, asked for on any process in the epoch
                    if self.eval_dataloader is not None:
                        self._run_eval_epoch(self.eval_dataloader)
                    if state.scheduler_per_epoch:
                        self.scheduler_step()
                    self.training_run_epoch_end()
                    self._call_event("on_training_run_epoch_end")
                    state.end_epoch()  # a stop from here on comes after the epoch: the last one's is the planned end
                    self._raise_agreed_stop("epoch_end")
                except StopTrainingError as error:
                    if state.open_epoch_at is not None:  # inside the training epoch: its loss so far, as a step limit
                        self._record_cut_short_epoch()
                    self._stop_training(error)
                    break
                self.run_history._increment_epoch()  # a cut-short epoch counts too
                if state.open_epoch_at is not None:
                    break  # the step limit fell inside the epoch: a state taken now resumes at its next batch
                state.next_epoch()
                safe_points.reach_safe_point(self)  # between epochs: saves asked for during the epoch are taken here
                if self._reached_max_steps():
                    break  # the step limit came before the epoch limit
            if state.save_requests:  # asked for after the last update of a run stopped mid-epoch
                safe_points.take_requested_saves(self)
        finally:
            state.end_epochs()  # from here on, saves are taken at once
            safe_points.end_saves_and_preemption(self)  # a save in the background is complete (or its error raised)
            self._end_non_finite_policy()
        self.training_run_end()
        self._call_event("on_training_run_end")
        if state.error_after_run is not None:
            raise state.error_after_run  # skip_non_finite_steps(on_exhausted="raise"), now that the run has ended

    def training_run_start(self) -> None:
        """Runs at the start of a training run, before ``on_training_run_start``. Default: nothing."""

    def _run_train_epoch(self, train_dl: Iterable) -> None:
        """Run one training epoch: a step per batch, an optimizer update per accumulation window."""
        state = self.run_state
        self.train_epoch_start()
        state.start_train_epoch(dataloader_length(train_dl))  # empty trackers; the length is None without __len__
        batches = self._epoch_batches(train_dl)  # from the saved step when resuming
        self._call_event("on_train_epoch_start")
        opens_window = True  # an epoch, resumed or not, starts with a window
        for step, batch, is_last_batch in batches:
            if opens_window:
                self._between_updates(step)
            self._call_event("on_train_step_start")
            state.batch_idx, state.closes_window = step, self._is_update_step(step, is_last_batch)
            if state.non_finite_policy is not None:  # the window's batches and the epoch's loss before it, kept
                state.non_finite_policy.remember_micro_batch(state, batch, step, opens_window)
            if self._passes_take_window_flag:
                self._perform_forward_and_backward_passes(batch, step, is_update_step=state.closes_window)
            else:  # an override written as pytorch-accelerated's, (batch, step): the run state holds the flag
                self._perform_forward_and_backward_passes(batch, step)
            opens_window = state.closes_window
            if not opens_window:
                continue  # the window goes on: gradients accumulate
            state.end_window(step, is_last_batch)  # a stop from here on leaves the epoch at its next batch
            if state.non_finite_policy is None or not self._skips_non_finite_update():
                self._update_parameters(step)
            if state.reached_max_steps():
                break  # the step limit falls inside this epoch
        self.train_epoch_end()
        self._record_epoch_values(
            state.train_loss_tracker, state.train_step_metrics, "train_loss_epoch", "train_{}_epoch"
        )
        self._call_event("on_train_epoch_end")

    def train_epoch_start(self) -> None:
        """Runs at the start of each training epoch. Default: puts the model in training mode."""
        self.model.train()

    def _perform_forward_and_backward_passes(
        self, batch, step: int, is_update_step: Optional[bool] = None, is_retry: Optional[bool] = None
    ) -> None:
        """Run the forward and backward passes of one micro-batch, under ``no_sync`` unless it closes its window.

        An override may take ``(self, batch, step)`` only, as pytorch-accelerated's: the loop then calls it with those
        two arguments (found once, as the trainer is constructed), and its ``super()`` call reads the rest from the
        run state.

        Args:
            batch: one batch from the training dataloader.
            step: the index of the micro-batch in the epoch, from 0.
            is_update_step: whether the micro-batch closes its accumulation window (or the epoch); ``None``: the run
                state's (``run_state.closes_window``, set by the loop for this micro-batch).
            is_retry: the micro-batch runs again, for a non-finite window: no event, its samples already counted;
                ``None``: the run state's (``run_state.retrying_window``).
        """
        state = self.run_state
        if is_update_step is None:  # called as (batch, step), e.g. by an override's super()
            is_update_step = state.closes_window
        if is_retry is None:
            is_retry = state.retrying_window
        syncs = is_update_step or state.accumulation_steps == 1
        with _SYNCING if syncs else self._accelerator.no_sync(self.model):  # DDP reads the flag in forward and backward
            batch_output = call_batch_hook(
                self.calculate_train_batch_loss, batch, step, self._batch_index_arguments.train
            )
            state.record_train_batch(batch_output, first_try=not is_retry)  # the unscaled loss, as it is logged
            if not is_retry:  # a step run again for non-finite gradients has had its event
                self._call_event("on_train_step_end", batch=batch, batch_output=batch_output, step=step)
            if not self.calls_torch_directly:  # DeepSpeed must step only at the end of a window
                set_deepspeed_gradient_sync(self._accelerator, is_update_step)
            loss = state.scale_loss(batch_output, step)
            # the outputs go before the backward pass, as in `loss_func(model(x), y).backward()`: the graph keeps
            # only what its backward needs (for a cross-entropy, not the logits), so the peak is a hand loop's
            del batch_output
            self.backward_step(loss)

    def calculate_train_batch_loss(self, batch, batch_idx: Optional[int] = None) -> dict:
        """Return the loss of one training batch, with the model outputs and the batch size.

        Runs for each training micro-batch, before ``on_train_step_end``. The default computes
        ``loss_func(model(batch[0]), batch[1])``, for a dict batch ``loss_func(model(**batch), batch["labels"])``,
        and without a ``loss_func`` takes the model output's ``loss``. An override may take ``(self, batch)`` or
        ``(self, batch, batch_idx)`` (the index goes to a parameter so named, or a second one without a default).

        Args:
            batch: one batch from the training dataloader.
            batch_idx: the index of the batch in the epoch, from 0 (also ``trainer.batch_idx``).

        Returns:
            A dict with ``loss`` (a scalar tensor, unscaled: the trainer scales it for accumulation), ``batch_size``
            (counted from the batch when left out) and ``model_outputs``. Extra keys reach ``on_train_step_end``, and
            each extra number or 0-d tensor is averaged over the epoch as ``train_<name>_epoch``. A loss averaged over
            tokens adds ``num_items_in_batch``, which then weights each micro-batch. Checked after each call: a
            ``TypeError`` or ``ValueError`` says what is wrong.
        """
        model_outputs = forward_batch(self.model, batch)
        loss = batch_loss(self.loss_func, model_outputs, batch)
        return {"loss": loss, "model_outputs": model_outputs, "batch_size": batch_size_of(batch)}

    def backward_step(self, loss: torch.Tensor) -> None:
        """Run the backward pass of one micro-batch, after ``on_train_step_end``.

        The default calls ``Accelerator.backward`` (mixed-precision loss scaling), or ``loss.backward()`` where that
        is all it would do (see ``calls_torch_directly``).

        Args:
            loss: the loss of ``calculate_train_batch_loss``, divided by the micro-batches of the current window.

        Raises:
            ValueError: ``loss`` does not require gradients (cut off from the model's graph).
        """
        if not loss.requires_grad:  # an attribute read, no sync: a detached loss would train nothing
            validate_loss_requires_grad(loss, self.model)
        if self.calls_torch_directly:
            loss.backward()
        else:
            self._accelerator.backward(loss)

    def _update_parameters(self, step: int) -> None:
        """Clip the accumulated gradients, step the optimizer and the scheduler, and zero the gradients."""
        state, config = self.run_state, cast(TrainerRunConfig, self.run_config)  # set by train()
        if state.window_needs_correction:  # a partial last window of a stream, or num_items_in_batch
            accumulation.finish_window(step, state, self._accelerator, self.model)
        if config.gradient_clip_norm is not None or config.gradient_clip_value is not None or self.track_gradient_norm:
            self._clip_gradients()
        if background_saver.staging is not None:  # an asynchronous save still copies the weights this update changes
            background_saver.wait_for_staging()
        self.optimizer_step()
        # fp16: the gradient scaler skips an update whose gradients overflowed, and the scheduler must not step
        skipped = self._accelerator.scaler is not None and self._accelerator.optimizer_step_was_skipped
        if not skipped and not state.scheduler_per_epoch:
            self.scheduler_step()
        self.optimizer_zero_grad()
        state.num_update_steps_completed += 1
        updates = state.num_update_steps_completed
        self._call_event("on_optimizer_step_end", step=step, num_update_steps_completed=updates)

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

    # --- The evaluation epoch (of a training run or of evaluate()), then the end of each epoch and of the run ---

    def _run_eval_epoch(self, valid_dl: Iterable, is_training: bool = True) -> None:
        """Run one evaluation epoch and record its loss: ``eval_loss_epoch`` in training, else ``evaluation_loss``."""
        state = self.run_state
        self.eval_epoch_start()
        state.start_eval_epoch()
        self._call_event("on_eval_epoch_start")
        for step, batch in enumerate(require_batches(valid_dl, NO_EVAL_BATCH)):
            state.batch_idx = step
            state.start_eval_batch(real_rows_in_batch(valid_dl, batch, self._accelerator))  # None unless rows repeat
            self._call_event("on_eval_step_start")
            batch_output = call_batch_hook(
                self.calculate_eval_batch_loss, batch, step, self._batch_index_arguments.eval
            )
            state.record_eval_batch(batch_output)
            self._call_event("on_eval_step_end", batch=batch, batch_output=batch_output, step=step)
            # released now, not when the next batch's outputs replace them: one step's outputs alive at a time
            del batch, batch_output
        state.end_eval_epoch()
        self.eval_epoch_end()
        names = ("eval_loss_epoch", "eval_{}_epoch") if is_training else ("evaluation_loss", "evaluation_{}")
        self._record_epoch_values(state.eval_loss_tracker, state.eval_step_metrics, *names)
        self._call_event("on_eval_epoch_end")

    def eval_epoch_start(self) -> None:
        """Runs at the start of each evaluation epoch. Default: puts the model in evaluation mode."""
        self.model.eval()

    def calculate_eval_batch_loss(self, batch, batch_idx: Optional[int] = None) -> dict:
        """Return the loss of one evaluation batch, without gradients; as :meth:`calculate_train_batch_loss`.

        Runs for each evaluation batch, before ``on_eval_step_end``. In the last batch of a multi-process evaluation
        the default computes the loss over the real rows only (``eval_batch_real_rows``), so ``eval_loss_epoch``
        equals the single-process value; ``model_outputs`` keep every row, as ``gather_for_metrics`` expects.
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
        self._unwrap_models()

    # --- An evaluation run: evaluate() ----------------------------------------------------------------

    def evaluate(
        self,
        dataset=None,
        per_device_batch_size: int = 8,
        dataloader_kwargs: Optional[dict] = None,
        collate_fn: Optional[Callable] = None,
    ) -> dict:
        """Run one evaluation epoch over ``dataset`` and add ``evaluation_loss`` to the run history, which is kept.

        Args:
            dataset: the data to evaluate, or a DataLoader over it (used as it is); defaults to the ``eval_dataset``
                (and collate function) of the last ``train()``.
            per_device_batch_size: the batch size on each process.
            dataloader_kwargs: extra arguments for the DataLoader.
            collate_fn: the collate function of the DataLoader.

        Returns:
            The metrics this evaluation recorded, by name (``evaluation_loss``, ``evaluation_<name>`` for each step
            metric, and what callbacks recorded), each a number.

        Raises:
            ValueError: no ``dataset``, and no ``eval_dataset`` from an earlier ``train()``; an invalid argument.

        Example::

            metrics = trainer.evaluate(test_dataset, per_device_batch_size=64)  # {"evaluation_loss": ...}
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
        try:
            self._run_evaluation()
        finally:
            end_dataloader_workers(self.eval_dataloader)
        return metrics_recorded_since(self.run_history, counts)

    def _run_evaluation(self) -> None:
        """Run the single evaluation epoch of an evaluation run."""
        self.evaluation_run_start()
        self._call_event("on_evaluation_run_start")
        try:
            self._run_eval_epoch(cast(Iterable, self.eval_dataloader), is_training=False)  # evaluate() set it
            self._raise_agreed_stop()
        except StopTrainingError as error:
            self._stop_training(error)
        self.evaluation_run_end()
        self._call_event("on_evaluation_run_end")

    def evaluation_run_start(self) -> None:
        """Runs at the start of an evaluation run, before ``on_evaluation_run_start``. Default: nothing."""

    def evaluation_run_end(self) -> None:
        """Runs at the end of an evaluation run. Default: unwraps ``self.model`` and the extra models."""
        self._unwrap_models()

    # --- A prediction run: predict() ------------------------------------------------------------------

    def predict(
        self,
        dataset,
        per_device_batch_size: int = 8,
        dataloader_kwargs: Optional[dict] = None,
        collate_fn: Optional[Callable] = None,
        output_dir: Union[str, Path, None] = None,
        chunk_size: int = 4096,
    ) -> Any:
        """Return the model's outputs for every sample of ``dataset``, in the dataset's order, on every process.

        The outputs of :meth:`calculate_predict_batch_output` (model in evaluation mode, no gradients) are gathered
        batch by batch, each sample once, moved to the CPU and joined along the first dimension. Only the
        ``on_predict_*`` events fire; a ``StopTrainingError`` raised in them is not held for an agreement point.

        Args:
            dataset: the samples: a dataset (with or without ``__len__``) or a ``DataLoader``, used as it is.
            per_device_batch_size: the batch size on each process.
            dataloader_kwargs: extra arguments for the DataLoader (no shuffling by default).
            collate_fn: the collate function of the DataLoader.
            output_dir: a new or empty folder where the outputs are written in chunk files as they come, instead of
                kept in memory (read back by :func:`~pytorch_accel_trainer.predictions.load_predictions`): a local
                path, or a URL of object storage (``s3://bucket/predictions``, through fsspec).
            chunk_size: the samples per chunk file, with ``output_dir``.

        Returns:
            The outputs (a tensor, or the same dict, tuple or list of tensors) on the CPU, ``None`` for a stream that
            yields no sample; with ``output_dir``, the folder written (a ``Path``, or the URL), returned on every
            process once it is complete.

        Raises:
            RuntimeError: called inside a training run (from a callback or a hook).
            FileExistsError: ``output_dir`` holds files.
            ValueError: an invalid argument; ``output_dir`` ending in ``.pt`` or ``.pth``; a batch's outputs whose
                structure differs from the first batch's (raised at that batch).

        Example::

            probabilities = trainer.predict(test_dataset, per_device_batch_size=64)  # a tensor of one row per sample
        """
        validate_not_in_training_run(self.run_state.in_training_run, "predict")
        validate_predict_arguments(dataset, per_device_batch_size, dataloader_kwargs, chunk_size)
        validate_prediction_folder(output_dir, self._accelerator.num_processes)
        dataloader = self._prepare_model_and(
            self._create_dataloader(dataset, per_device_batch_size, dataloader_kwargs, collate_fn, shuffle=False)
        )
        collector = (
            PredictionCollector()
            if output_dir is None
            else PredictionWriter(output_dir, chunk_size, writes=self._accelerator.is_main_process)
        )
        self.predict_dataloader = dataloader
        try:
            with training_modes_kept(self.model):
                self.model.eval()
                self._call_event("on_predict_run_start")
                self._run_predict_epoch(dataloader, collector)
        finally:
            self.predict_dataloader = None
            end_dataloader_workers(dataloader)
            self._unwrap_models()
        result = collector.result()  # with output_dir, the main process writes the last chunk and the index
        if output_dir is not None:
            self._accelerator.wait_for_everyone()  # no process returns the folder before it is complete
        self._call_event("on_predict_run_end")
        return result

    def _run_predict_epoch(self, dataloader: Iterable, collector: Any) -> None:
        """Run every batch through :meth:`calculate_predict_batch_output`; give ``collector`` its gathered outputs."""
        first_structure = None  # every batch's prediction must have the first one's, to be joined
        for step, batch in enumerate(predict_batches(dataloader)):  # a stream of no sample: no batch, no error
            with torch.no_grad():
                hook, index_argument = self.calculate_predict_batch_output, self._batch_index_arguments.predict
                batch_output = call_batch_hook(hook, batch, step, index_argument, loss_output=False)
            validate_prediction_output(batch_output)
            first_structure = first_structure or prediction_structure(batch_output)
            validate_same_structure(first_structure, batch_output, step)  # here, not in the join after every batch
            # a collective, then a host copy
            batch_output = to_cpu(gather_for_metrics_by_rank(self._accelerator, batch_output))
            collector.add(batch_output)
            self._call_event("on_predict_step_end", batch=batch, batch_output=batch_output, step=step)
            del batch, batch_output  # one step's outputs on the device at a time

    def calculate_predict_batch_output(self, batch, batch_idx: Optional[int] = None) -> Any:
        """Return the prediction of one batch: a tensor with one row per sample, or a dict, tuple or list of them.

        Runs for each batch of :meth:`predict`, under ``torch.no_grad()``. The default returns the model's output (a
        tensor batch passed as it is). An override may take ``batch_idx`` and post-process (an ``argmax``). Every
        batch must return the first batch's structure (the same keys and lengths, tensors of the same shape but for
        the first dimension), checked as each batch arrives (``ValueError``): pad what varies, such as a sequence
        length, to a fixed size.

        Example::

            def calculate_predict_batch_output(self, batch):
                return self.model(batch[0]).softmax(dim=-1)
        """
        if isinstance(batch, torch.Tensor):
            return self.model(batch)
        return forward_batch(self.model, batch)

    # --- The learning-rate range test: lr_find() ------------------------------------------------------

    def lr_find(
        self,
        train_dataset,
        start_lr: float = 1e-7,
        end_lr: float = 10.0,
        num_steps: int = 100,
        per_device_batch_size: int = 8,
        dataloader_kwargs: Optional[dict] = None,
        collate_fn: Optional[Callable] = None,
        smoothing: float = 0.98,
        diverge_factor: Optional[float] = 4.0,
    ) -> LrFinderResult:
        """Run the learning-rate range test, then put the model, optimizer and random states back, bit for bit.

        Makes up to ``num_steps`` updates with the trainer's own step (no accumulation, clipping or scheduler) while
        the learning rate of every parameter group grows exponentially from ``start_lr`` to ``end_lr``, and records
        each update's loss, averaged over processes. No callback event fires and the run history is not touched.

        Args:
            train_dataset: the training data (a dataset, a stream, or a ``DataLoader`` used as it is); shuffled.
            start_lr: the first learning rate.
            end_lr: the last learning rate, reached at the last step.
            num_steps: the most updates of the sweep.
            per_device_batch_size: the batch size on each process.
            dataloader_kwargs: extra arguments for the DataLoader.
            collate_fn: the collate function of the DataLoader.
            smoothing: the weight of the past in the moving average of the loss (0: no smoothing).
            diverge_factor: stop when the smoothed loss exceeds this many times its lowest value; ``None``: never.

        Returns:
            An :class:`~pytorch_accel_trainer.loop.lr_find.LrFinderResult`: ``lrs``, ``losses``, ``smoothed_losses``,
            ``suggestion`` (the steepest descent of the smoothed loss) and ``plot()``; the same on every process.

        Raises:
            RuntimeError: called inside a training run (from a callback or a hook).
            ValueError: an invalid argument (before any step), a trainer without an optimizer, data with no batch, or
                a loss that is not finite at the first step (broken data or model: no learning rate caused it).

        Example::

            result = trainer.lr_find(train_dataset, per_device_batch_size=32)
            if result.suggestion is not None:  # None: the loss diverged at the second step
                trainer.optimizer.param_groups[0]["lr"] = result.suggestion
        """
        validate_not_in_training_run(self.run_state.in_training_run, "lr_find")
        validate_lr_find_arguments(start_lr, end_lr, num_steps, smoothing, diverge_factor)
        validate_predict_arguments(train_dataset, per_device_batch_size, dataloader_kwargs, chunk_size=None)
        optimizer = self._training_optimizer
        if isinstance(self.model, torch.nn.Module):
            validate_optimizer_parameters(optimizer, self.model)
        snapshot = TrainerSnapshot.take(self)
        sweep = LrSweep(start_lr, end_lr, num_steps, smoothing, diverge_factor)
        try:
            dataloader = self._prepare_model_and(
                self._create_dataloader(train_dataset, per_device_batch_size, dataloader_kwargs, collate_fn, True)
            )
            self.model.train()
            self._training_optimizer.zero_grad(set_to_none=True)  # no gradient left from before in the first step
            for step, batch in zip(range(num_steps), endless_batches(dataloader)):
                sweep.set_learning_rate(self._training_optimizer, step)
                hook, index_argument = self.calculate_train_batch_loss, self._batch_index_arguments.train
                batch_output = call_batch_hook(hook, batch, step, index_argument)
                self.backward_step(batch_output["loss"])
                self.optimizer_step()
                self.optimizer_zero_grad()
                loss = self._accelerator.reduce(batch_output["loss"].detach().float(), "mean")  # a collective
                if sweep.record(loss.item()):  # a host sync per step; the same on every process
                    break  # the loss diverged
        finally:
            self._unwrap_models()
            release_prepared(self.accelerator)
            snapshot.restore(self)
        return sweep.result(self._accelerator)

    def _create_dataloader(
        self, dataset, batch_size: int, dataloader_kwargs: Optional[dict], collate_fn: Optional[Callable], shuffle: bool
    ) -> Iterable:
        """A DataLoader over ``dataset`` for predict() or lr_find(): the eval (or, to ``shuffle``, train) defaults."""
        dataset, given = dataset_and_dataloader(dataset)
        defaults = (
            self.get_default_train_dl_kwargs(batch_size) if shuffle else self.get_default_eval_dl_kwargs(batch_size)
        )
        return build_dataloader(dataset, given, defaults, dataloader_kwargs, collate_fn)[0]

    def _prepare_model_and(self, dataloader: Iterable) -> Iterable:
        """Prepare the model and optimizer (nothing of an earlier run kept), then ``dataloader``; return it prepared."""
        validate_model_and_loss(self.model, self.loss_func)
        release_prepared(self.accelerator)
        self._prepare(model_and_optimizer=True, dataloaders=False)
        placement = [batches_need_placing(dataloader, self.device)]
        return prepare_components(self.accelerator, [dataloader], device_placement=placement)[0]

    # --- Events and stops: the one way events fire, and where the processes agree to stop -------------

    def _call_event(self, event: str, **kwargs: Any) -> None:
        """Fire ``event`` on the callbacks: the one way the trainer fires its events, each right after its hook.

        A ``StopTrainingError`` raised in one of :data:`AGREED_STOP_EVENTS` is held in ``run_state`` until the next
        ``_raise_agreed_stop()``, where every process raises it together, so that none is left waiting in a
        collective for one that stopped; raised in any other event, it propagates at once.

        Args:
            event: one of the events (``callbacks.base.EVENTS``).
            **kwargs: the event's keyword arguments, after the trainer.
        """
        if event in self.callback_handler.unheard_events:
            return  # no callback handles it: the common case of the step events
        if background_saver.staging is not None and event != "on_train_step_end":
            background_saver.wait_for_staging()  # callbacks may change the weights an asynchronous save still copies
        try:
            self.callback_handler.call_event(event, self, **kwargs)
        except StopTrainingError as error:
            if event not in AGREED_STOP_EVENTS:
                raise  # a run's start or end: no agreement point follows
            self.run_state.hold_stop(error)

    def _raise_agreed_stop(self, point: str = "update") -> None:
        """Raise the ``StopTrainingError`` a callback of any process asked for, or the time budget's (one collective
        per call when distributed); every process must call this at the same ``point`` (``"update"``,
        ``"epoch_trained"``, ``"epoch_end"``: the time budget estimates the time to the next one of its kind)."""
        state = self.run_state
        if state.time_budget is not None:
            state.check_time_budget(point)  # train(max_time=...): a clock read, no sync
        stop_request = state.stop_request
        if stop_request is None and self._accelerator.num_processes == 1:
            return  # nothing to agree on
        agreed = self.process_agreement.agreed_exception(self._accelerator, stop_request)
        if agreed is not None:
            raise agreed

    def _record_cut_short_epoch(self) -> None:
        """Record the training epoch a stop (a callback's ``StopTrainingError``, the time budget, a preemption) cut
        short after some update, as a step limit inside an epoch records it: its ``train_loss_epoch`` over the batches
        trained, and the epoch counted in the history. Its end hooks do not run (as in pytorch-accelerated)."""
        state = self.run_state
        self._record_epoch_values(
            state.train_loss_tracker, state.train_step_metrics, "train_loss_epoch", "train_{}_epoch"
        )
        self.run_history._increment_epoch()

    def _stop_training(self, error: StopTrainingError) -> None:
        """End the run the agreed ``error`` stopped: drop it (keeping its ``stop_reason``), print it, fire the event."""
        self.run_state.drop_stop(error)
        self.print(error)
        self._call_event("on_stop_training_error")

    # --- Named decisions and small helpers of the loop ------------------------------------------------

    def _epochs(self) -> Iterable[int]:
        """The run's epochs, from the one a resumed run continues; without ``num_epochs``, until the step limit."""
        first = self.run_state.epoch  # 0, or the epoch a resumed run continues
        if self.run_state.nothing_left_to_train:
            return range(0)  # a finished run resumed: its step limit is reached (no epoch starts for one more update)
        num_epochs = get_run_config(self).num_epochs
        if num_epochs is None:
            return itertools.count(first)  # only max_num_train_steps ends this run
        return range(first, num_epochs)

    def _epoch_batches(self, train_dl: Iterable) -> Iterable[tuple[int, Any, bool]]:
        """This epoch's ``(step, batch, is_last_batch)``, from ``run_state.epoch_first_step`` (0 unless resuming)."""
        if hasattr(train_dl, "set_epoch"):
            train_dl.set_epoch(self.run_history.current_epoch - 1)  # the shuffle order depends on seed + epoch
        state = self.run_state
        reads_own_part = self._reads_own_stream_part(train_dl)
        state.epoch_first_step, train_dl = safe_points.skip_to_resume_position(state, train_dl)
        if reads_own_part:  # each process its own part of a stream: the epoch ends with the shortest
            train_dl = batches_every_process_has(train_dl, self.process_agreement, self._accelerator)
        # a dataloader that says it is empty was warned about at setup; any other must yield a batch
        error_if_empty = None if state.train_epoch_length == 0 else NO_TRAIN_BATCH
        return numbered_batches(train_dl, state.epoch_first_step, error_if_empty)

    def _between_updates(self, step: int) -> None:
        """The point between two updates, where micro-batch ``step`` opens a window (its batch fetched, no gradient
        pending): the end of a resume, the saves asked for, a preemption; then the agreed stop, if any."""
        if self.run_state.has_work_at_safe_point():
            safe_points.reach_safe_point(self, step)
        self._raise_agreed_stop()

    def _reads_own_stream_part(self, dataloader: Any) -> bool:
        """Whether each process reads its own part of the training stream (``train(stream_split="dataset")``)."""
        options = self.run_state.options
        split = None if options is None else options.stream_split
        return reads_own_part(dataloader, split, layout_of(self._accelerator).dp_size)

    def _is_update_step(self, step: int, is_last_batch: bool) -> bool:
        """Whether the micro-batch ``step`` closes an accumulation window (or the epoch)."""
        return is_last_batch or (step + 1) % self.run_state.accumulation_steps == 0

    def _reached_max_steps(self) -> bool:
        """Whether the run has made its ``max_num_train_steps`` updates."""
        return self.run_state.reached_max_steps()

    def _clip_gradients(self) -> None:
        """Clip by norm and/or value as set in ``train()``; keep the norm in ``last_gradient_norm`` (no sync)."""
        config = get_run_config(self)
        clip_norm, clip_value, track_norm = (
            config.gradient_clip_norm,
            config.gradient_clip_value,
            self.track_gradient_norm,
        )
        if clip_norm is None and clip_value is None and not track_norm:
            return  # nothing asked for: the default run
        norm = accumulation.clip_gradients(self._accelerator, self.model, clip_norm, clip_value, track_norm)
        if clip_norm is not None or track_norm:
            self.last_gradient_norm = norm

    def _skips_non_finite_update(self) -> bool:
        """Whether the non-finite policy skips this update, after its retries; may raise ``StopTrainingError``."""
        policy = cast(NonFinitePolicy, self.run_state.non_finite_policy)  # the loop calls it under a policy only
        return policy.skips_update(self.run_state, self.model, self._training_optimizer, self._replay_window)

    def _end_non_finite_policy(self) -> None:
        """Check no more gradients as the run's epochs end; say how many updates the policy skipped, if any."""
        policy = self.run_state.end_non_finite_policy()
        if policy is not None and policy.skipped_in_run and policy.on_exhausted == "skip":  # else the stop said it
            self.print(policy.summary())

    def _replay_window(self, window: list) -> None:
        """Run the window's ``(batch, step)`` pairs again, for a non-finite retry: no event, one sync at the last."""
        state = self.run_state
        state.retrying_window = True
        try:
            for index, (batch, step) in enumerate(window):
                state.batch_idx, state.closes_window = step, index == len(window) - 1
                if self._passes_take_window_flag:
                    self._perform_forward_and_backward_passes(batch, step, is_update_step=state.closes_window)
                else:
                    self._perform_forward_and_backward_passes(batch, step)
        finally:
            state.retrying_window = False

    def _record_epoch_values(
        self, loss_tracker: LossTracker, step_metrics: StepMetricsTracker, loss_name: str, metric_name_format: str
    ) -> None:
        """Record the epoch's mean loss and step metrics over every process (one read back per epoch)."""
        record_epoch_values(
            self.run_history, self._accelerator, loss_tracker, step_metrics, loss_name, metric_name_format
        )

    # --- What hooks and callbacks use: device, Accelerator, run counters, model, printing, gathering ---

    @property
    def device(self) -> torch.device:
        """The device of this process, as chosen by Accelerate."""
        return torch.device(self._accelerator.device)

    @property
    def accelerator(self) -> Accelerator:
        """The :class:`accelerate.Accelerator` of this trainer (read-only)."""
        return self._accelerator

    @property
    def num_update_steps_completed(self) -> int:
        """Optimizer updates made so far in the current training run."""
        return self.run_state.num_update_steps_completed

    @property
    def epoch_first_step(self) -> int:
        """The first micro-batch of the current training epoch: 0, or the batches a resumed run had trained on."""
        return self.run_state.epoch_first_step

    @property
    def batch_idx(self) -> Optional[int]:
        """The index in its epoch of the training or evaluation batch being run, from 0 (the ``step`` the step events
        receive); the last one's after an epoch, ``None`` before the first."""
        return self.run_state.batch_idx

    @property
    def eval_batch_real_rows(self) -> Optional[int]:
        """In an evaluation epoch, the rows of this process's batch that are real samples when the rest only repeat
        samples so that every process runs the same steps (the last batch of a multi-process run); else ``None``."""
        return self.run_state.eval_batch_real_rows

    @property
    def _train_dataloader(self) -> Optional[Iterable]:
        """Another name of :attr:`train_dataloader` (read and set)."""
        return self.train_dataloader

    @_train_dataloader.setter
    def _train_dataloader(self, dataloader: Optional[Iterable]) -> None:
        self.train_dataloader = dataloader

    @property
    def _eval_dataloader(self) -> Optional[Iterable]:
        """Another name of :attr:`eval_dataloader` (read and set)."""
        return self.eval_dataloader

    @_eval_dataloader.setter
    def _eval_dataloader(self, dataloader: Optional[Iterable]) -> None:
        self.eval_dataloader = dataloader

    @property
    def _training_optimizer(self) -> torch.optim.Optimizer:
        """``self.optimizer``, which a training run needs: an evaluation-only trainer (``optimizer=None``) has none."""
        if self.optimizer is None:
            raise ValueError("The trainer has no optimizer (optimizer=None): pass one to Trainer(...) to train.")
        return self.optimizer

    def get_model(self, keep_torch_compile: bool = False) -> torch.nn.Module:
        """Return the model without its distributed wrappers, and without ``torch.compile``'s unless
        ``keep_torch_compile``. Under FSDP its parameters are this process's shards: for full weights use
        ``save_checkpoint``, ``save_weights`` or ``sharded.get_full_model_state_dict`` (on every process)."""
        return self._accelerator.unwrap_model(self.model, keep_torch_compile=keep_torch_compile)

    def _unwrap_models(self) -> None:
        """Take the distributed wrappers off ``self.model``, the extra models and their optimizers."""
        self.model = self._unwrap_distributed_model()
        unwrap_extras(self.accelerator, self.extra_models, self.extra_optimizers)

    def _unwrap_distributed_model(self) -> torch.nn.Module:
        # keeps the wrapper of a model the user compiled; the trainer's own (torch_compile=...) is made again by prepare
        return unwrap_distributed_model(self._accelerator, self.model, keep_torch_compile=self.torch_compile is False)

    def print(self, *args, **kwargs) -> None:
        """Print once per node, like ``print``; each line is written in one call, so the output of other processes
        never lands inside it."""
        print_on_node(*args, **kwargs)

    def gather(self, tensor: torch.Tensor, padding_value: Any = None) -> torch.Tensor:
        """Concatenate ``tensor`` from every process along the first dimension.

        Args:
            tensor: the tensor of this process.
            padding_value: pads tensors of different lengths before gathering, and its rows are removed after;
                pick a value the data never holds. Either way, the rows Accelerate repeats in the last batch of the
                data are dropped (as in :meth:`gather_for_metrics`), so each sample is returned once.

        Returns:
            The gathered tensor, on every process.
        """
        if padding_value is None:
            return gather_for_metrics_by_rank(self._accelerator, tensor)
        if self.eval_batch_real_rows is not None:  # the last evaluation batch: the rows after these repeat samples
            tensor = tensor[: self.eval_batch_real_rows]
        tensor = self._accelerator.pad_across_processes(tensor, dim=0, pad_index=padding_value)
        gathered = keep_model_group_leaders(self._accelerator, self._accelerator.gather(tensor))
        return remove_padding(gathered, padding_value)

    def gather_for_metrics(self, data: Any) -> Any:
        """Gather ``data`` (tensors or picklable objects) from every process for metrics: over an evaluation epoch,
        exactly the dataset's rows, in order. A collective: every process must call it at the same step.

        Under tensor parallelism each sample is counted once, from its data-parallel rank (the processes of one
        tensor-parallel group hold the same rows)."""
        return gather_for_metrics_by_rank(self._accelerator, data)

    def run_extra_eval_epoch(
        self, model: Optional[torch.nn.Module] = None, callbacks=None, metric_name_prefix: str = ""
    ) -> None:
        """Run one more evaluation epoch now, during a training run, over its evaluation data.

        For callbacks that evaluate between updates or other weights. The trainer's model, callbacks, metric prefix
        and every module's training mode are restored after.

        Args:
            model: the module to evaluate in place of ``trainer.model`` (an EMA copy), on the run's device.
            callbacks: a :class:`CallbackHandler` or callbacks to call during this epoch instead of the trainer's.
            metric_name_prefix: prepended to each metric recorded during the epoch, so the epoch's own stay.

        Raises:
            ValueError: the run has no evaluation data, or ``model`` is on another device.

        Example::

            trainer.run_extra_eval_epoch(model=ema_model, metric_name_prefix="ema_")  # ema_eval_loss_epoch
        """
        if self.eval_dataloader is None:
            raise ValueError(
                "run_extra_eval_epoch() evaluates on the eval_dataset of the training run, but this run has none: pass "
                "train(..., eval_dataset=...), or call evaluate(dataset) outside the run."
            )
        history, evaluated = self.run_history, model if model is not None else self.model
        if model is not None:
            validate_model_on_device(model, self.device, "run_extra_eval_epoch(model=...)")
        restore = (self.model, self.callback_handler, getattr(history, "metric_name_prefix", ""))
        if callbacks is not None:
            self.callback_handler = callbacks if isinstance(callbacks, CallbackHandler) else CallbackHandler(callbacks)
        self.model = evaluated
        history.set_metric_name_prefix(metric_name_prefix)
        try:
            with training_modes_kept(evaluated):
                self._run_eval_epoch(self.eval_dataloader)
        finally:
            self.model, self.callback_handler = restore[:2]
            history.set_metric_name_prefix(restore[2])

    def skip_non_finite_steps(
        self, max_consecutive_skips: Optional[int] = None, max_retries: int = 0, on_exhausted: str = "skip"
    ) -> NonFinitePolicy:
        """For the rest of this training run, skip each optimizer update whose gradients are not finite.

        A skipped update leaves the weights, the optimizer and the scheduler untouched, and its loss out of
        ``train_loss_epoch``. Checking reads one flag back from the device per update (a host-device sync; none
        without a policy). ``SkipNonFiniteStepsCallback`` calls this in ``on_training_run_start``.

        Args:
            max_consecutive_skips: stop the run after this many skipped updates in a row (``None``: never).
            max_retries: first re-run the update's accumulation window this many times (a retry fires no event).
            on_exhausted: for an update still not finite after its retries: ``"skip"`` it and go on, ``"stop"`` the
                run cleanly, or stop it and ``"raise"`` a
                :class:`~pytorch_accel_trainer.callbacks.NonFiniteGradientsError` from ``train()`` once the run ended.

        Returns:
            The policy, which counts the skips (``skipped_in_epoch``, ``skipped_in_run``).

        Raises:
            ValueError: an invalid argument.
        """
        policy = NonFinitePolicy(
            max_consecutive_skips=max_consecutive_skips, max_retries=max_retries, on_exhausted=on_exhausted
        )
        self.run_state.set_non_finite_policy(policy)
        return policy


class TrainerWithTimmScheduler(TimmSchedulerMixin, Trainer):
    """A :class:`Trainer` that steps a `timm scheduler <https://timm.fast.ai/schedulers>`_ as timm expects:
    ``step_update(num_updates=n)`` after each update (``n``: the run's updates), ``step(epoch)`` after each epoch."""
