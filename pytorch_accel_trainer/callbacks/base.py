"""The callback protocol: the one list of events, the base class with a no-op per event, and the handler."""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import logging
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytorch_accel_trainer.state.storage import Destination
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
    "on_predict_run_start",
    "on_predict_step_end",
    "on_predict_run_end",
    "on_stop_training_error",
)

#: The events that end a run. Each callback's runs even when an earlier one raised (they close bars, put dataloaders
#: back, save); the first error is raised once they all have.
RUN_END_EVENTS = ("on_training_run_end", "on_evaluation_run_end", "on_predict_run_end")

#: The events that receive ``is_intermediate``: ``True`` in the evaluation epochs of ``StepBasedEvaluationCallback``.
EVAL_EPOCH_EVENTS = ("on_eval_epoch_start", "on_eval_epoch_end")

#: The most common of other trainers' names for these events: ``name: (whose name it is, what it is here)``, what it
#: is here being the event that means the same or, where there is none, what to do instead. A callback that defines
#: one of them, undeclared, is refused when it is added (it would never be called); declared as a custom event, it is
#: allowed. Any other name is a custom event, named in a warning at the end of a run that never fired it.
FOREIGN_EVENT_NAMES: dict[str, tuple[str, str]] = {
    "on_fit_start": ("Lightning's", "on_training_run_start"),
    "on_fit_end": ("Lightning's", "on_training_run_end"),
    "on_train_begin": ("Keras's and Hugging Face's", "on_training_run_start"),
    "on_train_end": ("Lightning's, Keras's and Hugging Face's", "on_training_run_end"),
    "on_before_train": ("mini.trainer's", "on_training_run_start"),
    "on_after_train": ("mini.trainer's", "on_training_run_end"),
    "on_epoch_begin": ("Keras's and Hugging Face's", "on_train_epoch_start"),
    "on_epoch_end": ("Keras's and Hugging Face's", "on_training_run_epoch_end"),
    "on_train_batch_start": ("Lightning's", "on_train_step_start"),
    "on_before_step": ("mini.trainer's", "on_train_step_start"),
    "on_train_batch_end": ("Lightning's, Dream Trainer's and Keras's", "on_train_step_end"),
    "on_step_end": ("Hugging Face's", "on_optimizer_step_end"),
    "on_after_step": ("mini.trainer's", "on_optimizer_step_end"),
    "on_validation_batch_end": ("Lightning's and Dream Trainer's", "on_eval_step_end"),
    "on_validation_epoch_end": ("Lightning's", "on_eval_epoch_end"),
    "on_after_backward": ("Lightning's", "no event: override the trainer's backward_step hook"),
    "on_save_checkpoint": ("Lightning's", "no event: a callback's state_dict() is saved in each training state"),
    "on_state_dict": ("mini.trainer's", "no event: a callback's state_dict() is saved in each training state"),
    "on_load_checkpoint": ("Lightning's", "no event: a callback's load_state_dict() restores it on resume"),
    "on_load_state_dict": ("mini.trainer's", "no event: a callback's load_state_dict() restores it on resume"),
}

#: fastai's event names, which lack the ``on_`` prefix: a callback method of one of these names is never called here,
#: so adding the callback warns, naming the event to use (a warning, not an error: it may be a helper of yours).
FASTAI_EVENT_NAMES: dict[str, str] = {
    "before_fit": "on_training_run_start",
    "after_fit": "on_training_run_end",
    "before_epoch": "on_train_epoch_start",
    "after_epoch": "on_training_run_epoch_end",
    "before_train": "on_train_epoch_start",
    "after_train": "on_train_epoch_end",
    "before_batch": "on_train_step_start",
    "after_loss": "on_train_step_end",
    "after_batch": "on_train_step_end",
    "after_step": "on_optimizer_step_end",
    "before_validate": "on_eval_epoch_start",
    "after_validate": "on_eval_epoch_end",
}

logger = logging.getLogger(__name__)


class CallbackMethodNotImplementedError(AttributeError):
    """A callback has no method (or attribute) of the name asked for.

    Raised, as in pytorch-accelerated, when an attribute a :class:`TrainerCallback` does not have is read, e.g. the
    handler of a custom event on a callback that does not handle it. It is an ``AttributeError``, so ``hasattr`` and
    ``getattr(callback, name, default)`` work as usual.
    """


