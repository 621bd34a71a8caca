"""The loop's training states: resume a run at its saved position, and at each safe point (between two optimizer
updates) take the saves asked for and stop when preempted.

The trainer's loop calls these functions, over the trainer's public API and its
:class:`~pytorch_accel_trainer.loop.run_state.RunState`: as a run starts (:func:`load_resume_plan`,
:func:`create_run_id`), as each epoch starts (:func:`skip_to_resume_position`), at each safe point
(:func:`reach_safe_point`) and as the run ends (:func:`take_requested_saves`, :func:`end_saves_and_preemption`). A
state is written by :func:`write_state`, which hands the trainer's parts (``trainer_parts.py``) to
:class:`~pytorch_accel_trainer.state.manager.TrainingStates`. The public methods that ask for these saves are
``persistence.py``'s.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Iterable, Optional, cast

from accelerate import PartialState, skip_first_batches
from accelerate.state import AcceleratorState
from accelerate.utils import broadcast_object_list

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.loop.data_position import samples_per_step, skip_first_samples
from pytorch_accel_trainer.loop.run_state import RunState
from pytorch_accel_trainer.loop.stream_position import (
    is_stream,
    replay_batches,
    replay_message,
    validate_stream_resume,
)
from pytorch_accel_trainer.loop.trainer_parts import (
    changed_by_updates_only,
    read_training_state,
    restore_rng_state,
    state_content,
)
from pytorch_accel_trainer.parallel.distributed import print_on_node
from pytorch_accel_trainer.parallel.layout import layout_of
from pytorch_accel_trainer.parallel.restarts import describe_restarted_attempt
from pytorch_accel_trainer.state import storage
from pytorch_accel_trainer.state.claims import release_claims
from pytorch_accel_trainer.state.files import StoredState, default_state_name
from pytorch_accel_trainer.state.manager import ResumePlan, ResumePosition, TrainingStates
from pytorch_accel_trainer.state.parts import Processes
from pytorch_accel_trainer.state.storage import Location

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer


# ------------------------------------------------------------------------------------------------
# Resume: where the run starts again, and when the saved RNG states go back
# ------------------------------------------------------------------------------------------------


def load_resume_plan(
    trainer: "Trainer", stored: Optional[StoredState], resume_from, facts: dict, allow_changes: bool
) -> Optional[ResumePlan]:
    """Load ``stored`` into the trainer (weights, optimizer, scheduler, history, callbacks) and return what the
    run still has to restore as it reaches the saved position; ``None`` when there is nothing to resume. ``facts``:
    this run's settings (:func:`~pytorch_accel_trainer.loop.trainer_parts.run_facts`), compared with the saved ones."""
    if resume_from is None:
        return None
    if stored is None:
        found = "holds no training state yet" if storage.exists(resume_from) else "does not exist yet"
        _say_if_restarted(trainer, None)
        trainer.print(f"resume_from={str(resume_from)!r} {found}: starting a new run.")
        return None
    plan = read_training_state(trainer, stored, facts, allow_changes)
    validate_stream_resume(plan, trainer.train_dataloader, facts)
    history = trainer.run_history
    if plan.history_epoch is not None and plan.history_epoch != history.current_epoch:
        history._set_epoch(plan.history_epoch)  # the saved history moved past an epoch a stop cut short
    shown: Any = stored.url or stored.folder  # a store's state: its URL, not its node-local copy
    _say_if_restarted(trainer, shown, plan)
    updates = f"(after {plan.num_update_steps_completed} optimizer updates)"
    trainer.print(f"Resuming from {shown} {updates} at {_where(plan, history.current_epoch)}, run {stored.run_id}")
    options = trainer.run_state.options
    if options is not None:
        nothing_left = describe_nothing_left(shown, plan, options.num_epochs, options.max_num_train_steps)
        if nothing_left:
            trainer.print(nothing_left)
    saved_processes, processes = stored.manifest["world_size"], trainer.accelerator.num_processes
    saved_layout, layout = plan.saved_run_facts.get("layout"), facts.get("layout")
    if saved_processes != processes or ("layout" in plan.saved_run_facts and saved_layout != layout):
        differ = saved_layout != layout  # the layouts are named when they differ
        saved_as, now_as = (_sizes(saved_layout), _sizes(layout)) if differ else ("", "")
        trainer.print(
            f"The state was saved by {saved_processes} process(es){saved_as} and resumes on {processes}{now_as}: "
            f"the model and optimizer are resharded, and the {plan.position.epoch_samples} samples of its epoch "
            "trained so far are skipped, the rest split between the data-parallel ranks (each trained once, in "
            "another order)."
        )
    return plan


