"""The callback protocol: the one list of events, the base class with a no-op per event, and the handler."""

from __future__ import annotations

import difflib
from collections.abc import Iterable as IterableABC
from typing import TYPE_CHECKING, Any, Iterable, Union

from pytorch_accel_trainer.errors import StopTrainingError, validate_positive_int  # noqa: F401  (users import them here)

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer

#: Every event the trainer fires, in the order of a training run followed by an evaluation run.
EVENTS = (
    "on_init_end",
    "on_training_run_start",
    "on_train_epoch_start",
    "on_train_step_start",
    "on_train_step_end",
    "on_optimizer_step_end",
    "on_train_epoch_end",
    "on_eval_epoch_start",
    "on_eval_step_start",
    "on_eval_step_end",
    "on_eval_epoch_end",
    "on_training_run_epoch_end",
    "on_training_run_end",
    "on_evaluation_run_start",
    "on_evaluation_run_end",
    "on_stop_training_error",
)


class TrainerCallback:
    """The base class of callbacks: one no-op method per event; override the ones you need.

    Every method receives the trainer first, then keyword arguments; accept ``**kwargs`` so that new
    arguments do not break a callback. A method whose name starts with ``on_`` but is not an event is
    refused when the callback is added, so a typo cannot silently do nothing.

    Example::

        class CountSteps(TrainerCallback):
            def __init__(self):
                self.steps = 0

            def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
                self.steps += 1
    """

    def on_init_end(self, trainer: "Trainer", **kwargs):
        """Called at the end of ``Trainer.__init__``."""

    def on_training_run_start(self, trainer: "Trainer", **kwargs):
        """Called after ``training_run_start``, once the dataloaders and scheduler exist."""

    def on_train_epoch_start(self, trainer: "Trainer", **kwargs):
        """Called after ``train_epoch_start``, before the first batch of a training epoch."""

    def on_train_step_start(self, trainer: "Trainer", **kwargs):
        """Called before ``calculate_train_batch_loss`` on each training batch."""

    def on_train_step_end(self, trainer: "Trainer", batch, batch_output: dict, **kwargs):
        """Called after ``calculate_train_batch_loss``, before the backward pass.

        Args:
            batch: the batch from the training dataloader.
            batch_output: the dictionary ``calculate_train_batch_loss`` returned, extra keys included;
                its ``loss`` is the unscaled loss, whatever the gradient accumulation.
            step: (keyword) the index of the batch in the epoch, from 0.
        """

    def on_optimizer_step_end(self, trainer: "Trainer", **kwargs):
        """Called after each optimizer update, once the scheduler has stepped and the gradients are zeroed.

        An update skipped for non-finite gradients (``SkipNonFiniteStepsCallback``) fires nothing; under fp16, an
        update the gradient scaler skipped for an overflow counts, as it does in ``num_update_steps_completed``.
        Do here what must follow every update (an EMA of the weights, a step-based log, evaluation or save); it
        fires once per accumulation window, not per batch. A training state asked for here is written at the next
        point between two updates: before the next batch of the epoch, or between epochs after its last update.

        Args:
            step: (keyword) the index in the epoch of the batch that closed the window, from 0.
            num_update_steps_completed: (keyword) the optimizer updates made so far in this run, this one included
                (``trainer.num_update_steps_completed``).
        """

    def on_train_epoch_end(self, trainer: "Trainer", **kwargs):
        """Called after ``train_epoch_end``; ``train_loss_epoch`` is already in the run history."""

    def on_eval_epoch_start(self, trainer: "Trainer", **kwargs):
        """Called after ``eval_epoch_start``, before the first evaluation batch."""

    def on_eval_step_start(self, trainer: "Trainer", **kwargs):
        """Called before ``calculate_eval_batch_loss`` on each evaluation batch."""

    def on_eval_step_end(self, trainer: "Trainer", batch, batch_output: dict, **kwargs):
        """Called after ``calculate_eval_batch_loss`` with the batch and the dictionary it returned."""

    def on_eval_epoch_end(self, trainer: "Trainer", **kwargs):
        """Called after ``eval_epoch_end``; the epoch's eval loss is already in the run history."""

    def on_training_run_epoch_end(self, trainer: "Trainer", **kwargs):
        """Called after ``training_run_epoch_end``, once the training and evaluation epochs are done."""

    def on_training_run_end(self, trainer: "Trainer", **kwargs):
        """Called after ``training_run_end``, at the very end of ``train()``."""

    def on_evaluation_run_start(self, trainer: "Trainer", **kwargs):
        """Called after ``evaluation_run_start``, at the start of ``evaluate()``."""

    def on_evaluation_run_end(self, trainer: "Trainer", **kwargs):
        """Called after ``evaluation_run_end``, at the very end of ``evaluate()``."""

    def on_stop_training_error(self, trainer: "Trainer", **kwargs):
        """Called when a :class:`StopTrainingError` ends a run early."""


