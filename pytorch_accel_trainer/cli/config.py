"""A training run described by data: the typed, frozen configuration that a YAML file or command-line flags fill.

:class:`TrainingConfig` holds the model and optimizer (by class path and arguments), the loss, the scheduler (its
arguments may be placeholders), the data (functions by import path), the callbacks, the ``Trainer`` options, the
``train()`` arguments and the run folder. ``pytorch-accel-trainer fit --config run.yaml`` (``cli.py``) parses one
with jsonargparse and calls :func:`run_training_config`; the Python API is unchanged and stays the primary way.
See ``docs/config.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Optional, Sequence, Union

import safetensors.torch
import torch

from pytorch_accel_trainer.callbacks import ExperimentTrackingCallback, SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.cli.run_folder import WEIGHTS_FILE, RunFolderCallback, remove_if_empty, validate_run_name
from pytorch_accel_trainer.placeholders import placeholder_from_text
from pytorch_accel_trainer.predictions import PREDICTION_FILE_SUFFIXES, validate_prediction_store
from pytorch_accel_trainer.run_config import OptionalNumber, max_time_seconds
from pytorch_accel_trainer.state.manager import RUN_FOLDER_STATES
from pytorch_accel_trainer.state.storage import as_location, exists, is_url, join, local_file_to_write, local_path
from pytorch_accel_trainer.trainer import DEFAULT_CALLBACKS, Trainer


class ConfigError(ValueError):
    """A configuration that cannot run: the message names the key, the value, the problem and the fix."""


class TimeBudgetText(str):
    """``train.max_time`` written with colons (``1:00:00:00``, ``12:00:00``), kept as that text for ``train()`` to
    read: jsonargparse would otherwise try ``float`` first and read it as a YAML 1.1 base-60 number (``1:00:00:00``:
    216000 s, not one day). Registered with jsonargparse by ``create_parser``."""

    def __new__(cls, value: Any) -> TimeBudgetText:
        if not isinstance(value, str) or ":" not in value:
            raise ValueError(f"{value!r} is not a time budget written with colons")
        return super().__new__(cls, value)


def serialize_time_budget_text(value: Any) -> str:
    """The text of a :class:`TimeBudgetText` (refusing other values, which jsonargparse then writes as their type)."""
    if not isinstance(value, TimeBudgetText):
        raise ValueError(f"{value!r} is not a TimeBudgetText")
    return str(value)


@dataclass(frozen=True)
class TrainerSettings:
    """The options of ``Trainer(...)`` besides the model, loss, optimizer and callbacks.

    Args:
        seed: seeds every random generator before the model is built and at the start of ``train()``; ``null``
            leaves them alone (the run is then not repeatable).
        mixed_precision: ``no``, ``bf16``, ``fp16``, ``fp8`` (or an alias: ``full``, ``bf16-mixed``, ...); ``null``
            takes it from ``accelerate launch``.
        torch_compile: compile the model with ``torch.compile``.
        cpu: run on the CPU even where a GPU is available.
    """

    seed: Optional[int] = 42
    mixed_precision: Optional[str] = None
    torch_compile: bool = False
    cpu: bool = False


@dataclass(frozen=True)
class TrainSettings:
    """The arguments of ``Trainer.train()`` (see its documentation); the datasets come from ``data``.

    Args:
        num_epochs: the number of epochs; ``null`` to stop on ``max_num_train_steps`` only.
        per_device_batch_size: the batch size on each process (also for evaluation).
        max_num_train_steps: the most optimizer updates to make.
        gradient_accumulation_steps: micro-batches per optimizer update.
        gradient_clip_value: clip each gradient element to ``[-value, value]``.
        gradient_clip_norm: clip the total gradient norm to this value.
        train_dataloader_kwargs: extra arguments of the training DataLoader (``num_workers``, ...).
        eval_dataloader_kwargs: extra arguments of the evaluation DataLoader.
        collate_fn: import path of the collate function of both dataloaders.
        resume_from: a training state, or a folder of them, to continue from (a path or an object-storage URL).
        allow_resume_changes: resume even if the batch size, accumulation, processes, data or an optimizer
            hyperparameter changed.
        scheduler_interval: ``step`` (after each update) or ``epoch`` (once per epoch).
        max_time: a time budget: seconds, ``DD:HH:MM:SS`` or ``HH:MM:SS`` (a cluster's wall-clock limit less a
            margin), read as ``train(max_time=...)`` reads the same text.
        max_time_save_dir: where a run its time budget stops saves a training state (besides the run folder's).
        stream_split: who reads a training stream on several processes: ``main_process`` (sends each process its
            batches) or ``dataset`` (a stream that splits itself: each process reads its own part).
        check_first_eval_batch: run the first evaluation batch through the model before training (``false``: skip
            that forward pass).
    """

    num_epochs: Optional[int] = None
    per_device_batch_size: int = 8
    max_num_train_steps: Optional[int] = None
    gradient_accumulation_steps: int = 1
    gradient_clip_value: OptionalNumber = None
    gradient_clip_norm: OptionalNumber = None
    train_dataloader_kwargs: Optional[dict] = None
    eval_dataloader_kwargs: Optional[dict] = None
    collate_fn: Optional[Callable] = None
    resume_from: Optional[str] = None
    allow_resume_changes: bool = False
    scheduler_interval: Literal["step", "epoch"] = "step"
    max_time: Union[TimeBudgetText, float, str, None] = None  # text with colons first: never a base-60 number
    max_time_save_dir: Optional[str] = None
    stream_split: Literal["main_process", "dataset"] = "main_process"
    check_first_eval_batch: bool = True


@dataclass(frozen=True)
class SchedulerSettings:
    """A learning-rate scheduler, built once the run's length is known (``train(create_scheduler_fn=...)``).

    Args:
        import_path: the scheduler class, e.g. ``torch.optim.lr_scheduler.OneCycleLR``.
        arguments: its arguments but the optimizer. A value may be a placeholder expression, resolved when training
            starts: ``NUM_EPOCHS``, ``NUM_UPDATE_STEPS_PER_EPOCH * NUM_EPOCHS``, ... (see ``TrainerPlaceholderValues``).
    """

    import_path: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DataSettings:
    """The datasets, each returned by a function given by import path (``package.module.function``).

    Args:
        train: the function that returns the training dataset (needed by ``fit``).
        eval: the function that returns the evaluation dataset (needed by ``evaluate``).
        predict: the function that returns the samples to predict (``predict``; ``eval`` when it is not given).
        arguments: keyword arguments passed to every function.
    """

    train: Optional[Callable] = None
    eval: Optional[Callable] = None
    predict: Optional[Callable] = None
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainingConfig:
    """A complete training run, as a config file or command-line flags describe it.

    Args:
        model: the model: ``class_path`` (import path of an ``nn.Module`` class) and ``init_args``. Built after
            seeding with ``trainer.seed``, so its initial weights are the same on every run.
        optimizer: ``class_path`` and ``init_args`` of the optimizer, built over the model's parameters (not needed
            by ``evaluate``).
        loss_func: import path of the loss function, or ``class_path``/``init_args`` of a loss module; ``null`` takes
            the ``loss`` of the model's output (Hugging Face models).
        scheduler: the learning-rate scheduler, if any.
        data: the datasets.
        callbacks: callbacks, each ``class_path`` and ``init_args``, added after the defaults.
        default_callbacks: start from the default callbacks (progress bar, printed metrics, ...).
        trainer_class: import path of the ``Trainer`` subclass to run.
        trainer_arguments: more keyword arguments of ``trainer_class`` (those of a subclass).
        trainer: the options of ``Trainer(...)``.
        train: the arguments of ``train()``.
        checkpoint: weights loaded before the run: the model that ``evaluate`` measures or ``predict`` runs, or the
            starting point of ``fit``. A run folder (its ``model.safetensors``), a ``.safetensors`` file
            (``save_weights``) or a file of ``save_checkpoint``. ``evaluate`` needs one, unless
            ``evaluate_initial_weights``.
        output_dir: write each run's folder here (``<output_dir>/<run_name>``): this config, the run config, the
            history, its plot, the final weights, the training states; ``null`` writes nothing.
        run_name: the run folder's name (one plain name, inside ``output_dir``); the start time by default. A name
            already taken gets ``-2``.
        save_training_states: save a training state at the end of each epoch in the run folder's
            ``training_states/``, to resume from (``--train.resume_from <run folder>``).
        max_training_states: keep the newest N of those states (3 by default); ``null`` keeps every one.
        evaluate_initial_weights: let ``evaluate`` measure the model as built, without a ``checkpoint``.
    """

    model: torch.nn.Module
    optimizer: Optional[Callable[[Iterable], torch.optim.Optimizer]] = None
    loss_func: Optional[Callable] = None
    scheduler: Optional[SchedulerSettings] = None
    data: DataSettings = field(default_factory=DataSettings)
    callbacks: list[TrainerCallback] = field(default_factory=list)
    default_callbacks: bool = True
    trainer_class: type[Trainer] = Trainer
    trainer_arguments: dict[str, Any] = field(default_factory=dict)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    checkpoint: Optional[str] = None
    output_dir: Optional[str] = None
    run_name: Optional[str] = None
    save_training_states: bool = False
    max_training_states: Optional[int] = 3
    evaluate_initial_weights: bool = False


# ------------------------------------------------------------------------------------------------
# Checks, before any work starts
# ------------------------------------------------------------------------------------------------


def validate_training_config(config: TrainingConfig, command: str) -> None:
    """Refuse a config that cannot run ``command`` (``fit``, ``evaluate`` or ``predict``), naming the key and the
    fix."""
    if not (isinstance(config.trainer_class, type) and issubclass(config.trainer_class, Trainer)):
        raise ConfigError(
            f"trainer_class: {config.trainer_class!r} is not a Trainer class; give the import path of "
            "pytorch_accel_trainer.Trainer or of a subclass of it, e.g. my_package.training.MyTrainer."
        )
    needed = {  # what each command needs: (key, value, a flag that sets it)
        "fit": (
            ("data.train", config.data.train, "--data.train my_package.data.train_dataset"),
            ("optimizer", config.optimizer, "--optimizer torch.optim.AdamW --optimizer.lr 0.001"),
        ),
        "evaluate": (("data.eval", config.data.eval, "--data.eval my_package.data.eval_dataset"),),
        "predict": (
            ("data.predict", config.data.predict or config.data.eval, "--data.predict my_package.data.test_samples"),
        ),
    }
    for key, value, example in needed[command]:
        if value is None:
            raise ConfigError(f"{key} is missing: `{command}` needs it. Set it in the config file or with {example}.")
    if command == "evaluate" and config.checkpoint is None and not config.evaluate_initial_weights:
        raise ConfigError(
            "checkpoint is missing: `evaluate` would measure the model's initial (untrained) weights. Pass the weights "
            "to measure with --checkpoint <run folder> (or its model.safetensors, or a save_checkpoint file), or "
            "--evaluate_initial_weights true to measure the model as built."
        )
    _validate_data_arguments(config, command)
    if config.checkpoint is not None:
        checkpoint_file(config.checkpoint)
    _validate_run_folder_keys(config)
    try:
        max_time_seconds(config.train.max_time)  # train()'s own check, before the datasets are built
    except (TypeError, ValueError) as error:
        raise ConfigError(f"train.{error}") from None
    if command == "fit" and config.train.num_epochs is None and config.train.max_num_train_steps is None:
        raise ConfigError(
            "train.num_epochs and train.max_num_train_steps are both null, so the run would never end: set "
            "train.num_epochs (e.g. --train.num_epochs 10), train.max_num_train_steps, or both."
        )
    if config.scheduler is not None:
        create_scheduler_factory(config.scheduler)  # the class imports and takes these arguments


def _validate_data_arguments(config: TrainingConfig, command: str) -> None:
    """``data.arguments`` go to every data function ``command`` calls: each must take them (its own ``TypeError``
    would come as a traceback once the run has started)."""
    data = config.data
    called = {
        "fit": (("data.train", data.train), ("data.eval", data.eval)),
        "evaluate": (("data.eval", data.eval),),
        "predict": (("data.predict", data.predict),) if data.predict is not None else (("data.eval", data.eval),),
    }
    for key, function in called[command]:
        if function is None:
            continue
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            continue  # no signature to read (a builtin): its own call says what it takes
        try:
            signature.bind(**data.arguments)
        except TypeError as error:
            name = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', function)}"
            raise ConfigError(
                f"data.arguments: {dict(data.arguments)!r} do not fit {key} ({name}): {error}. It takes "
                f"{list(signature.parameters)}; data.arguments go to every data function the command calls "
                f"(data.train and data.eval for fit), so give only arguments each of them takes, e.g. "
                f"--data.arguments '{{\"{next(iter(signature.parameters), 'name')}\": ...}}', or {{}} for none."
            ) from None


def checkpoint_file(checkpoint: str) -> Path:
    """The file of the ``checkpoint`` key: itself, or a run folder's ``model.safetensors``."""
    path = local_path(checkpoint)  # ~ and $VARIABLES expanded
    if path.is_dir():
        if not (path / WEIGHTS_FILE).is_file():
            raise ConfigError(
                f"checkpoint: {checkpoint!r} is a folder without {WEIGHTS_FILE}: pass a run folder (whose "
                f"{WEIGHTS_FILE} is written at the end of its run), a .safetensors file, or a file of save_checkpoint."
            )
        return path / WEIGHTS_FILE
    if not path.is_file():
        raise ConfigError(
            f"checkpoint: {checkpoint!r} does not exist: pass a run folder, its {WEIGHTS_FILE}, or a file of "
            "save_checkpoint."
        )
    return path


