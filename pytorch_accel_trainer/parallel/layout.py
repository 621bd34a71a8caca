"""The run's layout: how Accelerate's ``ParallelismConfig`` splits the processes into data-parallel groups
(``dp_replicate`` x ``dp_shard``) and the groups that compute one batch together (tensor parallel ``tp``, context
parallel ``cp``), and the ParallelismConfig a run is created with.

Everything the trainer counts in *samples* (samples per step, the data position, the epoch's last rows, stream
parts, the gathered evaluation and prediction rows) is per data-parallel rank: the processes of one tensor-parallel
group read the same batch, so counting them as processes would count each sample ``tp`` times. Decisions every
process must take together (agreed stops, the time budget, ``TrainResult``) stay world-wide.

Without a ``ParallelismConfig`` every process is its own data-parallel rank (``dp_size = num_processes``, ``dp_rank
= process_index``): one process, DDP and FSDP are unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import gather_object, recursively_apply

#: What ``accelerate launch --parallelism_config_*`` and an ``accelerate config`` file set (Accelerate reads them in
#: ``ParallelismConfig.__post_init__`` when ``ACCELERATE_USE_PARALLELISM_CONFIG`` is true).
PARALLELISM_CONFIG_SWITCH = "ACCELERATE_USE_PARALLELISM_CONFIG"


@dataclass(frozen=True)
class Layout:
    """How the processes of a run split the work (read from the Accelerator by :func:`layout_of`).

    Attributes:
        dp_replicate: data-parallel replicas (HSDP's outer dimension; DDP without a ParallelismConfig).
        dp_shard: data-parallel shards (FSDP2).
        tp: processes that split each layer (tensor parallel); they read the same batches.
        cp: processes that split each sequence (context parallel); they read the same batches.
        dp_size: data-parallel ranks: how many different batches one step reads.
        dp_rank: this process's data-parallel rank, ``0 .. dp_size - 1``.
        tp_rank: this process's rank in its tensor-parallel group (0 without tensor parallelism).
        leads_model_group: whether this process speaks for its data-parallel rank (tp and cp rank 0): of each
            group computing one batch, only its leader's rows are gathered.
        has_parallelism_config: whether the Accelerator has a ``ParallelismConfig``.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    dp_size: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    leads_model_group: bool = True
    has_parallelism_config: bool = False

    @property
    def model_group_size(self) -> int:
        """The processes that compute one batch together (``tp x cp``; 1 without tensor or context parallelism)."""
        return self.tp * self.cp

    def as_fact(self) -> dict:
        """The sizes, as a training state's facts record them."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "cp": self.cp}


def layout_of(accelerator: Union[Accelerator, AcceleratorState]) -> Layout:
    """The :class:`Layout` of ``accelerator``'s run (or of the process's ``AcceleratorState``); cheap (no
    collective), so call it where needed.

    Accelerate's mesh puts tensor, sequence and context parallelism innermost (``dp_replicate, dp_shard, cp, sp,
    tp``), so the processes of one model group are consecutive and the data-parallel rank is ``process_index //
    (tp x cp x sp)``: the rank Accelerate's prepared DataLoader reads for.
    """
    config = getattr(accelerator, "parallelism_config", None)
    if config is None:
        return Layout(
            dp_replicate=accelerator.num_processes,
            dp_size=accelerator.num_processes,
            dp_rank=accelerator.process_index,
        )
    group = int(config.non_data_parallel_size)
    tp_rank = accelerator.process_index % int(config.tp_size)  # tp is the innermost mesh dimension
    return Layout(
        dp_replicate=int(config.dp_replicate_size),
        dp_shard=int(config.dp_shard_size),
        tp=int(config.tp_size),
        cp=int(config.cp_size),
        dp_size=int(config.data_parallel_size),
        dp_rank=accelerator.process_index // group,
        tp_rank=tp_rank,
        leads_model_group=accelerator.process_index % group == 0,
        has_parallelism_config=True,
    )


def keep_model_group_leaders(accelerator: Accelerator, gathered: Any) -> Any:
    """Of rows gathered from every process (``Accelerator.gather``: each process's block in rank order), keep those
    of each model group's leader, so that each sample is counted once; ``gathered`` as is without tensor or context
    parallelism.

    ``gathered`` is a tensor (its first dimension ``num_processes`` equal blocks) or a list of per-process items in
    rank order (``gather_object`` of one item each).
    """
    layout = layout_of(accelerator)
    if layout.model_group_size == 1:
        return gathered
    if isinstance(gathered, torch.Tensor):
        blocks = gathered.reshape(layout.dp_size, layout.model_group_size, -1, *gathered.shape[1:])
        return blocks[:, 0].reshape(-1, *gathered.shape[1:])
    return list(gathered)[:: layout.model_group_size]


def gather_for_metrics_by_rank(accelerator: Accelerator, data: Any) -> Any:
    """``Accelerator.gather_for_metrics`` counting each sample once: over the data-parallel ranks, not the processes.

    Accelerate gathers from every process, so under tensor (or context) parallelism each batch would come back once
    per process of its group, and its trimming of the last batch's repeated rows would cut the wrong ones. Here the
    rows of each group's leader are kept, then the last batch trimmed to the dataset's remainder. Without tensor or
    context parallelism it is ``gather_for_metrics`` itself. A collective: every process must call it.
    """
    layout = layout_of(accelerator)
    if layout.model_group_size == 1:
        return accelerator.gather_for_metrics(data)
    tensors = _holds_only_tensors(data)
    if tensors:
        everyone = accelerator.gather(data)
        gathered = recursively_apply(lambda tensor: keep_model_group_leaders(accelerator, tensor), everyone)
    else:  # objects: each leader's list, in rank order
        gathered = gather_object(data if layout.leads_model_group else [])
    state = accelerator.gradient_state
    if not state.end_of_dataloader or state.remainder <= 0:
        return gathered
    remainder = state.remainder  # the last global batch's real rows, counted by data-parallel rank
    return recursively_apply(lambda tensor: tensor[:remainder], gathered) if tensors else gathered[:remainder]


def _holds_only_tensors(data: Any) -> bool:
    try:
        recursively_apply(lambda tensor: tensor, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def parallelism_config_from(accelerator_kwargs: dict) -> Optional[Any]:
    """The ``ParallelismConfig`` a run is asked to use: ``accelerator_kwargs["parallelism_config"]``, else the one
    ``accelerate launch --parallelism_config_*`` (or an ``accelerate config`` file) describes through
    ``ACCELERATE_USE_PARALLELISM_CONFIG=true`` and the ``PARALLELISM_CONFIG_*`` variables, else ``None``.

    Raises:
        TypeError: ``parallelism_config`` is not an ``accelerate.parallelism_config.ParallelismConfig``.
    """
    config = accelerator_kwargs.get("parallelism_config")
    if config is None and os.environ.get(PARALLELISM_CONFIG_SWITCH, "false").lower() == "true":
        from accelerate.parallelism_config import ParallelismConfig

        return ParallelismConfig()  # reads the PARALLELISM_CONFIG_* variables for every size not given
    if config is None:
        return None
    from accelerate.parallelism_config import ParallelismConfig

    if not isinstance(config, ParallelismConfig):
        raise TypeError(
            f"accelerator_kwargs['parallelism_config'] is {type(config).__name__}, not valid: pass an "
            "accelerate.parallelism_config.ParallelismConfig(dp_replicate_size=..., dp_shard_size=..., tp_size=...)."
        )
    return config


def validate_layout_on_cpu(config: Any, num_processes: int) -> None:
    """Refuse, on the CPU, a ``ParallelismConfig`` the run cannot train: one whose sizes do not multiply to the
    number of processes, or context parallelism.

    Raises:
        ValueError: naming the sizes and what to change.
    """
    sizes = (
        f"dp_replicate_size={config.dp_replicate_size} x dp_shard_size={config.dp_shard_size} x "
        f"tp_size={config.tp_size} x cp_size={config.cp_size}"
    )
    if config.cp_size > 1:
        raise ValueError(
            f"ParallelismConfig(cp_size={config.cp_size}) asks for context parallelism, which does not run on the "
            "CPU: torch's ring attention handles only the CUDA attention kernels (flash, efficient, cuDNN), and the "
            "CPU kernel has no sharding rule. Train with cp_size=1 on the CPU, or launch on GPUs."
        )
    if config.total_size != num_processes:
        raise ValueError(
            f"ParallelismConfig({sizes}) needs {config.total_size} processes, but {num_processes} were launched. "
            f"Launch {config.total_size} processes, or choose sizes whose product is {num_processes}."
        )
