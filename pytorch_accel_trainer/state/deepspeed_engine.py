"""DeepSpeed's engine as the model and optimizer of a training state (the manifest's layout ``deepspeed``).

Under DeepSpeed the model's and optimizer's state (ZeRO stage 1 and 2: each process's partition of the flat fp32
weights and of the optimizer's state, the module's weights by process 0; stage 3: each process's partition of the
parameters too) is in DeepSpeed's own format, which only its engine writes and reads. So a state's engine part is
written by the engine itself: every process calls ``engine.save_checkpoint`` into the state's temporary folder (its tag
``"."``: DeepSpeed's files lie directly in the folder, beside the trainer's own), each file written through
:func:`~pytorch_accel_trainer.state.parts.save_tensors_file` (flushed, checksummed as it is written) by the process
that writes it; everything else is the package's folder protocol, unchanged (``folder.py``: manifest last, ``latest``,
pruning, object storage). A resume verifies the folder first, then calls ``engine.load_checkpoint`` (model, optimizer;
the scheduler, RNG states, data position and history are the trainer's own parts, as under any layout).

DeepSpeed's partitions depend on the ZeRO stage and the number of processes: a state resumes on the same ones only,
else it is refused naming DeepSpeed's universal checkpoints (``ds_to_universal``), which convert between them and which
this package does not read. :func:`full_weights` gathers the full fp32 weights without a process group (DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint``): ``pytorch-accel-trainer consolidate``.

DeepSpeed reads its files with ``torch.load(weights_only=False)`` (they hold its own objects): a state is loaded only
after every file matched its manifest, but, as with any pickle, resume only states you trust.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state.files import DEEPSPEED, StoredState
from pytorch_accel_trainer.state.parts import save_tensors_file

#: The tag of DeepSpeed's checkpoint inside a training state: its files lie directly in the state's folder.
STATE_TAG = "."
#: The key of the engine's facts (:meth:`DeepSpeedEngineState.facts`) in a state's shared values.
FACTS_KEY = "deepspeed"

_warned_synchronous: list = []


class DeepSpeedEngineState:
    """A DeepSpeed engine as the :class:`~pytorch_accel_trainer.state.parts.EngineState` of a training state: its
    model, optimizer and ZeRO partitions, written and read by the engine (see the module's docstring)."""

    def __init__(self, engine: Any, world_size: int):
        self.engine, self.world_size = engine, world_size

    def facts(self) -> dict:
        """What a resume must share with the saving run for DeepSpeed to read its partitions."""
        return {"zero_stage": int(self.engine.zero_optimization_stage()), "world_size": self.world_size}

    def save(self, folder: Path) -> dict[str, tuple[int, str]]:
        """Write this process's DeepSpeed files into ``folder`` (every process calls this at once: DeepSpeed's save
        is collective); return each file written with its size and checksum (computed as it was written). DeepSpeed's
        recovery scripts (``zero_to_fp32.py``...), copied by process 0, are checksummed by the main process with the
        other files it finds."""
        checkpoint_engine = self.engine.checkpoint_engine
        if checkpoint_engine.is_decoupled():
            raise ValueError(
                f"DeepSpeed's checkpoint engine {type(checkpoint_engine).__name__} commits its files after save "
                "returns, so a training state could not checksum them. Use DeepSpeed's default (torch) checkpoint "
                "engine for training states."
            )
        written: dict[str, tuple[int, str]] = {}
        unexpected: list[str] = []

        def save_checksummed(state_dict: Any, path: str, *args: Any, **kwargs: Any) -> None:
            target = Path(path)
            if target.parent != folder:
                unexpected.append(path)  # checked after DeepSpeed's collective save: no process is left waiting
            written[target.name] = save_tensors_file(state_dict, target)

        checkpoint_engine.save = save_checksummed  # this engine's writer, for this save only
        try:
            self.engine.save_checkpoint(str(folder), tag=STATE_TAG, save_latest=False)
        finally:
            del checkpoint_engine.save  # its class's method again
        if unexpected:
            raise CheckpointError(
                f"DeepSpeed wrote {unexpected[0]} outside the state's folder {folder} (NVMe offload or MoE expert "
                "files): such a state could not be verified. Training states support DeepSpeed ZeRO 1, 2 and 3 "
                "without NVMe offload or expert layers."
            )
        return written

    def load(self, folder: Path) -> None:
        """Load the model, optimizer and ZeRO partitions from the verified state ``folder`` (every process calls
        this at once); the learning-rate scheduler is the trainer's own.

        Raises:
            CheckpointError: DeepSpeed found no checkpoint in ``folder``.
        """
        load_path, _ = self.engine.load_checkpoint(
            str(folder),
            tag=STATE_TAG,
            load_module_strict=True,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if load_path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint of its own in {folder}; the state was altered.")


def check_engine_fits(stored: StoredState, saved_facts: Any, engine: Optional[DeepSpeedEngineState]) -> None:
    """Refuse to resume a DeepSpeed state without DeepSpeed, another state under DeepSpeed, or a DeepSpeed state on
    another ZeRO stage or number of processes (``saved_facts``: what :meth:`DeepSpeedEngineState.facts` said when it
    was saved); before anything is loaded.

    Raises:
        CheckpointError: naming the difference and what to do.
    """
    folder = stored.url or stored.folder
    saved_by_deepspeed = stored.layout == DEEPSPEED
    if saved_by_deepspeed and not isinstance(saved_facts, dict):
        raise CheckpointError(f"{folder}: a DeepSpeed state whose trainer file names no ZeRO stage; it was altered.")
    if engine is None:
        if saved_by_deepspeed:
            raise CheckpointError(
                f"{folder} was saved under DeepSpeed ZeRO stage {saved_facts.get('zero_stage')} (DeepSpeed's own "
                "format), but this run does not use DeepSpeed. Resume it under DeepSpeed with the same stage and "
                "number of processes, or write its weights with pytorch-accel-trainer consolidate and start from "
                "those."
            )
        return
    if not saved_by_deepspeed:
        raise CheckpointError(
            f"{folder} was not saved under DeepSpeed (its layout is {stored.layout!r}), but this run uses DeepSpeed, "
            "which resumes only its own checkpoints. Resume it without DeepSpeed, or load its weights with "
            "load_checkpoint before training."
        )
    current = engine.facts()
    if saved_facts != current:
        raise CheckpointError(
            f"{folder} was saved under DeepSpeed ZeRO stage {saved_facts.get('zero_stage')} on "
            f"{saved_facts.get('world_size')} process(es), but this run uses ZeRO stage {current['zero_stage']} on "
            f"{current['world_size']}: DeepSpeed's partitions fit only the stage and number of processes that wrote "
            "them (allow_resume_changes=True cannot change that). Resume with the saving run's stage and number of "
            "processes; DeepSpeed's universal checkpoints (python -m deepspeed.checkpoint.ds_to_universal) convert "
            "between them, outside this package."
        )


def warn_background_save_is_synchronous() -> None:
    """Warn, once per process, that a background save under DeepSpeed is written on the training thread."""
    if not _warned_synchronous:
        _warned_synchronous.append(True)
        warnings.warn(
            "save_training_state(asynchronous=True) under DeepSpeed is written synchronously: DeepSpeed's engine "
            "writes its partitions itself, on the training thread, and has no copy to host memory the package could "
            "write in the background. The state is the same; only the loop waits for it.",
            stacklevel=3,
        )


def full_weights(stored: StoredState) -> dict[str, torch.Tensor]:
    """The full fp32 weights of the model of the verified DeepSpeed state ``stored``, by the plain model's names,
    gathered from every process's partition without a process group (DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint``).

    Raises:
        CheckpointError: DeepSpeed is not installed, or cannot read the state.
    """
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as error:
        raise CheckpointError(
            f"{stored.url or stored.folder} was saved under DeepSpeed, whose partitions only DeepSpeed reads: install "
            f"it (pip install -c constraints.txt deepspeed) to consolidate the state ({error})."
        ) from error
    try:
        weights = get_fp32_state_dict_from_zero_checkpoint(str(stored.folder), tag=STATE_TAG)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise CheckpointError(f"DeepSpeed could not read {stored.url or stored.folder} ({error}).") from error
    return {name: tensor.contiguous() for name, tensor in weights.items()}
