"""Batches: the DataLoader arguments the trainer builds, how a batch reaches the model and its loss hook, the checks of
what that hook returns, and what a batch's loss counts for in an epoch's mean."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import MethodType
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional

import torch
from accelerate.utils import find_batch_size
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from pytorch_accel_trainer.data import dataloader_batch_size
from pytorch_accel_trainer.parallel.layout import layout_of
from pytorch_accel_trainer.utils import seed_worker

NO_TRAIN_BATCH = (
    "The training dataloader yielded no batch in this epoch, so the run could not progress: check that "
    "train_dataset yields samples on every pass (a generator-based dataset must restart)."
)
NO_EVAL_BATCH = (
    "The evaluation dataloader yielded no batch: the evaluation dataset is empty (an iterable dataset that yields "
    "nothing, or a generator already consumed). Pass a dataset with at least one sample."
)


def merge_dataloader_kwargs(defaults: dict, overrides: Optional[dict], dataset: Any) -> dict:
    """The DataLoader arguments: ``defaults`` updated with the user's ``overrides``, which win."""
    kwargs = dict(defaults)
    overrides = dict(overrides or {})
    if "sampler" in overrides or "batch_sampler" in overrides or isinstance(dataset, IterableDataset):
        kwargs.pop("shuffle", None)  # a sampler, or a stream, decides the order itself
    if "batch_sampler" in overrides:
        kwargs.pop("batch_size", None)
    kwargs.update(overrides)
    if kwargs.get("num_workers", 0) > 0:
        kwargs.setdefault("persistent_workers", True)  # workers start once, not every epoch
        kwargs.setdefault("worker_init_fn", seed_worker)
    return kwargs


def end_dataloader_workers(*dataloaders: Any) -> None:
    """Stop the worker processes that the dataloaders of a run keep between epochs (``persistent_workers``, which
    :func:`merge_dataloader_kwargs` sets when there are workers), as the run ends: a dataloader iterated again starts
    them again. Left alone, they would outlive the run (``num_workers`` processes per dataloader) until the garbage
    collector frees the dataloader, and their shutdown would come wherever the collector runs: where it ran inside a
    thread's start, in a second ``train()`` of the same process, the workers did not end and each was waited for
    until torch's 5-s join timeout (10 s with 2 workers)."""
    for dataloader in dataloaders:
        for loader in (dataloader, getattr(dataloader, "base_dataloader", None)):  # Accelerate's wrapper, and its own
            iterator = getattr(loader, "_iterator", None)  # where torch's DataLoader keeps its persistent workers
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
                loader._iterator = None  # type: ignore[union-attr]  # the next iteration starts new workers


def dataset_and_dataloader(data: Any) -> tuple[Any, Optional[DataLoader]]:
    """Split what ``train()`` / ``evaluate()`` received into a dataset and, if it is a DataLoader, the DataLoader."""
    return (data.dataset, data) if isinstance(data, DataLoader) else (data, None)


def batch_size_for(given_dataloader: Optional[DataLoader], per_device_batch_size: int) -> int:
    """The per-device batch size of a run: a given DataLoader's own, else ``per_device_batch_size``."""
    if given_dataloader is None:
        return per_device_batch_size
    batch_size = dataloader_batch_size(given_dataloader)
    return per_device_batch_size if batch_size is None else batch_size  # batch_size=None was refused before


def given_dataloader_kwargs(dataloader: DataLoader) -> dict:
    """The arguments of a DataLoader the user built, as the run config records the trainer's own."""
    kwargs = {"batch_size": dataloader_batch_size(dataloader), "shuffle": isinstance(dataloader.sampler, RandomSampler)}
    return {
        **kwargs,
        "num_workers": dataloader.num_workers,
        "drop_last": dataloader.drop_last,
        "pin_memory": dataloader.pin_memory,
    }


