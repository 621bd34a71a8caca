"""What hooks and callbacks use from a trainer: its device and Accelerator, read-only views of the run state, the
unwrapped model, printing once per node, gathering across processes, and an extra evaluation epoch.

A mixin of :class:`~pytorch_accel_trainer.trainer.Trainer`, kept apart so that ``trainer.py`` holds the run's
skeleton.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from accelerate import Accelerator

from pytorch_accel_trainer.callbacks import CallbackHandler
from pytorch_accel_trainer.parallel.sharded import unwrap_distributed_model
from pytorch_accel_trainer.utils import remove_padding


class TrainerUtilitiesMixin:
    """Public utilities of a :class:`~pytorch_accel_trainer.trainer.Trainer`."""

    def run_extra_eval_epoch(
        self, model: Optional[torch.nn.Module] = None, callbacks=None, metric_name_prefix: str = ""
    ) -> None:
        """Run one more evaluation epoch now, during a training run, over its evaluation data.

        For callbacks that evaluate between updates (``StepBasedEvaluationCallback``) or other weights
        (``ModelEmaCallback``). Each metric recorded during the epoch gets ``metric_name_prefix``
        (``eval_loss_epoch`` becomes e.g. ``ema_model_eval_loss_epoch``), so the epoch's own are never overwritten.
        The trainer's model, callbacks, metric prefix and the training mode of every module are restored after.

        Args:
            model: the module to evaluate in place of ``trainer.model``, e.g. an EMA copy of the weights.
            callbacks: a :class:`CallbackHandler` or callbacks to call during this epoch instead of the trainer's.
            metric_name_prefix: prepended to the name of every metric recorded during the epoch.

        Example::

            trainer.run_extra_eval_epoch(model=ema_model, callbacks=[MetricCollectionCallback(...)], metric_name_prefix="ema_")
        """
        if self.eval_dataloader is None:
            raise ValueError(
                "run_extra_eval_epoch() evaluates on the eval_dataset of the training run, but this run has none: pass "
                "train(..., eval_dataset=...), or call evaluate(dataset) outside the run."
            )
        history, evaluated = self.run_history, model if model is not None else self.model
        restore = (self.model, self.callback_handler, getattr(history, "metric_name_prefix", ""))
        modes = [(module, module.training) for module in evaluated.modules()]
        if callbacks is not None:
            self.callback_handler = callbacks if isinstance(callbacks, CallbackHandler) else CallbackHandler(callbacks)
        self.model = evaluated
        history.set_metric_name_prefix(metric_name_prefix)
        try:
            self._run_eval_epoch(self.eval_dataloader)
        finally:
            self.model, self.callback_handler = restore[:2]
            history.set_metric_name_prefix(restore[2])
            for module, training in modes:  # module by module: frozen layers may be in eval mode on purpose
                module.training = training

    @property
    def device(self) -> torch.device:
        """The device of this process, as chosen by Accelerate."""
        return torch.device(self._accelerator.device)

    @property
    def accelerator(self) -> Accelerator:
        """The :class:`accelerate.Accelerator` of this trainer (read-only): its process index, ``reduce``, ``prepare``."""
        return self._accelerator

    @property
    def num_update_steps_completed(self) -> int:
        """Optimizer updates made so far in the current training run."""
        return self.run_state.num_update_steps_completed

    @property
    def epoch_first_step(self) -> int:
        """The first micro-batch of the current training epoch: 0, or the batches already trained on when a resumed
        run continues an epoch (a progress bar starts there)."""
        return self.run_state.epoch_first_step

    @property
    def _train_dataloader(self) -> Optional[Iterable]:
        """pytorch-accelerated's name of :attr:`train_dataloader`, kept for scripts and callbacks written for it."""
        return self.train_dataloader

    @_train_dataloader.setter
    def _train_dataloader(self, dataloader: Optional[Iterable]) -> None:
        self.train_dataloader = dataloader

    @property
    def _eval_dataloader(self) -> Optional[Iterable]:
        """pytorch-accelerated's name of :attr:`eval_dataloader`."""
        return self.eval_dataloader

    @_eval_dataloader.setter
    def _eval_dataloader(self, dataloader: Optional[Iterable]) -> None:
        self.eval_dataloader = dataloader

    def get_model(self, keep_torch_compile: bool = False) -> torch.nn.Module:
        """Return the model without its distributed or compiled wrappers (no ``module.``/``_orig_mod.`` keys).

        ``keep_torch_compile=True`` keeps the ``torch.compile`` wrapper (the distributed ones are still removed).

        Under FSDP its parameters are this process's shards: for full weights use ``save_checkpoint``,
        ``save_weights`` or ``sharded.get_full_model_state_dict`` (on every process).
        """
        return self._accelerator.unwrap_model(self.model, keep_torch_compile=keep_torch_compile)

    def _unwrap_distributed_model(self) -> torch.nn.Module:
        # keeps the wrapper of a model the user compiled; the trainer's own (torch_compile=...) is made again by prepare
        return unwrap_distributed_model(self._accelerator, self.model, keep_torch_compile=self.torch_compile is False)

    def print(self, *args, **kwargs) -> None:
        """Print once per node, like ``print``."""
        self._accelerator.print(*args, **kwargs)

    def gather(self, tensor: torch.Tensor, padding_value: Any = None) -> torch.Tensor:
        """Concatenate ``tensor`` from every process along the first dimension.

        Args:
            tensor: the tensor of this process.
            padding_value: if given, tensors of different lengths are padded with it before gathering, and
                rows made only of it are removed afterwards; pick a value the data never holds. In the last batch of an
                evaluation epoch, the rows Accelerate repeated (``eval_batch_real_rows``) are dropped first, so each
                sample is returned once when the tensor's rows are the batch's samples. Without it, the
                rows Accelerate repeats in the last batch of the data are dropped, as in :meth:`gather_for_metrics`.

        Returns:
            The gathered tensor, on every process.
        """
        if padding_value is None:
            return self._accelerator.gather_for_metrics(tensor)
        if self.eval_batch_real_rows is not None:  # the last evaluation batch: the rows after these repeat samples
            tensor = tensor[: self.eval_batch_real_rows]
        tensor = self._accelerator.pad_across_processes(tensor, dim=0, pad_index=padding_value)
        return remove_padding(self._accelerator.gather(tensor), padding_value)

    def gather_for_metrics(self, data: Any) -> Any:
        """Gather ``data`` (tensors, or any picklable objects) from every process for computing metrics.

        In the last batch of the data, the rows Accelerate repeated to give every process a full batch are dropped:
        over an evaluation epoch, the gathered rows are exactly the dataset's, in the dataset's order. Every process
        must call it at the same step.
        """
        return self._accelerator.gather_for_metrics(data)
