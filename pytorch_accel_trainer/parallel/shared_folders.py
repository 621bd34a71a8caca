"""Whether the folders a multi-node run shares are seen by every node, checked before any work.

A training state is written by every process (each its RNG states) into one folder that the main process seals, and
every process reads it back to resume: on machines with local disks, each node would write and read its own folder,
and the first save would fail after an epoch's work. So, at the start of ``train()``, the main process writes a probe
file into each such folder and each node's first process looks for it after a barrier; a node that does not see it
stops every node with one :class:`~pytorch_accel_trainer.errors.SharedFolderError`, before the first batch.

What works without sharing, so is not probed: export checkpoints (``save_checkpoint``, ``SaveBestModelCallback``:
written once per node, each node reads its own copy), weights (``save_weights``) and run folders (written by the main
process alone).
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Mapping

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from pytorch_accel_trainer.errors import SharedFolderError

PROBE_PREFIX = ".shared-folder-probe-"


def runs_on_one_node() -> bool:
    """Whether the launcher started every process on this machine (torchrun's ``LOCAL_WORLD_SIZE`` is the
    ``WORLD_SIZE``); ``False`` when it does not say."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    return local is not None and local == world


def node_name() -> str:
    """This machine as a message names it: the launcher's node rank (``GROUP_RANK``) and the host name."""
    rank = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK"))
    return f"node {rank} ({socket.gethostname()})" if rank is not None else socket.gethostname()


def check_folders_are_shared(accelerator: Accelerator, folders: Mapping) -> None:
    """Raise :class:`SharedFolderError` on every process when a node does not see one of ``folders`` (the main
    process's, each with what the run keeps there) as the main process does; every process must call this. Nothing is
    done on one node (three small collectives and a file per folder otherwise, once per ``train()``).
    """
    if accelerator.num_processes == 1 or runs_on_one_node():
        return
    # the main process's folders, a name no earlier probe had, and whether it could write the probes: a node without
    # the folder must not decide alone, and a folder the main process cannot write into stops every process too
    token, uses = uuid.uuid4().hex, {str(folder): use for folder, use in folders.items()}
    probe_name, failure = f"{PROBE_PREFIX}{token}", None
    if accelerator.is_main_process:
        try:
            for folder in uses:
                Path(folder).mkdir(parents=True, exist_ok=True)
                (Path(folder) / probe_name).write_text(node_name())
        except OSError as error:
            failure = f"the main process cannot write into {folder!r} ({uses[folder]}): {error}"
    shared: list = [(probe_name, uses, failure)]
    broadcast_object_list(shared)
    probe_name, uses, failure = shared[0]
    if failure is not None:
        raise SharedFolderError(f"{failure}. Give the run a folder every node can write to. Nothing was trained.")
    if not uses:
        return
    unseen = []
    if accelerator.is_local_main_process:
        unseen = [folder for folder in uses if not (Path(folder) / probe_name).is_file()]
    reports = gather_object([(node_name(), unseen)])
    accelerator.wait_for_everyone()  # every node has looked before the probe goes
    if accelerator.is_main_process:
        for folder in uses:
            (Path(folder) / probe_name).unlink(missing_ok=True)
    problems = [f"  {folder!r} ({uses[folder]}) on {node}" for node, missing in reports for folder in missing]
    if problems:
        listed = "\n".join(problems)
        raise SharedFolderError(
            "This run spans several machines, but folders it must share are not shared: the main process (on "
            f"{reports[0][0]}) wrote a probe file into each, and these nodes do not see it there:\n{listed}\n"
            "Every process writes its part of a training state into such a folder and reads it back to resume, so "
            "every node must see the same folder. Fix: put it on a filesystem every node mounts at the same path "
            "(NFS, Lustre, a cloud file share), or give an object-storage URL instead (e.g. 's3://bucket/states', "
            "with fsspec and the store's package, such as s3fs, installed). Nothing was trained."
        )
