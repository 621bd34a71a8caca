"""An exponential moving average (EMA) of the model's weights, updated after every optimizer step."""

from __future__ import annotations

import contextlib
import numbers
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pytorch_accel_trainer.callbacks.base import CallbackHandler
from pytorch_accel_trainer.callbacks.checkpoints import SaveBestModelCallback
from pytorch_accel_trainer.callbacks.evaluation import is_intermediate_evaluation, validate_can_evaluate_during_training
from pytorch_accel_trainer.utils import ModelEma

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer

#: The prefix of the metrics recorded while the EMA weights are evaluated, e.g. ``ema_model_eval_loss_epoch``.
EMA_METRIC_PREFIX = "ema_model_"


class ModelEmaCallback(SaveBestModelCallback):
    """Keeps an exponential moving average of the model's weights, evaluates it, and saves the best one.

    At the start of each run, ``ema_model = model_ema(model, decay=decay)`` copies the model (without its
    distributed or compiled wrapper); after every optimizer update, in ``on_optimizer_step_end``,
    ``ema_model.update(model)`` moves it towards the new weights. With the default
    :class:`~pytorch_accel_trainer.utils.ModelEma`, each floating-point parameter and buffer becomes
    ``decay * ema + (1 - decay) * weight`` (other buffers are copied), with ``torch._foreach`` operations and
    no host-device sync. pytorch-accelerated updates its EMA once per epoch instead.

    With ``evaluate_during_training``, each evaluation epoch of ``train()`` is followed by one over the
    same data with the EMA weights (``ema_model.module``), whose metrics are recorded with the prefix
    ``ema_model_`` (``ema_model_eval_loss_epoch``, ...), and the EMA weights are saved to ``save_path``
    whenever ``watch_metric`` improves. Without it, the EMA weights are saved at the end of every epoch. The
    EMA weights are never loaded into the model: read them from ``ema_model.module`` or from the file.

    Order matters: place this callback after the callbacks that record evaluation metrics (their state
    is reset by the EMA evaluation) and before those that read them (``LogMetricsCallback``).

    Args:
        decay: the weight of the running average at each update, in ``(0, 1)``.
        evaluate_during_training: evaluate the EMA weights after each evaluation epoch (needs an
            ``eval_dataset``) and save the best; ``False`` saves the EMA weights every epoch.
        save_path: the checkpoint file of the EMA weights.
        watch_metric: the metric that decides which EMA weights are best.
        greater_is_better: whether a larger value of ``watch_metric`` is better.
        model_ema: the class that keeps the average: called as ``model_ema(model, decay=decay)``, it must
            have ``update(model)`` and the averaged model as ``module``, as ``ModelEma`` (the default) has.
        callbacks: the callbacks called during the EMA evaluation epoch (e.g. a metrics callback); the
            trainer's callbacks are not.

    Example::

        callbacks = (*DEFAULT_CALLBACKS[:-1], ModelEmaCallback(decay=0.999), DEFAULT_CALLBACKS[-1])
    """

    def __init__(
        self,
        decay: float = 0.99,
        evaluate_during_training: bool = True,
        save_path: str | os.PathLike = "ema_model.pt",
        watch_metric: str = "ema_model_eval_loss_epoch",
        greater_is_better: bool = False,
        model_ema: Callable[..., Any] = ModelEma,
        callbacks: Iterable = (),
    ):
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0 < decay < 1:
            raise ValueError(f"decay is {decay!r}; pass a number between 0 and 1, e.g. decay=0.999.")
        if not callable(model_ema):
            raise TypeError(
                f"model_ema is a {type(model_ema).__name__}; pass a class such as ModelEma, "
                "called as model_ema(model, decay=decay)."
            )
        super().__init__(
            save_path=save_path,
            watch_metric=watch_metric,
            greater_is_better=greater_is_better,
            reset_on_train=False,
            save_optimizer=False,
            save_scheduler=False,
            load_saved_checkpoint=False,
        )
        self.decay: float = float(decay)
        self.evaluate_during_training: bool = evaluate_during_training
        self.model_ema_cls: Callable[..., Any] = model_ema
        self.callback_handler: CallbackHandler = CallbackHandler(callbacks)
        self.ema_model: Any = None  # the model_ema instance; its ``module`` holds the averaged weights
        self.num_updates: int = 0
        self._in_training_run: bool = False
        self._restored_weights: dict | None = None
        self._unwrapped: tuple | None = None  # (trainer.model, that model unwrapped)

    # ------------------------------------------------------------------------------------------------
    # Keeping the average
    # ------------------------------------------------------------------------------------------------

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        restored = self._state_was_restored
        super().on_training_run_start(trainer)
        if self.evaluate_during_training:
            validate_can_evaluate_during_training(trainer, type(self).__name__)
        self._unwrapped = None
        self.ema_model = self.model_ema_cls(self._unwrapped_model(trainer), decay=self.decay)
        if self.evaluate_during_training:
            self.ema_model.to(trainer.device)  # evaluated where the model is (a no-op for ModelEma's copy)
        if not restored:
            self.num_updates = 0
        if self._restored_weights is not None:
            self.ema_model.module.load_state_dict(self._restored_weights)
            self._restored_weights = None
        self._in_training_run = True

    def on_optimizer_step_end(self, trainer: Trainer, **kwargs):
        self.update(trainer)

    def update(self, trainer: Trainer) -> None:
        """Move the EMA weights one step towards the trainer's model's current weights."""
        self.ema_model.update(self._unwrapped_model(trainer))
        self.num_updates += 1

    def _unwrapped_model(self, trainer: Trainer):
        """``trainer.get_model()``, unwrapped again only when ``trainer.model`` is another object (unwrapping costs
        about 0.3 ms, on every step otherwise)."""
        if self._unwrapped is None or self._unwrapped[0] is not trainer.model:
            self._unwrapped = (trainer.model, trainer.get_model())
        return self._unwrapped[1]

    # ------------------------------------------------------------------------------------------------
    # Evaluating and saving the average
    # ------------------------------------------------------------------------------------------------

    def on_eval_epoch_end(self, trainer: Trainer, **kwargs):
        if not (self.evaluate_during_training and self._in_training_run) or is_intermediate_evaluation(trainer):
            return  # evaluate() runs, and the extra evaluations within an epoch, use the model itself
        trainer.print("\nRunning evaluation on EMA model")
        trainer.run_extra_eval_epoch(
            self.ema_model.module, callbacks=self.callback_handler, metric_name_prefix=EMA_METRIC_PREFIX
        )

    def on_training_run_epoch_end(self, trainer: Trainer, **kwargs):
        with self._ema_weights_in(trainer):
            if self.evaluate_during_training:
                super().on_training_run_epoch_end(trainer)  # saves the EMA weights when watch_metric improves
            else:
                trainer.save_checkpoint(
                    self.save_path,
                    checkpoint_kwargs={"epoch": trainer.run_history.current_epoch, "num_updates": self.num_updates},
                    save_optimizer=False,
                    save_scheduler=False,
                )

    def on_training_run_end(self, trainer: Trainer, **kwargs):
        self._in_training_run = False
        self._unwrapped = None  # the trainer releases its prepared model
        super().on_training_run_end(trainer)  # never loads: load_saved_checkpoint is False

    @contextlib.contextmanager
    def _ema_weights_in(self, trainer: Trainer):
        model = trainer.model
        trainer.model = self.ema_model.module
        try:
            yield
        finally:
            trainer.model = model

    # ------------------------------------------------------------------------------------------------
    # Training state
    # ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Return the EMA weights, the number of updates and the best metric, for the training-state checkpoint."""
        state = {**super().state_dict(), "num_updates": self.num_updates}
        weights = self.ema_model.module.state_dict() if self.ema_model is not None else self._restored_weights
        if weights is not None:
            state["ema_state_dict"] = dict(weights)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a state returned by :meth:`state_dict`, before or during the training run it resumes."""
        super().load_state_dict(state)
        self.num_updates = int(state.get("num_updates", 0))
        weights = state.get("ema_state_dict")
        if weights is not None and self._in_training_run:
            self.ema_model.module.load_state_dict(weights)
        else:
            self._restored_weights = weights  # loaded into the EMA copy made at the next on_training_run_start
