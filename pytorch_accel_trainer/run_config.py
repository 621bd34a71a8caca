"""The frozen description of the current run: the ``train()`` options and their checks (``max_time`` read as seconds
included), the checks of ``evaluate()``'s arguments, and the run config built from them."""

from __future__ import annotations

import datetime
import math
import re
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Optional, Protocol, Union

import torch
from accelerate import Accelerator, DistributedType

from pytorch_accel_trainer.data import dataloader_length, dataset_length, validate_dataloader_kwargs, validate_dataset
from pytorch_accel_trainer.errors import validate_positive_number, validate_positive_option
from pytorch_accel_trainer.parallel.layout import layout_of

#: An optional positive number; ``Union[int, float]`` rather than ``numbers.Number``, which parsers cannot build.
OptionalNumber = Optional[Union[int, float]]


@dataclass(frozen=True)
class TrainOptions:
    """The arguments of ``Trainer.train()`` other than the datasets, checked once when created.

    ``train()`` builds one and passes it on, so that adding an option touches this class, ``train()``'s
    signature and the place that uses it; ``trainer.run_state.options`` holds the current run's.

    Raises:
        ValueError, TypeError: an option is not valid; the message names it, its value and the fix.
    """

    num_epochs: Optional[int]
    per_device_batch_size: int = 8
    max_num_train_steps: Optional[int] = None
    gradient_accumulation_steps: int = 1
    gradient_clip_value: OptionalNumber = None
    create_scheduler_fn: Optional[Callable] = None
    train_dataloader_kwargs: Optional[dict] = None
    eval_dataloader_kwargs: Optional[dict] = None
    reset_run_history: bool = True
    collate_fn: Optional[Callable] = None
    gradient_clip_norm: OptionalNumber = None
    resume_from: Any = None
    allow_resume_changes: bool = False
    scheduler_interval: str = "step"
    max_time: Any = None
    max_time_save_dir: Any = None
    stream_split: str = "main_process"
    check_first_eval_batch: bool = True

    def __post_init__(self):
        validate_train_options(self)

    @classmethod
    def from_arguments(cls, arguments: dict, **changes: Any) -> TrainOptions:
        """The options among ``arguments`` (``train()``'s ``locals()``: its datasets and ``self`` are left out), with
        ``changes`` applied."""
        return cls(**{**{field.name: arguments[field.name] for field in fields(cls)}, **changes})


def validate_train_options(options: TrainOptions) -> None:
    """Check every option of ``Trainer.train`` (a ``TrainOptions``) before any work starts."""
    num_epochs, max_num_train_steps = options.num_epochs, options.max_num_train_steps
    validate_positive_option("num_epochs", num_epochs, allow_none=True)
    validate_positive_option("max_num_train_steps", max_num_train_steps, allow_none=True)
    if num_epochs is None and max_num_train_steps is None:
        raise ValueError(
            "num_epochs and max_num_train_steps are both None, so the run would never end: pass num_epochs, "
            "max_num_train_steps, or both (whichever comes first ends the run)."
        )
    validate_positive_option("per_device_batch_size", options.per_device_batch_size)
    validate_positive_option("gradient_accumulation_steps", options.gradient_accumulation_steps)
    validate_positive_number("gradient_clip_value", options.gradient_clip_value)
    validate_positive_number("gradient_clip_norm", options.gradient_clip_norm)
    _validate_scheduler_factory(options.create_scheduler_fn)
    if options.scheduler_interval not in ("step", "epoch"):
        raise ValueError(
            f"scheduler_interval={options.scheduler_interval!r} is not valid: pass 'step' to step the scheduler after "
            "each optimizer update (the default), or 'epoch' to step it once at the end of each epoch."
        )
    if options.stream_split not in ("main_process", "dataset"):
        raise ValueError(
            f"stream_split={options.stream_split!r} is not valid: pass 'main_process' to have the main process read a "
            "training stream and send each process its batches (the default), or 'dataset' for a stream that splits "
            "itself between the processes, each reading its own part."
        )
    validate_dataloader_kwargs("train_dataloader_kwargs", options.train_dataloader_kwargs)
    validate_dataloader_kwargs("eval_dataloader_kwargs", options.eval_dataloader_kwargs)
    max_time_seconds(options.max_time)
    if options.max_time_save_dir is not None and options.max_time is None:
        raise ValueError(
            f"max_time_save_dir={str(options.max_time_save_dir)!r} is where a run stopped by its time budget saves, "
            "but max_time is None: pass max_time too (e.g. max_time='00:11:50:00'), or leave max_time_save_dir out."
        )
    if not isinstance(options.check_first_eval_batch, bool):
        raise TypeError(
            f"check_first_eval_batch={options.check_first_eval_batch!r} is not valid: pass True to run the first "
            "evaluation batch through the model before training (the default), or False to skip that forward pass."
        )
    if options.collate_fn is not None and not callable(options.collate_fn):
        raise TypeError(
            f"collate_fn={options.collate_fn!r} is not callable: pass a function that turns a list of samples into "
            "a batch, or None for torch's default_collate."
        )


