"""What ``Trainer.predict`` returns: the outputs of every batch joined into one structure, in memory or in chunk files.

A prediction is a tensor with one row per sample, or a dict, tuple or list of them (nested freely): the batches'
outputs are concatenated along the first dimension, leaf by leaf, so every batch's must have the first batch's
structure (:func:`validate_same_structure`). :class:`PredictionCollector` keeps them in memory;
:class:`PredictionWriter` writes them to a folder, local or in object storage (a URL, through fsspec: see
``state/storage.py``), in chunks of about ``chunk_size`` samples as they come, and :func:`load_predictions` reads
such a folder back as the one structure the collector would have returned.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch

from pytorch_accel_trainer.data import validate_dataloader_kwargs, validate_dataset
from pytorch_accel_trainer.errors import validate_positive_option
from pytorch_accel_trainer.state import storage

#: The file a complete prediction folder holds last: its chunks, in order, and the samples they hold.
INDEX_FILE = "predictions.json"
CHUNK_FILE = "chunk-{:06d}.pt"
#: The suffixes that name one file of predictions (``torch.save``'s usual ones), never a folder.
PREDICTION_FILE_SUFFIXES = (".pt", ".pth")
#: The hook whose outputs are checked: the errors name it.
HOOK_NAME = "calculate_predict_batch_output"


def validate_prediction_output(output: Any, hook_name: str = HOOK_NAME) -> int:
    """Return the number of rows (samples) of one batch's prediction, checking that every leaf is a tensor with the
    same first dimension.

    Raises:
        TypeError: a leaf is not a tensor, or is a 0-d tensor (no row per sample).
        ValueError: the leaves have different numbers of rows.
    """
    rows = {tuple(path): _leaf_rows(leaf, path, hook_name) for path, leaf in _leaves(output, ())}
    if not rows:
        raise TypeError(
            f"{hook_name} returned {output!r}, which holds no tensor: return a tensor of one row per sample."
        )
    if len(set(rows.values())) > 1:
        raise ValueError(
            f"{hook_name} returned tensors with different numbers of rows ({_describe(rows)}): every tensor of a "
            "prediction needs one row per sample of the batch, so that the batches can be joined."
        )
    return next(iter(rows.values()))


def _leaves(output: Any, path: tuple) -> list:
    if isinstance(output, Mapping):
        return [leaf for key, value in output.items() for leaf in _leaves(value, (*path, key))]
    if isinstance(output, (tuple, list)):
        return [leaf for index, value in enumerate(output) for leaf in _leaves(value, (*path, index))]
    return [(path, output)]


def _leaf_rows(leaf: Any, path: tuple, hook_name: str) -> int:
    where = "".join(f"[{key!r}]" for key in path) or "its output"
    if not isinstance(leaf, torch.Tensor):
        raise TypeError(
            f"{hook_name} returned {type(leaf).__name__} at {where}: a prediction holds tensors (nested in dicts, "
            "tuples or lists) with one row per sample; turn other values into tensors, or keep them in a callback."
        )
    if leaf.dim() == 0:
        raise TypeError(
            f"{hook_name} returned a 0-d tensor at {where}: a prediction needs one row per sample of the batch "
            "(e.g. return outputs, not outputs.mean())."
        )
    return leaf.size(0)


def _describe(rows: dict) -> str:
    return ", ".join(f"{''.join(f'[{key!r}]' for key in path) or 'output'}: {count}" for path, count in rows.items())


def prediction_structure(output: Any) -> Any:
    """What must be the same in every batch's prediction for the batches to be joined: each dict's keys (a dict), each
    tuple's or list's items (a list), and each tensor's shape (a tuple; only the first dimension may differ)."""
    if isinstance(output, Mapping):
        return {key: prediction_structure(value) for key, value in output.items()}
    if isinstance(output, (tuple, list)):
        return [prediction_structure(value) for value in output]
    return tuple(output.shape)


def validate_same_structure(first: Any, output: Any, batch_idx: int, hook_name: str = HOOK_NAME) -> None:
    """Refuse the prediction of batch ``batch_idx`` unless it has ``first``, the :func:`prediction_structure` of the
    first batch's: the same keys and lengths, and tensors whose shapes differ in the first dimension only. Checked as
    each batch arrives (host metadata only), so that a mismatch stops the prediction there, not in the join at the end.

    Raises:
        ValueError: naming the batch, where in the output, what the first batch gave and what this one gave.
    """
    difference = _first_difference(first, prediction_structure(output), ())
    if difference is None:
        return
    path, expected, received = difference
    where = f" at {''.join(f'[{key!r}]' for key in path)}" if path else ""
    raise ValueError(
        f"{hook_name} returned {_describe_structure(received)}{where} for batch {batch_idx}, where batch 0 gave "
        f"{_describe_structure(expected)}: the batches' predictions are joined along the first dimension, so each "
        "must have the same keys and lengths, and tensors of the same shape but for the first dimension. Return the "
        "same keys from every batch, and pad what varies to a fixed size (e.g. torch.nn.functional.pad to the "
        "longest length of the dataset)."
    )


