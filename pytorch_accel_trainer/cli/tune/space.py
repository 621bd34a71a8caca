"""The search space: read from a YAML file (or a dict) and checked, each of its bounds and choices checked against
the config the trials run (as ``fit`` parses it, and as ``Trainer.train()`` takes the ``train.*`` keys), drawn for a
trial, and written as the trial's flags.

A space names config keys, as flags name them: ``{config key: {low, high[, log, step, type]} or {choices: [...]}}``.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import yaml

from pytorch_accel_trainer.cli.config import ConfigError
from pytorch_accel_trainer.cli.parsing import describe_yaml_error, load_yaml, parse_command
from pytorch_accel_trainer.cli.tune.folder import BASE_CONFIG_FILE
from pytorch_accel_trainer.run_config import TrainOptions
from pytorch_accel_trainer.state.storage import local_path

if TYPE_CHECKING:
    import optuna

_RANGE_KEYS = {"low", "high", "log", "step", "type"}


def load_search_space(space: Union[str, Path, Mapping]) -> dict:
    """The search space of a YAML file (or a dict), checked: ``{config key: {low, high[, log, step, type]} or
    {choices: [...]}}``.

    Raises:
        ConfigError: a key's range or choices cannot be searched; the message names the key and the fix.
    """
    if not isinstance(space, Mapping):
        path = local_path(space)  # ~ and $VARIABLES expanded
        if not path.is_file():
            raise ConfigError(f"--search {str(space)!r} is not a file: give a YAML file of the search space.")
        text = path.read_text()
        try:  # as a config file is read: never base-60, aliases bounded
            space = load_yaml(text, str(path)) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"--search: {describe_yaml_error(path, text, error)}") from None
    if not isinstance(space, Mapping) or not space:
        raise ConfigError(
            f"The search space {space!r} is empty or not a mapping: give one entry per config key, e.g. "
            "'optimizer.init_args.lr: {low: 1.0e-5, high: 0.1, log: true}'."
        )
    return {str(key): _checked_range(str(key), value) for key, value in space.items()}


def _number(key: str, name: str, value: Any) -> Union[int, float]:
    if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"search space {key}: {name}={value!r} is not a number; give e.g. {name}: 0.001.")
    return value


def _checked_range(key: str, value: Any) -> dict:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"search space {key}: {value!r} is not a range or a list of choices; give {{low: ..., high: ...}} "
            "(with log: true for a log scale, step: for a grid) or {choices: [...]}."
        )
    if "choices" in value:
        if set(value) != {"choices"} or not isinstance(value["choices"], list) or not value["choices"]:
            raise ConfigError(
                f"search space {key}: {dict(value)!r}: give choices alone, as a non-empty list, e.g. "
                "{choices: [16, 32]}."
            )
        return {"choices": list(value["choices"])}
    unknown = set(value) - _RANGE_KEYS
    if unknown or "low" not in value or "high" not in value:
        raise ConfigError(
            f"search space {key}: {dict(value)!r} needs low and high (and may have log, step, type), or choices; "
            f"{'unknown: ' + str(sorted(unknown)) if unknown else 'low or high is missing'}."
        )
    low, high = _number(key, "low", value["low"]), _number(key, "high", value["high"])
    kind = value.get("type", "int" if isinstance(low, int) and isinstance(high, int) else "float")
    if kind not in ("int", "float"):
        raise ConfigError(f"search space {key}: type={kind!r} is not valid: choose int or float.")
    log = value.get("log", False)
    if not isinstance(log, bool):  # bool("false") is True: a quoted false would search a log scale
        raise ConfigError(
            f"search space {key}: log={log!r} is not true or false: write log: true or log: false, without quotes."
        )
    if kind == "int" and not (float(low).is_integer() and float(high).is_integer()):
        raise ConfigError(
            f"search space {key}: type: int with low={low!r}, high={high!r}: the trials would draw whole numbers "
            f"between {int(low)} and {int(high)}. Give whole bounds for an int key, or leave type: int out for a "
            "float key."
        )
    if not low < high or (log and low <= 0):
        raise ConfigError(
            f"search space {key}: low={low!r}, high={high!r} is not a range{' on a log scale' if log else ''}: give "
            f"low < high{' and low > 0' if log else ''}."
        )
    checked = {"type": kind, "low": int(low) if kind == "int" else low, "high": int(high) if kind == "int" else high}
    checked["log"] = log
    if value.get("step") is not None:
        checked["step"] = _checked_step(key, kind, log, _number(key, "step", value["step"]))
    return checked


def _checked_step(key: str, kind: str, log: bool, step: Union[int, float]) -> Union[int, float]:
    """A range's grid step: positive, whole for an int range, and not on a log scale (Optuna takes neither)."""
    if log:
        raise ConfigError(
            f"search space {key}: log: true and step: {step!r} cannot be combined (Optuna draws a log scale "
            "continuously, a grid in even steps): drop step, or drop log."
        )
    if step <= 0 or (kind == "int" and not float(step).is_integer()):
        example = "1" if kind == "int" else "0.1"
        raise ConfigError(
            f"search space {key}: step={step!r} is not valid: give a positive {'whole ' if kind == 'int' else ''}"
            f"number, e.g. step: {example}."
        )
    return int(step) if kind == "int" else step


