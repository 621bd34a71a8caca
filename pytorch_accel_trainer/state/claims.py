"""Which job saves into a local folder of training states: the folder's claim, ``<folder>/.claim``.

One folder, one run (docs/training_state.md, "Run identity"): two jobs saving into one folder at once would interleave
their states (``step_2``, ``step_2-2``, ..., ``final``, ``final-2``) and race on its renames. So the main process of a
run claims each local folder it saves into before the first batch (:func:`take_claim`), naming its run, host and
process. A claim of another live process of this host refuses the run; a claim whose process is gone (a job killed
anywhere) or that this process made (an earlier ``train()`` of the script) is taken; a claim of another host, whose
process cannot be checked from here (a requeue on another node after a crash), is taken over with a line saying so.
Before each save the main process checks that the claim is still its own (:func:`keep_claim`): a job whose folder was
taken over stops at its next save, never writing a state beside the other job's. The claim is removed as the run ends
(:func:`release_claims`).

A free folder is claimed with one atomic link of a file already written whole, so of two jobs started at once exactly
one gets it; a stale claim is replaced atomically and read back (of two jobs replacing it at once, the later wins).
The claim is a hidden file, never a state, a damaged state or a temporary to the lookup, pruning or the "folder holds
no state" checks. A folder in object storage has no claim: each run needs its own prefix there.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.parallel.distributed import print_on_node
from pytorch_accel_trainer.state.files import TEMPORARY_PREFIX, is_abandoned, read_small_text, writer_tag

CLAIM_NAME = ".claim"

#: The folders this process claimed and still holds (absolute paths): a claim gone from one of them was taken over
#: (and released) by another job.
_held: set[Path] = set()


@dataclass(frozen=True)
class Claim:
    """A job's claim of a folder of training states: its run, and the host and pid of its main process."""

    run_id: str
    host: str
    pid: int

    @classmethod
    def of_this_process(cls, run_id: str) -> "Claim":
        return cls(run_id, socket.gethostname(), os.getpid())

    @property
    def is_this_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid()

    @property
    def is_on_another_host(self) -> bool:
        return self.host != socket.gethostname()

    @property
    def is_live_here(self) -> bool:
        """Whether it is another process of this host, still running."""
        return not (self.is_on_another_host or self.is_this_process or is_abandoned(self.host, self.pid))

    def describe(self) -> str:
        return f"run {self.run_id}, process {self.pid} on host {self.host}"


def read_claim(parent: Path) -> Optional[Claim]:
    """The claim of ``parent``; ``None`` when it has none, or one that is not a claim (a claim is written whole)."""
    try:
        fields = json.loads(read_small_text(parent / CLAIM_NAME, 4096))
        return Claim(str(fields["run_id"]), str(fields["host"]), int(fields["pid"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def take_claim(parent: Path, run_id: str) -> None:
    """Claim ``parent`` for the run ``run_id`` of this process (its main process) before the run's first batch; a
    claim of another host taken over is said in one line.

    Raises:
        CheckpointError: another live process of this host holds the claim, or won it at the same moment.
    """
    mine = Claim.of_this_process(run_id)
    if _create(parent, mine):
        _held.add(parent.absolute())
        return
    held = read_claim(parent)
    if held is not None and held.is_live_here:
        raise CheckpointError(_in_use(parent, held, "holds it"))
    _replace(parent, mine)  # a claim whose process is gone, this process's own, or another host's
    now = read_claim(parent)
    if now != mine:  # another job replaced it at the same moment: the later writer wins
        raise CheckpointError(_in_use(parent, now, "claimed it at the same moment"))
    _held.add(parent.absolute())
    if held is not None and held.is_on_another_host:
        print_on_node(
            f"Took over {parent} from {held.describe()}, whose liveness cannot be checked from here: if that job "
            "still runs, it stops at its next save."
        )


def keep_claim(parent: Path, run_id: str, state_name: str) -> bool:
    """Before a save of ``state_name`` into ``parent`` (main process): check that this process still holds its
    claim. A folder it does not hold (a save after ``train()``, or into ``max_time_save_dir``) is claimed for this
    save alone, as :func:`take_claim` does: return ``True`` then, and release it after the save.

    Raises:
        CheckpointError: another job took the claim over, naming it; nothing of the state was written.
    """
    if parent.absolute() not in _held:
        take_claim(parent, run_id)
        return True
    held = read_claim(parent)
    if held is not None and held.is_this_process:
        return False
    holder = "another job" if held is None else f"another job ({held.describe()})"
    raise CheckpointError(
        f"{parent} was taken over by {holder} since this run claimed it: two jobs save training states into one "
        f"folder. This run stops without writing its state {state_name} beside that job's (its earlier states are "
        "intact). Give each job its own save_dir, or stop the other job."
    )


def release_claims(folders: Iterable[Path]) -> None:
    """As a run ends: remove the claims of ``folders`` this process still holds (another job's are left)."""
    for folder in folders:
        held = read_claim(folder)
        _held.discard(folder.absolute())
        if held is not None and held.is_this_process:
            (folder / CLAIM_NAME).unlink(missing_ok=True)


def _in_use(parent: Path, holder: Optional[Claim], what: str) -> str:
    other = "another job" if holder is None else f"another job ({holder.describe()})"
    return (
        f"{parent} is the folder of training states of {other}, which {what}: two jobs would save into one "
        "folder, mixing their states. Give each job its own save_dir (SaveTrainingStateCallback(save_dir=...)), or "
        "stop the other job first; nothing was written there."
    )


def _write_temporary(parent: Path, claim: Claim) -> Path:
    temporary = parent / f"{TEMPORARY_PREFIX}{CLAIM_NAME}-{writer_tag()}"  # this process's own: none shares it
    with open(temporary, "w") as handle:
        handle.write(json.dumps(asdict(claim)))
        handle.flush()
        os.fsync(handle.fileno())
    return temporary


def _create(parent: Path, claim: Claim) -> bool:
    """Make ``claim`` the claim of ``parent`` if it has none, whole and at once (a link fails if the name is taken);
    ``False`` when it has one (or links are not supported here: the caller replaces and reads back instead)."""
    temporary = _write_temporary(parent, claim)
    try:
        os.link(temporary, parent / CLAIM_NAME)
        return True
    except OSError:
        return False
    finally:
        temporary.unlink(missing_ok=True)


def _replace(parent: Path, claim: Claim) -> None:
    os.replace(_write_temporary(parent, claim), parent / CLAIM_NAME)
