"""Run history (metrics by epoch) and the device-side loss accumulator."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

if TYPE_CHECKING:  # pandas is imported only when a table is asked for
    import pandas


class RunHistory(ABC):
    """The abstract record of the metrics of a run, by epoch.

    Subclass it to keep metrics somewhere else than in memory; the trainer only uses the methods below.
    """

    @abstractmethod
    def get_metric_names(self) -> set:
        """Return the names of every metric recorded so far."""

    @abstractmethod
    def get_metric_values(self, metric_name: str) -> list:
        """Return every value recorded for ``metric_name``, oldest first."""

    @abstractmethod
    def get_latest_metric(self, metric_name: str) -> Any:
        """Return the newest value recorded for ``metric_name``."""

    @abstractmethod
    def update_metric(self, metric_name: str, metric_value: Any) -> None:
        """Record ``metric_value`` for ``metric_name`` at the current epoch."""

    @property
    @abstractmethod
    def current_epoch(self) -> int:
        """The epoch being run, counted from 1."""

    @abstractmethod
    def _increment_epoch(self) -> None:
        """Move on to the next epoch; called by the trainer at the end of each training-run epoch."""

    def set_metric_name_prefix(self, prefix: str = "") -> None:
        """Prefix the names of the metrics recorded from now on; override in subclasses."""
        raise NotImplementedError(
            f"{type(self).__name__} has no set_metric_name_prefix(); implement it to use prefixes."
        )

    def delete_metric(self, metric_name: str) -> None:
        """Forget every value of ``metric_name``; override in subclasses."""
        raise NotImplementedError(f"{type(self).__name__} has no delete_metric(); implement it to forget a metric.")

    def _set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the current epoch (a resumed run continues its epoch count); override in subclasses."""
        raise NotImplementedError(f"{type(self).__name__} has no _set_epoch(); it cannot continue a resumed run.")

    @abstractmethod
    def reset(self) -> None:
        """Forget every metric and go back to epoch 1."""

    def state_dict(self) -> dict:
        """Return the history as tensors and plain values, for a training state; override in subclasses."""
        raise NotImplementedError(
            f"{type(self).__name__} has no state_dict(), so it cannot be saved with the training state: implement "
            "state_dict() and load_state_dict(), or use InMemoryRunHistory."
        )

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        raise NotImplementedError(f"{type(self).__name__} has no load_state_dict(); see state_dict().")


class UnknownMetricError(KeyError, ValueError):
    """A metric name that the run history has not recorded: a ``KeyError``, and a ``ValueError`` as in
    pytorch-accelerated, so that either ``except`` catches it."""


