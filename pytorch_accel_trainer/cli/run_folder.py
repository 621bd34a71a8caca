"""A folder per run that holds what reproduces and describes it: config, run config, history, plot, weights.

``RunFolderCallback(output_dir)`` gives each training run ``<output_dir>/<run_name>/``; the command line
(``pytorch-accel-trainer fit --output_dir runs``) adds it for you, with the run's ``config.yaml``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from accelerate.utils import broadcast_object_list

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.plotting import plot_run_history
from pytorch_accel_trainer.run_config import get_run_config
from pytorch_accel_trainer.state.storage import (
    Location,
    as_location,
    exists,
    join,
    local_file_to_write,
    validate_location,
    write_text,
)

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer

CONFIG_FILE, RUN_CONFIG_FILE, HISTORY_FILE, PLOT_FILE, WEIGHTS_FILE = (
    "config.yaml",
    "run_config.json",
    "history.csv",
    "history.png",
    "model.safetensors",
)


def validate_run_name(run_name: Optional[str]) -> None:
    """Refuse a run name that is not one plain folder name: the run folder must stay inside ``output_dir``."""
    if run_name is None:
        return
    separators = {"/", "\\", os.sep, *([os.altsep] if os.altsep else [])}
    if not isinstance(run_name, str) or run_name in ("", ".", "..") or any(sep in run_name for sep in separators):
        raise ValueError(
            f"run_name is {run_name!r}: it must be one plain folder name (no '/', not '..'), so that the run folder "
            "stays inside output_dir; e.g. run_name='baseline'. To write elsewhere, change output_dir."
        )


def remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` if it holds no file (only empty folders, such as an unused ``training_states``): what a
    run that failed before writing anything leaves. Anything that holds a file is left as it is."""
    try:
        for path in sorted(folder.rglob("*"), key=lambda path: len(path.parts), reverse=True):
            if path.is_symlink() or not path.is_dir():
                return
        for path in sorted(folder.rglob("*"), key=lambda path: len(path.parts), reverse=True):
            path.rmdir()
        folder.rmdir()
    except OSError:
        pass  # another process removed it, or a file appeared: left as it is


def unused_run_folder(output_dir: Location, run_name: Optional[str]) -> Location:
    """``output_dir/run_name`` (the start time by default), with ``-2``, ``-3``, ... if taken; a URL in a store.

    Never an earlier run's folder.
    """
    name = run_name or time.strftime("run-%Y%m%d-%H%M%S")
    folder, number = join(output_dir, name), 1
    while exists(folder):
        number += 1
        folder = join(output_dir, f"{name}-{number}")
    return folder


def has_non_finite_weights(trainer: "Trainer") -> bool:
    """Whether any weight of the model, on any process, is NaN or infinite (one host-device sync; a small collective
    with several processes, which every process must join)."""
    count = torch.zeros((), device=trainer.device)
    for parameter in trainer.get_model().parameters():
        count += (~torch.isfinite(parameter.detach())).sum()  # device ops: one sync, below
    if trainer.accelerator.num_processes > 1:
        count = trainer.accelerator.reduce(count, "sum")
    return bool(count.item())


class RunFolderCallback(TrainerCallback):
    """Writes each training run's folder: ``config.yaml`` (when given), ``run_config.json`` at its start;
    ``history.csv``, ``history.png`` (with matplotlib) and ``model.safetensors`` (the final weights) at its end.

    The folder is ``<output_dir>/<run_name>``; a name already taken gets ``-2`` (``-3``, ...), so nothing an earlier
    run wrote is overwritten. The main process chooses it and tells the others (one small collective, once);
    only the main process writes, but every process takes part in saving the weights (FSDP gathers them).

    Args:
        output_dir: the parent folder of the run folders; an object-storage URL (``"s3://bucket/runs"``) works too
            (each file written locally, then uploaded as one object).
        run_name: the run folder's name, one plain name (so the folder stays inside ``output_dir``); the start time
            (``run-YYYYmmdd-HHMMSS``) by default.
        config_text: the text of ``config.yaml``, the run's complete configuration (the command line passes it).

    Attributes:
        folder: the run folder, once chosen (at the start of the run, or by :meth:`choose_folder`).
    """

    def __init__(self, output_dir: Union[str, Path], run_name: Optional[str] = None, config_text: Optional[str] = None):
        validate_run_name(run_name)
        validate_location(output_dir)  # an object-storage URL needs its package: said now, not at the run's end
        self.output_dir = as_location(output_dir)  # an object-storage URL stays one
        self.run_name = run_name
        self.config_text = config_text
        self.folder: Optional[Location] = None

    def choose_folder(self, trainer: "Trainer") -> Location:
        """Choose and create this run's folder (once); every process must call this."""
        if self.folder is None:
            accelerator = trainer.accelerator
            # a str on the main process; None on the others until broadcast_object_list fills it in
            chosen: list[Any] = [
                str(unused_run_folder(self.output_dir, self.run_name)) if accelerator.is_main_process else None
            ]
            if accelerator.num_processes > 1:
                broadcast_object_list(chosen)  # the main process's choice: the start time differs between processes
            self.folder = as_location(chosen[0])
            if accelerator.is_main_process and isinstance(self.folder, Path):  # a store has no folders to make
                self.folder.mkdir(parents=True)
            accelerator.wait_for_everyone()
        return self.folder

    def on_training_run_start(self, trainer: "Trainer", **kwargs):
        folder, run_config = self.choose_folder(trainer), get_run_config(trainer)
        if not run_config.is_world_process_zero:
            return
        if self.config_text is not None:
            write_text(join(folder, CONFIG_FILE), self.config_text)
        text = json.dumps(run_config.to_dict(), indent=2, sort_keys=True, default=repr)  # functions by name
        write_text(join(folder, RUN_CONFIG_FILE), text + "\n")

    def on_training_run_end(self, trainer: "Trainer", **kwargs):
        folder = self.choose_folder(trainer)  # chosen at the run start
        weights = join(folder, WEIGHTS_FILE)
        if has_non_finite_weights(trainer):  # e.g. a run TerminateOnNaNCallback stopped: no NaN weights to serve
            trainer.print(
                f"{weights} was not written: the model's weights are NaN or infinite at the end of the run. The "
                "training states, if any, hold the last finite ones."
            )
        else:
            trainer.save_weights(weights)  # every process: a collective under FSDP
        if not get_run_config(trainer).is_world_process_zero:
            return
        history = trainer.run_history
        if hasattr(history, "to_csv"):
            with local_file_to_write(join(folder, HISTORY_FILE)) as path:  # a URL: uploaded once written
                history.to_csv(path)
        try:
            with local_file_to_write(join(folder, PLOT_FILE)) as path:
                plot_run_history(history, path)
        except ImportError:
            pass  # matplotlib is optional: the run folder then has no plot
        except ValueError:
            pass  # no metric to plot (a run stopped before its first epoch ended)