def with_own_generator_and_checked_collate(dataloader: Any, collate_fn: Optional[Callable]) -> Any:
    """Give a DataLoader built by the trainer a generator of its own and a collate function that refuses ``None``.

    Data loading then draws its seeds (shuffle order, worker seeds) from that generator, never from the global
    RNG, so the model's randomness (dropout) does not depend on when dataloader iterators are created: with
    persistent workers, or after a resume. Set after construction, as passing ``generator=`` would (the sampler
    and the workers' base seed read it), so that the DataLoader is built with exactly the arguments of
    ``get_default_*_dl_kwargs`` and the user's, as pytorch-accelerated builds it. A generator passed in the
    dataloader arguments is kept.
    """
    if dataloader.generator is None:
        dataloader.generator = torch.Generator()
        if isinstance(dataloader.sampler, RandomSampler) and dataloader.sampler.generator is None:
            dataloader.sampler.generator = dataloader.generator
    if collate_fn is not None:  # read when each iterator starts (and pickled to workers then)
        dataloader.collate_fn = checked_collate_fn(collate_fn)
    return dataloader


class CheckedCollateFn:
    """A ``collate_fn`` that refuses to return ``None`` (it pickles whenever ``collate_fn`` does, for workers)."""

    def __init__(self, collate_fn: Callable):
        self.collate_fn = collate_fn

    def __call__(self, samples: Any) -> Any:
        batch = self.collate_fn(samples)
        if batch is None:  # one comparison per batch, on the host
            name = getattr(self.collate_fn, "__qualname__", None) or repr(self.collate_fn)
            count = len(samples) if hasattr(samples, "__len__") else "?"
            raise TypeError(
                f"collate_fn={name} returned None for a list of {count} samples; it must return the batch (e.g. a "
                "tuple of tensors, or a dict of them): check that it ends with a return statement."
            )
        return batch


def build_dataloader(
    dataset: Any, given: Optional[DataLoader], defaults: dict, overrides: Optional[dict], collate_fn: Optional[Callable]
) -> tuple[Any, dict]:
    """The dataloader of a run and its arguments: a DataLoader the run was given (``given``), as it is; else a new one
    over ``dataset`` from ``defaults`` updated with the user's ``overrides`` (which win), with ``collate_fn`` (a
    ``None`` batch is then a clear ``TypeError``), drawing its shuffle order and worker seeds from a generator of its
    own, not the global RNG."""
    if given is not None:
        return given, given_dataloader_kwargs(given)
    kwargs = merge_dataloader_kwargs(defaults, overrides, dataset)
    dataloader = DataLoader(dataset=dataset, collate_fn=collate_fn, **kwargs)
    return with_own_generator_and_checked_collate(dataloader, collate_fn), kwargs


def checked_collate_fn(collate_fn: Optional[Callable]) -> Optional[Callable]:
    """Return ``collate_fn`` wrapped in a :class:`CheckedCollateFn`; ``None`` (torch's default) as it is."""
    return None if collate_fn is None else CheckedCollateFn(collate_fn)


def batches_need_placing(dataloader: Any, device: torch.device) -> bool:
    """Whether Accelerate should move each batch of ``dataloader`` to the device (``send_to_device``).

    On the CPU, batches of a map-style dataset are already where they go, and the per-batch call costs about
    5 us. Iterable datasets keep it: without it Accelerate would shard them differently (no dispatching).
    """
    return device.type != "cpu" or isinstance(getattr(dataloader, "dataset", None), IterableDataset)


def real_rows_in_batch(dataloader: Any, batch: Any, accelerator: Any) -> Optional[int]:
    """Rows of this process's batch that are real samples, or ``None`` when all are.

    To give every process the same steps, Accelerate fills the last batch of each process with samples from
    the start of the data; the real ones are the first ``remainder`` rows of all processes' batches in
    process order (what ``gather_for_metrics`` keeps). Reading it costs no collective.
    """
    if accelerator.num_processes == 1 or not getattr(dataloader, "end_of_dataloader", False):
        return None
    layout = layout_of(accelerator)  # by data-parallel rank: a tensor-parallel group reads one batch
    if layout.dp_size == 1:
        return None
    remainder = getattr(dataloader, "remainder", -1)
    if remainder <= 0:
        return None  # a whole number of global batches, or a dataloader that does not say
    rows = find_batch_size(batch)
    real_rows = min(max(remainder - layout.dp_rank * rows, 0), rows)
    return None if real_rows == rows else real_rows