def _validate_scheduler_factory(create_scheduler_fn: Any) -> None:
    if create_scheduler_fn is None:
        return
    if isinstance(create_scheduler_fn, torch.optim.lr_scheduler.LRScheduler) or hasattr(
        create_scheduler_fn, "get_last_lr"
    ):
        raise TypeError(
            f"create_scheduler_fn received a scheduler instance ({type(create_scheduler_fn).__name__}); it needs a "
            "factory that takes the optimizer, because the optimizer is only prepared when training starts. Pass "
            "e.g. functools.partial(torch.optim.lr_scheduler.StepLR, step_size=7) instead."
        )
    if not callable(create_scheduler_fn):
        raise TypeError(
            f"create_scheduler_fn={create_scheduler_fn!r} is not callable: pass a function that takes the optimizer "
            "and returns a scheduler, e.g. functools.partial(StepLR, step_size=7)."
        )


def validate_evaluate_arguments(dataset: Any, per_device_batch_size: int, dataloader_kwargs: Any) -> None:
    """Check every argument of ``Trainer.evaluate`` before any work starts."""
    if dataset is None:
        raise ValueError(
            "evaluate() received no dataset and the trainer has no eval_dataset from an earlier train(): pass "
            "evaluate(dataset=...)."
        )
    validate_dataset("dataset", dataset)
    validate_positive_option("per_device_batch_size", per_device_batch_size)
    validate_dataloader_kwargs("dataloader_kwargs", dataloader_kwargs)


#: ``train(max_time=...)`` as text: ``"DD:HH:MM:SS"``, or ``"HH:MM:SS"`` without the days.
_MAX_TIME_FIELDS = ("days", "hours", "minutes", "seconds")


#: The longest time budget taken: ``datetime.timedelta``'s (999999999 days); a longer one is a typo.
_MAX_TIME_LIMIT = datetime.timedelta.max


def max_time_seconds(max_time: Any) -> Optional[float]:
    """The time budget ``train(max_time=...)`` in seconds (``None``: no budget), from seconds, ``"DD:HH:MM:SS"`` or
    ``"HH:MM:SS"``, a ``datetime.timedelta`` or a dict of its arguments (``{"hours": 12}``). The command line and
    config files give it as the same text (see ``docs/config.md``).

    Raises:
        ValueError, TypeError: naming the value and the forms taken; ``ValueError`` also for a budget longer than
            999999999 days (``datetime.timedelta.max``).
    """
    if max_time is None:
        return None
    forms = (
        "pass seconds (max_time=3600), 'DD:HH:MM:SS' or 'HH:MM:SS' (max_time='00:11:50:00' or '11:50:00' for "
        "11 h 50 min), a datetime.timedelta, or a dict of its arguments (max_time={'hours': 11, 'minutes': 50})"
    )
    seconds: Any = None
    too_long = False
    try:
        if isinstance(max_time, str):
            parts = [part.strip() for part in max_time.strip().split(":")]
            if len(parts) in (3, 4) and all(re.fullmatch("[0-9]+", part) for part in parts):
                fields = dict(zip(_MAX_TIME_FIELDS[-len(parts) :], map(int, parts)))
                seconds = datetime.timedelta(**fields).total_seconds()
        elif isinstance(max_time, datetime.timedelta):
            seconds = max_time.total_seconds()
        elif isinstance(max_time, dict):
            try:
                seconds = datetime.timedelta(**max_time).total_seconds()
            except (TypeError, ValueError):  # an unknown name, a value that is not a number, NaN
                seconds = None
        elif isinstance(max_time, (int, float)) and not isinstance(max_time, bool):
            seconds = float(max_time)
        else:
            raise TypeError(f"max_time={max_time!r} is a {type(max_time).__name__}: {forms}.")
    except OverflowError:  # past timedelta's range
        too_long = True
    if too_long or (seconds is not None and math.isfinite(seconds) and seconds > _MAX_TIME_LIMIT.total_seconds()):
        raise ValueError(
            f"max_time={max_time!r} is longer than the longest time budget taken, {_MAX_TIME_LIMIT.days} days "
            "(datetime.timedelta.max): pass the job's real limit (e.g. max_time='00:11:50:00'), or max_time=None for "
            "no budget."
        )
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"max_time={max_time!r} is not a time budget longer than 0 s: {forms}.")
    return seconds


