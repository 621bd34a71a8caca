"""The default callbacks of a trainer, as pytorch-accelerated's ``get_default_callbacks`` returns them."""

from __future__ import annotations

from pytorch_accel_trainer.callbacks.control import TerminateOnNaNCallback
from pytorch_accel_trainer.callbacks.device import MoveModulesToDeviceCallback
from pytorch_accel_trainer.callbacks.progress import LogMetricsCallback, PrintProgressCallback, ProgressBarCallback


def get_default_callbacks(progress_bar: bool = True, verbose: bool = False) -> tuple:
    """Return the classes of the default callbacks, in calling order: ``DEFAULT_CALLBACKS`` of the trainer.

    Args:
        progress_bar: include :class:`ProgressBarCallback`; ``False`` leaves it out (e.g. in a log file).
        verbose: the console callbacks as instances with ``verbose=True``: pytorch-accelerated's output (a line per
            stage and per metric, a bar per training and evaluation epoch) instead of a line per epoch.

    Example::

        callbacks = (*get_default_callbacks(progress_bar=False), MyCallback)
        trainer = Trainer(model, loss_func, optimizer, callbacks=callbacks)
    """
    if verbose:
        verbose_bar = (ProgressBarCallback(verbose=True),) if progress_bar else ()
        return (
            MoveModulesToDeviceCallback,
            TerminateOnNaNCallback,
            PrintProgressCallback(verbose=True),
            *verbose_bar,
            LogMetricsCallback(verbose=True),
        )
    bar = (ProgressBarCallback,) if progress_bar else ()
    return (MoveModulesToDeviceCallback, TerminateOnNaNCallback, PrintProgressCallback, *bar, LogMetricsCallback)