def _validate_run_folder_keys(config: TrainingConfig) -> None:
    if config.max_training_states is not None and (
        isinstance(config.max_training_states, bool) or config.max_training_states < 1
    ):
        raise ConfigError(
            f"max_training_states is {config.max_training_states!r}: pass a positive number of states to keep (e.g. "
            "3), or null to keep every one."
        )
    if config.output_dir is None:
        return
    try:
        validate_run_name(config.run_name)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if is_url(config.output_dir):
        return  # a store's URL: its package is checked where the run folder is made
    output_dir = local_path(config.output_dir)  # ~ and $VARIABLES expanded, as the run folder's is
    existing = next(folder for folder in (output_dir, *output_dir.absolute().parents) if folder.exists())
    if not existing.is_dir():
        raise ConfigError(
            f"output_dir: {config.output_dir!r} cannot hold run folders: {str(existing)!r} is a file. Pass a folder "
            "(created if needed), e.g. --output_dir runs."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"output_dir: {config.output_dir!r} cannot be written: {str(existing)!r} is not writable by this user. "
            "Pass a folder you can write to, e.g. --output_dir runs."
        )


def create_scheduler_factory(settings: SchedulerSettings) -> Callable:
    """The ``create_scheduler_fn`` of ``scheduler``: a partial of its class, placeholders in place."""
    scheduler_class = import_object(settings.import_path, "scheduler.import_path")
    arguments = {}
    for name, value in settings.arguments.items():
        try:
            arguments[name] = placeholder_from_text(value) if isinstance(value, str) else value
        except ValueError as error:
            raise ConfigError(f"scheduler.arguments.{name}: {error}") from None
    try:
        inspect.signature(scheduler_class).bind(None, **arguments)  # None stands for the optimizer
    except TypeError as error:
        names = [name for name in inspect.signature(scheduler_class).parameters if name != "optimizer"]
        raise ConfigError(
            f"scheduler.arguments: {settings.arguments!r} do not fit {settings.import_path} ({error}); its arguments "
            f"are {names}. Fix the names, or give the missing ones "
            f"(e.g. --scheduler.arguments.{names[0] if names else 'x'} ...)."
        ) from None
    return functools.partial(scheduler_class, **arguments)


