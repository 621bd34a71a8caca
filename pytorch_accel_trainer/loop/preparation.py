"""What ``train()`` and ``evaluate()`` do before the first batch: the factory hooks and Accelerate's preparation.

A mixin of :class:`~pytorch_accel_trainer.trainer.Trainer`, kept apart so that ``trainer.py`` holds the run's
skeleton. The ``create_*`` and ``get_default_*`` methods are documented hooks: override them on a Trainer
subclass as any other.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Optional

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DataLoaderConfiguration

from pytorch_accel_trainer.callbacks import CallbackHandler, with_limit_batches_from_env
from pytorch_accel_trainer.callbacks.base import validate_callback_list
from pytorch_accel_trainer.loop import persistence
from pytorch_accel_trainer.loop.batches import batches_need_placing
from pytorch_accel_trainer.parallel.distributed import create_accelerator, release_prepared, wrappers_only_call_torch
from pytorch_accel_trainer.parallel.sharded import prepare_components
from pytorch_accel_trainer.placeholders import placeholder_values, resolve_placeholders
from pytorch_accel_trainer.run_config import TrainerRunConfig, TrainOptions, build_run_config
from pytorch_accel_trainer.utils import dataset_length, worker_init_fn
from pytorch_accel_trainer.validation import overrides, validate_model_and_loss


class SetupMixin:
    """The setup of a :class:`~pytorch_accel_trainer.trainer.Trainer` run: dataloaders, Accelerator, scheduler."""

    def _create_callback_handler(self) -> CallbackHandler:
        """Return the :class:`CallbackHandler` that calls the trainer's callbacks (with a
        ``LimitBatchesCallback`` added while the environment variable ``PT_ACC_LIMIT_BATCHES`` is set)."""
        validate_callback_list(self._callbacks)  # a single callback where a list is expected is a TypeError
        return CallbackHandler(with_limit_batches_from_env(self._callbacks), events=self.callback_events)

    def _create_accelerator(self) -> Accelerator:
        """Return the :class:`accelerate.Accelerator` that runs training; override to configure it.

        Launched on several processes on a machine without GPUs (``accelerate launch --multi_gpu`` or
        ``torchrun``), it runs one multi-process job on the CPU (gloo), where Accelerate alone would run
        independent copies of the training.

        The default shuffles with Accelerate's seedable sampler: the order of epoch ``e`` depends only on
        ``seed + e`` (``seed`` 0 when ``Trainer(seed=None)``), identical on every process, so a resumed run
        can skip to any batch by sampler offset.
        """
        data_seed = self.seed if self.seed is not None else 0
        options = {"dataloader_config": DataLoaderConfiguration(use_seedable_sampler=True, data_seed=data_seed)}
        options.update(self.accelerator_kwargs)  # the user's, from Trainer(accelerator_kwargs=...)
        return create_accelerator(mixed_precision=self.mixed_precision, cpu=self.cpu, **options)

    # ------------------------------------------------------------------------------------------------
    # Setup hooks
    # ------------------------------------------------------------------------------------------------

    def get_default_train_dl_kwargs(self, batch_size: int) -> dict:
        """Return the default training DataLoader arguments.

        ``num_workers`` is 0: on small in-memory data, worker processes make each step several times
        slower. Pass ``train_dataloader_kwargs={"num_workers": 4}`` for data that is costly to load;
        workers then persist across epochs and seed numpy per worker.
        """
        return {
            "shuffle": True,
            "pin_memory": torch.cuda.is_available(),
            "batch_size": batch_size,
            "num_workers": 0,
            "worker_init_fn": worker_init_fn,
        }

    def get_default_eval_dl_kwargs(self, batch_size: int) -> dict:
        """Return the default evaluation DataLoader arguments: as for training, without shuffling."""
        return {
            "shuffle": False,
            "pin_memory": torch.cuda.is_available(),
            "batch_size": batch_size,
            "num_workers": 0,
            "worker_init_fn": worker_init_fn,
        }

    def create_scheduler(self) -> Any:
        """Return the learning-rate scheduler built by ``self.create_scheduler_fn(self.optimizer)``, or ``None``
        when ``train()`` was given no ``create_scheduler_fn``.

        Runs once in ``train()``, after the dataloaders are prepared, so that
        :class:`TrainerPlaceholderValues` in a ``functools.partial`` factory resolve to this run's values.
        The scheduler is stepped once per optimizer update, in :meth:`scheduler_step`. Override it to build the
        scheduler in code: the override is called with or without a ``create_scheduler_fn``.
        """
        if self.create_scheduler_fn is None:
            return None
        values = placeholder_values(self.run_config, self.train_dataloader, self.eval_dataloader)
        return resolve_placeholders(self.create_scheduler_fn, values)(self.optimizer)

    # ------------------------------------------------------------------------------------------------
    # Internal setup
    # ------------------------------------------------------------------------------------------------

    def _prepare_model_optimizer_and_dataloaders(self) -> None:
        """Wrap the model, optimizer and dataloaders for the current devices and processes, via Accelerate.

        Preparing shards each DataLoader across processes, which changes its length: the run config and
        the scheduler are built after this. The two halves, :meth:`_prepare_model_and_optimizer` and
        :meth:`_prepare_dataloaders` (pytorch-accelerated's documented internals), may be overridden: then each is
        called, and Accelerate prepares the halves in two calls (DeepSpeed needs one: override this method there).
        """
        validate_model_and_loss(self.model, self.loss_func)  # here, not in __init__: a subclass may prepare its own
        release_prepared(self.accelerator)  # nothing of an earlier run is kept or prepared twice
        if overrides(self, "_prepare_model_and_optimizer") or overrides(self, "_prepare_dataloaders"):
            self._prepare_model_and_optimizer()
            self._prepare_dataloaders()
        else:
            self._prepare(model_and_optimizer=True, dataloaders=True)  # one call, as DeepSpeed needs

    def _prepare_model_and_optimizer(self) -> None:
        """Wrap the model and optimizer via Accelerate (and compile the model, with ``torch_compile``)."""
        self._prepare(model_and_optimizer=True, dataloaders=False)

    def _prepare_dataloaders(self) -> None:
        """Wrap the dataloaders via Accelerate: shard them across processes, and place their batches."""
        self._prepare(model_and_optimizer=False, dataloaders=True)

    def _prepare(self, model_and_optimizer: bool, dataloaders: bool) -> None:
        if model_and_optimizer:
            self.model = self._unwrap_distributed_model()  # a model left wrapped by an earlier run is wrapped once
            if isinstance(self.optimizer, AcceleratedOptimizer):
                self.optimizer = self.optimizer.optimizer
        components = [self.model, self.optimizer] if model_and_optimizer else [None, None]
        components += [self.train_dataloader, self.eval_dataloader] if dataloaders else [None, None]
        placement = [None, None, *(batches_need_placing(dl, self.device) for dl in components[2:])]
        # the extra models (add_model) in the same call: Accelerate places them and their optimizers together
        extras = self._unwrapped_extras() if model_and_optimizer else []
        components = prepare_components(
            self.accelerator, components + extras, device_placement=placement + [None] * len(extras)
        )
        if dataloaders:
            self.train_dataloader, self.eval_dataloader = components[2:4]
        if not model_and_optimizer:
            return
        self.model, self.optimizer = components[:2]
        # where Accelerate's optimizer wrapper and backward() would only call torch, call torch (100 us a step)
        self.calls_torch_directly = not self.always_use_accelerate_wrappers and wrappers_only_call_torch(
            self.accelerator
        )
        if self.calls_torch_directly and isinstance(self.optimizer, AcceleratedOptimizer):
            self.optimizer = self.optimizer.optimizer
        self._store_prepared_extras(components[4:])
        if self.torch_compile is not False:  # True or a dict, even {}; compiled after the DDP wrapper, as torch advises
            options = self.torch_compile if isinstance(self.torch_compile, Mapping) else {}
            self.model = torch.compile(self.model, **options)

    def _create_run_config(self, options: Optional[TrainOptions] = None, **train_arguments) -> TrainerRunConfig:
        """Return the frozen :class:`TrainerRunConfig` of the run being started, on the prepared dataloaders.

        Takes the run's :class:`TrainOptions`, or, as pytorch-accelerated's method, ``train()``'s arguments by
        keyword (``per_device_batch_size=``, ``num_epochs=``, ``gradient_accumulation_steps=``, ...).
        """
        if options is None:
            options = TrainOptions(**train_arguments)
        dataloaders, kwargs = (
            (self.train_dataloader, self.eval_dataloader),
            (self._train_dl_kwargs, self._eval_dl_kwargs),
        )
        return build_run_config(options, self._accelerator, dataloaders, kwargs, self.train_dataset, self.seed)

    def _check_eval_batch_size(self) -> None:
        """Warn when the last evaluation batch of a multi-process run repeats samples (pytorch-accelerated's check).

        Accelerate fills the last batch of every process so that all run the same steps. The evaluation loss,
        ``gather_for_metrics`` and ``gather`` count each sample once, but a hook that collects its own per-batch
        tensors on each process sees the repeated rows: this says how many there will be.
        """
        config = self.run_config
        length = dataset_length(self.eval_dataset)
        if length is None or not config.is_distributed or not config.eval_total_batch_size:
            return  # one process, or a stream of unknown length: no sample is repeated
        repeated = -length % config.eval_total_batch_size
        if repeated:
            warnings.warn(
                f"The evaluation dataset has {length} samples and the evaluation batch of all processes together is "
                f"{config.eval_total_batch_size}, so the last batch repeats {repeated} samples to keep the processes in "
                "step. The loss, gather() and gather_for_metrics() count each sample once; per-process tensors collected "
                "in your own hooks hold the repeats (use eval_batch_real_rows to drop them). A batch size that divides "
                "the dataset avoids it.",
                stacklevel=2,
            )

    def _load_resume_plan(self, stored_state) -> None:
        """Load the training state to resume from, if any, and start the run state at its position."""
        state = self.run_state
        options = state.options
        state.resume = persistence.load_resume_plan(
            self, stored_state, options.resume_from, options.allow_resume_changes
        )
        if state.resume is not None:
            state.num_update_steps_completed = state.resume.num_update_steps_completed
            state.epoch = state.resume.position.loop_epoch