def _sizes(layout: Optional[dict]) -> str:
    """A run fact's layout as `` with the layout dp_shard 2 x tp 2`` (the sizes above 1); ``""`` without one."""
    if layout is None:
        return ""
    return " with the layout " + (" x ".join(f"{name} {size}" for name, size in layout.items() if size > 1) or "1")


def validate_resume_target(stored: Optional[StoredState], num_epochs: Optional[int], max_steps: Optional[int]) -> None:
    """Refuse, before any work, to resume ``stored`` when it trained past this run's ``num_epochs`` or
    ``max_num_train_steps`` (``max_steps``): the run would train nothing, and say nothing of why. A target exactly
    reached (a finished run resumed, as a requeued job does after its last save) is no error: see
    :func:`describe_nothing_left`.

    Raises:
        CheckpointError: naming the state, what it trained, the target and the fix.
    """
    if stored is None:
        return
    position, updates = ResumePosition(**stored.manifest["position"]), stored.manifest["num_update_steps_completed"]
    shown: Any = stored.url or stored.folder
    epochs = f"{position.loop_epoch} epochs" + (
        f" and {position.batches_seen} batches of epoch {position.loop_epoch + 1}" if position.batches_seen else ""
    )
    trained_epochs = position.loop_epoch + (1 if position.batches_seen else 0)  # a started epoch is past a target
    if num_epochs is not None and (trained_epochs > num_epochs):
        raise CheckpointError(
            f"{shown} already trained {epochs} ({updates} optimizer updates), past num_epochs={num_epochs}: this run "
            f"would train nothing. Pass num_epochs={trained_epochs} or more to train on from it, or resume from an "
            "earlier state."
        )
    if max_steps is not None and updates > max_steps:
        raise CheckpointError(
            f"{shown} already made {updates} optimizer updates ({epochs}), past max_num_train_steps={max_steps}: this "
            f"run would train nothing. Pass max_num_train_steps={updates} or more (or None) to train on from it, or "
            "resume from an earlier state."
        )


def describe_nothing_left(shown: Any, plan: ResumePlan, num_epochs: Optional[int], max_steps: Optional[int]) -> str:
    """``"nothing left to train: ..."`` when the state ``shown`` (of ``plan``) exactly reached this run's
    ``num_epochs`` or ``max_num_train_steps`` (``max_steps``); ``""`` when it has something left."""
    epoch = plan.position.loop_epoch
    if num_epochs is not None and epoch >= num_epochs:
        return f"nothing left to train: {shown} already trained {epoch} epochs (num_epochs={num_epochs})."
    if max_steps is not None and plan.num_update_steps_completed >= max_steps:
        updates = f"{plan.num_update_steps_completed} optimizer updates"
        return f"nothing left to train: {shown} already made {updates} (max_num_train_steps={max_steps})."
    return ""


def _say_if_restarted(trainer: "Trainer", resumed_from: Any, plan: Optional[ResumePlan] = None) -> None:
    """On an attempt ``torchrun --max-restarts`` restarted, say so, and where it resumes (``parallel/restarts.py``)."""
    epoch = trainer.run_history.current_epoch
    updates = None if plan is None else plan.num_update_steps_completed
    line = describe_restarted_attempt(resumed_from, epoch=epoch, num_update_steps=updates)
    if line is not None:
        trainer.print(line)


