"""The command line: ``pytorch-accel-trainer fit|evaluate|predict|tune --config run.yaml --train.num_epochs 5``.

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
from dataclasses import dataclass, fields
from typing import Any, Literal, Optional, Sequence, cast

import yaml
from accelerate.utils import set_seed
from jsonargparse import ActionConfigFile, ArgumentParser

from pytorch_accel_trainer.callbacks.trackers import plain_hyperparameters
from pytorch_accel_trainer.cli.config import ConfigError, TrainingConfig, run_prediction_config, run_training_config
from pytorch_accel_trainer.cli.tune import create_pruner, tune

#: The options of ``tune`` that are not keys of the config.
TUNE_OPTIONS = ("search", "n_trials", "metric", "direction", "storage", "study_name", "pruner")

COMMANDS = {
    "fit": "Train the model (Trainer.train) and, with data.eval, evaluate it after each epoch.",
    "evaluate": "Evaluate the model (Trainer.evaluate) on data.eval, e.g. with the weights of --checkpoint.",
    "tune": (
        "Search hyperparameters with Optuna (--search space.yaml --n_trials 20): each trial a fit in a run folder of "
        "output_dir/trials; the best trial's config is written to output_dir/best_config.yaml."
    ),
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
        if command == "tune":
            _add_tune_arguments(subparser)
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


@dataclass(frozen=True)
class ParsedCommand:
    """A command line, parsed: the subcommand, jsonargparse's namespace, the complete config as YAML, and (when built)
    the :class:`TrainingConfig` and the flat hyperparameters given to experiment trackers."""

    command: str
    namespace: Any
    config_text: str
    config: Optional[TrainingConfig] = None
    hyperparameters: Optional[dict] = None


def parse_command(argv: Optional[Sequence[str]] = None, instantiate: bool = True) -> ParsedCommand:
    """Parse ``argv`` and, with ``instantiate`` (not for ``tune``, whose trials build their own), seed and build the
    config it describes (the model is built then).

    Raises:
        ConfigError: the command line or a config file is not valid (the message names the key, the value and the
            fix).
    """
    parser = create_parser()
    try:
        parsed = parser.parse_args(argv)
    except ArgumentError as error:
        raise ConfigError(explain_parse_error(error, parser)) from None
    command = parsed.command
    subparser = parser.command_parsers[command]
    namespace = parsed[command]
    config_text = subparser.dump(namespace, skip_unset=False)  # every key, nulls included: a complete file
    if not instantiate or command == "tune":
        return ParsedCommand(command, namespace, config_text)
    if namespace.trainer.seed is not None:
        set_seed(namespace.trainer.seed)  # before the model is built: the same initial weights on every run
    try:
        instantiated = subparser.instantiate(namespace)
    except (ArgumentError, TypeError, ValueError) as error:
        raise ConfigError(f"The configuration could not be built: {error}. Fix the arguments named above.") from None
    config = TrainingConfig(**{item.name: instantiated[item.name] for item in fields(TrainingConfig)})
    hyperparameters = plain_hyperparameters(yaml.safe_load(config_text))
    return ParsedCommand(command, namespace, config_text, config, hyperparameters)


def _add_tune_arguments(subparser: ArgumentParser) -> None:
    """The options of ``tune`` besides the config (see ``cli/tune.py``)."""
    subparser.add_argument("--search", type=str, required=True, help="a YAML file of the search space")
    subparser.add_argument("--n_trials", type=int, required=True, help="the trials the study must have")
    subparser.add_argument("--metric", type=str, default="eval_loss_epoch", help="the metric reported each epoch")
    subparser.add_argument("--direction", type=str, default="minimize", help="minimize or maximize the metric")
    subparser.add_argument(
        "--storage",
        type=Optional[str],
        default=None,
        help="a database URL or a journal file (journal:study.log) shared by several processes; "
        "<output_dir>/study.db by default",
    )
    subparser.add_argument("--study_name", type=str, default="tune", help="the study's name in the storage")
    subparser.add_argument(
        "--pruner",
        type=Literal["median", "hyperband", "none"],
        default="median",
        help="Optuna's pruner: median (MedianPruner), hyperband (HyperbandPruner) or none",
    )


def main(argv: Optional[Sequence[str]] = None) -> Any:
    """Parse ``argv`` (``sys.argv[1:]`` by default) and run it; return what the run returned (a ``TrainResult``,
    the evaluation's metrics, the path of the predictions, a ``TuneResult``).

    Raises:
        ConfigError: the configuration is not valid (the message names the key, the value and the fix).
    """
    if os.getcwd() not in sys.path:  # import paths resolve from the current folder, as with `python -m`
        sys.path.insert(0, os.getcwd())
    parsed = parse_command(argv)
    if parsed.command == "tune":
        return run_tune_command(parsed.namespace, parsed.config_text)
    config = cast(TrainingConfig, parsed.config)
    if parsed.command == "predict":
        return run_prediction_config(config, parsed.namespace.output, parsed.config_text)[1]
    _, result = run_training_config(config, parsed.command, parsed.config_text, parsed.hyperparameters)
    return result


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