def _first_difference(expected: Any, received: Any, path: tuple) -> Optional[tuple]:
    """The first place where two prediction structures differ, as ``(path, expected, received)``; ``None`` if none."""
    if isinstance(expected, dict) and isinstance(received, dict):
        if set(expected) != set(received):
            return path, expected, received
        differences = (_first_difference(expected[key], received[key], (*path, key)) for key in expected)
    elif isinstance(expected, list) and isinstance(received, list):
        if len(expected) != len(received):
            return path, expected, received
        differences = (_first_difference(*pair, (*path, index)) for index, pair in enumerate(zip(expected, received)))
    elif isinstance(expected, tuple) and isinstance(received, tuple):  # two tensors' shapes
        return None if expected[1:] == received[1:] else (path, expected, received)
    else:
        return path, expected, received
    return next((difference for difference in differences if difference is not None), None)


def _describe_structure(structure: Any) -> str:
    if isinstance(structure, dict):
        return f"a dict with the keys {list(structure)}"
    if isinstance(structure, list):
        return f"a tuple or list of {len(structure)} items"
    return f"a tensor of shape {structure}"


def predict_batches(dataloader: Iterable) -> Iterator:
    """The batches of ``dataloader``; none, rather than Accelerate's ``ValueError``, for a stream that yields no
    sample (Accelerate's dispatcher says so on every process at the first batch, so every process stops together)."""
    iterator = iter(dataloader)
    try:
        first = next(iterator)
    except StopIteration:
        return
    except ValueError as error:
        if "does not contain any data" not in str(error):  # Accelerate's words for an empty stream
            raise
        return
    yield first
    yield from iterator


def concatenate_predictions(outputs: list) -> Any:
    """Join the predictions of several batches, each of the same structure, along the first dimension."""
    first = outputs[0]
    if isinstance(first, Mapping):
        return _same_type(first, {key: concatenate_predictions([output[key] for output in outputs]) for key in first})
    if isinstance(first, (tuple, list)):
        joined = [concatenate_predictions([output[index] for output in outputs]) for index in range(len(first))]
        return type(first)(*joined) if hasattr(first, "_fields") else type(first)(joined)  # a namedtuple too
    return torch.cat(outputs)


def _same_type(original: Any, values: dict) -> Any:
    """``values`` as a mapping of ``original``'s type (a ``dict``, an ``OrderedDict``, ...)."""
    mapping_type: Any = type(original)
    return mapping_type(values)


def to_cpu(output: Any) -> Any:
    """``output`` with every tensor moved to the CPU (the same structure)."""
    if isinstance(output, Mapping):
        return _same_type(output, {key: to_cpu(value) for key, value in output.items()})
    if isinstance(output, (tuple, list)):
        moved = [to_cpu(value) for value in output]
        return type(output)(*moved) if hasattr(output, "_fields") else type(output)(moved)
    return output.cpu() if isinstance(output, torch.Tensor) else output


class PredictionCollector:
    """Keeps the gathered predictions in memory; :meth:`result` joins them."""

    def __init__(self) -> None:
        self.outputs: list = []

    def add(self, output: Any) -> None:
        """Keep one batch's gathered prediction (on the CPU)."""
        self.outputs.append(output)

    def result(self) -> Any:
        """The predictions of every batch, joined (``None`` when there were no batches)."""
        return concatenate_predictions(self.outputs) if self.outputs else None


class PredictionWriter:
    """Writes the gathered predictions to ``folder`` in chunk files of at least ``chunk_size`` samples, as they come.

    Only the process that ``writes`` does (the main one); every process holds at most one chunk in memory. The index
    file written last lists the chunks: a folder without it is an interrupted prediction, which
    :func:`load_predictions` refuses. In object storage each chunk is one object, uploaded once written.

    Args:
        folder: a path or a URL (see :func:`validate_prediction_folder`): a folder that does not exist yet, or is
            empty (an earlier prediction is never overwritten).
        chunk_size: the samples after which a chunk is written.
        writes: whether this process writes (``False`` on all but the main process).
    """

    def __init__(self, folder: Union[str, os.PathLike], chunk_size: int, writes: bool) -> None:
        self.folder, self.chunk_size, self.writes = storage.as_location(folder), chunk_size, writes
        self.pending: list = []
        self.pending_rows = 0
        self.chunks: list = []
        if writes and isinstance(self.folder, Path):  # a store has no folders: its objects' names make one
            self.folder.mkdir(parents=True, exist_ok=True)

    def add(self, output: Any) -> None:
        """Take one batch's gathered prediction; write a chunk once ``chunk_size`` samples are pending."""
        self.pending.append(output)
        self.pending_rows += validate_prediction_output(output)
        if self.pending_rows >= self.chunk_size:
            self._write_chunk()

    def _write_chunk(self) -> None:
        if self.writes and self.pending:
            name = CHUNK_FILE.format(len(self.chunks))
            with storage.local_file_to_write(storage.join(self.folder, name)) as path:  # a URL: uploaded after
                torch.save(concatenate_predictions(self.pending), path)
            self.chunks.append({"file": name, "samples": self.pending_rows})
        self.pending, self.pending_rows = [], 0

    def result(self) -> storage.Location:
        """Write the last chunk and the index (on the main process; the caller waits for it on the others); return
        the folder: a ``Path``, or the URL."""
        self._write_chunk()
        if self.writes:
            index = {"chunks": self.chunks, "samples": sum(chunk["samples"] for chunk in self.chunks)}
            storage.write_text(storage.join(self.folder, INDEX_FILE), json.dumps(index, indent=2) + "\n")
        return self.folder


