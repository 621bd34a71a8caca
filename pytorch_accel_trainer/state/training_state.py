"""The training state's public import path: the lookup (:func:`find_resumable_state`), the position a state was
taken at and what a resume applies, and the errors of its format. The code lives by responsibility in
``manager.py`` (the owner, :class:`TrainingStates`, and which state a resume continues) and ``folder.py`` (one
state's folder: written, verified, pruned).
"""

from pytorch_accel_trainer.state.folder import (
    StateFormatError,
    list_complete_states,
    prune_states,
    read_manifest,
    verify_folder,
    write_training_state,
)
from pytorch_accel_trainer.state.manager import (
    ResumePlan,
    ResumePosition,
    TrainingStates,
    find_resumable_state,
    validate_save_dir,
)

__all__ = [
    "ResumePlan",
    "ResumePosition",
    "StateFormatError",
    "TrainingStates",
    "find_resumable_state",
    "list_complete_states",
    "prune_states",
    "read_manifest",
    "validate_save_dir",
    "verify_folder",
    "write_training_state",
]
