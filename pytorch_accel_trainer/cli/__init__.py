"""Runs described by data: the typed, frozen config a YAML file or flags fill (``config``), the
``pytorch-accel-trainer`` command line (parsed by ``parsing``, run by ``commands``), the hyperparameter search
(the ``tune`` subpackage: its space, study and trials) and the folder each run writes (``run_folder``).

Above the Trainer: it builds trainers from configs; nothing below imports it.
"""

from pytorch_accel_trainer.cli.commands import console_main, main
from pytorch_accel_trainer.cli.parsing import create_parser

__all__ = ["console_main", "create_parser", "main"]