@dataclass(frozen=True)
class TrainerRunConfig:
    """An immutable record of how the current training or evaluation run is set up.

    The fields are those of pytorch-accelerated's ``TrainerRunConfig``, plus ``gradient_clip_norm``, ``seed`` and
    ``data_parallel_size`` (the processes that read different batches: ``num_processes`` divided by the tensor- and
    context-parallel sizes of a ``ParallelismConfig``; the total batch sizes count it). Step counts are optimizer
    updates; ``None`` means "unknown", as for a dataset without ``__len__``.
    """

    num_epochs: Optional[int]
    train_per_device_batch_size: Optional[int]
    train_dl_kwargs: Optional[dict]
    eval_per_device_batch_size: Optional[int]
    eval_dl_kwargs: Optional[dict]
    gradient_accumulation_steps: int
    train_total_batch_size: Optional[int]
    eval_total_batch_size: Optional[int]
    num_update_steps_per_epoch: Optional[int]
    num_local_update_steps_per_epoch: Optional[int]
    max_num_train_steps: Optional[int]
    is_local_process_zero: bool
    is_world_process_zero: bool
    is_distributed: bool
    mixed_precision: str
    num_processes: int
    gradient_clip_value: OptionalNumber = None
    gradient_clip_norm: OptionalNumber = None
    seed: Optional[int] = None
    data_parallel_size: Optional[int] = None  # None: num_processes (a run config built by hand)

    def __getitem__(self, name: str) -> Any:
        """Allow ``run_config["num_epochs"]``, as older pytorch-accelerated code does."""
        return getattr(self, name)

    def to_dict(self) -> dict:
        """Return the fields as a plain dictionary."""
        return asdict(self)


class _HasRunConfig(Protocol):
    """A trainer, as far as :func:`get_run_config` needs one."""

    @property
    def run_config(self) -> Optional[TrainerRunConfig]: ...


def get_run_config(trainer: _HasRunConfig) -> TrainerRunConfig:
    """Return the run config of the trainer's current (or last) run.

    For callbacks and hooks that run during ``train()`` or ``evaluate()``, which set it before
    ``on_training_run_start`` / ``on_evaluation_run_start``.

    Raises:
        RuntimeError: no run has started yet, so the trainer has no run config.
    """
    config = trainer.run_config
    if config is None:
        raise RuntimeError(
            "trainer.run_config is None: it is set when train() or evaluate() starts. Read it from "
            "on_training_run_start or on_evaluation_run_start onwards, not before the first run."
        )
    return config


def data_parallel_size(trainer: _HasRunConfig) -> int:
    """The processes of the trainer's current (or last) run that read different batches (``num_processes`` without
    tensor or context parallelism): what sample counts and rates multiply by."""
    config = get_run_config(trainer)
    return config.data_parallel_size or config.num_processes


def count_update_steps(num_batches: Optional[int], gradient_accumulation_steps: int) -> Optional[int]:
    """Return the optimizer updates in an epoch of ``num_batches`` micro-batches (a partial window counts)."""
    if num_batches is None:
        return None
    return math.ceil(num_batches / gradient_accumulation_steps)


def plan_run_length(
    num_epochs: Optional[int], max_num_train_steps: Optional[int], updates_per_epoch: Optional[int]
) -> tuple[Optional[int], Optional[int]]:
    """Return the ``(num_epochs, max_num_train_steps)`` the run will really make.

    Whichever limit comes first ends the run, so each is lowered to what the other allows when the
    number of updates per epoch is known.
    """
    if updates_per_epoch is None:
        return num_epochs, max_num_train_steps
    steps_in_epochs = None if num_epochs is None else num_epochs * updates_per_epoch
    if max_num_train_steps is None:
        return num_epochs, steps_in_epochs
    total_steps = max_num_train_steps if steps_in_epochs is None else min(max_num_train_steps, steps_in_epochs)
    return math.ceil(total_steps / max(updates_per_epoch, 1)), total_steps