def validate_prediction_folder(folder: Union[str, os.PathLike, None], num_processes: int = 1) -> None:
    """Refuse a folder for :class:`PredictionWriter` before any batch runs: one that holds anything (predictions never
    overwrite files), a name of one file (``.pt``, ``.pth``), or a URL no process could write or every process read.

    A URL (``s3://bucket/preds``, ``memory://preds``) is a folder in that store, written through fsspec; a local path
    has ``~`` and ``$VARIABLES`` expanded (``state.storage.as_location``).

    Raises:
        FileExistsError: ``folder`` exists and is not an empty folder.
        ValueError: ``folder`` ends in ``.pt`` or ``.pth``; a URL that lost a slash or names no bucket; ``memory://``
            on several processes.
        ImportError: the URL's store needs a package that is not installed (fsspec, s3fs, ...).
    """
    if folder is None:
        return
    location = storage.as_location(folder)
    if Path(str(location)).suffix.lower() in PREDICTION_FILE_SUFFIXES:
        raise ValueError(
            f"output_dir={str(folder)!r} names a file ({Path(str(location)).suffix}), but output_dir is a folder of "
            "chunk files. Give a folder (e.g. output_dir='predictions'), or write one file yourself: "
            "torch.save(trainer.predict(dataset), 'predictions.pt')."
        )
    validate_prediction_store(location, num_processes, "output_dir")
    if isinstance(location, Path):
        taken = location.exists() and (not location.is_dir() or any(location.iterdir()))
    else:
        taken = storage.exists(location)  # an object, or objects under the URL as a prefix
    if taken:
        raise FileExistsError(
            f"output_dir={str(folder)!r} already exists and is not an empty folder: predict() never overwrites "
            "files. Give a new folder, or remove this one first."
        )


def validate_prediction_store(location: storage.Location, num_processes: int, argument: str) -> None:
    """Refuse, before any batch runs, a URL whose store's packages are not installed, or ``memory://`` on several
    processes; a local path needs nothing. ``argument`` names where the value was given (``"output_dir"``).

    Raises:
        ImportError: fsspec, or the store's package (s3fs, gcsfs, ...), is not installed.
        ValueError: ``memory://`` on several processes: fsspec's in-memory store lives inside one process.
    """
    storage.validate_location(location)
    if isinstance(location, str):
        storage.validate_store_reaches_every_process(location, num_processes, argument, _PREDICTIONS_IN_MEMORY)


#: Why several processes cannot share predictions in ``memory://``.
_PREDICTIONS_IN_MEMORY = (
    "only the main one would hold the predictions, and the others could not read what predict returns",
    "Nothing was predicted.",
)


def load_predictions(folder: Union[str, os.PathLike], map_location: Optional[str] = "cpu") -> Any:
    """Read back the predictions ``Trainer.predict(..., output_dir=folder)`` wrote (a local folder, or its URL): the
    same structure, equal to what ``predict`` returns in memory; ``None`` for a prediction of no sample.

    Each chunk is read with ``torch.load(weights_only=True)``: tensors in dicts, tuples and lists load as they are;
    a prediction of namedtuples loads inside ``torch.serialization.safe_globals([MyTuple])``.

    Raises:
        FileNotFoundError: ``folder`` has no index file: not a prediction folder, or a prediction that was interrupted.

    Example::

        folder = trainer.predict(dataset, output_dir="predictions", chunk_size=10_000)
        predictions = load_predictions(folder)
    """
    location = storage.as_location(folder)
    if not storage.exists(storage.join(location, INDEX_FILE)):
        raise FileNotFoundError(
            f"{str(folder)!r} has no {INDEX_FILE}: it is not a folder of Trainer.predict(output_dir=...), or the "
            "prediction that wrote it did not finish. Run the prediction again into a new folder."
        )
    with storage.local_file_to_read(storage.join(location, INDEX_FILE)) as index_path:
        chunks = json.loads(index_path.read_text())["chunks"]
    if not chunks:
        return None
    outputs = []
    for chunk in chunks:
        with storage.local_file_to_read(storage.join(location, chunk["file"])) as path:
            outputs.append(torch.load(path, map_location=map_location, weights_only=True))
    return concatenate_predictions(outputs)


def validate_predict_arguments(
    dataset: Any, per_device_batch_size: int, dataloader_kwargs: Any, chunk_size: Optional[int]
) -> None:
    """Check the arguments of ``Trainer.predict`` before any work starts."""
    validate_dataset("dataset", dataset)
    validate_positive_option("per_device_batch_size", per_device_batch_size)
    validate_dataloader_kwargs("dataloader_kwargs", dataloader_kwargs)
    validate_positive_option("chunk_size", chunk_size, allow_none=True)