class TrainerCallback:
    """The base class of callbacks: one no-op method per event; override the ones you need.

    Every method receives the trainer first, then keyword arguments; accept ``**kwargs`` so that new
    arguments do not break a callback. Every argument but the trainer has a default, so the events can also be
    called by hand as in pytorch-accelerated's tests, e.g. ``callback.on_train_step_end(trainer, step=0)``. A method
    whose name starts with ``on_`` but is not an event is a custom event, which a Trainer subclass fires with
    ``callback_handler.call_event(name, ...)``, as in pytorch-accelerated; but one whose name is a likely
    misspelling of an event (``on_train_epoch_ends``) is refused when the callback is added, and a custom event
    method that was never called by the end of a run is named in a warning, so a typo cannot silently do nothing.
    Reading an attribute a callback does not have raises :class:`CallbackMethodNotImplementedError`, an
    ``AttributeError``.

    Example::

        class CountSteps(TrainerCallback):
            def __init__(self):
                self.steps = 0

            def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
                self.steps += 1
    """

    def on_init_end(self, trainer: Trainer, **kwargs):
        """Called at the end of ``Trainer.__init__``."""

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        """Called after ``training_run_start``, once the dataloaders and scheduler exist."""

    def on_train_epoch_start(self, trainer: Trainer, **kwargs):
        """Called after ``train_epoch_start``, before the first batch of a training epoch."""

    def on_train_step_start(self, trainer: Trainer, **kwargs):
        """Called before ``calculate_train_batch_loss`` on each training batch."""

    def on_train_step_end(self, trainer: Trainer, batch=None, batch_output: dict | None = None, **kwargs):
        """Called after ``calculate_train_batch_loss``, before the backward pass.

        Args:
            batch: the batch from the training dataloader.
            batch_output: the dictionary ``calculate_train_batch_loss`` returned, extra keys included;
                its ``loss`` is the unscaled loss, whatever the gradient accumulation.

        Keyword Args:
            step: the index of the batch in the epoch, from 0 (also ``trainer.batch_idx``).
        """

    def on_optimizer_step_end(self, trainer: Trainer, **kwargs):
        """Called after each optimizer update, once the scheduler has stepped and the gradients are zeroed.

        An update skipped for non-finite gradients (``SkipNonFiniteStepsCallback``) fires nothing; under fp16, an
        update the gradient scaler skipped for an overflow counts, as it does in ``num_update_steps_completed``.
        Do here what must follow every update (an EMA of the weights, a step-based log, evaluation or save); it
        fires once per accumulation window, not per batch. A training state asked for here is written at the next
        point between two updates: before the next batch of the epoch, or between epochs after its last update.

        Keyword Args:
            step: the index in the epoch of the batch that closed the window, from 0.
            num_update_steps_completed: the optimizer updates made so far in this run, this one included
                (``trainer.num_update_steps_completed``).
        """

    def on_train_epoch_end(self, trainer: Trainer, **kwargs):
        """Called after ``train_epoch_end``; ``train_loss_epoch`` and the step metrics (``train_<name>_epoch``) are
        already in the run history."""

    def on_eval_epoch_start(self, trainer: Trainer, **kwargs):
        """Called after ``eval_epoch_start``, before the first evaluation batch.

        Keyword Args:
            is_intermediate: ``True`` in an evaluation of ``StepBasedEvaluationCallback`` during a training
                epoch, else ``False``.
        """

    def on_eval_step_start(self, trainer: Trainer, **kwargs):
        """Called before ``calculate_eval_batch_loss`` on each evaluation batch."""

    def on_eval_step_end(self, trainer: Trainer, batch=None, batch_output: dict | None = None, **kwargs):
        """Called after ``calculate_eval_batch_loss`` with the batch and the dictionary it returned.

        Args:
            batch: the batch from the evaluation dataloader.
            batch_output: the dictionary ``calculate_eval_batch_loss`` returned, extra keys included.

        Keyword Args:
            step: the index of the batch in the evaluation epoch, from 0 (also ``trainer.batch_idx``).
        """

    def on_eval_epoch_end(self, trainer: Trainer, **kwargs):
        """Called after ``eval_epoch_end``; the epoch's eval loss and step metrics are already in the run history.

        Keyword Args:
            is_intermediate: as in :meth:`on_eval_epoch_start`.
        """

    def on_training_run_epoch_end(self, trainer: Trainer, **kwargs):
        """Called after ``training_run_epoch_end``, once the training and evaluation epochs are done."""

    def on_training_run_end(self, trainer: Trainer, **kwargs):
        """Called after ``training_run_end``, at the very end of ``train()``."""

    def on_evaluation_run_start(self, trainer: Trainer, **kwargs):
        """Called after ``evaluation_run_start``, at the start of ``evaluate()``."""

    def on_evaluation_run_end(self, trainer: Trainer, **kwargs):
        """Called after ``evaluation_run_end``, at the very end of ``evaluate()``."""

    def on_predict_run_start(self, trainer: Trainer, **kwargs):
        """Called at the start of ``predict()``, the model prepared and in evaluation mode, before the first batch."""

    def on_predict_step_end(self, trainer: Trainer, batch=None, batch_output=None, **kwargs):
        """Called after each batch of ``predict()``.

        Args:
            batch: this process's batch.
            batch_output: the batch's prediction (what ``calculate_predict_batch_output`` returned) gathered from
                every process, on the CPU: the same on every process, each sample once.

        Keyword Args:
            step: the index of the batch, from 0.
        """

    def on_predict_run_end(self, trainer: Trainer, **kwargs):
        """Called at the end of ``predict()``, the model unwrapped and back in its training modes."""

    def on_stop_training_error(self, trainer: Trainer, **kwargs):
        """Called when a :class:`StopTrainingError` ends a run early."""

    def watched_metric(self) -> tuple[str, Any] | None:
        """The run-history metric this callback watches and its best value so far (``None`` before the first), which
        ``train()`` reports in its ``TrainResult`` (``best_metric_name``, ``best_metric``: the first callback's that
        watches one); the default, ``None``, watches none. ``MonitorCallback`` and its subclasses return theirs."""
        return None

    def writes_to(self) -> tuple[Destination, ...]:
        """The folders or object-storage URLs this callback writes to, each with what it keeps there; by default
        none. A callback that saves files overrides it, so that the trainer checks its destinations before the
        first batch as it does the built-in ones' (they can be written, a local folder is shared by every node, a
        store of training states reaches every process).

        Example::

            from pytorch_accel_trainer.callbacks import CHECKPOINTS, Destination

            class SaveEveryEpoch(TrainerCallback):
                def writes_to(self):
                    return (Destination(self.folder, CHECKPOINTS, "SaveEveryEpoch(folder=...)"),)
        """
        return ()

    def __getattr__(self, name: str) -> Any:
        # Only called for an attribute that normal lookup did not find; a parent class (an nn.Module, say) may have it.
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            message = f"{type(self).__name__!r} object has no attribute {name!r}"
            raise CallbackMethodNotImplementedError(message) from None


