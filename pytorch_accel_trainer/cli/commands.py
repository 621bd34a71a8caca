"""Runs the command line ``pytorch-accel-trainer fit|evaluate|predict|tune|consolidate``: :func:`main` and the console
script.

The command line is parsed into a :class:`~pytorch_accel_trainer.cli.config.TrainingConfig` from YAML files and flags
(:func:`~pytorch_accel_trainer.cli.parsing.parse_command`, later ones win), then run with
:func:`~pytorch_accel_trainer.cli.config.run_training_config`. ``--print_config`` prints the complete, reloadable config
instead of running. ``consolidate STATE OUTPUT`` writes a training state's full weights as one file, on one machine
(:func:`~pytorch_accel_trainer.state.consolidate.consolidate`). The same works as ``python -m pytorch_accel_trainer``,
and under ``accelerate launch`` or ``torchrun`` like any script. See ``docs/config.md``.
"""

from __future__ import annotations

import linecache
import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional, Sequence, cast

import yaml

from pytorch_accel_trainer.cli.config import (
    ConfigError,
    TrainingConfig,
    TrainSettings,
    run_prediction_config,
    run_training_config,
)
from pytorch_accel_trainer.cli.parsing import TUNE_OPTIONS, parse_command, put_current_folder_on_import_path
from pytorch_accel_trainer.cli.tune import create_pruner, tune
from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state.storage import Location


def main(argv: Optional[Sequence[str]] = None) -> Any:
    """Parse ``argv`` (``sys.argv[1:]`` by default) and run it; return what the run returned (a ``TrainResult``,
    the evaluation's metrics, the path of the predictions, a ``TuneResult``).

    Raises:
        ConfigError: the configuration is not valid (the message names the key, the value and the fix).
    """
    put_current_folder_on_import_path()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["consolidate"]:
        return run_consolidate_command(argv[1:])
    parsed = parse_command(argv)
    if parsed.command == "tune":
        return run_tune_command(parsed.namespace, parsed.config_text)
    config = cast(TrainingConfig, parsed.config)
    if parsed.command == "predict":
        return run_prediction_config(config, parsed.namespace.output, parsed.config_text)[1]
    _, result = run_training_config(config, parsed.command, parsed.config_text, parsed.hyperparameters)
    return result


def run_consolidate_command(argv: Sequence[str]) -> Location:
    """Run ``consolidate STATE OUTPUT [--part NAME]``: the full weights of a (sharded) training state as one file."""
    import argparse

    from pytorch_accel_trainer.state.consolidate import OUTPUT_KINDS, consolidate

    parser = argparse.ArgumentParser(
        prog="pytorch-accel-trainer consolidate",
        description="Write the full weights of a training state (written by any number of processes, FSDP included) "
        "as one file, on this machine, without launching processes.",
    )
    parser.add_argument(
        "state",
        help="a training state's folder, a folder of them (the newest good one is used), a run folder, or the URL of "
        "one of these in object storage",
    )
    kinds = ", ".join(f"{suffix} ({kind})" for suffix, kind in OUTPUT_KINDS.items())
    parser.add_argument("output", help=f"the new file to write (never overwritten; a path or a URL): {kinds}")
    parser.add_argument(
        "--part", default="model", help="the model to write: model (default), or extra_model:NAME; never an optimizer"
    )
    namespace = parser.parse_args(argv)
    output = consolidate(namespace.state, namespace.output, namespace.part)
    print(f"Wrote the full weights of {namespace.state} ({namespace.part}) to {output}")
    return output


def run_tune_command(namespace: Any, config_text: str) -> Any:
    """Run ``tune``: the config of the command line (without the search's own options) is every trial's base."""
    base = yaml.safe_load(config_text)
    options = {key: base.pop(key) for key in TUNE_OPTIONS}
    return tune(
        base,
        options["search"],
        options["n_trials"],
        output_dir=base.get("output_dir") or "tuning",
        metric=options["metric"],
        direction=options["direction"],
        storage=options["storage"],
        study_name=options["study_name"],
        pruner=create_pruner(options["pruner"]),
    )


def console_main(argv: Optional[Sequence[str]] = None) -> int:
    """The console script: run :func:`main`; a user's mistake (a bad configuration, or a value, path or permission
    the library refuses) is one message on stderr and exit status 2. Errors of the user's own code, or of torch,
    keep their traceback."""
    try:
        main(argv)
    except (ConfigError, CheckpointError, ValueError, TypeError, OSError) as error:
        message = describe_user_mistake(error)
        if message is None:
            raise
        print(f"pytorch-accel-trainer: error: {message}", file=sys.stderr)
        return 2
    return 0


#: The package's folder: an error raised from a file in it is one the library detected.
_PACKAGE_FOLDER = Path(__file__).resolve().parents[1]


def describe_user_mistake(error: BaseException) -> Optional[str]:
    """The one-line message of an error that is a user's mistake, or ``None`` for one that is not: a
    :class:`ConfigError`; a ``ValueError``, ``TypeError``, ``CheckpointError`` or ``OSError`` the library raised; or
    an ``OSError`` about a path (missing, not writable, a file where a folder is needed)."""
    if isinstance(error, ConfigError):
        return str(error)
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    file_name = "" if frame is None else frame.tb_frame.f_code.co_filename
    # raised by a `raise` of the library's own (a check), not by a bug of it (`None[0]`), whose traceback is kept
    raised_here = (
        frame is not None
        and _PACKAGE_FOLDER in Path(file_name).resolve().parents
        and linecache.getline(file_name, frame.tb_lineno).lstrip().startswith("raise ")
    )
    if isinstance(error, OSError) and error.filename is not None and not raised_here:
        return (
            f"{error.strerror or error}: {str(error.filename)!r}. Fix the path in the config (or the flag that gives "
            "it): it must exist, be the right kind (file or folder) and be readable, or writable for output_dir."
        )
    if not raised_here:
        return None
    message = str(error)
    argument = re.match(r"(\w+)[= ]", message)
    if argument and argument.group(1) in {item.name for item in fields(TrainSettings)}:
        message = f"train.{message}"  # the key of the config that gave the argument
    return message
