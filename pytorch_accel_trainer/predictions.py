"""What ``Trainer.predict`` returns: the outputs of every batch joined into one structure, in memory or in chunk files.

A prediction is a tensor with one row per sample, or a dict, tuple or list of them (nested freely): the batches'
outputs are concatenated along the first dimension, leaf by leaf. :class:`PredictionCollector` keeps them in memory;
:class:`PredictionWriter` writes them to a folder in chunks of about ``chunk_size`` samples as they come, and
:func:`load_predictions` reads such a folder back as the one structure the collector would have returned.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch

#: The file a complete prediction folder holds last: its chunks, in order, and the samples they hold.
INDEX_FILE = "predictions.json"
CHUNK_FILE = "chunk-{:06d}.pt"


def validate_prediction_output(output: Any, hook_name: str = "calculate_predict_batch_output") -> int:
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
    :func:`load_predictions` refuses.

    Args:
        folder: a folder that does not exist yet, or is empty (an earlier prediction is never overwritten).
        chunk_size: the samples after which a chunk is written.
        writes: whether this process writes (``False`` on all but the main process).
    """

    def __init__(self, folder: Union[str, os.PathLike], chunk_size: int, writes: bool) -> None:
        self.folder, self.chunk_size, self.writes = Path(folder), chunk_size, writes
        self.pending: list = []
        self.pending_rows = 0
        self.chunks: list = []

    def add(self, output: Any) -> None:
        """Take one batch's gathered prediction; write a chunk once ``chunk_size`` samples are pending."""
        self.pending.append(output)
        self.pending_rows += validate_prediction_output(output)
        if self.pending_rows >= self.chunk_size:
            self._write_chunk()

    def _write_chunk(self) -> None:
        if self.writes and self.pending:
            name = CHUNK_FILE.format(len(self.chunks))
            torch.save(concatenate_predictions(self.pending), self.folder / name)
            self.chunks.append({"file": name, "samples": self.pending_rows})
        self.pending, self.pending_rows = [], 0

    def result(self) -> Path:
        """Write the last chunk and the index; return the folder."""
        self._write_chunk()
        if self.writes:
            index = {"chunks": self.chunks, "samples": sum(chunk["samples"] for chunk in self.chunks)}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return self.folder


def validate_prediction_folder(folder: Union[str, os.PathLike, None]) -> None:
    """Refuse a folder for :class:`PredictionWriter` that holds anything: predictions never overwrite files."""
    if folder is None:
        return
    path = Path(folder)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(
            f"output_dir={str(folder)!r} already exists and is not an empty folder: predict() never overwrites "
            "files. Give a new folder, or remove this one first."
        )


def load_predictions(folder: Union[str, os.PathLike], map_location: Optional[str] = "cpu") -> Any:
    """Read back the predictions ``Trainer.predict(..., output_dir=folder)`` wrote: the same structure, equal to
    what ``predict`` returns in memory.

    Raises:
        FileNotFoundError: ``folder`` has no index file: not a prediction folder, or a prediction that was interrupted.

    Example::

        folder = trainer.predict(dataset, output_dir="predictions", chunk_size=10_000)
        predictions = load_predictions(folder)
    """
    index_path = Path(folder) / INDEX_FILE
    if not index_path.exists():
        raise FileNotFoundError(
            f"{str(folder)!r} has no {INDEX_FILE}: it is not a folder of Trainer.predict(output_dir=...), or the "
            "prediction that wrote it did not finish. Run the prediction again into a new folder."
        )
    chunks = json.loads(index_path.read_text())["chunks"]
    if not chunks:
        return None
    outputs = [torch.load(Path(folder) / chunk["file"], map_location=map_location) for chunk in chunks]
    return concatenate_predictions(outputs)