class InMemoryRunHistory(RunHistory):
    """A :class:`RunHistory` kept in memory, with export to pandas and CSV.

    Example::

        history = trainer.run_history
        history.get_latest_metric("eval_loss_epoch")
        history.to_dataframe()          # one row per epoch, one column per metric
        history.to_csv("history.csv")
    """

    def __init__(self):
        self._current_epoch = 1
        self._metrics: dict[str, list] = defaultdict(list)
        self._epochs: dict[str, list[int]] = defaultdict(list)
        self.metric_name_prefix = ""

    def get_metric_names(self) -> set:
        return set(self._metrics)

    def get_metric_values(self, metric_name: str) -> list:
        return list(self._metric(metric_name))

    def get_latest_metric(self, metric_name: str) -> Any:
        values = self._metric(metric_name)
        if not values:
            raise ValueError(f"The metric {metric_name!r} has no values yet.")
        return values[-1]

    def update_metric(self, metric_name: str, metric_value: Any) -> None:
        name = f"{self.metric_name_prefix}{metric_name}"
        self._metrics[name].append(metric_value)
        self._epochs[name].append(self._current_epoch)

    def delete_metric(self, metric_name: str) -> None:
        """Forget every value of ``metric_name``."""
        self._metric(metric_name)
        del self._metrics[metric_name], self._epochs[metric_name]

    def set_metric_name_prefix(self, prefix: str = "") -> None:
        """Prefix the names of the metrics recorded from now on (``""`` to stop)."""
        self.metric_name_prefix = prefix

    @property
    def current_epoch(self) -> int:
        return self._current_epoch

    def _increment_epoch(self) -> None:
        self._current_epoch += 1

    def _set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"epoch is {epoch!r}; epochs are counted from 1: pass an int >= 1.")
        self._current_epoch = epoch

    def reset(self) -> None:
        self._current_epoch = 1
        self._metrics.clear()
        self._epochs.clear()

    def state_dict(self) -> dict:
        return {
            "current_epoch": self._current_epoch,
            "metrics": {name: [_plain(value) for value in values] for name, values in self._metrics.items()},
            "epochs": {name: list(epochs) for name, epochs in self._epochs.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.reset()
        self._current_epoch = state["current_epoch"]
        self._metrics.update({name: list(values) for name, values in state["metrics"].items()})
        self._epochs.update({name: list(epochs) for name, epochs in state["epochs"].items()})

    def to_dataframe(self) -> "pandas.DataFrame":
        """Return every metric as a column of a DataFrame indexed by epoch.

        A metric recorded several times in one epoch keeps its last value for that epoch.
        """
        import pandas

        columns = {
            name: pandas.Series(values, index=self._epochs[name]).groupby(level=0).last()
            for name, values in sorted(self._metrics.items())
        }
        frame = pandas.DataFrame(columns)
        frame.index.name = "epoch"
        return frame

    def to_csv(self, path: str) -> None:
        """Write :meth:`to_dataframe` to a CSV file at ``path``."""
        self.to_dataframe().to_csv(path)

    def _metric(self, metric_name: str) -> list:
        if metric_name not in self._metrics:
            raise UnknownMetricError(
                f"No metric named {metric_name!r} in the run history; the metrics recorded are {sorted(self._metrics)}."
            )
        return self._metrics[metric_name]


def _plain(value: Any) -> Any:
    """A metric value as something ``torch.load(weights_only=True)`` reads back (numpy scalars become floats)."""
    if hasattr(value, "item") and not isinstance(value, torch.Tensor) and getattr(value, "shape", None) == ():
        return value.item()
    return value


class DeferredSum:
    """A weighted sum of scalar tensors, added up on their device and read back to the host only when asked.

    The first value allocates the sum, one 0-d float32 tensor on its device, kept for the object's life
    (:meth:`reset` zeroes it in place); every later value is added into it in place: one small device op per
    value and never a host-device sync. Nothing of a value is kept, so nothing a step allocates outlives the step:
    references to each step's loss, kept to be summed later, held small allocations between the steps' activations
    that kept the CPU allocator from reusing or returning that memory (the resident memory of a run grew by
    megabytes a step).
    """

    def __init__(self):
        self._sum: torch.Tensor | None = None  # the accumulator, allocated once (see the class docstring)
        self._has_values = False
        self.weight_total: Any = 0

    def reset(self) -> None:
        """Start again from 0; the accumulator is zeroed in place, not allocated again during a step."""
        if self._has_values:
            self._sum.zero_()  # type: ignore[union-attr]  # _has_values means it exists
        self._has_values = False
        self.weight_total = 0

    def add(self, value: torch.Tensor, weight: Any = 1) -> None:
        """Add ``value * weight`` (``weight`` a number or a scalar tensor); ``value`` is not kept."""
        self.add_detached(value.detach(), weight)

    def add_detached(self, value: torch.Tensor, weight: Any = 1) -> None:
        """:meth:`add` for a ``value`` its caller has detached already (a tensor op less: a step's loss is detached
        once, by the loss tracker, not twice)."""
        accumulator = self._sum
        if accumulator is None or accumulator.device != value.device:
            accumulator = self._sum = torch.zeros((), dtype=torch.float32, device=value.device)
        if isinstance(weight, torch.Tensor):
            if weight.device == accumulator.device:
                accumulator.addcmul_(value, weight)
            else:  # a CPU count beside a CUDA loss: an operand of a product may be a 0-d CPU tensor
                accumulator.add_(value.float() * weight)
        else:
            accumulator.add_(value, alpha=weight)
        self._has_values = True
        total = self.weight_total
        if (
            isinstance(total, torch.Tensor)
            and (not isinstance(weight, torch.Tensor) or weight.device == total.device)
            and torch.result_type(total, weight) == total.dtype  # e.g. not a float added to an int count
        ):
            total.add_(weight)  # a tensor count: in place, no new tensor a step
        else:
            self.weight_total = total + weight

    @property
    def total(self) -> torch.Tensor | None:
        """A copy of the sum so far, on the device (``None`` before the first value)."""
        return self._sum.clone() if self._has_values else None  # type: ignore[union-attr]

    def state_dict(self) -> dict:
        """The exact state, as copies; ``pending`` and ``pending_weight`` (values not yet added) are always
        ``None``, for the states saved before the sum was added up in place."""
        return {
            "total": self._sum.clone() if self._has_values else None,  # type: ignore[union-attr]
            "pending": None,
            "pending_weight": None,
            "weight_total": _copied(self.weight_total),
        }

    def load_state_dict(self, state: dict) -> None:
        total, pending = state["total"], state["pending"]
        if pending is not None:  # a state saved with values not yet added: add them as they would have been
            pending_sum = pending.float().sum() * state["pending_weight"]
            total = pending_sum if total is None else total + pending_sum
        self._has_values = total is not None
        if total is not None:
            self._sum = total.detach().to(torch.float32, copy=True).reshape(())  # never the state's own tensor
        elif self._sum is not None:
            self._sum.zero_()
        self.weight_total = _copied(state["weight_total"])


def _copied(value: Any) -> Any:
    """A tensor's copy (the sums are changed in place), any other value as it is."""
    return value.clone() if isinstance(value, torch.Tensor) else value


class LossTracker:
    """Sums batch losses, weighted by batch size, without leaving the device.

    An update adds the loss into one tensor on the device, in place (a :class:`DeferredSum`): no host-device
    synchronisation, and nothing of the step kept. Reading the sum back to the host (a synchronisation) happens
    once, in :meth:`reduce_average`, at the end of an epoch. Plain Python numbers are summed on the host, as
    pytorch-accelerated's ``LossTracker`` does, so its API (``loss_value``, ``average``, ``total_loss``,
    ``running_count``) works too; reading ``average`` of tensor losses is a host-device synchronisation.
    """

    def __init__(self):
        self._sum = DeferredSum()
        # the sum of the losses given as numbers; a tensor once a batch size was a tensor
        self._host_total: Union[float, torch.Tensor] = 0
        # the last batch's loss, detached: its autograd graph is not kept alive until the next batch's
        self.loss_value: Any = 0

    def reset(self) -> None:
        self._sum.reset()
        self._host_total = 0
        self.loss_value = 0

    def update(self, loss_batch_value: Union[torch.Tensor, float], batch_size: Union[int, torch.Tensor] = 1) -> None:
        """Add one batch's mean loss, weighted by its number of samples."""
        if isinstance(loss_batch_value, torch.Tensor):
            loss_batch_value = loss_batch_value.detach()
        self.loss_value = loss_batch_value
        if isinstance(loss_batch_value, torch.Tensor):
            self._sum.add_detached(loss_batch_value, batch_size)
        else:  # a number: summed on the host, exactly as given
            self._host_total += loss_batch_value * batch_size
            self._sum.weight_total = self._sum.weight_total + batch_size  # numbers: nothing to add in place

    @property
    def total_loss(self) -> Union[torch.Tensor, float, None]:
        """The batch-size-weighted sum of the losses so far: a device tensor for tensor losses (``None`` before
        the first), a number for numbers."""
        return self._with_host_total(self._sum.total)

    def peek_total_loss(self) -> Union[torch.Tensor, float, None]:
        """:attr:`total_loss`, which reading never changes: the epoch's loss is the same to the last bit whether or
        not a callback read it during the epoch."""
        return self.total_loss

    def _with_host_total(self, device_total: Optional[torch.Tensor]) -> Union[torch.Tensor, float, None]:
        if device_total is None:
            return self._host_total if self.running_count else None
        return device_total + self._host_total if self._host_total else device_total

    @property
    def running_count(self) -> Union[int, torch.Tensor]:
        """The number of samples so far (a copy, for a tensor: the count is added up in place)."""
        return _copied(self._sum.weight_total)

    @property
    def average(self) -> float:
        """The per-sample average on this process (0 before the first update); a host read for tensor losses."""
        count, total = self.running_count, self.total_loss
        if total is None or not count:
            return 0
        average = total / count
        return average.item() if isinstance(average, torch.Tensor) else average

    def state_dict(self) -> dict:
        return {**self._sum.state_dict(), "host_total": _copied(self._host_total)}

    def absorb(self, state: Optional[dict]) -> None:
        """Add the sums of another tracker's :meth:`state_dict` to this one's (a resume on fewer or more processes
        gives one process every saved process's sums of the interrupted epoch); ``None`` adds nothing."""
        if not state:
            return
        other = LossTracker()
        other.load_state_dict(state)
        other_total, own_total = other._sum.total, self._sum.total
        if other_total is not None:
            self._sum.load_state_dict(
                {
                    "total": other_total if own_total is None else own_total + other_total,
                    "pending": None,
                    "pending_weight": None,
                    "weight_total": self._sum.weight_total + other._sum.weight_total,
                }
            )
        else:
            self._sum.weight_total = self._sum.weight_total + other._sum.weight_total
        self._host_total = self._host_total + other._host_total

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self._host_total = state.pop("host_total", 0)
        self._sum.load_state_dict(state)

    def reduce_average(self, reduce_sum, device: torch.device) -> Optional[float]:
        """Return the per-sample average over every process, or ``None`` when no process tracked a loss.

        Every process must call this, even one that saw no batch, since it is a collective operation.

        Args:
            reduce_sum: sums a tensor over processes (``accelerator.reduce``).
            device: where the sum is taken.
        """
        total_loss = self.total_loss
        total = torch.as_tensor(0.0 if total_loss is None else total_loss, dtype=torch.float32).to(device)
        count = torch.as_tensor(self.running_count, device=device).float()
        loss_sum, sample_count = reduce_sum(torch.stack([total, count])).tolist()  # the epoch's one sync
        return loss_sum / sample_count if sample_count else None


#: The keys of a batch-loss hook's dict that the trainer uses itself; every other scalar is a step metric.
BATCH_OUTPUT_KEYS = frozenset({"loss", "model_outputs", "batch_size", "num_items_in_batch"})


def is_scalar_metric(value: Any) -> bool:
    """Whether ``value`` is a number or a 0-d tensor (``True``/``False`` and strings are not metrics)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_complex()
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class StepMetricsTracker:
    """Averages, over an epoch, the extra scalars a batch-loss hook returns beside ``loss``.

    ``calculate_train_batch_loss`` may return ``{"loss": ..., "batch_size": ..., "accuracy": ...}``: each extra
    number or 0-d tensor is weighted like the loss (by ``num_items_in_batch``, else ``batch_size``) and summed on
    the device, as :class:`LossTracker` does, so a step costs no host-device synchronisation; other values (lists,
    tensors with dimensions, strings) are left alone.
    """

    def __init__(self):
        self.trackers: dict[str, LossTracker] = {}
        # the trackers of metrics no batch of this epoch returned yet, reset: taken back as they come, so that an
        # epoch's step allocates no new sum (see DeferredSum)
        self._idle: dict[str, LossTracker] = {}

    def reset(self) -> None:
        for tracker in self.trackers.values():
            tracker.reset()
        self._idle.update(self.trackers)
        self.trackers = {}

    def update(self, batch_output: Any, weight: Any) -> None:
        """Add the step metrics of one batch's output, each weighted by ``weight``."""
        for name, value in batch_output.items():
            if name not in BATCH_OUTPUT_KEYS and is_scalar_metric(value):
                tracker = self.trackers.get(name)
                if tracker is None:
                    tracker = self.trackers[name] = self._idle.pop(name) if name in self._idle else LossTracker()
                tracker.update(value.detach() if isinstance(value, torch.Tensor) else value, weight)

    def state_dict(self) -> dict:
        return {name: tracker.state_dict() for name, tracker in self.trackers.items()}

    def load_state_dict(self, state: dict) -> None:
        self.trackers = {}
        for name, tracker_state in state.items():
            self.trackers[name] = LossTracker()
            self.trackers[name].load_state_dict(tracker_state)

    def absorb(self, state: Optional[dict]) -> None:
        """Add the sums of another tracker's :meth:`state_dict` to this one's (see :meth:`LossTracker.absorb`)."""
        for name, tracker_state in (state or {}).items():
            self.trackers.setdefault(name, LossTracker()).absorb(tracker_state)

    def reduce_averages(self, reduce_sum, device: torch.device, names: list) -> dict:
        """Return the weighted mean of each metric in ``names`` over every process (one collective, one host
        read); a metric no process saw in this epoch is left out.

        Every process must call this with the same ``names``, even one that saw none of them.

        Args:
            reduce_sum: sums a tensor over processes (``accelerator.reduce``).
            device: where the sums are taken.
            names: the metrics of every process, in one order (see ``step_metric_names``).
        """
        if not names:
            return {}
        sums = []
        for name in names:
            tracker = self.trackers.get(name)
            total = None if tracker is None else tracker.total_loss
            count = 0 if tracker is None else tracker.running_count
            sums.append(torch.as_tensor(0.0 if total is None else total, dtype=torch.float32).to(device))
            sums.append(torch.as_tensor(count, device=device).float())
        reduced = reduce_sum(torch.stack(sums)).tolist()  # the epoch's one sync for its step metrics
        return {name: reduced[2 * i] / reduced[2 * i + 1] for i, name in enumerate(names) if reduced[2 * i + 1]}


def metric_counts(run_history: RunHistory) -> dict:
    """How many values each metric of ``run_history`` has, to tell later what a run recorded."""
    return {name: len(run_history.get_metric_values(name)) for name in run_history.get_metric_names()}


def metrics_recorded_since(run_history: RunHistory, counts: dict) -> dict:
    """The latest value of each metric recorded since ``counts`` (from :func:`metric_counts`) was taken."""
    recorded = {}
    for name in sorted(run_history.get_metric_names()):
        values = run_history.get_metric_values(name)
        if len(values) > counts.get(name, 0):
            recorded[name] = values[-1]
    return recorded
