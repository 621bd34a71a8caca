"""The trainer's training state as parts handed to ``state/``: what a state holds, and how a resume puts it back.

``state/`` is given what it saves, never the trainer (``state/parts.py``): here the trainer's model, optimizer and extra
models become sharded parts (in one file written by one process, or each process its own shard through
``torch.distributed.checkpoint``); its position, counters, run history, scheduler and scaler the shared plain values;
its RNG states, loss sums and callbacks' states each process's own. A resume reads them back in the same three groups,
checking each against this run before anything is loaded (the run's settings, the optimizers' classes and groups, the
extra models). Under DeepSpeed the model and optimizer are its engine's, written and read by the engine itself
(``state/deepspeed_engine.py``); the rest is the same.

A resume on another number of processes (``allow_resume_changes=True``): the model and optimizer are resharded (by DCP,
or each process taking its part of a one-file state's full tensors); the loss sums of the interrupted epoch of every
saved process are added into process 0's (the epoch's loss is the same); process ``r`` takes the callbacks' states of
saved process ``r`` (of process 0 beyond the saved count) and, where the saved run had a process ``r``, its RNG states;
a new process keeps those the trainer's seed gave it. The data position is converted to samples by
``loop/safe_points.py``.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, cast

import numpy as np
import torch
from accelerate.utils import send_to_device

from pytorch_accel_trainer.data import dataset_length
from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.loop.stream_position import stream_split_fact, stream_state_name
from pytorch_accel_trainer.parallel.layout import layout_of
from pytorch_accel_trainer.parallel.sharded import deepspeed_engine, inner_optimizer, state_module
from pytorch_accel_trainer.state.async_save import data_pointer
from pytorch_accel_trainer.state.deepspeed_engine import FACTS_KEY, DeepSpeedEngineState, check_engine_fits
from pytorch_accel_trainer.state.files import DEEPSPEED, StoredState, rank_file, validate_plain
from pytorch_accel_trainer.state.folder import history_epoch, load_tensors_file, load_trainer_file
from pytorch_accel_trainer.state.manager import ResumePlan, ResumePosition
from pytorch_accel_trainer.state.parts import (
    TENSOR_MARK,
    ModelState,
    OptimizerState,
    Processes,
    StateContent,
    Stateful,
    check_fit,
    load_sharded,
)
from pytorch_accel_trainer.tracking import LossTracker, StepMetricsTracker

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer

#: The sharded parts of the extra models of ``add_model`` and of their optimizers: ``extra_model:<name>``...
EXTRA_MODEL_PART, EXTRA_OPTIMIZER_PART = "extra_model:", "extra_optimizer:"


def run_facts(trainer: "Trainer") -> dict:
    """The settings a resumed run must share with the saved one to continue it exactly: the world size and the layout
    of a ``ParallelismConfig`` (``dp_replicate``, ``dp_shard``, ``tp``, ``cp``), the batch size, accumulation and
    dataset length, and who reads a stream."""
    config = trainer.run_config
    layout = layout_of(trainer.accelerator)
    facts = {
        "world_size": trainer.accelerator.num_processes,
        # a ParallelismConfig's sizes (None without one): who holds which part of the model, who reads which batch
        "layout": layout.as_fact() if layout.has_parallelism_config else None,
        "per_device_batch_size": None if config is None else config.train_per_device_batch_size,
        "gradient_accumulation_steps": None if config is None else config.gradient_accumulation_steps,
        "train_dataset_length": None if trainer.train_dataset is None else dataset_length(trainer.train_dataset),
    }
    options = trainer.run_state.options
    split = None if options is None else options.stream_split
    stream_split = stream_split_fact(trainer.train_dataloader, split, layout.dp_size)
    if stream_split is not None:  # a stream on several processes: who reads it places the saved position
        facts["stream_split"] = stream_split
    return facts


def sharded_parts(trainer: "Trainer", names: Optional[Iterable[str]] = None) -> dict[str, Stateful]:
    """The trainer's sharded parts (``names`` of them, or all): ``model``, ``optimizer``, and each extra model of
    ``add_model`` and its optimizer."""
    module = state_module(trainer.accelerator, trainer.model, trainer.get_model())
    parts: dict[str, Stateful] = {"model": ModelState(module)}
    if trainer.optimizer is not None:
        parts["optimizer"] = OptimizerState(module, inner_optimizer(trainer.optimizer))
    for name in trainer.extra_models:
        extra = state_module(trainer.accelerator, trainer.extra_models[name], trainer.get_extra_model(name))
        parts[f"{EXTRA_MODEL_PART}{name}"] = ModelState(extra)
        if name in trainer.extra_optimizers:
            optimizer = inner_optimizer(trainer.extra_optimizers[name])
            parts[f"{EXTRA_OPTIMIZER_PART}{name}"] = OptimizerState(extra, optimizer)
    return parts if names is None else {name: parts[name] for name in names}


def changed_by_updates_only(trainer: "Trainer") -> frozenset:
    """The data pointers of the model's parameters and of its optimizer's state: the tensors that only the loop's
    optimizer update changes (``StateContent.changed_by_updates_only``). Extra models and optimizers are left out:
    a hook may step those anywhere."""
    tensors: list[torch.Tensor] = list(trainer.model.parameters())
    if trainer.optimizer is not None:
        optimizer_state = inner_optimizer(trainer.optimizer).state.values()
        tensors += [value for state in optimizer_state for value in state.values() if isinstance(value, torch.Tensor)]
    return frozenset(pointer for pointer in map(data_pointer, tensors) if pointer)


def _callback_states(callbacks: Iterable) -> dict:
    """The states of the callbacks whose class has a ``state_dict`` method, by class name."""
    states = {}
    for callback in callbacks:
        if callable(getattr(type(callback), "state_dict", None)):  # asked of the class: no __getattr__ of callbacks
            state = callback.state_dict()
            validate_plain(state, f"{type(callback).__name__}.state_dict()")
            states[type(callback).__name__] = state
    return states


def _stream_state(trainer: "Trainer", position: ResumePosition) -> Optional[dict]:
    """Where this process's training stream is at ``position``, if it can say (``loop/stream_position.py``)."""
    positions = trainer.run_state.stream_positions
    inside_epoch = position.rng_restore_point == "after_iterator" and position.loop_epoch == trainer.run_state.epoch
    if positions is None or not inside_epoch:
        return None  # at an epoch's start the stream starts afresh
    stream_state = positions.state_after(position.batches_seen)
    if stream_state is not None:
        validate_plain(stream_state, stream_state_name(trainer.train_dataset))
    return stream_state


