"""Placeholders resolve by arithmetic on known values, never by eval()."""

from __future__ import annotations

import functools
import inspect

import pytest

from pytorch_accel_trainer import placeholders
from pytorch_accel_trainer.placeholders import TrainerPlaceholderValues as P
from pytorch_accel_trainer.placeholders import resolve_placeholders

VALUES = {P.NUM_EPOCHS: 3, P.NUM_UPDATE_STEPS_PER_EPOCH: 10, P.TRAIN_DATALOADER_LEN: 40, P.EVAL_DATALOADER_LEN: None}


def _factory(optimizer, *args, **kwargs):
    return optimizer, args, kwargs


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        (P.NUM_EPOCHS, 3),
        (P.NUM_EPOCHS * P.NUM_UPDATE_STEPS_PER_EPOCH, 30),
        (P.NUM_EPOCHS * 2 + 1, 7),
        (2 * P.NUM_EPOCHS, 6),
        (1 + P.NUM_UPDATE_STEPS_PER_EPOCH * P.NUM_EPOCHS - 5, 26),
        (P.TRAIN_DATALOADER_LEN // 4, 10),
    ],
)
def test_expressions_resolve_in_args_and_keywords(expression, expected):
    factory = functools.partial(_factory, expression, total=expression, fixed=5)
    resolved = resolve_placeholders(factory, VALUES)
    assert resolved("optimizer") == (expected, ("optimizer",), {"total": expected, "fixed": 5})


def test_an_unknown_value_is_a_clear_error():
    factory = functools.partial(_factory, steps=P.EVAL_DATALOADER_LEN)
    with pytest.raises(ValueError, match="EVAL_DATALOADER_LEN, whose value is unknown"):
        resolve_placeholders(factory, VALUES)


def test_plain_callables_pass_through():
    """Plain callables pass through, and the placeholder names match pytorch-accelerated's."""
    assert resolve_placeholders(_factory, VALUES) is _factory
    assert P.placeholder_set() == {
        "NUM_EPOCHS",
        "NUM_UPDATE_STEPS_PER_EPOCH",
        "PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH",
        "TRAIN_DATALOADER_LEN",
        "EVAL_DATALOADER_LEN",
    }


def test_resolution_uses_no_eval():
    assert "eval(" not in inspect.getsource(placeholders)


def test_config_text_becomes_placeholders():
    """Placeholder text of a config file becomes the same placeholders, without evaluating code."""
    import functools

    import pytest

    from pytorch_accel_trainer.placeholders import placeholder_from_text, resolve_placeholders

    values = {P.NUM_EPOCHS: 4, P.NUM_UPDATE_STEPS_PER_EPOCH: 5}
    cases = {
        "NUM_EPOCHS": 4,
        "NUM_UPDATE_STEPS_PER_EPOCH * NUM_EPOCHS + 10": 30,
        "2 * NUM_EPOCHS": 8,
        "10 - NUM_EPOCHS // 2": 8,
    }
    for text, expected in cases.items():
        assert resolve_placeholders(functools.partial(dict, x=placeholder_from_text(text)), values)() == {"x": expected}
    assert placeholder_from_text("cos") == "cos" and placeholder_from_text("a b") == "a b"  # plain strings stay
    for text in ("NUM_EPOCHS ** 2", "__import__('os') or NUM_EPOCHS", "NUM_EPOCHS.real"):
        with pytest.raises(ValueError, match="is not a placeholder expression"):
            placeholder_from_text(text)