class CallbackHandler:
    """Calls the registered callbacks, in the order given, for each event the trainer fires.

    Callback classes are instantiated with no arguments; instances are used as they are. Two callbacks
    of the same class are refused, as in pytorch-accelerated.

    Args:
        callbacks: callback classes or instances.
        events: custom events, beyond :data:`EVENTS`, that a Trainer subclass fires (see :meth:`register_events`).
            Declaring them is optional: it silences the warning about a custom event method never called in a run.
    """

    def __init__(self, callbacks: Iterable[TrainerCallback | type] = (), events: Iterable[str] = ()):
        self.callbacks: list = []
        #: The custom events declared with ``events`` or :meth:`register_events`, in order.
        self.custom_events: tuple[str, ...] = ()
        self._listeners: dict[str, list] = {}
        #: The events of :data:`EVENTS` that no callback handles and whose call does nothing else (the events that
        #: end a run never are: their call also warns of custom methods never called). Found as each is first fired;
        #: the trainer skips them, so that an event nobody listens to costs one set lookup.
        self.unheard_events: set[str] = set()
        self._is_intermediate = False
        #: Undeclared custom event methods of the callbacks (``on_*`` names that are not events), by name, with the
        #: classes that define them; the custom events fired so far; the names already warned about.
        self._undeclared_methods: dict[str, list[str]] = {}
        self._fired_custom_events: set[str] = set()
        self._warned_never_called: set[str] = set()
        self.register_events(*events)
        self.add_callbacks(callbacks)

    def add_callbacks(self, callbacks: Iterable[TrainerCallback | type]) -> None:
        """Add each callback (class or instance) of ``callbacks``, a list or tuple of them."""
        validate_callback_list(callbacks)
        for callback in callbacks:
            self.add_callback(callback)

    def add_callback(self, callback: TrainerCallback | type) -> None:
        """Add one callback, given as a class or an instance.

        Raises:
            TypeError: ``callback`` has none of the events of :class:`TrainerCallback` (a plain function, say).
            ValueError: it defines an ``on_*`` method whose name is a likely misspelling of an event, or one of its
                class is registered.
        """
        callback_class = callback if isinstance(callback, type) else type(callback)
        custom_methods = _validate_event_methods(callback_class, self.events)
        _validate_is_callback(callback)
        instance = callback() if isinstance(callback, type) else callback
        if type(instance) in {type(existing) for existing in self.callbacks}:
            raise ValueError(
                f"A {type(instance).__name__} is already registered (callbacks: {self.callback_list}); "
                "a trainer takes one callback of each class. Remove the duplicate."
            )
        self.callbacks.append(instance)
        for name in custom_methods:
            self._undeclared_methods.setdefault(name, []).append(callback_class.__name__)
        self._forget_listeners()

    def remove_callback(self, callback_class: type) -> None:
        """Remove the callback of class ``callback_class``."""
        self.callbacks = [cb for cb in self.callbacks if type(cb) is not callback_class]
        self._forget_listeners()

    def clear_callbacks(self) -> None:
        """Remove every callback."""
        self.callbacks = []
        self._forget_listeners()

    def register_events(self, *events: str) -> None:
        """Declare custom events, fired by a Trainer subclass with ``callback_handler.call_event(event, ...)``.

        Optional: a callback's ``on_*`` method that is not an event is a custom event already. Declaring says the
        event is meant, so no warning names its method when a run ends without firing it; declared events are
        listed in :attr:`events`.

        Raises:
            ValueError: an event is not a valid method name, or starts with ``_``.
        """
        for event in events:
            if not isinstance(event, str) or not event.isidentifier() or event.startswith("_"):
                raise ValueError(
                    f"Custom callback event {event!r} is not a method name: pass names such as 'on_my_event' "
                    "(letters, digits and underscores, not starting with '_')."
                )
            if event not in self.events:
                self.custom_events = (*self.custom_events, event)
            self._undeclared_methods.pop(event, None)
        self._forget_listeners()

    @property
    def events(self) -> tuple[str, ...]:
        """Every event this handler may fire: :data:`EVENTS`, then the custom events."""
        return (*EVENTS, *self.custom_events)

    def __iter__(self):
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    @property
    def callback_list(self) -> list[str]:
        """The class names of the registered callbacks, in calling order."""
        return [type(cb).__name__ for cb in self.callbacks]

    def watched_metric(self) -> tuple[str | None, Any]:
        """The metric the first callback that watches one watches and its best value so far
        (:meth:`TrainerCallback.watched_metric`); ``(None, None)`` when none does. A callback without the method (one
        that only has event methods) watches none."""
        for callback in self.callbacks:
            watched_metric = getattr(callback, "watched_metric", None)
            watched = watched_metric() if callable(watched_metric) else None
            if watched is not None:
                return watched
        return None, None

    @contextlib.contextmanager
    def intermediate_evaluation(self) -> Iterator[None]:
        """Within this block, the evaluation-epoch events receive ``is_intermediate=True`` (``False`` otherwise)."""
        previous, self._is_intermediate = self._is_intermediate, True
        try:
            yield
        finally:
            self._is_intermediate = previous

    def call_event(self, event: str, *args, **kwargs) -> None:
        """Call ``event`` on every callback that handles it, in order.

        A built-in event reaches the callbacks that override it, with the keyword arguments each names. A custom event
        (one not in :data:`EVENTS`) reaches the callbacks with a method of its name, with ``args`` and ``kwargs`` as
        they are (positional arguments included), as in pytorch-accelerated; none handling it is not an error, unless
        its name is a likely misspelling of an event (then it would silently never run). The evaluation-epoch events
        also receive ``is_intermediate`` (see :meth:`intermediate_evaluation`). For the events that end a run, every
        callback's method runs even when one raises; the first error is raised after; then a warning names each
        undeclared custom event method that no ``call_event`` has reached (once per name).
        An error a callback raises reaches the caller: the trainer fires its own events through
        ``Trainer._call_event``, which holds a ``StopTrainingError`` until the processes agree to stop.

        Raises:
            ValueError: ``event`` is not an event, no callback handles it, and its name is a likely misspelling of
                an event.
        """
        listeners = self._listeners.get(event)
        if listeners is None:
            listeners = self._find_listeners(event)
        if event in EVAL_EPOCH_EVENTS:
            kwargs.setdefault("is_intermediate", self._is_intermediate)
        if event in RUN_END_EVENTS:
            try:
                _call_each(listeners, event, args, kwargs)
            finally:
                self._warn_of_custom_methods_never_called()
            return
        for method in listeners:
            method(*args, **kwargs)

    def _forget_listeners(self) -> None:
        """The callbacks or events changed: find each event's listeners again as it fires."""
        self._listeners.clear()
        self.unheard_events.clear()

    def _find_listeners(self, event: str) -> list:
        if event in EVENTS:
            # Callbacks that keep the base no-op are left out, so an event nobody listens to costs nothing.
            base_method = getattr(TrainerCallback, event)
            methods = [getattr(cb, event, None) for cb in self.callbacks]
            listeners = [
                _taking_only_its_arguments(m)
                for m in methods
                if callable(m) and getattr(m, "__func__", m) is not base_method
            ]
        else:
            listeners = [m for m in (getattr(cb, event, None) for cb in self.callbacks) if callable(m)]
            misspelt = _misspelt_event(event)
            if not listeners and event not in self.custom_events and misspelt is not None:
                raise ValueError(
                    f"Unknown callback event {event!r} (did you mean {misspelt!r}?): it is not one of the events and "
                    f"no registered callback has a method of that name (callbacks: {self.callback_list}), so nothing "
                    f"would run. Fix the name; for a custom event of that name, declare it with "
                    f"trainer.callback_handler.register_events({event!r})."
                )
            self._fired_custom_events.add(event)
        self._listeners[event] = listeners
        if not listeners and event in EVENTS and event not in RUN_END_EVENTS:
            self.unheard_events.add(event)
        return listeners

    def _warn_of_custom_methods_never_called(self) -> None:
        """At the end of a run: one warning per undeclared custom event method that nothing has fired (a typo the
        misspelling check let through, or an event the trainer in use does not fire)."""
        for name, classes in self._undeclared_methods.items():
            if name in self._fired_custom_events or name in self._warned_never_called:
                continue
            self._warned_never_called.add(name)
            warnings.warn(
                f"{', '.join(classes)} defines {name!r}, which is not a trainer event and was never called in this "
                f"run: no call_event({name!r}, ...) fired it. If it is a custom event your Trainer fires, nothing is "
                f"wrong (declare it to silence this: callback_events = ({name!r},) on the Trainer subclass, or "
                f"trainer.callback_handler.register_events({name!r})); else rename it to one of the events: "
                f"{list(EVENTS)}.",
                UserWarning,
                stacklevel=3,
            )