def engine_state(trainer: "Trainer") -> Optional[DeepSpeedEngineState]:
    """DeepSpeed's engine as the model and optimizer of the trainer's training state (its only model: ``add_model``
    is refused under DeepSpeed), or ``None`` outside DeepSpeed."""
    engine = deepspeed_engine(trainer.accelerator)
    return None if engine is None else DeepSpeedEngineState(engine, trainer.accelerator.num_processes)


def state_content(trainer: "Trainer", position: ResumePosition, checkpoint_kwargs: Optional[dict]) -> StateContent:
    """Everything the trainer's training state at ``position`` holds, in the three groups of ``state/parts.py``
    (under DeepSpeed the model and optimizer as its engine, :func:`engine_state`)."""
    engine = engine_state(trainer)
    checkpoint_kwargs = dict(checkpoint_kwargs or {})
    validate_plain(checkpoint_kwargs, "checkpoint_kwargs")
    scheduler_state = None if trainer.scheduler is None else trainer.scheduler.state_dict()
    if scheduler_state is not None:
        validate_plain(scheduler_state, "scheduler.state_dict()")
    scaler = trainer.accelerator.scaler
    shared = {
        "position": asdict(position),
        "num_update_steps_completed": trainer.num_update_steps_completed,
        "run_history": trainer.run_history.state_dict(),
        "history_epoch": trainer.run_state.history_epoch(position),
        "run_facts": trainer.run_state.run_facts,
        "checkpoint_kwargs": checkpoint_kwargs,
        "optimizer_class": type(inner_optimizer(trainer.optimizer)).__qualname__,  # checked on resume
        "extra_optimizer_classes": extra_optimizer_classes(trainer.extra_optimizers),
        "scheduler": scheduler_state,
        "scaler": None if scaler is None else scaler.state_dict(),
        FACTS_KEY: None if engine is None else engine.facts(),
    }
    own = {
        "rng": capture_rng_state(),
        "train_loss_tracker": trainer.run_state.train_loss_tracker.state_dict(),
        "train_step_metrics": trainer.run_state.train_step_metrics.state_dict(),
        "callbacks": _callback_states(trainer.callback_handler.callbacks),
        "stream_position": _stream_state(trainer, position),
    }
    return StateContent({} if engine is not None else sharded_parts(trainer), shared, own, engine)


