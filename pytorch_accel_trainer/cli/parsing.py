"""The command line: ``pytorch-accel-trainer fit|evaluate|predict|tune --config run.yaml --train.num_epochs 5``.

Its parser, and :func:`parse_command`, which reads a :class:`~pytorch_accel_trainer.cli.config.TrainingConfig` from
YAML files and flags with jsonargparse (later ones win). YAML is read by :func:`load_yaml`: as jsonargparse reads it,
but without YAML 1.1's base-60 numbers. A config file that cannot be read, is not valid YAML, is empty, is not a
mapping, gives a key twice or holds aliases that expand to a huge structure is refused, naming the file (and the line),
and an unknown key is named with the closest valid one. ``commands`` runs what it returns; ``tune`` parses the command
of each trial with it. See ``docs/config.md``.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from argparse import ArgumentError
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import yaml
from accelerate.utils import set_seed
from jsonargparse import ActionConfigFile, ArgumentParser, set_loader
from jsonargparse.typing import register_type

from pytorch_accel_trainer.callbacks.trackers import plain_hyperparameters
from pytorch_accel_trainer.cli.config import ConfigError, TimeBudgetText, TrainingConfig, serialize_time_budget_text

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


# ------------------------------------------------------------------------------------------------
# YAML as the command line reads it
# ------------------------------------------------------------------------------------------------

#: The name under which :func:`load_yaml` is registered with jsonargparse (its ``parser_mode``).
YAML_MODE = "pytorch_accel_trainer_yaml"

#: The most values a YAML text's aliases (``*name``) may add once expanded. A hand-written config holds hundreds of
#: values; 600 bytes of nested aliases (a "billion laughs") hold billions, which loading would build (minutes,
#: gigabytes) before any message.
MAX_ALIAS_VALUES = 100_000


class ConfigYamlLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """PyYAML's safe loader as jsonargparse sets it up (``1e-3`` is a float, dates stay text), without YAML 1.1's
    base-60 numbers: ``max_time: 1:00:00:00`` is the text of one day, not the integer 216000 (1 * 60**3), and
    ``12:30`` stays text (YAML 1.2 dropped base-60 too). Every key is read so, since no key means base 60. A leading
    0 is decimal, as in YAML 1.2 and in a flag (``010`` is 10; octal is ``0o10``)."""


def _without_base_60() -> None:
    implicit = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp"}
    ConfigYamlLoader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in implicit]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    # YAML 1.1's int and jsonargparse's float (1e-3 without a dot), each less its base-60 form
    # (`[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+` and `[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*`); octal written as YAML
    # 1.2 writes it (`0o17`), a leading 0 decimal (see _construct_int)
    integer = r"""^(?:[-+]?0b[0-1_]+
        |[-+]?0o[0-7_]+
        |[-+]?[0-9][0-9_]*
        |[-+]?0x[0-9a-fA-F_]+)$"""
    number = r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$"""
    ConfigYamlLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(integer, re.X), list("-+0123456789"))
    ConfigYamlLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
    ConfigYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(number, re.X), list("-+0123456789."))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """An integer as YAML 1.2 and a flag read it: ``010`` is 10, not YAML 1.1's octal 8 (a file and a flag gave
    ``train.num_epochs`` 8 and 10); ``0o17``, ``0x1f`` and ``0b11`` keep their bases, ``1_000`` is 1000."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
    base = {"0b": 2, "0o": 8, "0x": 16}.get(digits[:2].lower(), 10)
    return sign * int(digits if base == 10 else digits[2:], base)


_without_base_60()


def load_yaml(text: str, path: str = "") -> Any:
    """Read YAML ``text`` (a config file, or a flag's value) as the command line does: with :class:`ConfigYamlLoader`,
    after :func:`validate_aliases`; ``path`` names the file in errors. jsonargparse reads every value with it.

    Raises:
        yaml.YAMLError: not valid YAML.
        ConfigError: aliases that expand to a huge structure, or one that contains itself.
    """
    loader = ConfigYamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        validate_aliases(node, path or f"The YAML value {text[:60]!r}")
        value = loader.construct_document(node)
    finally:
        loader.dispose()
    # as jsonargparse's own loader: text that YAML reads as keys without values (`a:`, `{a, b}`) stays text
    if isinstance(value, dict) and value and all(item is None for item in value.values()):
        keys = set(text.strip().rstrip(":").strip(" {}").replace(" ", "").split(","))
        if keys == {str(key) for key in value}:
            return text
    return value


def validate_aliases(root: yaml.Node, source: Any) -> None:
    """Refuse YAML whose aliases (``*name``, each a repeat of its anchor's whole content) expand to more than
    :data:`MAX_ALIAS_VALUES` values, or make a value that contains itself: either would be built in full by the
    parser. Each node of the composed YAML is visited once (memoized by ``id``), so the check takes no longer than
    composing did.

    Raises:
        ConfigError: naming ``source`` (a file, or the value) and the anchor's line.
    """
    sizes: dict[int, int] = {}  # by node: how many values it holds once expanded
    uses: dict[int, int] = {}  # by node: how many times the YAML refers to it
    nodes: dict[int, yaml.Node] = {}
    open_nodes: set[int] = set()  # the nodes on the current path: one met again contains itself
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = _children(node)
        if children_done:
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
            open_nodes.discard(id(node))
            continue
        if id(node) in open_nodes:
            raise ConfigError(
                f"{source}, line {node.start_mark.line + 1}: an alias refers to the value that contains it (an anchor "
                "repeated inside itself), a value without end. Write the value out instead of the alias."
            )
        uses[id(node)] = uses.get(id(node), 0) + 1
        if id(node) in sizes:
            continue  # met through another alias: counted once
        open_nodes.add(id(node))
        nodes[id(node)] = node
        stack.append((node, True))
        stack.extend((child, False) for child in children)
    added = sizes[id(root)] - len(sizes)  # what the repeats add to the values written out
    if added > MAX_ALIAS_VALUES:
        largest = max((key for key in uses if uses[key] > 1), key=lambda key: sizes[key] * uses[key])
        raise ConfigError(
            f"{source}: its aliases (*name) expand to {sizes[id(root)]:,} values (the anchor on line "
            f"{nodes[largest].start_mark.line + 1} alone, {sizes[largest]:,} values, appears {uses[largest]} times): "
            "each alias repeats its anchor's whole content, and nested ones multiply (a 'billion laughs'). Aliases "
            f"may add at most {MAX_ALIAS_VALUES:,} values to those written out: write the values out, or use fewer "
            "levels of aliases."
        )


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


class CommandLineParser(ArgumentParser):
    """jsonargparse's parser of the command line, with the parser of each subcommand by name in ``command_parsers``."""

    command_parsers: dict[str, ArgumentParser]


def create_parser() -> CommandLineParser:
    """Return the parser of the command line: one subcommand per entry of :data:`COMMANDS`, each taking every key of
    :class:`TrainingConfig` as a flag (``--train.num_epochs 5``) and ``--config`` files; ``parser.command_parsers``
    holds the parser of each subcommand."""
    set_loader(YAML_MODE, load_yaml, (yaml.YAMLError,))  # jsonargparse's registries: both calls are idempotent
    register_type(TimeBudgetText, serialize_time_budget_text)
    parser = CommandLineParser(
        prog="pytorch-accel-trainer",
        description=__doc__.splitlines()[0],
        exit_on_error=False,
        allow_abbrev=False,
        parser_mode=YAML_MODE,
    )
    subcommands = parser.add_subcommands(dest="command", required=True)
    parser.command_parsers = {}
    for command, description in COMMANDS.items():
        subparser = ArgumentParser(
            description=description, exit_on_error=False, allow_abbrev=False, parser_mode=YAML_MODE
        )
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
                help="where to write the predictions (a path or a URL): a .pt or .pth file, or a new folder written in "
                "chunks as they come (no suffix, or a trailing /)",
            )
        subcommands.add_subcommand(command, subparser, help=description)
        parser.command_parsers[command] = subparser
    return parser


def put_current_folder_on_import_path() -> None:
    """Let the config's import paths (``mydata.train_dataset``) resolve from the current folder first, as with
    ``python -m``: the command line (:func:`~pytorch_accel_trainer.cli.commands.main`) and
    :func:`~pytorch_accel_trainer.cli.tune.tune` call it before they parse a config."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


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
    _validate_seed(namespace.trainer.seed)
    if namespace.trainer.seed is not None:
        set_seed(namespace.trainer.seed)  # before the model is built: the same initial weights on every run
    try:
        instantiated = subparser.instantiate(namespace)
    except (ArgumentError, TypeError, ValueError) as error:
        raise ConfigError(f"The configuration could not be built: {error}. Fix the arguments named above.") from None
    config = TrainingConfig(**{item.name: instantiated[item.name] for item in fields(TrainingConfig)})
    hyperparameters = plain_hyperparameters(load_yaml(config_text))
    return ParsedCommand(command, namespace, config_text, config, hyperparameters)


def _validate_seed(seed: Optional[int]) -> None:
    """``trainer.seed`` in numpy's range, checked before it seeds anything (numpy's own error names no key)."""
    if seed is not None and not 0 <= seed < 2**32:
        raise ConfigError(
            f"trainer.seed is {seed}: a seed is a whole number from 0 to 2**32 - 1 (4294967295), the range numpy "
            "takes. Pass e.g. --trainer.seed 42 (or seed: 42 under trainer: in the config file), or null to leave "
            "the random generators alone."
        )


def _add_tune_arguments(subparser: ArgumentParser) -> None:
    """The options of ``tune`` besides the config (see :func:`~pytorch_accel_trainer.cli.tune.tune`)."""
    subparser.add_argument("--search", type=str, required=True, help="a YAML file of the search space")
    subparser.add_argument("--n_trials", type=int, required=True, help="the trials the study must have")
    subparser.add_argument("--metric", type=str, default="eval_loss_epoch", help="the metric reported each epoch")
    subparser.add_argument(
        "--direction",
        type=Literal["minimize", "maximize"],
        default="minimize",
        help="minimize or maximize the metric (a study keeps the direction it was created with)",
    )
    subparser.add_argument(
        "--storage",
        type=Optional[str],
        default=None,
        help="a database URL or a journal file (journal:study.log) shared by several processes; "
        "<output_dir>/study.db by default",
    )
    subparser.add_argument(
        "--study_name",
        type=str,
        default="tune",
        help="the study's name in the storage; a study belongs to one search (config, search space, metric)",
    )
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
    """Refuse a config file that cannot be read, is not valid YAML, is empty, is not a mapping of keys, holds aliases
    that expand to a huge structure (:func:`validate_aliases`), or gives a key twice in one mapping (YAML keeps the
    last silently: the first one's settings would be lost).

    Raises:
        ConfigError: naming the file, the line and the key.
    """
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} cannot be read as a config file ({error}): give a readable YAML file.") from None
    try:
        node = yaml.compose(text, Loader=ConfigYamlLoader)
    except yaml.YAMLError as error:
        raise ConfigError(describe_yaml_error(path, text, error)) from None
    except RecursionError:
        raise ConfigError(f"{path} nests its values too deeply to be read: a config nests a few levels.") from None
    if node is None:
        raise ConfigError(f"{path} is empty: a config file is a mapping of keys (`fit --print_config` prints one).")
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(
            f"{path} holds a YAML {node.tag.rsplit(':', 1)[-1]}, not a mapping of keys such as `model:` and `train:` "
            "(`pytorch-accel-trainer fit --print_config` prints a complete config to edit)."
        )
    validate_aliases(node, path)
    _refuse_duplicate_keys(path, node)


def describe_yaml_error(path: Path, text: str, error: yaml.YAMLError) -> str:
    """The parser's message, with the file, the line and the column where it stopped, and the fix."""
    mark = getattr(error, "problem_mark", None)
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
    problem = getattr(error, "problem", None) or str(error)
    context = getattr(error, "context", None)
    line = text.splitlines()[mark.line] if mark is not None and mark.line < len(text.splitlines()) else ""
    if "\t" in line[: mark.column + 1 if mark is not None else 0]:  # the parser's words do not always say "tab"
        fix = "YAML indents with spaces, never tabs: replace the tab there by spaces."
    else:
        fix = "Fix the file there (`pytorch-accel-trainer fit --print_config` prints a valid config to compare with)."
    return f"{where}: not valid YAML ({problem}{f', {context}' if context else ''}). {fix}"


def _refuse_duplicate_keys(path: Path, root: yaml.Node) -> None:
    """Each mapping's keys, each node once however many aliases repeat it (memoized by ``id``)."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, prefix = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, prefix) for item in reversed(node.value))
        if not isinstance(node, yaml.MappingNode):
            continue
        lines: dict[str, int] = {}
        values = []
        for key_node, value_node in node.value:
            key = str(key_node.value)
            if key in lines and key != "<<":
                raise ConfigError(
                    f"{path}, line {key_node.start_mark.line + 1}: the key {prefix + key!r} is given a second time "
                    f"(first on line {lines[key]}), and YAML would silently drop the first one's settings. Merge the "
                    "two into one."
                )
            lines[key] = key_node.start_mark.line + 1
            values.append((value_node, f"{prefix}{key}."))
        stack.extend(reversed(values))  # in the file's order


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