def dataloader_batch_size(dataloader: Any, dataloader_kwargs: Optional[dict], per_device_batch_size: int) -> int:
    """The batch size of each process of the prepared ``dataloader``, read from it (an overridden
    ``create_*_dataloader`` may build its own, whatever ``train()`` was given); for an iterable that does not say,
    its ``batch_size`` argument, else ``per_device_batch_size``."""
    for source in (getattr(dataloader, "batch_sampler", None), dataloader):
        size = getattr(source, "batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return (dataloader_kwargs or {}).get("batch_size", per_device_batch_size)


def build_run_config(
    options: TrainOptions,
    accelerator: Accelerator,
    dataloaders: tuple,
    dataloader_kwargs: tuple,
    train_dataset: Any,
    seed: Optional[int],
) -> TrainerRunConfig:
    """Return the :class:`TrainerRunConfig` of a run with ``options`` on the prepared ``(train, eval)`` dataloaders.

    Built after Accelerate prepares the dataloaders, which shards them across processes and changes their length.

    Raises:
        ValueError: the training dataloader has no batch on this process.
    """
    train_dataloader, eval_dataloader = dataloaders
    train_dl_kwargs, eval_dl_kwargs = dataloader_kwargs
    per_device_batch_size, accumulation = options.per_device_batch_size, options.gradient_accumulation_steps
    train_batch_size: Optional[int] = dataloader_batch_size(train_dataloader, train_dl_kwargs, per_device_batch_size)
    eval_batch_size = dataloader_batch_size(eval_dataloader, eval_dl_kwargs, per_device_batch_size)
    num_processes = accelerator.num_processes
    data_parallel = layout_of(accelerator).dp_size  # the processes of a tensor-parallel group read the same batches
    updates_per_epoch: Optional[int]
    if train_dataloader is None:
        train_batch_size, updates_per_epoch = None, 0
    else:
        updates_per_epoch = count_update_steps(dataloader_length(train_dataloader), accumulation)
        if updates_per_epoch == 0 and dataset_length(train_dataset) is not None:  # else the loop names the empty epoch
            raise ValueError(
                f"The training dataloader has no batches on this process (dataset of {len(train_dataset)} "
                f"samples, batch size {train_batch_size}, {num_processes} processes, "
                f"dataloader arguments {train_dl_kwargs}). Lower the batch size or drop drop_last=True."
            )
        if updates_per_epoch == 0:  # a dataloader of the user's that says it is empty, over data of unknown size
            warnings.warn(
                "The training dataloader has no batches (len(dataloader) == 0), so this run makes no update. Check "
                "what create_train_dataloader returns.",
                stacklevel=3,
            )
    num_epochs, max_num_train_steps = plan_run_length(
        options.num_epochs, options.max_num_train_steps, updates_per_epoch
    )
    return TrainerRunConfig(
        num_epochs=num_epochs,
        train_per_device_batch_size=train_batch_size,
        train_dl_kwargs=train_dl_kwargs,
        eval_per_device_batch_size=eval_batch_size,
        eval_dl_kwargs=eval_dl_kwargs,
        gradient_accumulation_steps=accumulation,
        train_total_batch_size=None if train_batch_size is None else train_batch_size * data_parallel * accumulation,
        eval_total_batch_size=None if eval_batch_size is None else eval_batch_size * data_parallel,
        num_update_steps_per_epoch=updates_per_epoch,
        num_local_update_steps_per_epoch=updates_per_epoch,
        max_num_train_steps=max_num_train_steps,
        is_local_process_zero=accelerator.is_local_main_process,
        is_world_process_zero=accelerator.is_main_process,
        is_distributed=accelerator.distributed_type != DistributedType.NO,
        mixed_precision=accelerator.mixed_precision,
        num_processes=num_processes,
        gradient_clip_value=options.gradient_clip_value,
        gradient_clip_norm=options.gradient_clip_norm,
        seed=seed,
        data_parallel_size=data_parallel,
    )