def import_object(path: str, key: str) -> Any:
    """The object at import path ``path`` (``package.module.name``); ``key`` names where the config gave it."""
    module_name, _, name = str(path).rpartition(".")
    try:
        module = __import__(module_name, fromlist=[name]) if module_name else None
        return getattr(module, name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(
            f"{key}: {path!r} does not import ({type(error).__name__}: {error}). Give the full import path of the "
            "object, e.g. torch.optim.lr_scheduler.OneCycleLR, from a package installed or in the current folder."
        ) from None


# ------------------------------------------------------------------------------------------------
# Running a config
# ------------------------------------------------------------------------------------------------


def create_trainer(
    config: TrainingConfig,
    config_text: Optional[str] = None,
    hyperparameters: Optional[dict] = None,
    extra_callbacks: Sequence[TrainerCallback] = (),
) -> Trainer:
    """Return the trainer that ``config`` describes, with its callbacks, the checkpoint's weights loaded, and (with
    ``output_dir``) its run folder chosen.

    Args:
        config: a validated configuration (:func:`validate_training_config`), whose model is built.
        config_text: the YAML of the complete configuration, written to the run folder.
        hyperparameters: the flat configuration given to experiment trackers with the run config.
        extra_callbacks: callbacks added after the config's (``tune``'s pruning callback).
    """
    model = config.model
    try:
        optimizer = None if config.optimizer is None else config.optimizer(model.parameters())
    except (TypeError, ValueError) as error:  # the optimizer's own check of its arguments (lr < 0, ...)
        raise ConfigError(
            f"optimizer: the optimizer refused its arguments ({error}). Fix optimizer.init_args (e.g. "
            "--optimizer.init_args.lr 0.001)."
        ) from None
    callbacks = [*(DEFAULT_CALLBACKS if config.default_callbacks else ()), *config.callbacks, *extra_callbacks]
    for callback in config.callbacks:
        if isinstance(callback, ExperimentTrackingCallback) and hyperparameters:  # trackers get the whole config
            callback.config = {**hyperparameters, **(callback.config or {})}
    settings = config.trainer
    trainer = config.trainer_class(
        model,
        config.loss_func,
        optimizer,
        callbacks=callbacks,
        seed=settings.seed,
        mixed_precision=settings.mixed_precision,
        torch_compile=settings.torch_compile,
        cpu=settings.cpu,
        **config.trainer_arguments,
    )
    if config.checkpoint is not None:
        load_checkpoint(trainer, checkpoint_file(config.checkpoint))
    if config.output_dir is not None:
        run_folder = RunFolderCallback(config.output_dir, config.run_name, config_text)
        trainer.callback_handler.add_callback(run_folder)
        folder = run_folder.choose_folder(trainer)  # a path, or an object-storage URL
        for callback in config.callbacks:  # the trackers' run is named as its folder, unless the config names it
            if isinstance(callback, ExperimentTrackingCallback):
                callback.use_run_name(str(folder).rsplit("/", 1)[-1])
        if config.save_training_states:  # one per epoch: the last one is the run's end, so no `final` besides it
            trainer.callback_handler.add_callback(
                SaveTrainingStateCallback(
                    save_dir=join(folder, RUN_FOLDER_STATES),
                    save_every_n_epochs=1,
                    save_at_end=False,
                    max_checkpoints=config.max_training_states,
                )
            )
    return trainer


def load_checkpoint(trainer: Trainer, path: Path) -> None:
    """Load the weights of ``path`` (safetensors, or a file of save_checkpoint) into the trainer's model."""
    from safetensors import SafetensorError

    if path.suffix != ".safetensors":
        trainer.load_checkpoint(path, load_optimizer=False)
        return
    try:
        safetensors.torch.load_model(trainer.model, str(path))
    except SafetensorError as error:
        raise ConfigError(f"checkpoint: {str(path)!r} is not a safetensors file ({error}).") from None
    except RuntimeError as error:
        raise ConfigError(
            f"checkpoint: {str(path)!r} does not fit the model ({str(error).strip()[:500]}): pass the weights of a run "
            "of this model."
        ) from None


def run_training_config(
    config: TrainingConfig,
    command: str = "fit",
    config_text: Optional[str] = None,
    hyperparameters: Optional[dict] = None,
    extra_callbacks: Sequence[TrainerCallback] = (),
) -> tuple[Trainer, Union[Any, dict]]:
    """Run ``command`` (``fit``: ``train()``; ``evaluate``: ``evaluate()``) as ``config`` describes, with
    ``extra_callbacks`` added; return the trainer and what the run returned (a ``TrainResult``, or the evaluation's
    metrics)."""
    validate_training_config(config, command)
    data, arguments = config.data, config.data.arguments
    eval_dataset = None if data.eval is None else data.eval(**arguments)
    trainer = create_trainer(config, config_text, hyperparameters, extra_callbacks)
    try:
        return trainer, _run_command(trainer, config, command, eval_dataset)
    finally:
        for callback in trainer.callback_handler:
            if isinstance(callback, RunFolderCallback) and isinstance(callback.folder, Path):  # not in a store
                remove_if_empty(callback.folder)  # a run that failed before writing anything, or an evaluation


def _run_command(trainer: Trainer, config: TrainingConfig, command: str, eval_dataset: Any) -> Any:
    data, arguments, train = config.data, config.data.arguments, config.train
    if command == "evaluate":
        return trainer.evaluate(
            eval_dataset,
            per_device_batch_size=train.per_device_batch_size,
            dataloader_kwargs=train.eval_dataloader_kwargs,
            collate_fn=train.collate_fn,
        )
    scheduler = None if config.scheduler is None else create_scheduler_factory(config.scheduler)
    create_train_dataset = data.train
    if create_train_dataset is None:  # refused by validate_training_config; checked again for the type checker
        raise ConfigError(
            "data.train is missing: `fit` needs it. Set it in the config file or with "
            "--data.train my_package.data.train_dataset."
        )
    result = trainer.train(
        create_train_dataset(**arguments),
        num_epochs=train.num_epochs,
        eval_dataset=eval_dataset,
        per_device_batch_size=train.per_device_batch_size,
        max_num_train_steps=train.max_num_train_steps,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        gradient_clip_value=train.gradient_clip_value,
        gradient_clip_norm=train.gradient_clip_norm,
        create_scheduler_fn=scheduler,
        train_dataloader_kwargs=train.train_dataloader_kwargs,
        eval_dataloader_kwargs=train.eval_dataloader_kwargs,
        collate_fn=train.collate_fn,
        resume_from=train.resume_from,  # a path or a URL, as train() takes it
        allow_resume_changes=train.allow_resume_changes,
        scheduler_interval=train.scheduler_interval,
        max_time=train.max_time,
        max_time_save_dir=train.max_time_save_dir,
        stream_split=train.stream_split,
        check_first_eval_batch=train.check_first_eval_batch,
    )
    return result


def run_prediction_config(
    config: TrainingConfig, output: str, config_text: Optional[str] = None
) -> tuple[Trainer, Any]:
    """Run ``Trainer.predict`` on ``data.predict`` (or ``data.eval``) as ``config`` describes, with the weights of
    ``checkpoint``; write the predictions to ``output`` and return the trainer and the location written: a ``Path``,
    or the URL as given (without a trailing ``/``).

    ``output`` is a local path or a URL of object storage (``s3://bucket/preds.pt``; see ``state/storage.py``). One
    ending in ``.pt`` or ``.pth`` is one file of the predictions (``torch.load`` reads it), written by the main
    process; one without a suffix, or ending in ``/``, a new folder the predictions are written to in chunks as they
    come (``Trainer.predict(output_dir=...)``; ``predictions.load_predictions`` reads it). Any other suffix
    (``preds.bin``, ``v1.2``) is refused as ambiguous. Nothing is overwritten. Every process returns once it is
    written.

    Raises:
        ConfigError: ``output`` exists, or its suffix is neither a file's nor a folder's.
    """
    validate_training_config(config, "predict")
    writes_file = _predictions_output_is_file(output)
    location = as_location(output)
    if exists(location):
        raise ConfigError(
            f"--output {output!r} already exists: predictions never overwrite a file. Give a new path, or remove it."
        )
    create_dataset = config.data.predict or config.data.eval
    if create_dataset is None:  # refused by validate_training_config; checked again for the type checker
        raise ConfigError("data.predict is missing: `predict` needs it (or data.eval).")
    dataset = create_dataset(**config.data.arguments)
    trainer = create_trainer(dataclasses.replace(config, output_dir=None), config_text)  # a prediction: no run folder
    train = config.train
    arguments: dict[str, Any] = {
        "per_device_batch_size": train.per_device_batch_size,
        "dataloader_kwargs": train.eval_dataloader_kwargs,
        "collate_fn": train.collate_fn,
    }
    if not writes_file:
        return trainer, trainer.predict(dataset, output_dir=location, **arguments)
    validate_prediction_store(location, trainer.accelerator.num_processes, "--output")
    predictions = trainer.predict(dataset, **arguments)
    if trainer.accelerator.is_main_process:
        with local_file_to_write(location) as path:  # a URL: written here, then uploaded as one object
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(predictions, path)
    trainer.accelerator.wait_for_everyone()
    return trainer, location


def _predictions_output_is_file(output: str) -> bool:
    """Whether ``--output`` names one file of predictions (a ``.pt`` or ``.pth`` suffix) rather than a folder of
    chunks (no suffix, or a trailing ``/``).

    Raises:
        ConfigError: another suffix, which could mean either.
    """
    suffix = Path(output).suffix
    if suffix.lower() in PREDICTION_FILE_SUFFIXES:
        return True
    if suffix and not output.endswith("/"):
        raise ConfigError(
            f"--output {output!r} ends in {suffix}, which names neither a file of predictions nor a folder: write "
            f"{str(Path(output).with_suffix('.pt'))!r} for one file (.pt or .pth, read by torch.load), or "
            f"{output + '/'!r} (a trailing /) for a folder of chunk files (read by load_predictions)."
        )
    return False