def _candidate_values(spec: dict) -> list:
    """The values of a range or choices that a check must try: every choice, or both bounds."""
    return list(spec["choices"]) if "choices" in spec else [spec["low"], spec["high"]]


def suggest_values(trial: optuna.Trial, space: dict) -> dict:
    """The trial's value of each key of ``space`` (``trial.suggest_*``)."""
    values = {}
    for key, spec in space.items():
        if "choices" in spec:
            values[key] = trial.suggest_categorical(key, spec["choices"])
        elif spec["type"] == "int":
            values[key] = trial.suggest_int(key, spec["low"], spec["high"], step=spec.get("step", 1), log=spec["log"])
        else:
            values[key] = trial.suggest_float(key, spec["low"], spec["high"], step=spec.get("step"), log=spec["log"])
    return values


def value_flags(values: Mapping) -> list:
    """``--key value`` for each config key, as the command line takes them (values written as YAML reads them)."""
    flags = []
    for key, value in values.items():
        flags += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return flags


def validated_trial_config(
    config: Union[str, Path, Mapping], config_text: str, space: dict, flags: tuple, metric: str
) -> dict:
    """:func:`_validate_trial_config` of the config file, or of a dict written to a file of its own for the parser."""
    if not isinstance(config, Mapping):
        return _validate_trial_config(Path(config), space, flags, metric)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / BASE_CONFIG_FILE
        path.write_text(config_text)
        return _validate_trial_config(path, space, flags, metric)


def _validate_trial_config(config_file: Path, space: dict, flags: tuple, metric: str) -> dict:
    """Parse the command of the trials (none runs) with each bound and choice of the space, so that a key or value
    the config does not take is one error now, not a failed trial later; return the complete config of the trials
    (``flags`` applied) as it is before the space's values."""
    command = ["fit", "--config", str(config_file), *flags]
    base = yaml.safe_load(parse_command(command, instantiate=False).config_text)
    if metric.startswith("eval") and base["data"]["eval"] is None:
        raise ConfigError(
            f"--metric {metric!r} is an evaluation metric, but the config has no data.eval, so no trial would record "
            "it: set data.eval, or give a training metric (--metric train_loss_epoch)."
        )
    candidates = {key: _candidate_values(spec) for key, spec in space.items()}
    for index in range(max(len(values) for values in candidates.values())):  # each value once, in few parses
        values = {key: options[min(index, len(options) - 1)] for key, options in candidates.items()}
        parse_command([*command, *value_flags(values)], instantiate=False)
    for key, spec in space.items():
        _validate_range_type(key, spec, _config_value(base, key))
    _validate_train_values(base["train"], candidates)
    return base


def _config_value(config: dict, key: str) -> Any:
    """The value of a dotted key in the complete config (``None`` where the config has no such key)."""
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _validate_range_type(key: str, spec: dict, config_value: Any) -> None:
    """Refuse an int range for a key whose config value is a float (``type: int``, or int bounds): every trial would
    get a whole number (a learning rate of 0 or 1)."""
    if spec.get("type") == "int" and isinstance(config_value, float):
        raise ConfigError(
            f"search space {key}: an int range (low={spec['low']}, high={spec['high']}) for a key whose config value "
            f"is a float ({config_value!r}): every trial would get a whole number. Give float bounds (low: "
            f"{float(spec['low'])}, high: {float(spec['high'])}) and no type: int."
        )


def _validate_train_values(train: dict, candidates: dict) -> None:
    """Refuse a bound or choice of a ``train.*`` key that ``Trainer.train()`` refuses (``train.num_epochs: {low: 0,
    ...}``), which would otherwise fail only the trials that draw it."""
    options = {field.name: train[field.name] for field in fields(TrainOptions) if field.name in train}
    options["collate_fn"] = None  # an import path here, which the parse has checked
    searched = {key[len("train.") :]: values for key, values in candidates.items() if key.startswith("train.")}
    searched = {name: values for name, values in searched.items() if name in options}
    first = {name: values[0] for name, values in searched.items()}
    for name, values in searched.items():
        for value in values:
            try:
                TrainOptions(**{**options, **first, name: value})
            except (ValueError, TypeError) as error:
                raise ConfigError(
                    f"search space train.{name}: {value!r} would be refused by Trainer.train(): {error} Give a range "
                    "or choices of values it takes."
                ) from None
