"""Placeholders for scheduler factories whose arguments are only known once training starts.

A learning-rate scheduler such as ``OneCycleLR`` needs the number of optimizer updates in the run, which
is only known after the dataloaders have been created and prepared for the current processes. Put a
:class:`TrainerPlaceholderValues` member where that number goes in a :func:`functools.partial` factory;
the trainer resolves it (with plain arithmetic, never ``eval``) right before calling the factory.
"""

from __future__ import annotations

import ast
import difflib
import enum
import functools
import operator
from typing import Any, Callable, Mapping, Optional, Union

from pytorch_accel_trainer.data import dataloader_length

_OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "//": operator.floordiv,
}


class _PlaceholderArithmetic:
    """Arithmetic shared by a placeholder and the expressions built from it."""

    def _combine(self, symbol: str, other: Any, reverse: bool = False) -> "PlaceholderExpression":
        if isinstance(other, TrainerPlaceholderValues):
            other = PlaceholderExpression(other)
        if not isinstance(other, (int, float, PlaceholderExpression)):
            return NotImplemented
        left, right = (other, self) if reverse else (self, other)
        return PlaceholderExpression(_as_expression(left), symbol, right)

    def __add__(self, other):
        return self._combine("+", other)

    def __radd__(self, other):
        return self._combine("+", other, reverse=True)

    def __sub__(self, other):
        return self._combine("-", other)

    def __rsub__(self, other):
        return self._combine("-", other, reverse=True)

    def __mul__(self, other):
        return self._combine("*", other)

    def __rmul__(self, other):
        return self._combine("*", other, reverse=True)

    def __floordiv__(self, other):
        return self._combine("//", other)

    def __rfloordiv__(self, other):
        return self._combine("//", other, reverse=True)


class _PlaceholderValuesType(enum.EnumMeta):
    """The enum's class: a misspelt member is an ``AttributeError`` that lists the members and suggests one."""

    def __getattr__(cls, name: str) -> Any:
        parent = getattr(super(), "__getattr__", None)  # EnumMeta has one before Python 3.12
        if parent is not None:
            try:
                return parent(name)
            except AttributeError:
                pass
        if name.startswith("_"):  # internals, probed by enum, copy and pickle: the plain error
            raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}", name=name, obj=cls)
        members = list(cls.__dict__.get("_member_names_", ()))
        matches = difflib.get_close_matches(name.upper(), members, n=1)  # num_epochs -> NUM_EPOCHS too
        suggestion = f" (did you mean {cls.__name__}.{matches[0]}?)" if matches else ""
        raise AttributeError(
            f"{cls.__name__} has no placeholder {name!r}{suggestion}. The placeholders are: {', '.join(members)}.",
            name=name,
            obj=cls,
        )


class TrainerPlaceholderValues(_PlaceholderArithmetic, enum.Enum, metaclass=_PlaceholderValuesType):
    """Values a scheduler factory may use before they are known.

    Example::

        from functools import partial
        from torch.optim.lr_scheduler import OneCycleLR
        from pytorch_accel_trainer import TrainerPlaceholderValues as P

        create_scheduler_fn = partial(
            OneCycleLR,
            max_lr=0.1,
            epochs=P.NUM_EPOCHS,
            steps_per_epoch=P.NUM_UPDATE_STEPS_PER_EPOCH,
        )

    Members combine with ``+``, ``-``, ``*`` and ``//`` and numbers (``P.NUM_EPOCHS * 2 + 1``).

    ``NUM_UPDATE_STEPS_PER_EPOCH`` is the number of optimizer updates each process makes in one epoch.
    Every process makes the same updates in lockstep, so this is also the number of scheduler steps per
    epoch, whatever the number of processes: ``OneCycleLR`` above spans the run exactly on 1 or 8 GPUs.
    ``PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH`` is the same value, kept for pytorch-accelerated code.
    ``TRAIN_DATALOADER_LEN`` and ``EVAL_DATALOADER_LEN`` are the number of batches per process.
    """

    NUM_EPOCHS = "num_epochs"
    NUM_UPDATE_STEPS_PER_EPOCH = "num_update_steps_per_epoch"
    PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH = "num_local_update_steps_per_epoch"
    TRAIN_DATALOADER_LEN = "train_dataloader_len"
    EVAL_DATALOADER_LEN = "eval_dataloader_len"

    @classmethod
    def placeholder_set(cls) -> set[str]:
        """Return the names of every placeholder."""
        return {member.name for member in cls}


class PlaceholderExpression(_PlaceholderArithmetic):
    """An arithmetic expression over placeholders and numbers, built by the operators above."""

    def __init__(self, left: Any, symbol: Optional[str] = None, right: Any = None):
        self.left, self.symbol, self.right = left, symbol, right

    def resolve(self, values: Mapping[TrainerPlaceholderValues, Any]) -> Any:
        """Return the value of the expression, given a value for each placeholder it uses."""
        left = _resolve_value(self.left, values)
        if self.symbol is None:
            return left
        return _OPERATORS[self.symbol](left, _resolve_value(self.right, values))

    def __repr__(self) -> str:
        if self.symbol is None:
            return repr(self.left)
        return f"({self.left!r} {self.symbol} {self.right!r})"