def _taking_only_its_arguments(method: Any) -> Any:
    """``method`` itself if it takes ``**kwargs``; else a wrapper that drops the keyword arguments it does not name.

    The trainer passes more keyword arguments than pytorch-accelerated did (``step=`` to ``on_eval_step_end``, ...):
    a callback written for it without ``**kwargs`` keeps working. Found once per event, not per call.
    """
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: called as it is
        return method
    if any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
        return method
    names = {
        parameter.name
        for parameter in parameters
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    }

    @functools.wraps(method)
    def call(*args, **kwargs):
        return method(*args, **{name: value for name, value in kwargs.items() if name in names})

    return call


def _call_each(listeners: list, event: str, args: tuple, kwargs: dict) -> None:
    """Call every listener, even after one raised; then raise the first error (later ones are logged)."""
    first_error = None
    for method in listeners:
        try:
            method(*args, **kwargs)
        except Exception as error:
            if first_error is None:
                first_error = error
            else:
                logger.error("%s raised in %s, after an earlier callback's error", method, event, exc_info=error)
    if first_error is not None:
        raise first_error


#: How alike (``difflib``'s ratio, 0 to 1) a name must be to an event's to be taken for a misspelling of it: another
#: form of its words (``on_train_epoch_ends``, ``on_eval_step_ended``) or a typo (``on_trian_step_end``) is; a custom
#: event (``on_invoke_save_checkpoint``) is not.
MISSPELLING_CUTOFF = 0.9


