"""pytorch_accel_trainer: a readable, correct and fast training loop on Hugging Face Accelerate.

Importing the package only defines names: it seeds nothing and configures no logging.
"""

from accelerate import notebook_launcher

from pytorch_accel_trainer.placeholders import TrainerPlaceholderValues
from pytorch_accel_trainer.trainer import DEFAULT_CALLBACKS, Trainer

__version__ = "0.1.0"

__all__ = ["DEFAULT_CALLBACKS", "Trainer", "TrainerPlaceholderValues", "__version__", "notebook_launcher"]