#: A whole number that a scheduler factory may receive as a placeholder (or an expression of placeholders), which the
#: trainer replaces with the run's value before calling it.
IntOrPlaceholder = Union[int, TrainerPlaceholderValues, PlaceholderExpression]


def _as_expression(value: Any) -> Any:
    if isinstance(value, TrainerPlaceholderValues):
        return PlaceholderExpression(value)
    return value


def _resolve_value(value: Any, values: Mapping[TrainerPlaceholderValues, Any]) -> Any:
    if isinstance(value, PlaceholderExpression):
        return value.resolve(values)
    if isinstance(value, TrainerPlaceholderValues):
        resolved = values.get(value)
        if resolved is None:
            raise ValueError(
                f"The scheduler factory uses TrainerPlaceholderValues.{value.name}, whose value is unknown in "
                "this run (the training dataset has no __len__, or there is no eval dataset). Give the dataset "
                "a __len__, or pass the number itself in the factory."
            )
        return resolved
    return value


def resolve_placeholders(factory: Callable, values: Mapping[TrainerPlaceholderValues, Any]) -> Callable:
    """Return ``factory`` with every placeholder in its partial arguments replaced by its value.

    Args:
        factory: a callable; only a :func:`functools.partial` can hold placeholders.
        values: the value of each placeholder in the current run.

    Returns:
        A new partial with resolved arguments, or ``factory`` itself when it is not a partial.
    """
    if not isinstance(factory, functools.partial):
        return factory
    args = [_resolve_value(arg, values) for arg in factory.args]
    keywords = {name: _resolve_value(arg, values) for name, arg in factory.keywords.items()}
    return functools.partial(resolve_placeholders(factory.func, values), *args, **keywords)


def replace_trainer_placeholder_values(trainer: Any, instance: Callable) -> Callable:
    """Return ``instance`` with its placeholders replaced by the values of ``trainer``'s current run.

    pytorch-accelerated's function, same arguments: ``trainer`` needs ``run_config`` and its (prepared)
    ``_train_dataloader`` / ``_eval_dataloader``. Unlike there, no string is evaluated as code, and placeholders
    in positional arguments, in nested partials and in arithmetic (``NUM_EPOCHS * 2``) are resolved too.
    """
    values = placeholder_values(trainer.run_config, trainer._train_dataloader, trainer._eval_dataloader)
    return resolve_placeholders(instance, values)


def placeholder_values(run_config: Any, train_dataloader: Any, eval_dataloader: Any) -> dict:
    """The value of each placeholder in a run with ``run_config`` and these prepared dataloaders."""
    return {
        TrainerPlaceholderValues.NUM_EPOCHS: run_config.num_epochs,
        TrainerPlaceholderValues.NUM_UPDATE_STEPS_PER_EPOCH: run_config.num_update_steps_per_epoch,
        TrainerPlaceholderValues.PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH: run_config.num_local_update_steps_per_epoch,
        TrainerPlaceholderValues.TRAIN_DATALOADER_LEN: dataloader_length(train_dataloader),
        TrainerPlaceholderValues.EVAL_DATALOADER_LEN: dataloader_length(eval_dataloader),
    }


_AST_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//"}


def _refuse_misspelt_placeholders(text: str, names: set, members: set) -> None:
    """Refuse a text whose names are almost placeholder names (``NUM_EPOCH``, ``num_epochs``): passed on as a
    string, it would fail inside the scheduler, far from the typo."""
    for name in sorted(names):
        matches = difflib.get_close_matches(name.upper(), sorted(members), n=1, cutoff=0.8)
        if matches:
            raise ValueError(
                f"{text!r} names no placeholder (did you mean {matches[0]}?). The placeholders are "
                f"{sorted(members)}, written in capitals, e.g. 'NUM_UPDATE_STEPS_PER_EPOCH * NUM_EPOCHS'."
            )


def placeholder_from_text(text: str) -> Any:
    """The placeholder (or expression) a config file writes as text: ``"NUM_EPOCHS"``,
    ``"NUM_UPDATE_STEPS_PER_EPOCH * NUM_EPOCHS + 10"``; ``text`` itself when it names no placeholder.

    Parsed as a Python expression tree and rebuilt from placeholder names, numbers and ``+ - * //`` only: nothing
    is evaluated as code.

    Raises:
        ValueError: ``text`` uses a placeholder name together with something else than these, or names none but
            is close to one (``NUM_EPOCH``, ``num_epochs``: a typo, with "did you mean").
    """
    members = TrainerPlaceholderValues.placeholder_set()
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return text
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    if not names & members:
        _refuse_misspelt_placeholders(text, names, members)
        return text  # an ordinary string argument

    def build(node: ast.AST) -> Any:
        if isinstance(node, ast.Name) and node.id in members:
            return TrainerPlaceholderValues[node.id]
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPERATORS:
            # placeholder arithmetic
            return _OPERATORS[_AST_OPERATORS[type(node.op)]](build(node.left), build(node.right))
        raise ValueError(
            f"{text!r} is not a placeholder expression: use the placeholders {sorted(members)}, numbers and + - * //, "
            "e.g. 'NUM_UPDATE_STEPS_PER_EPOCH * NUM_EPOCHS'."
        )

    return build(tree)