def loss_weight(batch_output: dict, real_rows: Optional[int]) -> Any:
    """What a batch's loss counts for in the epoch's mean: its items if given, else its samples, of which at
    most the real ones in a last evaluation batch with repeated samples."""
    if "num_items_in_batch" in batch_output:
        return batch_output["num_items_in_batch"]
    if real_rows is not None:  # a hook that returned the whole batch's size
        return min(batch_output["batch_size"], real_rows)
    return batch_output["batch_size"]


def batch_size_from(batch: Any) -> Optional[int]:
    """The number of samples in ``batch``, found as the default hooks find it (``utils.batch_size_of``): the rows of
    the targets of an ``(inputs, targets, ...)`` tuple or list, else of its inputs; a dict's ``labels``, else its first
    tensor; a tensor's rows. ``None`` for any other batch (strings, a list of samples): the hook must say. Reads
    shapes only: no host-device sync."""
    if isinstance(batch, torch.Tensor):
        return _rows(batch)
    if is_mapping(batch):
        try:
            return int(batch_size_of(batch))
        except (TypeError, IndexError):
            return None  # a dict without a tensor
    if isinstance(batch, (tuple, list)):
        for position in (1, 0):  # the targets, as the default hooks count them; else the inputs
            if len(batch) > position and _rows(batch[position]) is not None:
                return _rows(batch[position])
    return None


def _rows(value: Any) -> Optional[int]:
    """The first dimension of a tensor that has one; else ``None``."""
    return value.size(0) if isinstance(value, torch.Tensor) and value.dim() else None


def with_batch_size(batch_output: Any, batch: Any) -> Any:
    """A batch-loss hook's output with the ``batch_size`` it left out found from ``batch`` (:func:`batch_size_from`),
    as a new dict; an output that has one, or that is not a dict, as it is (``validate_batch_output`` checks it)."""
    if not is_mapping(batch_output) or "batch_size" in batch_output:
        return batch_output
    batch_size = batch_size_from(batch)
    return batch_output if batch_size is None else {**batch_output, "batch_size": batch_size}


def forward_batch(model: Any, batch: Any) -> Any:
    """The model's output for a batch of the default hooks: ``(inputs, targets, ...)``, or a dict of keyword
    arguments."""
    if not isinstance(batch, (tuple, list)) and is_mapping(batch):
        return model(**batch)
    return model(batch[0])