def _where(plan: ResumePlan, current_epoch: int) -> str:
    """Where a resume goes on, as the run history counts epochs: ``epoch 3, 8 batches in`` (at its 9th batch), or
    ``the start of epoch 3``."""
    epoch = plan.history_epoch if plan.history_epoch is not None else current_epoch
    if plan.position.batches_seen:
        return f"epoch {epoch}, {plan.position.batches_seen} batches in"
    return f"the start of epoch {epoch}"


def create_run_id(trainer: "Trainer", plan: Optional[ResumePlan]) -> str:
    """The identity of the run starting: that of the state it resumes, else a new one (the main process's, on every
    process: one small collective)."""
    if plan is not None and plan.run_id is not None:
        return plan.run_id
    chosen = [uuid.uuid4().hex]
    if trainer.accelerator.num_processes > 1:
        broadcast_object_list(chosen)
    return chosen[0]


def skip_to_resume_position(state: RunState, train_dl: Iterable) -> tuple[int, Iterable]:
    """Return this epoch's first step and dataloader: after a resume, only the batches not yet trained on.

    Batches already seen are skipped by sampler offset, so resuming at step 10,000 costs about the same as at step 10
    (map-style data); on another number of processes or batch size, the epoch's samples trained so far are skipped
    and the rest split again (``loop/data_position.py``). A stream is put back where it was when it can say where it
    is, else replayed (``loop/stream_position.py``).
    """
    options = state.options
    per_device = None if options is None else options.per_device_batch_size
    process = PartialState()
    data_parallel = layout_of(AcceleratorState()).dp_size  # a tensor-parallel group reads one batch
    state.start_epoch_data(samples_per_step(train_dl, per_device, data_parallel))
    resume = state.resume
    first_step = 0
    if resume is not None and resume.position.loop_epoch == state.epoch:
        position = resume.position
        first_step = position.batches_seen
        if position.rng_restore_point == "after_iterator":  # taken inside the epoch: its loss so far goes back
            state.restore_train_trackers(resume.train_loss_tracker, resume.train_step_metrics)
        if position.epoch_samples != first_step * state.epoch_samples_per_step:  # split differently from here
            train_dl = skip_first_samples(train_dl, position.epoch_samples)
            state.start_epoch_data(state.epoch_samples_per_step, (position.epoch_samples, first_step))
        elif first_step and state.stream_positions is not None and resume.stream_state is not None:
            cast(Any, train_dl).load_state_dict(resume.stream_state)  # the stream goes on where it stopped
        elif first_step and is_stream(train_dl):
            print_on_node(replay_message(first_step, data_parallel, state.epoch_samples_per_step, train_dl))
            train_dl = replay_batches(train_dl, first_step, show_progress=process.is_main_process)
        elif first_step:
            train_dl = skip_first_batches(train_dl, first_step)
        _restore_rng_if_due(state, "before_iterator")
    if state.stream_positions is not None:
        train_dl = state.stream_positions.follow(train_dl, first_step)
    return first_step, train_dl


def _restore_rng_if_due(state: RunState, point: str) -> None:
    """Put back the saved RNG states where the saved run took them; this ends the resume."""
    rng_state = state.end_resume_at(point)
    if rng_state is not None:
        restore_rng_state(rng_state)


# ------------------------------------------------------------------------------------------------
# Safe points: between two optimizer updates
# ------------------------------------------------------------------------------------------------


def reach_safe_point(trainer: "Trainer", step: Optional[int] = None) -> None:
    """Between two optimizer updates: finish a resume, take the saves asked for, stop if preempted.

    Args:
        step: the micro-batch about to run in the current epoch; ``None`` between epochs.
    """
    state = trainer.run_state
    if not state.has_work_at_safe_point():
        return  # no resume to finish, no save asked for, no preemption: the common case
    # a new kind of work below must also make RunState.has_work_at_safe_point() true, or it would never run
    _restore_rng_if_due(state, "after_iterator")
    saved_to = take_requested_saves(trainer, step) if state.save_requests else ()
    _exit_if_preempted(trainer, step, saved_to)