class CallbackHandler:
    """Calls the registered callbacks, in the order given, for each event the trainer fires.

    Callback classes are instantiated with no arguments; instances are used as they are. Two callbacks
    of the same class are refused, as in pytorch-accelerated.
    """

    def __init__(self, callbacks: Iterable[Union[TrainerCallback, type]] = ()):
        self.callbacks: list = []
        self._listeners: dict[str, list] = {}
        self.add_callbacks(callbacks)

    def add_callbacks(self, callbacks: Iterable[Union[TrainerCallback, type]]) -> None:
        """Add each callback (class or instance) of ``callbacks``, a list or tuple of them."""
        validate_callback_list(callbacks)
        for callback in callbacks:
            self.add_callback(callback)

    def add_callback(self, callback: Union[TrainerCallback, type]) -> None:
        """Add one callback, given as a class or an instance.

        Raises:
            TypeError: ``callback`` has none of the events of :class:`TrainerCallback` (a plain function, say).
            ValueError: it defines an ``on_*`` method that is not an event, or one of its class is registered.
        """
        _validate_event_methods(callback if isinstance(callback, type) else type(callback))
        _validate_is_callback(callback)
        instance = callback() if isinstance(callback, type) else callback
        if type(instance) in {type(existing) for existing in self.callbacks}:
            raise ValueError(
                f"A {type(instance).__name__} is already registered (callbacks: {self.callback_list}); "
                "a trainer takes one callback of each class. Remove the duplicate."
            )
        self.callbacks.append(instance)
        self._listeners.clear()

    def remove_callback(self, callback_class: type) -> None:
        """Remove the callback of class ``callback_class``."""
        self.callbacks = [cb for cb in self.callbacks if type(cb) is not callback_class]
        self._listeners.clear()

    def clear_callbacks(self) -> None:
        """Remove every callback."""
        self.callbacks = []
        self._listeners.clear()

    def __iter__(self):
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    @property
    def callback_list(self) -> list[str]:
        """The class names of the registered callbacks, in calling order."""
        return [type(cb).__name__ for cb in self.callbacks]

    def call_event(self, event: str, *args, **kwargs) -> None:
        """Call ``event`` on every callback that overrides it, in order.

        Raises:
            ValueError: ``event`` is not one of :data:`EVENTS`.
        """
        listeners = self._listeners.get(event)
        if listeners is None:
            listeners = self._listeners[event] = self._find_listeners(event)
        for method in listeners:
            method(*args, **kwargs)

    def _find_listeners(self, event: str) -> list:
        # Callbacks that keep the base no-op are left out, so an event nobody listens to costs nothing.
        if event not in EVENTS:
            raise ValueError(f"Unknown callback event {event!r}{_suggest(event)}. The events are: {list(EVENTS)}.")
        base_method = getattr(TrainerCallback, event)
        methods = [getattr(cb, event, None) for cb in self.callbacks]
        return [m for m in methods if callable(m) and getattr(m, "__func__", m) is not base_method]


def _suggest(name: str) -> str:
    matches = difflib.get_close_matches(name, EVENTS, n=1)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


def _validate_event_methods(callback_class: type) -> None:
    """Refuse a callback with an ``on_*`` method that is not an event: it would never be called."""
    unknown = [
        name
        for name in dir(callback_class)
        if name.startswith("on_") and name not in EVENTS and callable(getattr(callback_class, name))
    ]
    if unknown:
        raise ValueError(
            f"{callback_class.__name__} defines {unknown[0]!r}{_suggest(unknown[0])}, which is not a "
            f"callback event, so it would never be called. Rename it to one of: {list(EVENTS)}."
        )


def _is_callback(callback: Any) -> bool:
    """A TrainerCallback (class or instance), or an object or class with at least one event method."""
    if isinstance(callback, TrainerCallback) or (isinstance(callback, type) and issubclass(callback, TrainerCallback)):
        return True
    return any(callable(getattr(callback, event, None)) for event in EVENTS)


def _callback_name(callback: Any) -> str:
    if isinstance(callback, type) or (callable(callback) and hasattr(callback, "__qualname__")):
        return callback.__qualname__
    return f"{type(callback).__name__}()"


def _validate_is_callback(callback: Any) -> None:
    """Refuse what the handler would never call: a function, or an object with none of the events."""
    if _is_callback(callback):
        return
    name = _callback_name(callback)
    if callable(callback) and not isinstance(callback, type):
        raise TypeError(
            f"callbacks received the function {name}, which is not a callback and would never be called: put its "
            "code in an event method of a TrainerCallback subclass, e.g. class MyCallback(TrainerCallback): "
            f"def on_train_epoch_end(self, trainer, **kwargs): {name}(trainer), and pass MyCallback()."
        )
    raise TypeError(
        f"{name} is not a callback: it has none of the TrainerCallback events, so it would never be called. "
        f"Subclass TrainerCallback and override the events you need, among: {list(EVENTS)}."
    )


def validate_callback_list(callbacks: Any) -> None:
    """Refuse a single callback (class, instance or function), or anything else that is not a list of them."""
    if isinstance(callbacks, IterableABC) and not isinstance(callbacks, (str, bytes)) and not _is_callback(callbacks):
        return
    if _is_callback(callbacks):
        name = _callback_name(callbacks)
        raise TypeError(
            f"callbacks={name} is a single callback, not a list of them: pass callbacks=[{name}] (or "
            f"callbacks=[*DEFAULT_CALLBACKS, {name}] to keep the default callbacks)."
        )
    if callable(callbacks) and not isinstance(callbacks, type):
        raise TypeError(
            f"callbacks={_callback_name(callbacks)} is a function, not a list of callbacks (a function would never be "
            "called): pass a list of TrainerCallback subclasses or instances, whose on_* methods are the events, e.g. "
            "callbacks=[*DEFAULT_CALLBACKS, MyCallback()]."
        )
    raise TypeError(
        f"callbacks={callbacks!r} is not a list of callbacks: pass a list of TrainerCallback classes or instances, "
        "e.g. callbacks=[*DEFAULT_CALLBACKS, MyCallback()], or callbacks=[] for none."
    )
