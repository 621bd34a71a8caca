"""docs/differences.md names only features that exist, and answers every habit of the other seed trainers.

Each backticked reference to this package on the page is resolved against the package itself: ``trainer.x.y``
on a trainer after a real run, ``Trainer(...)``, ``train(...)``, ``trainer.method(...)`` and
``SomeCallback(...)`` with the keyword arguments they are given, ``pytorch_accel_trainer.module`` paths, and the
classes, errors and event names it writes. In the section on the other seed trainers, each bullet is ``**their
habit.** our answer``: only the answer is checked (the habit names the other trainer's API), and it must name a
feature that exists here, or say "Not supported" and why. The table of other trainers' event names on
docs/callbacks.md is checked against the one the code refuses.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch
from conftest import linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer.callbacks.base import EVENTS, FASTAI_EVENT_NAMES, FOREIGN_EVENT_NAMES

ROOT = Path(__file__).resolve().parents[1]
DIFFERENCES = (ROOT / "docs" / "differences.md").read_text()
SEED_SECTION = "## Compared with the other seed trainers"
SEEDS = ("qurious", "Hezar", "mini.trainer", "Dream Trainer")

#: Where a bare class or error name is looked up.
NAMESPACES = (
    "pytorch_accel_trainer",
    "pytorch_accel_trainer.trainer",
    "pytorch_accel_trainer.callbacks",
    "pytorch_accel_trainer.errors",
    "pytorch_accel_trainer.tracking",
    "pytorch_accel_trainer.run_config",
    "pytorch_accel_trainer.loop.run_state",
    "pytorch_accel_trainer.state.checkpointing",
    "pytorch_accel_trainer.cli.config",
    "pytorch_accel_trainer.cli.run_folder",
    "pytorch_accel_trainer.schedulers",
)
#: The endings of the names of this package's classes that the page may name bare.
CLASS_SUFFIXES = ("Callback", "Error", "Result", "Options", "RunConfig", "TrainingConfig", "Weights", "Tracker")
#: Hook-like names the page may write bare (not metric names such as ``train_loss_step``): each must be a member
#: of the Trainer.
HOOK_NAME = re.compile(
    r"^(calculate_\w+|create_\w+(?<!_fn)|get_default_\w+|_create_\w+)$"
    r"|^(?!(train|eval)_\w+_step$|is_)\w+(_step|_epoch_start|_epoch_end|_run_start|_run_end)$"
)


def _resolve_name(name: str):
    if hasattr(builtins, name):
        return getattr(builtins, name)
    for namespace in NAMESPACES:
        module = importlib.import_module(namespace)
        if hasattr(module, name):
            return getattr(module, name)
    return None


def _has_attribute(target, name: str) -> bool:
    """Whether ``target`` has ``name``; for a class, also a dataclass field or an attribute its methods set."""
    if hasattr(target, name):
        return True
    if not isinstance(target, type):
        return False
    if name in getattr(target, "__dataclass_fields__", {}):
        return True
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        return False
    return re.search(rf"self\.{name}\b[^=\n]*=(?!=)", source) is not None


@pytest.fixture(scope="module")
def trained():
    """A trainer after a short real run with evaluation: its run state, run config and history exist."""
    trainer = make_trainer(make_linear())
    trainer.train(linear_dataset(16), num_epochs=1, eval_dataset=linear_dataset(8, seed=1), per_device_batch_size=4)
    return trainer


def _top_level_keywords(arguments: str) -> list:
    """The ``name=`` of a call's arguments at its top level (not those of calls or dicts inside it)."""
    keywords, depth, start = [], 0, 0
    parts = []
    for index, char in enumerate(arguments):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(arguments[start:index])
            start = index + 1
    parts.append(arguments[start:])
    for part in parts:
        match = re.match(r"\s*([A-Za-z_]\w*)\s*=(?!=)", part)
        if match:
            keywords.append(match.group(1))
    return keywords


def _call_arguments(span: str, open_index: int) -> str:
    depth = 0
    for index in range(open_index, len(span)):
        depth += span[index] == "("
        depth -= span[index] == ")"
        if depth == 0:
            return span[open_index + 1 : index]
    return span[open_index + 1 :]


def _check_keywords(function, arguments: str, span: str) -> list:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return []
    if any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters.values()):
        return []
    return [f"{span}: no parameter {name!r}" for name in _top_level_keywords(arguments) if name not in parameters]