def take_requested_saves(trainer: "Trainer", step: Optional[int] = None) -> set:
    """Write the training states asked for since the last safe point, at the position of ``step``; return their
    folders' parents. Also called as a run ends, so that a save asked for after its last update is not lost."""
    saved_to = set()
    for parent, request in trainer.run_state.take_save_requests().items():
        # inside an epoch the next update is the loop's: an asynchronous save copies beside its forward and backward
        write_state(trainer, parent, trainer.run_state.position(step), **request, copy_beside_step=step is not None)
        saved_to.add(parent)
    return saved_to


def write_state(
    trainer: "Trainer",
    parent: Location,
    position: ResumePosition,
    kinds=("rolling",),
    checkpoint_kwargs=None,
    max_rolling=None,
    asynchronous=False,
    name=None,
    copy_beside_step=False,
) -> Location:
    """Write a training state of ``trainer`` under ``parent`` and say so; every process must call this.

    The trainer hands its parts to :class:`~pytorch_accel_trainer.state.manager.TrainingStates`, which writes them
    (see :meth:`~pytorch_accel_trainer.state.manager.TrainingStates.save`: a save in the background waited for
    first, ``asynchronous``, object storage); the folder of the new state (its URL in a store) is returned.

    ``copy_beside_step``: the loop takes the save between two updates and waits for
    ``async_save.saver.wait_for_staging()`` before the next: an asynchronous save then copies the parameters and the
    optimizer's state on its background thread, beside the next forward and backward passes (``async_save.py``)."""
    started = time.monotonic()
    content = state_content(trainer, position, checkpoint_kwargs)
    if asynchronous and copy_beside_step:
        content.changed_by_updates_only = changed_by_updates_only(trainer)
    fields = {
        "num_update_steps_completed": trainer.num_update_steps_completed,
        "position": asdict(position),
        "kinds": sorted(set(kinds)),
        "run_facts": content.shared["run_facts"],
        **({} if trainer.run_state.run_id is None else {"run_id": trainer.run_state.run_id}),
    }
    name = name or default_state_name(trainer.num_update_steps_completed)
    states = TrainingStates(Processes.of_accelerator(trainer.accelerator))
    location = states.save(parent, content, fields, name, max_rolling, asynchronous)
    if asynchronous and content.engine is None:  # DeepSpeed's engine wrote its state at once
        trainer.print(f"Saving training state {location} in the background")
        return location
    if trainer.run_state.time_budget is not None:  # the state saved at a stop must fit in the budget too
        trainer.run_state.time_budget.note_save(time.monotonic() - started)
    trainer.print(f"Saved training state {location}")
    return location


def _exit_if_preempted(trainer: "Trainer", step: Optional[int], saved_to: Iterable) -> None:
    signal_number = _agreed_preemption_signal(trainer)
    if not signal_number:
        return
    state = trainer.run_state
    if state.preemption_save_dir is not None and state.preemption_save_dir not in saved_to:
        write_state(trainer, state.preemption_save_dir, state.position(step))
    TrainingStates.wait()  # a state being written in the background is complete before the process exits
    trainer.print(
        f"Stopped by signal {signal_number}: the training state is saved; exiting with code {128 + signal_number}."
    )
    sys.exit(128 + signal_number)


def _agreed_preemption_signal(trainer: "Trainer") -> Optional[int]:
    """The preemption signal any process received; every process leaves at the same step."""
    state = trainer.run_state
    if state.preemption_save_dir is None:
        return state.preemption_signal
    (signal_number,) = trainer.process_agreement.any_process(trainer.accelerator, state.preemption_signal or 0)
    return signal_number or None  # one small host-side collective per update window, no device sync


def end_saves_and_preemption(trainer: "Trainer") -> None:
    """As a run ends: wait for a save under way in the background, put back the signal handlers, and release the
    claims of the run's folders of states (``state/claims.py``)."""
    try:
        TrainingStates.end_run()  # a save in the background is complete (or its error raised), host copies freed
    finally:
        trainer.run_state.end_preemption()  # the signal handlers enable_preemption replaced are put back
        release_claims(trainer.run_state.checked_save_dirs)  # only this process's: another job's are left