def batch_loss(loss_func: Any, model_outputs: Any, batch: Any) -> torch.Tensor:
    """``loss_func(outputs, targets)``, or without a ``loss_func`` the loss the model returned."""
    if loss_func is None:
        return model_output_loss(model_outputs)
    targets = batch["labels"] if not isinstance(batch, (tuple, list)) and is_mapping(batch) else batch[1]
    try:
        return loss_func(model_outputs, targets)
    except (TypeError, AttributeError) as error:
        if not is_mapping(model_outputs):
            raise
        raise TypeError(
            f"loss_func {getattr(loss_func, '__name__', type(loss_func).__name__)!r} failed on the model's output, "
            f"a {type(model_outputs).__name__} with keys {list(model_outputs)[:8]}, not a tensor ({error}). Pass "
            "loss_func=None to use the output's 'loss' (transformers models return one when the batch has "
            "labels), return the tensor from the model's forward, or override calculate_train_batch_loss and "
            "calculate_eval_batch_loss to pick it (e.g. outputs['logits'])."
        ) from error


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch of the default hooks: ``len(batch[1])``, or for a dict the first
    dimension of ``labels`` (else of its first tensor)."""
    if isinstance(batch, (tuple, list)) or not is_mapping(batch):
        targets = batch[1]
        return targets.size(0) if isinstance(targets, torch.Tensor) else len(targets)
    tensor = batch.get("labels")
    if not isinstance(tensor, torch.Tensor):
        tensor = next((value for value in batch.values() if isinstance(value, torch.Tensor)), None)
    if tensor is None:
        raise TypeError(
            f"The batch is a dict with the keys {sorted(batch)} but no tensor, so its size is unknown; override "
            "calculate_train_batch_loss / calculate_eval_batch_loss to return 'batch_size' yourself."
        )
    return tensor.size(0)


class BatchIndexArguments(NamedTuple):
    """How each batch hook of a trainer takes the batch index (see :func:`batch_index_argument`), read once."""

    train: Optional[str]  # calculate_train_batch_loss
    eval: Optional[str]  # calculate_eval_batch_loss
    predict: Optional[str]  # calculate_predict_batch_output

    @classmethod
    def of(cls, trainer: Any) -> BatchIndexArguments:
        """Read the signatures of ``trainer``'s batch hooks (as it is constructed: never on the step's path)."""
        return cls(
            batch_index_argument(trainer.calculate_train_batch_loss),
            batch_index_argument(trainer.calculate_eval_batch_loss),
            batch_index_argument(trainer.calculate_predict_batch_output),
        )


def batch_index_argument(hook: Callable) -> Optional[str]:
    """How the batch hook ``hook`` (a bound method or a function) takes the batch index: by keyword when it names a
    parameter ``batch_idx`` (``"keyword"``); as its argument after the batch when that one has no default, whatever
    its name (``"positional"``: ``training_step(self, batch, index)``); or not at all (``None``: pytorch-accelerated's
    ``(self, batch)``). Reads the signature: the trainer calls it once per hook, as it is constructed."""
    function, is_method = getattr(hook, "__func__", hook), isinstance(hook, MethodType)
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: called with the batch alone
        return None
    if any(
        parameter.name == "batch_idx" and parameter.kind is not parameter.POSITIONAL_ONLY for parameter in parameters
    ):
        return "keyword"
    positional = [
        parameter
        for parameter in parameters
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    ]
    index = 2 if is_method else 1  # after self and the batch
    if len(positional) > index and positional[index].default is inspect.Parameter.empty:
        return "positional"
    return None


def call_batch_hook(
    hook: Callable, batch: Any, batch_idx: int, index_argument: Optional[str], loss_output: bool = True
) -> Any:
    """Call the batch hook ``hook`` on ``batch``, with ``batch_idx`` as ``index_argument`` says (what
    :func:`batch_index_argument` found when the trainer was constructed: no signature is read here), and return its
    output.

    With ``loss_output`` (the batch-loss hooks, ``calculate_train_batch_loss`` and ``calculate_eval_batch_loss``), the
    output is checked, and a ``batch_size`` it left out is found from the batch (shapes only: no host sync);
    ``loss_output=False`` returns the output as it is (``calculate_predict_batch_output``).

    Raises:
        TypeError, ValueError: a batch-loss output that is not a dict with a one-element tensor ``loss`` (a scalar;
            one of shape ``(1,)`` is returned as one) and a ``batch_size``, given or found; the message names the
            hook.
    """
    if index_argument is None:
        output = hook(batch)
    else:
        output = hook(batch, batch_idx=batch_idx) if index_argument == "keyword" else hook(batch, batch_idx)
    if not loss_output:
        return output
    if isinstance(output, dict) and "batch_size" in output:
        loss = output.get("loss")
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            return output  # the common shape, checked in a few reads; else the full check says what is wrong
    output = with_batch_size(output, batch)
    validate_batch_output(output, getattr(hook, "__name__", "the batch-loss hook"))
    if output["loss"].dim():  # one element of shape (1,), e.g. YOLOv7's batch_size * loss: used as the scalar it is
        output = {**output, "loss": output["loss"].reshape(())}
    return output


def numbered_batches(
    batches: Iterable, first_step: int, error_message: Optional[str]
) -> Iterator[tuple[int, Any, bool]]:
    """Yield ``(step, batch, is_last)`` from ``first_step`` on, looking one batch ahead, so that the loop knows which
    batch ends the epoch even for a dataset without ``__len__``.

    Raises:
        ValueError: ``error_message``, when ``batches`` yields nothing (``None``: an empty epoch is allowed).
    """
    iterator = iter(batches)
    current = first_batch(iterator, error_message)
    if current is NO_BATCH:
        return  # an empty epoch, allowed
    step = first_step
    for following in iterator:
        yield step, current, False
        current, step = following, step + 1
    yield step, current, True


#: What :func:`first_batch` returns for batches that hold none, when that is allowed.
NO_BATCH = object()


def first_batch(iterator: Iterator, error_message: str | None) -> Any:
    """The first batch of ``iterator``; when there is none, raise ``ValueError(error_message)`` (``None``: return
    :data:`NO_BATCH` instead). Accelerate's dispatcher (iterable datasets) says an empty dataset in its own words,
    which become ``error_message`` too."""
    try:
        return next(iterator)
    except StopIteration:
        if error_message is None:
            return NO_BATCH
        raise ValueError(error_message) from None
    except ValueError as error:
        if error_message is None or "does not contain any data" not in str(error):
            raise
        raise ValueError(error_message) from error


def require_batches(batches: Iterable, error_message: str) -> Iterator:
    """Yield from ``batches``; raise ``ValueError(error_message)`` if there is none."""
    iterator = iter(batches)
    yield first_batch(iterator, error_message)
    yield from iterator


def is_mapping(value: Any) -> bool:
    """``isinstance(value, Mapping)``, with the common cases first: the abstract-class check costs about 1 us, on
    every step."""
    if isinstance(value, dict):
        return True
    return not isinstance(value, (tuple, list, torch.Tensor)) and isinstance(value, Mapping)


def model_output_loss(model_outputs: Any) -> torch.Tensor:
    """The ``loss`` a model returned with its output (a transformers ``ModelOutput``, a dict or an object)."""
    loss = model_outputs.get("loss") if isinstance(model_outputs, Mapping) else getattr(model_outputs, "loss", None)
    if loss is None:
        raise ValueError(
            f"loss_func is None and the model output (a {type(model_outputs).__name__}) has no 'loss'. Pass "
            "Trainer(loss_func=...), or return a loss from the model (transformers models do when the batch has "
            "'labels')."
        )
    return loss


def validate_batch_output(batch_output: Any, hook_name: str) -> None:
    """Check what ``calculate_train_batch_loss`` / ``calculate_eval_batch_loss`` returned (no host sync)."""
    if not is_mapping(batch_output):
        raise TypeError(
            f"{hook_name} returned {type(batch_output).__name__}; it must return a dict with the keys 'loss', "
            "'model_outputs' and 'batch_size', e.g. {'loss': loss, 'model_outputs': outputs, 'batch_size': len(y)}."
        )
    if "loss" not in batch_output:
        raise ValueError(
            f"{hook_name} returned a dict with the keys {sorted(batch_output)}, missing ['loss']; add it, e.g. "
            "{'loss': loss, 'model_outputs': outputs, 'batch_size': len(y)}."
        )
    if "batch_size" not in batch_output:  # the trainer found none in the batch either (loop/batches.py)
        raise ValueError(
            f"{hook_name} returned a dict with the keys {sorted(batch_output)}, without 'batch_size', and the batch "
            "holds no tensor to count its samples from (the trainer counts the targets of an (inputs, targets) tuple, "
            "a dict's 'labels' or a batch's first tensor). Return it: {'loss': loss, 'batch_size': len(y)}."
        )
    loss = batch_output["loss"]
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{hook_name} returned a loss of type {type(loss).__name__}; it must be a scalar torch.Tensor with "
            "gradients, as a loss function returns."
        )
    if loss.numel() != 1:  # one element in any shape, as pytorch-accelerated takes it: (1,) is used as a scalar
        raise ValueError(
            f"{hook_name} returned a loss of shape {tuple(loss.shape)}; the trainer needs a scalar (or one element). "
            "Reduce it first, e.g. loss.mean(), or use a loss function with reduction='mean'."
        )


def validate_loss_requires_grad(loss: torch.Tensor, model: torch.nn.Module) -> None:
    """Refuse, before its backward pass, a training loss cut off from the model's graph (one attribute read: no
    host-device sync)."""
    if loss.requires_grad:
        return
    num_trainable = sum(1 for parameter in model.parameters() if parameter.requires_grad)
    if num_trainable == 0:
        raise ValueError(
            "calculate_train_batch_loss returned a loss that does not require gradients, and the model has no "
            "trainable parameter (each has requires_grad=False), so there is nothing to train: unfreeze some before "
            "train() (parameter.requires_grad_(True), or ModelFreezer.unfreeze())."
        )
    raise ValueError(
        "calculate_train_batch_loss returned a loss that does not require gradients (requires_grad=False), so the "
        f"backward pass cannot reach the model's {num_trainable} trainable parameters. It was cut off from the model "
        "outputs: compute the loss from them without .detach(), .item(), torch.tensor(...) or torch.no_grad(), and "
        "return that tensor."
    )
