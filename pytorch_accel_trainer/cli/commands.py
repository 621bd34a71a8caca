"""The command line: ``pytorch-accel-trainer fit|evaluate|predict --config run.yaml --train.num_epochs 5``.

Parses a :class:`~pytorch_accel_trainer.cli.config.TrainingConfig` from YAML files and flags with jsonargparse (later
ones win), then runs it with :func:`~pytorch_accel_trainer.cli.config.run_training_config`. ``--print_config`` prints
the complete, reloadable config instead of running. The same works as ``python -m pytorch_accel_trainer``, and under
``accelerate launch`` or ``torchrun`` like any script. See ``docs/config.md``.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from argparse import ArgumentError
from dataclasses import fields
from typing import Any, Optional, Sequence

import yaml
from accelerate.utils import set_seed
from jsonargparse import ActionConfigFile, ArgumentParser

from pytorch_accel_trainer.callbacks.trackers import plain_hyperparameters
from pytorch_accel_trainer.cli.config import ConfigError, TrainingConfig, run_prediction_config, run_training_config

COMMANDS = {
    "fit": "Train the model (Trainer.train) and, with data.eval, evaluate it after each epoch.",
    "evaluate": "Evaluate the model (Trainer.evaluate) on data.eval, e.g. with the weights of --checkpoint.",
    "predict": (
        "Write the model's outputs (Trainer.predict) for data.predict (else data.eval) to --output, with the weights "
        "of --checkpoint (a run folder or a weights file)."
    ),
}


class CommandLineParser(ArgumentParser):
    """jsonargparse's parser of the command line, with the parser of each subcommand by name in ``command_parsers``."""

    command_parsers: dict[str, ArgumentParser]


def create_parser() -> CommandLineParser:
    """Return the parser of the command line: one subcommand per entry of :data:`COMMANDS`, each taking every key of
    :class:`TrainingConfig` as a flag (``--train.num_epochs 5``) and ``--config`` files; ``parser.command_parsers``
    holds the parser of each subcommand."""
    parser = CommandLineParser(
        prog="pytorch-accel-trainer", description=__doc__.splitlines()[0], exit_on_error=False, allow_abbrev=False
    )
    subcommands = parser.add_subcommands(dest="command", required=True)
    parser.command_parsers = {}
    for command, description in COMMANDS.items():
        subparser = ArgumentParser(description=description, exit_on_error=False, allow_abbrev=False)
        subparser.add_argument(
            "--config", action=ActionConfigFile, help="a YAML config file; flags after it override it"
        )
        subparser.add_class_arguments(TrainingConfig, None, fail_untyped=True)
        if command == "predict":
            subparser.add_argument(
                "--output",
                type=str,
                required=True,
                help="where to write the predictions: a .pt file, or a new folder written in chunks as they come",
            )
        subcommands.add_subcommand(command, subparser, help=description)
        parser.command_parsers[command] = subparser
    return parser


def main(argv: Optional[Sequence[str]] = None) -> Any:
    """Parse ``argv`` (``sys.argv[1:]`` by default) and run it; return what the run returned.

    Raises:
        ConfigError: the configuration is not valid (the message names the key, the value and the fix).
    """
    if os.getcwd() not in sys.path:  # import paths resolve from the current folder, as with `python -m`
        sys.path.insert(0, os.getcwd())
    parser = create_parser()
    try:
        parsed = parser.parse_args(argv)
    except ArgumentError as error:
        raise ConfigError(explain_parse_error(error, parser)) from None
    command = parsed.command
    subparser = parser.command_parsers[command]
    namespace = parsed[command]
    config_text = subparser.dump(namespace, skip_unset=False)  # every key, nulls included: a complete file
    if namespace.trainer.seed is not None:
        set_seed(namespace.trainer.seed)  # before the model is built: the same initial weights on every run
    try:
        instantiated = subparser.instantiate(namespace)
    except (ArgumentError, TypeError, ValueError) as error:
        raise ConfigError(f"The configuration could not be built: {error}. Fix the arguments named above.") from None
    config = TrainingConfig(**{item.name: instantiated[item.name] for item in fields(TrainingConfig)})
    if command == "predict":
        return run_prediction_config(config, namespace.output, config_text)[1]
    hyperparameters = plain_hyperparameters(yaml.safe_load(config_text))
    _, result = run_training_config(config, command, config_text, hyperparameters)
    return result


def console_main(argv: Optional[Sequence[str]] = None) -> int:
    """The console script: run :func:`main`; a bad configuration is one message on stderr and exit status 2."""
    try:
        main(argv)
    except ConfigError as error:
        print(f"pytorch-accel-trainer: error: {error}", file=sys.stderr)
        return 2
    return 0


def explain_parse_error(error: ArgumentError, parser: CommandLineParser) -> str:
    """jsonargparse's message (which names the key and the value), with the closest valid key for an unknown one
    and where to find the valid keys."""
    message = str(error).strip()
    unknown = re.findall(r"(?:option|Key|key|arguments:)\s+'?-*([\w.]+)", message)
    known = sorted({key for subparser in parser.command_parsers.values() for key in _keys(subparser)})
    hints = [f"did you mean {match!r}?" for name in unknown for match in difflib.get_close_matches(name, known, n=1)]
    hint = f" ({'; '.join(hints)})" if hints else ""
    return (
        f"The configuration is not valid{hint}:\n{message}\nFix the key named above: "
        "`pytorch-accel-trainer fit --help` lists every key with its type, "
        "and `pytorch-accel-trainer fit --print_config` prints a complete config to edit."
    )


def _keys(parser: ArgumentParser) -> list:
    return [action.dest for action in parser._actions if action.dest not in ("help", "config", "print_config")]