def _misspelt_event(name: str) -> str | None:
    """The trainer event that ``name`` (not itself an event) is a likely misspelling of, or ``None``."""
    matches = difflib.get_close_matches(name, EVENTS, n=1, cutoff=MISSPELLING_CUTOFF)
    return matches[0] if matches and name not in EVENTS else None


def _foreign_name_message(callback_class: type, name: str) -> str:
    """What to say of a callback method named as another trainer's event (see :data:`FOREIGN_EVENT_NAMES`)."""
    whose, here = FOREIGN_EVENT_NAMES[name]
    declare = (
        f"If it is a custom event your Trainer subclass fires, declare it (callback_events = ({name!r},) on the "
        "subclass)."
    )
    if here in EVENTS:
        return (
            f"{callback_class.__name__} defines {name!r}, which is {whose} name for an event; here the event is "
            f"{here!r}, and {name!r} would never be called. Rename the method to {here!r} (its keyword arguments are "
            f"listed in docs/callbacks.md). {declare}"
        )
    return (
        f"{callback_class.__name__} defines {name!r}, which is {whose} name for an event that this trainer does not "
        f"fire ({here}), so {name!r} would never be called. {declare}"
    )


def _validate_event_methods(callback_class: type, events: Iterable[str] = EVENTS) -> list[str]:
    """Refuse a callback with an ``on_*`` method named as another trainer's event (:data:`FOREIGN_EVENT_NAMES`) or
    whose name is a likely misspelling of an event (either would never be called), and warn of a method named as a
    fastai event; return its other ``on_*`` methods that are not events: custom events, undeclared."""
    events = tuple(events)
    custom = [
        name
        for name in dir(callback_class)
        if name.startswith("on_") and name not in events and callable(getattr(callback_class, name))
    ]
    _warn_of_fastai_names(callback_class)
    for name in custom:
        if name in FOREIGN_EVENT_NAMES:
            raise ValueError(_foreign_name_message(callback_class, name))
        misspelt = _misspelt_event(name)
        if misspelt is not None:
            raise ValueError(
                f"{callback_class.__name__} defines {name!r} (did you mean {misspelt!r}?), which is not a callback "
                f"event, so it would never be called. Rename it to {misspelt!r}, one of the events: {list(EVENTS)}. "
                f"If it is a custom event your Trainer subclass fires, declare it (callback_events = ({name!r},) on "
                "the subclass) or give it a name further from the events'."
            )
    return custom


def _warn_of_fastai_names(callback_class: type) -> None:
    for name, event in FASTAI_EVENT_NAMES.items():
        if callable(getattr(callback_class, name, None)):
            warnings.warn(
                f"{callback_class.__name__} defines {name!r}, which is fastai's name for an event; here the event is "
                f"{event!r}, and the trainer only calls on_* methods, so {name!r} is never called by it. Rename it to "
                f"{event!r}; if it is a helper of your own, rename it to silence this.",
                UserWarning,
                stacklevel=4,
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
    if isinstance(callbacks, Iterable) and not isinstance(callbacks, (str, bytes)) and not _is_callback(callbacks):
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


def overrides(trainer: Any, name: str) -> bool:
    """Whether the trainer method ``name`` is a user's own: set on the instance, or defined by more than one class of
    its MRO. Callbacks and the trainer ask it before relying on what the default hook does."""
    return name in vars(trainer) or sum(name in vars(cls) for cls in type(trainer).__mro__) > 1
