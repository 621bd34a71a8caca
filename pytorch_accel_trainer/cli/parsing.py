"""The command line: ``pytorch-accel-trainer fit|evaluate|predict|tune --config run.yaml --train.num_epochs 5``.

Its parser, and :func:`parse_command`, which reads a :class:`~pytorch_accel_trainer.cli.config.TrainingConfig` from
YAML files and flags with jsonargparse (later ones win). A config file that is empty, is not a mapping or gives a key
twice is refused, and an unknown key is named with the closest valid one. ``commands`` runs what it returns;
``tune`` parses the command of each trial with it. See ``docs/config.md``.
"""

from __future__ import annotations

import difflib
import re
import sys
from argparse import ArgumentError
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import yaml
from accelerate.utils import set_seed
from jsonargparse import ActionConfigFile, ArgumentParser

from pytorch_accel_trainer.callbacks.trackers import plain_hyperparameters
from pytorch_accel_trainer.cli.config import ConfigError, TrainingConfig

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
    argv = list(sys.argv[1:] if argv is None else argv)
    for path in config_files(argv):
        validate_config_file(path)
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


def config_files(argv: Sequence[str]) -> list[Path]:
    """The files given to ``--config`` in ``argv`` (a value that is no file is YAML text, left to the parser)."""
    files = []
    for index, argument in enumerate(argv):
        value = argument.split("=", 1)[1] if argument.startswith("--config=") else None
        if argument == "--config" and index + 1 < len(argv):
            value = argv[index + 1]
        if value is not None and Path(value).is_file():
            files.append(Path(value))
    return files


def validate_config_file(path: Path) -> None:
    """Refuse a config file that is empty, is not a mapping of keys, or gives a key twice in one mapping (YAML
    keeps the last silently: the first one's settings would be lost).

    Raises:
        ConfigError: naming the file, the key and its lines.
    """
    try:
        node = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return  # the parser reports it, with the file's name
    if node is None:
        raise ConfigError(f"{path} is empty: a config file is a mapping of keys (`fit --print_config` prints one).")
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(
            f"{path} holds a YAML {node.tag.rsplit(':', 1)[-1]}, not a mapping of keys such as `model:` and `train:` "
            "(`pytorch-accel-trainer fit --print_config` prints a complete config to edit)."
        )
    _refuse_duplicate_keys(path, node, "")


def _refuse_duplicate_keys(path: Path, node: yaml.Node, prefix: str) -> None:
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(path, item, prefix)
    if not isinstance(node, yaml.MappingNode):
        return
    lines: dict[str, int] = {}
    for key_node, value_node in node.value:
        key = str(key_node.value)
        if key in lines and key != "<<":
            raise ConfigError(
                f"{path}, line {key_node.start_mark.line + 1}: the key {prefix + key!r} is given a second time (first "
                f"on line {lines[key]}), and YAML would silently drop the first one's settings. Merge the two into "
                "one."
            )
        lines[key] = key_node.start_mark.line + 1
        _refuse_duplicate_keys(path, value_node, f"{prefix}{key}.")


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