def check_reference(span: str, trainer, checked_events: bool) -> tuple[list, bool]:
    """The problems of one backticked span, and whether it named a feature of this package."""
    span = " ".join(span.split())
    problems, named = [], False
    from pytorch_accel_trainer import Trainer

    if span.startswith("pytorch_accel_trainer."):
        path = re.match(r"[\w.]+", span).group(0)
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                target = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for part in parts[cut:]:
                if not hasattr(target, part):
                    return [f"{span}: {path} does not resolve"], True
                target = getattr(target, part)
            return [], True
        return [f"{span}: {path} does not import"], True
    chain = re.match(r"trainer\.([A-Za-z_][\w.]*)", span)
    if chain:
        target, named = trainer, True
        names = chain.group(1).split(".")
        for name in names:
            if target is None:
                break  # e.g. last_gradient_norm before clipping: the name exists, its value is unset
            if not _has_attribute(target, name):
                return [f"{span}: {type(target).__name__} has no {name!r}"], True
            target = getattr(target, name, None)
        open_index = chain.end()
        if open_index < len(span) and span[open_index] == "(" and callable(target):
            problems += _check_keywords(target, _call_arguments(span, open_index), span)
        return problems, named
    call = re.match(r"([A-Za-z_]\w*)\(", span)
    if call:
        name = call.group(1)
        function = None
        if name in ("Trainer",):
            function = Trainer
        elif hasattr(Trainer, name) and not name.startswith("__"):
            function = getattr(Trainer, name)
        elif name.endswith(CLASS_SUFFIXES) or name[:1].isupper():
            function = _resolve_name(name)
            if function is None and name.endswith(CLASS_SUFFIXES):
                return [f"{span}: no class {name!r} in this package"], True
        if function is not None:
            problems += _check_keywords(function, _call_arguments(span, call.end() - 1), span)
            return problems, True
        return [], False
    bare = re.fullmatch(r"([A-Za-z_]\w*)(\.[A-Za-z_]\w*)*(\(\))?", span)
    if bare:
        head, *attributes = span.removesuffix("()").split(".")
        if head.endswith(CLASS_SUFFIXES) and head[:1].isupper() and not head.startswith("Test"):  # not a test class
            target = _resolve_name(head)
            if target is None:
                return [f"{span}: no class {head!r} in this package"], True
            for attribute in attributes:
                if not _has_attribute(target, attribute):
                    return [f"{span}: {head} has no {attribute!r}"], True
                target = getattr(target, attribute, None)
            return [], True
        if checked_events and head.startswith("on_") and not attributes:
            known = head in EVENTS or head in FOREIGN_EVENT_NAMES
            return ([] if known else [f"{span}: not an event, nor another trainer's name for one"]), True
        if HOOK_NAME.match(head) and not head.startswith("on_") and not attributes:
            return ([] if hasattr(Trainer, head) else [f"{span}: the Trainer has no {head!r}"]), True
    return [], False


def _sections(text: str) -> list:
    """``(heading, body)`` of each ``##`` / ``###`` section of a markdown page."""
    parts = re.split(r"^(#{2,3} .+)$", text, flags=re.MULTILINE)
    return list(zip(parts[1::2], parts[2::2]))


def _bullets(body: str) -> list:
    """The text of each top-level ``- `` bullet of a section, continuation lines included."""
    return [bullet.strip() for bullet in re.split(r"^- ", body, flags=re.MULTILINE)[1:]]


def _spans(text: str) -> list:
    return re.findall(r"`([^`]+)`", text)


def _seed_bullets():
    seed_part = DIFFERENCES[DIFFERENCES.index(SEED_SECTION) :]
    for heading, body in _sections(seed_part):
        if heading.removeprefix("### ") in SEEDS:
            for bullet in _bullets(body):
                yield heading.removeprefix("### "), bullet


SEED_BULLETS = list(_seed_bullets())


def test_each_seed_trainer_has_its_section():
    """Each seed trainer has its section on docs/differences.md, with its habits."""
    assert [heading for heading, _ in _sections(DIFFERENCES) if heading.removeprefix("### ") in SEEDS] == [
        f"### {seed}" for seed in SEEDS
    ]
    counts = {seed: sum(name == seed for name, _ in SEED_BULLETS) for seed in SEEDS}
    assert all(count >= 10 for count in counts.values()), counts