# ------------------------------------------------------------------------------------------------
# The random number generators of a process, as plain tensors and numbers (no pickle needed to read them back)
# ------------------------------------------------------------------------------------------------


def capture_rng_state() -> dict:
    """Return the state of every RNG of this process: torch, CUDA, numpy and ``random``."""
    numpy_state = cast(tuple, np.random.get_state(legacy=True))  # the legacy form: a tuple
    python_version, python_internal, python_gauss = random.getstate()
    state = {
        "torch": torch.random.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(numpy_state[1].astype(np.int64)),
            "position": int(numpy_state[2]),
            "has_gauss": int(numpy_state[3]),
            "cached_gaussian": float(numpy_state[4]),
        },
        "python": {"version": python_version, "internal": list(python_internal), "gauss": python_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Restore what :func:`capture_rng_state` returned."""
    torch.random.set_rng_state(state["torch"])
    np.random.set_state(_numpy_state(state))
    random.setstate(_python_state(state))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def validate_rng_state(state: Any) -> None:
    """Check that ``state`` (as :func:`capture_rng_state` returns, read from a file) can be restored, by loading it
    into throwaway generators: the process's own are untouched.

    Raises:
        ValueError: what is wrong (a key missing, a state of the wrong size or type), in the generator's words.
    """
    try:
        torch.Generator().set_state(state["torch"])
        np.random.RandomState().set_state(_numpy_state(state))
        random.Random().setstate(_python_state(state))
        cuda = state.get("cuda", [])
        if not isinstance(cuda, list) or any(
            not isinstance(generator, torch.Tensor) or generator.dtype != torch.uint8 for generator in cuda
        ):
            raise TypeError("the CUDA generators' states are not a list of uint8 tensors")
    except (LookupError, TypeError, ValueError, RuntimeError, AttributeError, OverflowError) as error:
        problem = f"{type(error).__name__}: {error}"
        raise ValueError(f"its random generators' states cannot be restored ({problem})") from None


def _numpy_state(state: dict) -> tuple:
    numpy_state = state["numpy"]
    return (
        "MT19937",
        numpy_state["keys"].numpy().astype(np.uint32),
        numpy_state["position"],
        numpy_state["has_gauss"],
        numpy_state["cached_gaussian"],
    )


def _python_state(state: dict) -> tuple:
    python_state = state["python"]
    return (python_state["version"], tuple(python_state["internal"]), python_state["gauss"])


# ------------------------------------------------------------------------------------------------
# Reading a state back into the trainer
# ------------------------------------------------------------------------------------------------


def describe_changes(saved: dict, current: dict) -> list[str]:
    """List each run setting that differs between a saved state and the current run."""
    return [
        f"{name}: saved {saved.get(name)!r}, now {current.get(name)!r}"
        for name in sorted(current)
        if name in saved and saved[name] != current[name]  # a setting an older state did not record is not compared
    ]


#: Parameter-group keys of how an optimizer computes, not of what it computes: a resume neither compares nor restores
#: them (nor ``params``, the group's parameters, compared by the optimizer checks).
IMPLEMENTATION_FLAGS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


def _optimizers(trainer: "Trainer") -> list[tuple[str, str, torch.optim.Optimizer, bool]]:
    """``(name, part, optimizer, scheduled)`` of the trainer's optimizer and of each extra model's (``part``: its
    name in a state; ``scheduled``: the trainer's scheduler moves its ``lr``)."""
    optimizers = []
    if trainer.optimizer is not None:
        optimizers.append(("optimizer", "optimizer", inner_optimizer(trainer.optimizer), trainer.scheduler is not None))
    for name, optimizer in trainer.extra_optimizers.items():
        part = f"{EXTRA_OPTIMIZER_PART}{name}"
        optimizers.append((f"extra optimizer {name!r}", part, inner_optimizer(optimizer), False))
    return optimizers


def describe_hyperparameter_changes(saved_parts: dict, optimizers: list) -> list[str]:
    """List each hyperparameter of the parameter groups of ``optimizers`` (``(name, part, optimizer, scheduled)``)
    that differs from its group's in the state's ``saved_parts`` (a group count that differs is left to the optimizer
    checks)."""
    changes = []
    for name, part, optimizer, scheduled in optimizers:
        saved = saved_parts.get(part)
        saved_groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if not isinstance(saved_groups, list) or len(saved_groups) != len(optimizer.param_groups):
            continue
        for index, (saved_group, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
            for key, (before, now) in differing_hyperparameters(saved_group, group, scheduled).items():
                changes.append(f"{name} param_groups[{index}][{key!r}]: saved {before!r}, now {now!r}")
    return changes


def differing_hyperparameters(saved: Any, group: dict, scheduled: bool = False) -> dict:
    """``{key: (saved value, value)}`` for each hyperparameter of the parameter group ``group`` that differs from the
    ``saved`` group's. Not compared: the implementation flags, a key the saved group lacks (an older torch's), a
    tensor, and what a scheduler moves during a run: ``lr`` when ``scheduled`` and each ``key`` beside an
    ``initial_<key>`` (torch's schedulers but ``ReduceLROnPlateau``, and this package's, set ``initial_lr`` as they
    are created: the ``initial_lr`` is compared instead), and ``momentum`` and ``betas`` when a scheduler cycles them
    (``OneCycleLR``, ``CyclicLR``: ``base_momentum``)."""
    if not isinstance(saved, dict):
        return {}  # not an optimizer state: the optimizer checks refuse it
    moved = {"lr"} if scheduled else set()
    for key in (*saved, *group):
        if isinstance(key, str) and key.startswith("initial_"):
            moved.add(key[len("initial_") :])
        elif key == "base_momentum":
            moved |= {"momentum", "betas"}
    differing = {}
    for key, value in group.items():
        if key in IMPLEMENTATION_FLAGS or key in moved or key not in saved:
            continue
        before = saved[key]
        if _holds_tensor(before) or _holds_tensor(value):
            continue  # a tensor learning rate (or its mark in a state's plain part) is not compared
        if (list(before) if isinstance(before, tuple) else before) != (
            list(value) if isinstance(value, tuple) else value
        ):
            differing[key] = (before, value)  # a tuple may be read back as a list
    return differing


def _holds_tensor(value: Any) -> bool:
    for item in value if isinstance(value, (list, tuple)) else (value,):
        if isinstance(item, torch.Tensor) or (isinstance(item, str) and item == TENSOR_MARK):
            return True
    return False


def _restore_hyperparameters(trainer: "Trainer", given: list[list[dict]]) -> None:
    """Put this run's hyperparameters (``given``: each optimizer's groups, copied before the state was loaded) back
    into the loaded groups, so that a resume with ``allow_resume_changes=True`` trains with the values given. A
    scheduled key (``lr``) takes the new ``initial_<key>``, its current value scaled by new / old ``initial_<key>``,
    and the trainer's scheduler its new base values."""
    for (_, _, optimizer, scheduled), given_groups in zip(_optimizers(trainer), given):
        for group, given_group in zip(optimizer.param_groups, given_groups):
            for key, (loaded, value) in differing_hyperparameters(group, given_group, scheduled).items():
                scheduled = key[len("initial_") :]  # "lr" for "initial_lr"; for another key, no key of the group
                current = group.get(scheduled) if key.startswith("initial_") else None
                if all(isinstance(number, (int, float)) for number in (current, loaded, value)):
                    group[scheduled] = current * value / loaded if loaded else value  # the schedule so far, rescaled
                group[key] = value
    if trainer.optimizer is not None:
        _rebase_scheduler(trainer.scheduler, inner_optimizer(trainer.optimizer))


def _rebase_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Give ``scheduler`` the base values of ``optimizer``'s groups (their ``initial_<key>``), as it would have taken
    them had it been created with them: torch's ``base_lrs``, this package's ``base_lr_values``."""
    if scheduler is None:
        return
    groups = optimizer.param_groups
    if isinstance(getattr(scheduler, "base_lrs", None), list) and all("initial_lr" in group for group in groups):
        scheduler.base_lrs = [group["initial_lr"] for group in groups]
        if isinstance(getattr(scheduler, "_last_lr", None), list):
            scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() says until the next step
    field = getattr(scheduler, "param_group_field", None)
    if isinstance(getattr(scheduler, "base_lr_values", None), list) and all(f"initial_{field}" in g for g in groups):
        scheduler.base_lr_values = [group[f"initial_{field}"] for group in groups]


def extra_optimizer_classes(optimizers: dict) -> dict:
    """The class of each extra optimizer, saved with a state so that a resume can name a different one."""
    return {name: type(inner_optimizer(optimizer)).__qualname__ for name, optimizer in optimizers.items()}


def describe_extras_difference(kind: str, saved, registered) -> Optional[str]:
    """Why the names of the extra ``kind`` (``"models"``, ``"optimizers"``) a checkpoint or state holds differ from
    those a trainer registered, naming both sets and what would be lost; ``None`` when they are the same."""
    saved, registered = sorted(saved), sorted(registered)
    if saved == registered:
        return None
    lost = [f"{name!r} is not in it (it would keep its current state)" for name in registered if name not in saved]
    lost += [
        f"{name!r} is not registered (its saved state would be dropped)" for name in saved if name not in registered
    ]
    return f"it holds the extra {kind} {saved}, but this trainer has {registered}: {'; '.join(lost)}"


def describe_optimizer_mismatch(
    saved: Any, saved_class: Optional[str], optimizer: torch.optim.Optimizer, compare_parameters: bool = True
) -> Optional[str]:
    """Why an optimizer state (``state_dict()`` of a ``saved_class`` optimizer) cannot be loaded into ``optimizer``,
    or ``None`` when it fits: another class (``saved_class=None`` compares none), and with
    ``compare_parameters`` another number of parameter groups or of parameters in a group, or other per-parameter
    state where both have some. (A training state keys the per-parameter state by parameter names, where the live
    optimizer numbers them: only the class and the groups are compared then.)"""
    current = inner_optimizer(optimizer)
    current_class = type(current).__qualname__
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("state"), dict)
        or not isinstance(saved.get("param_groups"), list)
        or not all(isinstance(group, dict) and isinstance(group.get("params"), list) for group in saved["param_groups"])
    ):
        return "it is not an optimizer state_dict (a dict of 'state' and a list of 'param_groups')"
    if saved_class is not None and saved_class != current_class:
        return f"it was saved by the optimizer {saved_class}, but this trainer's optimizer is {current_class}"
    if not compare_parameters:
        return None
    saved_sizes = [len(group["params"]) for group in saved["param_groups"]]
    current_sizes = [len(group["params"]) for group in current.param_groups]
    if saved_sizes != current_sizes:
        return (
            f"its parameter groups hold {saved_sizes} parameters, but those of this trainer's {current_class} hold "
            f"{current_sizes}"
        )
    current_state = current.state_dict()["state"]
    for index, values in saved["state"].items():
        if index in current_state and (not isinstance(values, dict) or set(values) != set(current_state[index])):
            keys = sorted(values) if isinstance(values, dict) else values
            kept = sorted(current_state[index])
            return f"parameter {index} has the state {keys}, but this trainer's {current_class} keeps {kept}"
    return None


def _check_settings(
    trainer: "Trainer", stored: StoredState, shared: dict, facts: Optional[dict], allow: bool, hyperparameters: list
) -> None:
    """Refuse a state saved by a run set up differently (unless ``allow``): other ``facts``, other ``hyperparameters``
    (:func:`describe_hyperparameter_changes`); or that holds other parts than this trainer has (extra models,
    optimizer class, scheduler), before anything is loaded."""
    folder = stored.folder
    if facts is not None and not allow:
        changes = describe_changes(shared["run_facts"], facts) + hyperparameters
        if changes:
            listed_changes = "\n  ".join(changes)
            raise CheckpointError(
                f"{folder} was saved by a run set up differently, so resuming would not continue it exactly:"
                f"\n  {listed_changes}\n"
                "Restore those settings, or pass allow_resume_changes=True to train() to resume anyway (on another "
                "number of processes or layout, every remaining sample of the epoch is still trained once, in another "
                "order: see docs/training_state.md, 'Another number of processes')."
            )
    saved_parts = set(shared.get("plain_parts") or {})
    for kind, prefix, registered in (
        ("models", EXTRA_MODEL_PART, trainer.extra_models),
        ("optimizers", EXTRA_OPTIMIZER_PART, trainer.extra_optimizers),
    ):
        saved = [part[len(prefix) :] for part in saved_parts if part.startswith(prefix)]
        difference = describe_extras_difference(kind, saved, registered)
        if difference is not None:
            raise CheckpointError(
                f"{folder} does not fit this trainer: {difference}. Register the extra models and optimizers it was "
                "saved with (add_model, before train()), or start a new run."
            )
    if facts is not None and (shared["scheduler"] is not None) != (trainer.scheduler is not None):
        has = shared["scheduler"] is not None
        raise CheckpointError(
            f"{folder} {'holds' if has else 'has no'} scheduler state, but this run {'has no' if has else 'has a'} "
            "scheduler: pass the create_scheduler_fn of the saved run."
        )


def _check_optimizers(trainer: "Trainer", stored: StoredState, shared: dict, groups: bool) -> None:
    """Refuse a state whose optimizers (the trainer's, the extra models') are of another class, or (``groups``) hold
    other parameter groups than this trainer's, before anything is loaded."""
    folder = stored.folder
    plain = shared.get("plain_parts") or {}
    if trainer.optimizer is not None:
        mismatch = describe_optimizer_mismatch(
            plain.get("optimizer"), shared["optimizer_class"], trainer.optimizer, groups
        )
        if mismatch is not None:
            raise CheckpointError(
                f"{folder} does not fit this trainer's optimizer: {mismatch}. Resume with the optimizer the state was "
                "saved with (same class, same parameter groups), or start a new run."
            )
    saved_classes = shared.get("extra_optimizer_classes") or {}
    for name, optimizer in trainer.extra_optimizers.items():
        saved_optimizer = plain.get(f"{EXTRA_OPTIMIZER_PART}{name}")
        mismatch = describe_optimizer_mismatch(saved_optimizer, saved_classes.get(name), optimizer, groups)
        if mismatch is not None:
            raise CheckpointError(
                f"{folder} does not fit the optimizer of the extra model {name!r}: {mismatch}. Resume with the extra "
                "models and optimizers the state was saved with."
            )


def load_rank_file(path: Path) -> dict:
    """One process's own part of a state (``rank_<N>.pt``): its RNG states, loss sums and callbacks' states, checked."""
    rank_state = load_tensors_file(path)
    if (
        not isinstance(rank_state, dict)
        or not isinstance(rank_state.get("callbacks"), dict)
        or not {"rng", "train_loss_tracker"} <= set(rank_state)
    ):
        raise CheckpointError(f"{path}: not a process's state (rng, train_loss_tracker, callbacks); it was altered.")
    if rank_state["rng"] is not None:
        try:
            validate_rng_state(rank_state["rng"])
        except ValueError as error:
            raise CheckpointError(f"{path}: {error}; it was altered.") from None
    return rank_state


def _own_state(stored: StoredState, processes: Processes) -> dict:
    """This process's own saved state: its own file's; on another number of processes, see the module's text."""
    listed, saved_count = stored.manifest["files"], stored.manifest["world_size"]
    if saved_count == processes.count:
        return load_rank_file(stored.folder / rank_file(processes.rank))
    own = load_rank_file(stored.folder / rank_file(processes.rank if processes.rank < saved_count else 0))
    own["stream_position"] = None  # a stream is not split again: refused where its position matters
    if processes.rank >= saved_count:
        own["rng"] = None  # a new process keeps the RNG states the trainer's seed gave it
    loss, metrics = LossTracker(), StepMetricsTracker()
    if processes.rank == 0:  # every saved process's sums of the interrupted epoch, added up here
        for rank in range(saved_count):
            saved = load_rank_file(stored.folder / rank_file(rank)) if rank_file(rank) in listed else {}
            loss.absorb(saved.get("train_loss_tracker"))
            metrics.absorb(saved.get("train_step_metrics"))
    own["train_loss_tracker"], own["train_step_metrics"] = loss.state_dict(), metrics.state_dict()
    return own


def read_training_state(
    trainer: "Trainer", stored: StoredState, facts: Optional[dict], allow_changes: bool
) -> ResumePlan:
    """Load a verified training state into ``trainer`` (weights, optimizer, scheduler, history, callbacks); the rest
    (position, counters, RNG states) is returned as a :class:`ResumePlan` for the run state.

    Every setting and part is checked to fit this run before anything is loaded.

    Args:
        facts: the current run's settings (:func:`run_facts`), compared with the saved ones; ``None`` (a load outside
            a run) skips the comparison.
        allow_changes: resume even when a setting differs.
    """
    accelerator = trainer.accelerator
    engine = engine_state(trainer)
    shared = load_trainer_file(stored)
    if engine is not None or stored.layout == DEEPSPEED:  # a run or a state under DeepSpeed: its own format
        check_engine_fits(stored, shared.get(FACTS_KEY), engine)
    optimizers = _optimizers(trainer)
    changed = [] if facts is None else describe_hyperparameter_changes(shared.get("plain_parts") or {}, optimizers)
    _check_settings(trainer, stored, shared, facts, allow_changes, changed)
    processes = Processes.of_accelerator(accelerator)
    if engine is None:
        parts = sharded_parts(trainer)
        # the clearest error first: the optimizers' classes, then the tensors' names and shapes, then the groups
        _check_optimizers(trainer, stored, shared, groups=False)
        live = check_fit(stored, shared, parts)
        _check_optimizers(trainer, stored, shared, groups=True)
    own = _own_state(stored, processes)
    given = [[dict(group) for group in optimizer.param_groups] for _, _, optimizer, _ in optimizers] if changed else []
    if engine is None:
        load_sharded(stored, shared, parts, processes, live)
    else:  # DeepSpeed's model, optimizer and partitions, by its engine (its stage and processes checked above)
        engine.load(stored.folder)
    if shared["scheduler"] is not None and trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(shared["scheduler"])
    if changed:  # allowed: the hyperparameters given win over the saved ones
        _restore_hyperparameters(trainer, given)
        listed = "\n  ".join(changed)
        trainer.print(f"Resuming with this run's hyperparameters (allow_resume_changes=True):\n  {listed}")
    if shared["scaler"] is not None and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(shared["scaler"])
    trainer.run_history.load_state_dict(shared["run_history"])
    for callback in trainer.callback_handler:
        state = own["callbacks"].get(type(callback).__name__)
        if state is not None and callable(getattr(callback, "load_state_dict", None)):
            callback.load_state_dict(state)
    return ResumePlan(
        position=ResumePosition(**shared["position"]),
        rng_state=own["rng"],
        # read onto the CPU: the epoch's partial sums go back to the device its next losses are summed on
        train_loss_tracker=send_to_device(own["train_loss_tracker"], accelerator.device),
        train_step_metrics=send_to_device(own.get("train_step_metrics", {}), accelerator.device),
        checkpoint_kwargs=shared["checkpoint_kwargs"],
        folder=stored.folder,
        num_update_steps_completed=shared["num_update_steps_completed"],
        run_id=stored.run_id,
        history_epoch=history_epoch(shared, stored.folder),
        saved_run_facts=shared["run_facts"],
        stream_state=own.get("stream_position"),
    )
