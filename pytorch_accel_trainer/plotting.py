"""Plot the metrics of a run history by epoch, and a learning-rate range test (matplotlib, an optional dependency)."""

from __future__ import annotations

import math
import numbers
import os
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

from pytorch_accel_trainer.tracking import RunHistory

if TYPE_CHECKING:  # matplotlib is imported only when a plot is asked for
    from matplotlib.figure import Figure


def plot_run_history(
    run_history: RunHistory,
    save_path: Union[str, os.PathLike, None] = None,
    metric_names: Optional[Iterable[str]] = None,
    num_columns: int = 3,
) -> "Figure":
    """Plot every numeric metric of ``run_history`` by epoch, one panel per metric, and optionally save it.

    Metrics whose values are not numbers (lists of per-class values, say) are left out. With an
    :class:`~pytorch_accel_trainer.tracking.InMemoryRunHistory`, each point sits at the epoch it was recorded
    in (the last value of an epoch, as in ``to_dataframe()``); with another run history, values are
    numbered from 1.

    Args:
        run_history: the run history, e.g. ``trainer.run_history``.
        save_path: an image file to write (``.png``, ``.svg``, ``.pdf``, ...); ``None`` writes nothing.
        metric_names: the metrics to plot, in this order; every numeric metric, sorted, by default.
        num_columns: panels per row.

    Returns:
        The matplotlib ``Figure`` (not attached to pyplot, so nothing opens a window).

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: a name in ``metric_names`` is not in the run history, or no metric can be plotted.

    Example::

        plot_run_history(trainer.run_history, "history.png")
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:
        raise ImportError(
            'plot_run_history needs matplotlib, which is not installed: pip install "pytorch-accel-trainer[plot]"'
        ) from error

    series = _numeric_series(run_history, metric_names)
    num_columns = max(1, min(num_columns, len(series)))
    num_rows = math.ceil(len(series) / num_columns)
    figure = Figure(figsize=(4.5 * num_columns, 3.2 * num_rows), layout="constrained")
    axes = figure.subplots(num_rows, num_columns, squeeze=False).flatten()
    for ax, (name, (epochs, values)) in zip(axes, series.items()):
        ax.plot(epochs, values, marker="o")
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    for ax in axes[len(series) :]:
        ax.set_visible(False)
    if save_path is not None:
        figure.savefig(save_path)
    return figure


def _numeric_series(run_history: RunHistory, metric_names: Optional[Iterable[str]]) -> dict:
    """Return ``{name: (epochs, values)}`` for each metric to plot."""
    available = run_history.get_metric_names()
    names = sorted(available) if metric_names is None else list(metric_names)
    unknown = [name for name in names if name not in available]
    if unknown:
        raise ValueError(
            f"No metric named {unknown[0]!r} in the run history; the metrics recorded are {sorted(available)}."
        )
    frame = run_history.to_dataframe() if hasattr(run_history, "to_dataframe") else None
    series = {}
    for name in names:
        if frame is not None:
            column = frame[name].dropna()
            epochs, values = list(column.index), list(column)
        else:
            values = run_history.get_metric_values(name)
            epochs = list(range(1, len(values) + 1))
        if values and all(isinstance(value, numbers.Real) for value in values):
            series[name] = (epochs, values)
    if not series:
        raise ValueError(
            f"None of the metrics {names} holds numbers to plot; record plain numbers in the run history "
            "(e.g. tensor.item())."
        )
    return series


def plot_lr_find(result: Any, save_path: Union[str, os.PathLike, None] = None) -> "Figure":
    """Plot a learning-rate range test (``Trainer.lr_find``): the loss against the learning rate, on a log scale.

    The raw losses are drawn faint, the smoothed ones (which the suggestion reads) solid, and the suggested learning
    rate marked, in the style of :func:`plot_run_history`.

    Args:
        result: what ``Trainer.lr_find`` returned (its ``lrs``, ``losses``, ``smoothed_losses`` and ``suggestion``).
        save_path: an image file to write; ``None`` writes nothing.

    Returns:
        The matplotlib ``Figure`` (not attached to pyplot).

    Raises:
        ImportError: matplotlib is not installed.

    Example::

        plot_lr_find(trainer.lr_find(train_dataset), "lr_find.png")
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            'plot_lr_find needs matplotlib, which is not installed: pip install "pytorch-accel-trainer[plot]"'
        ) from error

    figure = Figure(figsize=(4.5, 3.2), layout="constrained")
    ax = figure.subplots()
    ax.plot(result.lrs, result.losses, alpha=0.3, label="loss")
    ax.plot(result.lrs, result.smoothed_losses, label="smoothed loss")
    if result.suggestion is not None:
        index = result.lrs.index(result.suggestion)
        ax.plot(
            [result.suggestion],
            [result.smoothed_losses[index]],
            marker="o",
            color="red",
            label=f"suggestion {result.suggestion:.2g}",
        )
    smoothed = [value for value in result.smoothed_losses if math.isfinite(value)]
    if smoothed and smoothed[0] > min(smoothed):  # above the start's loss the curve only diverges: show the descent
        bottom = min(value for value in (*smoothed, *result.losses) if math.isfinite(value))
        top = smoothed[0] + 0.5 * (smoothed[0] - min(smoothed))
        ax.set_ylim(bottom - 0.05 * (top - bottom), top)
    ax.set_xscale("log")
    ax.set_title("learning-rate range test")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    if save_path is not None:
        figure.savefig(save_path)
    return figure