@pytest.mark.parametrize(
    ("seed", "bullet"), SEED_BULLETS, ids=[f"{seed}-{index}" for index, (seed, _) in enumerate(SEED_BULLETS)]
)
def test_every_habit_is_answered(seed, bullet, trained):
    """Every habit is answered by a feature that exists, or by the reason it is not supported."""
    habit = re.match(r"\*\*(.+?)\*\*", bullet, flags=re.DOTALL)
    assert habit, f"{seed}: a bullet that does not open with the habit in bold: {bullet[:80]!r}"
    answer = " ".join(bullet[habit.end() :].split())
    problems, named = [], False
    for span in _spans(answer):
        span_problems, span_named = check_reference(span, trained, checked_events=True)
        problems += span_problems
        named = named or span_named
    assert problems == []
    assert named or "Not supported" in answer, f"{seed}: {habit.group(1)!r} names no feature and gives no reason"
    if "Not supported" in answer:
        reason = answer[answer.index("Not supported") :]
        assert re.search(r"Not supported[^.]*[:,]", reason), f"{seed}: {habit.group(1)!r}: not supported, but why?"


@pytest.mark.parametrize(
    "heading", [heading for heading, _ in _sections(DIFFERENCES[: DIFFERENCES.index(SEED_SECTION)])]
)
def test_other_sections_name_real_features(heading, trained):
    """Every section before the seed trainers' names only features that exist."""
    body = dict(_sections(DIFFERENCES))[heading]
    problems = []
    for span in _spans(body):
        problems += check_reference(span, trained, checked_events=False)[0]
    assert problems == []


def test_checks_catch_a_missing_name(trained):
    """The checks catch a name that does not exist."""
    assert check_reference("trainer.no_such_method()", trained, True)[0]
    assert check_reference("train(gradient_clip=1.0)", trained, True)[0]
    assert check_reference("Trainer(device='cuda')", trained, True)[0]
    assert check_reference("SkipNonFiniteStepsCallback(on_exhausted='raise', retries=3)", trained, True)[0]
    assert check_reference("NoSuchCallback(x=1)", trained, True)[0]
    assert check_reference("pytorch_accel_trainer.cli.nothing", trained, True)[0]
    assert check_reference("on_batch_finish", trained, True)[0]
    assert check_reference("calculate_batch_loss", trained, True)[0]
    assert check_reference("TrainResult.no_field", trained, True)[0]
    assert check_reference("trainer.load_checkpoint(path, strict=False)", trained, True) == ([], True)
    assert check_reference("TrainResult.stop_reason", trained, True) == ([], True)


def test_config_file_is_not_the_scripts_job():
    """The page does not say a config file is the script's job: the command line reads one."""
    assert "Building them from a config file is the script's job" not in DIFFERENCES
    assert "pytorch-accel-trainer fit --config" in DIFFERENCES


def _callbacks_page_table(first_column: str) -> dict:
    text = (ROOT / "docs" / "callbacks.md").read_text()
    start = text.index(f"| {first_column} |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[-1].strip("`")
    return rows


def test_callbacks_md_foreign_names_table():
    """The table of other trainers' event names on callbacks.md is the one the trainer refuses."""
    documented = _callbacks_page_table("name")
    assert set(documented) == set(FOREIGN_EVENT_NAMES)
    for name, (_, here) in FOREIGN_EVENT_NAMES.items():
        assert documented[name] == (here if here in EVENTS else here.replace("no event: ", "no event; ")), name
    assert _callbacks_page_table("fastai's name") == FASTAI_EVENT_NAMES


def test_trainer_md_train_signature():
    """The train() signature on trainer.md is the code's."""
    from pytorch_accel_trainer import Trainer

    text = (ROOT / "docs" / "trainer.md").read_text()
    block = text[text.index("trainer.train(\n") : text.index(") -> TrainResult")]
    documented = re.findall(r"^\s+(\w+)(?:=|,)", block, flags=re.MULTILINE)
    assert documented == [name for name in inspect.signature(Trainer.train).parameters if name != "self"]


def test_bad_bullet_reference_fails(trained):
    """A bad reference in a bullet fails the check."""
    bullet = "**`fit(model)`.** `trainer.fit(model)` does it."
    answer = bullet[re.match(r"\*\*(.+?)\*\*", bullet).end() :]
    assert check_reference(_spans(answer)[0], trained, True)[0]
    assert torch.is_tensor(torch.zeros(1))  # the module imports torch for the fixture's model
