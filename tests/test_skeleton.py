"""The skeleton of docs/inside_the_trainer.md is the exact order in which the trainer calls its hooks and fires its
events.

The page's ```text blocks are read by the rules the page states ("How to read the skeleton"): ``# name(...)`` at the
start of a line opens a procedure; a line whose first call is a hook or an event is a step of the sequence, a call of
a procedure runs it there, any other call is a named step that adds nothing; ``for``, ``if``, ``try``/``except``,
``break`` and ``raise`` work as in Python, an ``if``/``except`` may hold its one-line body after the colon, and the
conditions are Python expressions over the few names :meth:`Expansion.value_of` knows. :func:`expected_sequence`
expands the skeleton for one run (its epochs, batches, accumulation and the stop a callback asks for) into the exact
list of hooks and events; the tests compare it with what a real run recorded: a ``Trainer`` subclass that records each
hook call and a callback that records each event, in one list. Any hook or event added, removed or moved, in the code
or on the page, fails the comparison (the last tests show that it does).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from conftest import RecordingCallback, linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import EVENTS, SaveTrainingStateCallback, StopTrainingError

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "inside_the_trainer.md"

#: Public methods of the Trainer that are not hooks of the skeleton: the entry points (the skeleton's procedures), the
#: default factories' own helpers (called by the default ``create_*_dataloader``, not by the loop), and what hooks,
#: callbacks and users call (utilities, extra models, saving and loading, preemption).
NOT_HOOKS = frozenset(
    {
        "train",
        "evaluate",
        "predict",
        "lr_find",
        "get_default_train_dl_kwargs",
        "get_default_eval_dl_kwargs",
        "print",
        "gather",
        "gather_for_metrics",
        "get_model",
        "add_model",
        "get_extra_model",
        "update_extra_model",
        "run_extra_eval_epoch",
        "save_checkpoint",
        "load_checkpoint",
        "save_weights",
        "save_training_state",
        "load_training_state",
        "enable_preemption",
        "request_preemption",
        "skip_non_finite_steps",
    }
)
#: The hooks: every other public method of the Trainer, so that a new one must be placed on the page (or listed above).
HOOKS = tuple(
    name
    for name, _ in inspect.getmembers(Trainer, inspect.isfunction)
    if not name.startswith("_") and name not in NOT_HOOKS
)
#: The most lines the skeleton may have: a skeleton, not a second copy of the loop (which grew to 175 lines). 74 for
#: training and evaluation (the update and the point between two updates are procedures of their own, as in the
#: code; the check of the first evaluation batch is a step of its own, since a user can switch it off), and the 7
#: lines of a prediction run, and the tensor-parallel plan of each of the three (a hook of its own, before preparing).
MAX_SKELETON_LINES = 84

# the runs: 3 training batches (an odd number, so the second accumulation window of 2 is partial), 2 eval batches
TRAIN_SAMPLES, EVAL_SAMPLES, BATCH_SIZE, ACCUMULATION = 6, 4, 2, 2
TRAIN_BATCHES, EVAL_BATCHES = 3, 2


# ------------------------------------------------------------------------------------------------
# Reading the skeleton
# ------------------------------------------------------------------------------------------------


class SkeletonError(ValueError):
    """The skeleton does not follow the page's rules, or names a condition this module does not know."""


@dataclass
class Node:
    code: str  # the line without its comment
    line: int  # its line number on the page, from 1
    body: list[Node] = field(default_factory=list)


def skeleton_lines(page: str) -> list[tuple[int, str]]:
    """The non-blank lines of the page's ```text blocks, with their line numbers."""
    lines, in_block = [], False
    for number, line in enumerate(page.splitlines(), start=1):
        if line.startswith("```"):
            in_block = line == "```text"
        elif in_block and line.strip():
            lines.append((number, line.rstrip()))
    return lines


def parse_skeleton(page: str) -> dict[str, list[Node]]:
    """The skeleton's procedures, by name: each the tree of its lines, nested by indentation."""
    procedures: dict[str, list[Node]] = {}
    stack: list[tuple[int, list[Node]]] = []  # (indentation, the list the lines of that indentation go to)
    for number, line in skeleton_lines(page):
        header = re.match(r"# (\w+)\(", line)
        if header:
            procedures[header.group(1)] = []
            stack = [(0, procedures[header.group(1)])]
            continue
        code = line.split("#", 1)[0].rstrip()
        if not code:
            continue  # a comment line
        if not stack:
            raise SkeletonError(f"line {number}: {code.strip()!r} comes before any '# name(...)' line")
        indent = len(code) - len(code.lstrip())
        while indent < stack[-1][0]:
            stack.pop()
        if indent != stack[-1][0]:
            raise SkeletonError(f"line {number}: {code.strip()!r} is indented by {indent}, expected {stack[-1][0]}")
        head, one_line_body = _split_one_liner(code.strip())
        node = Node(head, number)
        stack[-1][1].append(node)
        if one_line_body is not None:
            node.body.append(Node(one_line_body, number))
        elif head.endswith(":"):
            stack.append((indent + 4, node.body))
    for name, nodes in procedures.items():
        _check_blocks(name, nodes)
    return procedures


def _split_one_liner(code: str) -> tuple[str, Optional[str]]:
    """``if condition: statement`` (or ``except E: statement``) as its header and its one-line body."""
    match = re.fullmatch(r"((?:if|except) [^:]+:)\s+(\S.*)", code)
    return (match.group(1), match.group(2)) if match else (code, None)


def _check_blocks(name: str, nodes: list[Node]) -> None:
    for node in nodes:
        if node.code.endswith(":") and not node.body:
            raise SkeletonError(f"line {node.line} of {name}(): {node.code!r} opens a block with no line in it")
        _check_blocks(name, node.body)


def first_call(code: str) -> Optional[str]:
    """The name of the first call of a line, ``None`` when it calls nothing (a dotted call's last name)."""
    match = re.search(r"(\w+)\(", code)
    return match.group(1) if match else None


def named_calls(page: str) -> set[str]:
    """Every ``name(`` of the skeleton, comments included, but no method of another object (``accelerator.prepare``)."""
    return {name for _, line in skeleton_lines(page) for name in re.findall(r"(?<![\w.])(\w+)\(", line)}


# ------------------------------------------------------------------------------------------------
# Expanding the skeleton for one run
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """What the tests know of a run: enough to expand the skeleton's loops and decisions.

    Attributes:
        entry: the procedure the run calls after ``Trainer()``: ``"train"``, ``"evaluate"`` or ``"predict"``.
        epochs: the indices of the training-run epochs that run (a resumed run's start at the saved one).
        first_step: the first batch of the first of them (a state saved inside an epoch resumes at its next batch).
        stop_after: ``(event, n)``: a callback raises ``StopTrainingError`` in the n-th call of that event.
    """

    entry: str = "train"
    epochs: tuple = (0, 1)
    train_batches: int = TRAIN_BATCHES
    eval_batches: int = EVAL_BATCHES  # 0: no eval dataset
    predict_batches: int = 0
    accumulation: int = ACCUMULATION
    first_step: int = 0
    scheduler_interval: str = "step"
    stop_after: Optional[tuple] = None


class _Stop(Exception):
    """``raise StopTrainingError`` in the skeleton."""


class _Break(Exception):
    """``break`` in the skeleton."""


class _Names(Mapping):
    """The names a condition or a loop of the skeleton may use, each computed when it is read."""

    def __init__(self, value_of: Callable[[str], Any]):
        self.value_of = value_of

    def __getitem__(self, name: str) -> Any:
        return self.value_of(name)

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


class Expansion:
    """Runs the skeleton's procedures for one :class:`Run` and keeps the hooks and events they reach, in order."""

    def __init__(self, procedures: dict[str, list[Node]], run: Run):
        self.procedures, self.run = procedures, run
        self.sequence: list[str] = []
        self.bound: dict[str, Any] = {}  # the loop variables
        self.stop_requested = False

    def value_of(self, name: str) -> Any:
        """The value, in this run, of a name of the skeleton's conditions and loops."""
        run, step = self.run, self.bound.get("step")
        if name in self.bound:
            return self.bound[name]
        values: dict[str, Callable[[], Any]] = {
            "epochs": lambda: run.epochs,
            "batches": lambda: range(run.first_step if self.bound["epoch"] == run.epochs[0] else 0, run.train_batches),
            "eval_dataset": lambda: "an eval dataset" if run.eval_batches else None,
            "eval_dl": lambda: range(run.eval_batches) if run.eval_batches else None,
            "predict_dl": lambda: range(run.predict_batches),
            "scheduler_interval": lambda: run.scheduler_interval,
            "is_window_start": lambda: step % run.accumulation == 0,
            "is_update_step": lambda: (step + 1) % run.accumulation == 0 or step == run.train_batches - 1,
            "non_finite_skip": lambda: False,  # no non-finite policy in these runs
            "stop_requested": lambda: self.stop_requested,
            "reached_max_steps": lambda: lambda: False,  # no max_num_train_steps in these runs
            "epoch_cut_short": lambda: False,  # so no epoch the step limit cuts short
            "tensor_parallel": lambda: False,  # one process: no ParallelismConfig (tests/scripts/layouts_run.py)
        }
        if name not in values:
            raise KeyError(name)
        return values[name]()

    def evaluate(self, expression: str, node: Node) -> Any:
        try:
            return eval(expression, {"__builtins__": {}}, _Names(self.value_of))
        except NameError as error:
            raise SkeletonError(
                f"line {node.line}: {expression!r} uses a name this test does not know ({error}); "
                "give it its meaning in Expansion.value_of"
            ) from error

    def call(self, name: str) -> list[str]:
        self.execute(self.procedures[name])
        return self.sequence

    def execute(self, nodes: list[Node]) -> None:
        index = 0
        while index < len(nodes):
            node, index = nodes[index], index + 1
            code = node.code
            if code == "try:":
                handler = nodes[index] if index < len(nodes) else None
                if handler is None or handler.code != "except StopTrainingError:":
                    raise SkeletonError(f"line {node.line}: a try: must be followed by 'except StopTrainingError:'")
                index += 1
                try:
                    self.execute(node.body)
                except _Stop:
                    self.execute(handler.body)
            elif loop := re.fullmatch(r"for (\w+)(?:, \w+)* in (.+):", code):
                for item in self.evaluate(loop.group(2), node):
                    self.bound[loop.group(1)] = item
                    try:
                        self.execute(node.body)
                    except _Break:
                        break
            elif condition := re.fullmatch(r"if (.+):", code):
                # a condition is read only where its lines change the sequence
                if _changes_sequence(node.body, self.procedures) and self.evaluate(condition.group(1), node):
                    self.execute(node.body)
            elif code == "break":
                raise _Break
            elif code == "raise StopTrainingError":
                self.stop_requested = False
                raise _Stop
            elif code.endswith(":"):
                raise SkeletonError(f"line {node.line}: {code!r} is not a block these rules know")
            elif first_call(code) in self.procedures:
                self.execute(self.procedures[first_call(code)])
            elif first_call(code) in HOOKS or first_call(code) in EVENTS:
                self.emit(first_call(code))

    def emit(self, name: str) -> None:
        self.sequence.append(name)
        if self.run.stop_after is not None and name == self.run.stop_after[0]:
            self.stop_requested |= self.sequence.count(name) == self.run.stop_after[1]


def _changes_sequence(nodes: list[Node], procedures: dict) -> bool:
    return any(
        node.code in ("break", "raise StopTrainingError")
        or first_call(node.code) in (*HOOKS, *EVENTS, *procedures)
        or _changes_sequence(node.body, procedures)
        for node in nodes
    )


def expected_sequence(run: Run, page: Optional[str] = None) -> list[str]:
    """The hooks and events the skeleton shows for ``run``: those of ``Trainer()``, then of ``train()`` or
    ``evaluate()``."""
    procedures = parse_skeleton(PAGE.read_text() if page is None else page)
    expansion = Expansion(procedures, run)
    expansion.call("Trainer")
    return expansion.call(run.entry)


def assert_same_sequence(recorded: list[str], expected: list[str]) -> None:
    if recorded != expected:
        diff = difflib.unified_diff(
            expected, recorded, "the skeleton of docs/inside_the_trainer.md", "the trainer", lineterm=""
        )
        raise AssertionError("The trainer's hooks and events differ from the skeleton:\n" + "\n".join(diff))


# ------------------------------------------------------------------------------------------------
# Recording real runs
# ------------------------------------------------------------------------------------------------


def recording_trainer_class(log: list, base: type = Trainer) -> type:
    """A subclass of ``base`` that appends the name of each hook to ``log`` as the hook is called."""

    def recorder(name):
        def hook(self, *args, **kwargs):
            log.append(name)
            return getattr(base, name)(self, *args, **kwargs)

        hook.__name__ = hook.__qualname__ = name
        return hook

    return type("RecordingTrainer", (base,), {name: recorder(name) for name in HOOKS})


def recording_callback(log: list, stop_after: Optional[tuple] = None) -> RecordingCallback:
    """A callback that appends each event to ``log``, and raises ``StopTrainingError`` in the call ``stop_after``."""
    methods = {}
    if stop_after is not None:
        event, occurrence = stop_after
        record = getattr(RecordingCallback, event)

        def record_then_stop(self, trainer, **kwargs):
            record(self, trainer, **kwargs)
            if log.count(event) == occurrence:
                raise StopTrainingError(f"stopped in call {occurrence} of {event}")

        methods[event] = record_then_stop
    callback = type("Recorder", (RecordingCallback,), methods)()
    callback.events = log
    return callback


def recorded_trainer(log: list, stop_after: Optional[tuple] = None, base: type = Trainer) -> Trainer:
    """A real trainer of ``Linear(1, 1)`` (no default callbacks) whose hooks and events are recorded in ``log``."""
    callback = recording_callback(log, stop_after)
    return make_trainer(make_linear(), callbacks=[callback], trainer_class=recording_trainer_class(log, base))


def train_arguments(with_eval: bool = True, **changes) -> dict:
    arguments = {
        "train_dataset": linear_dataset(TRAIN_SAMPLES),
        "num_epochs": 2,
        "eval_dataset": linear_dataset(EVAL_SAMPLES, seed=1) if with_eval else None,
        "per_device_batch_size": BATCH_SIZE,
        "gradient_accumulation_steps": ACCUMULATION,
        "create_scheduler_fn": functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1),
    }
    return {**arguments, **changes}


def record_training_run(with_eval: bool = True, stop_after: Optional[tuple] = None, base=Trainer, **changes) -> list:
    log: list = []
    recorded_trainer(log, stop_after, base).train(**train_arguments(with_eval, **changes))
    return log


@pytest.fixture(scope="module")
def training_run_log() -> list:
    """The hooks and events of run (a): 2 epochs of 3 batches in windows of 2, each followed by an evaluation."""
    return record_training_run()


# ------------------------------------------------------------------------------------------------
# The page
# ------------------------------------------------------------------------------------------------


def test_skeleton_shows_every_hook_and_event():
    page = PAGE.read_text()
    calls = named_calls(page)
    assert sorted(set(HOOKS) - calls) == [], "hooks missing from the skeleton"
    assert sorted(set(EVENTS) - calls) == [], "events missing from the skeleton"
    assert {"Trainer", "train", "evaluate", "predict"} <= set(parse_skeleton(page))


def test_skeleton_names_only_defined_names():
    """The skeleton names only what the package defines."""
    source = "\n".join(path.read_text() for path in (ROOT / "pytorch_accel_trainer").rglob("*.py"))
    defined = set(re.findall(r"def (\w+)\(", source)) | set(re.findall(r"class (\w+)\b", source))
    missing = sorted(named_calls(PAGE.read_text()) - defined)
    assert not missing, f"the skeleton of docs/inside_the_trainer.md names what the package does not define: {missing}"


def test_the_skeleton_stays_a_skeleton():
    lines = skeleton_lines(PAGE.read_text())
    assert len(lines) <= MAX_SKELETON_LINES, f"the skeleton has {len(lines)} lines: move the details to the prose"
    assert max(len(line) for _, line in lines) <= 120


# ------------------------------------------------------------------------------------------------
# Real runs against the skeleton
# ------------------------------------------------------------------------------------------------


def test_a_training_run_follows_the_skeleton(training_run_log):
    """(a) 2 epochs, gradient_accumulation_steps=2 over 3 batches (a partial last window), an eval dataset."""
    expected = expected_sequence(Run())
    assert expected.count("optimizer_step") == 4  # 2 windows per epoch: the second of one batch
    assert_same_sequence(training_run_log, expected)


@pytest.mark.parametrize(("with_eval", "scheduler_interval"), [(False, "step"), (True, "epoch")])
def test_other_run_branches_follow_skeleton(with_eval, scheduler_interval):
    log = record_training_run(with_eval, scheduler_interval=scheduler_interval)
    run = Run(eval_batches=EVAL_BATCHES if with_eval else 0, scheduler_interval=scheduler_interval)
    assert_same_sequence(log, expected_sequence(run))


def test_an_evaluation_run_follows_the_skeleton():
    """(b) evaluate() over 5 samples in batches of 2: 3 batches."""
    log: list = []
    recorded_trainer(log).evaluate(linear_dataset(5), per_device_batch_size=BATCH_SIZE)
    assert_same_sequence(log, expected_sequence(Run(entry="evaluate", eval_batches=3)))


def test_a_prediction_run_follows_the_skeleton():
    """(d) predict() over 5 samples in batches of 2: 3 batches, no evaluation hook or event."""
    log: list = []
    recorded_trainer(log).predict(linear_dataset(5), per_device_batch_size=BATCH_SIZE)
    assert_same_sequence(log, expected_sequence(Run(entry="predict", predict_batches=3)))


@pytest.mark.parametrize(
    ("every", "state", "epochs", "first_step"),
    [
        ({"save_every_n_epochs": 1}, "epoch_1", (1,), 0),  # taken after epoch 1 of 2: the resumed run is epoch 2
        ({"save_every_n_steps": 1}, "step_1", (0, 1), 2),  # after the first update: from the third batch of epoch 1
    ],
)
def test_a_resumed_run_follows_the_skeleton(tmp_path, every, state, epochs, first_step):
    """(c) A SaveTrainingStateCallback writes states during a first run; a second trainer resumes from one."""
    saves = SaveTrainingStateCallback(tmp_path, save_at_end=False, save_on_signals=(), **every)
    make_trainer(make_linear(), callbacks=[saves]).train(**train_arguments())
    log: list = []
    recorded_trainer(log).train(**train_arguments(resume_from=tmp_path / state))
    assert_same_sequence(log, expected_sequence(Run(epochs=epochs, first_step=first_step)))


@pytest.mark.parametrize(
    "stop_after",
    [
        ("on_train_step_end", 1),  # held to the end of the first window, after its update
        ("on_train_epoch_end", 1),  # held to the end of the training epoch: no evaluation
        ("on_eval_epoch_end", 2),  # held to the end of the last epoch, after on_training_run_epoch_end
    ],
)
def test_stopped_run_follows_the_skeleton(stop_after):
    log = record_training_run(stop_after=stop_after)
    expected = expected_sequence(Run(stop_after=stop_after))
    assert expected.count("on_stop_training_error") == 1
    assert_same_sequence(log, expected)


def test_stopped_evaluation_follows_skeleton():
    stop_after = ("on_eval_step_start", 1)  # held to the end of the evaluation epoch
    log: list = []
    recorded_trainer(log, stop_after).evaluate(linear_dataset(5), per_device_batch_size=BATCH_SIZE)
    expected = expected_sequence(Run(entry="evaluate", eval_batches=3, stop_after=stop_after))
    assert_same_sequence(log, expected)


# ------------------------------------------------------------------------------------------------
# The comparison fails on drift, on the page or in the code
# ------------------------------------------------------------------------------------------------


def _line_index(lines: list[str], code: str) -> int:
    return next(index for index, line in enumerate(lines) if line.split("#")[0].strip() == code)


def _swap_lines(page: str, first: str, second: str) -> str:
    """The page with the skeleton lines ``first`` and ``second`` (their code, each keeping its indentation) swapped."""
    lines = page.splitlines()
    a, b = _line_index(lines, first), _line_index(lines, second)
    lines[a], lines[b] = lines[a].replace(first, second), lines[b].replace(second, first)
    return "\n".join(lines)


def _duplicate_line(page: str, code: str) -> str:
    lines = page.splitlines()
    index = _line_index(lines, code)
    return "\n".join(lines[: index + 1] + lines[index:])


def _dedent_line(page: str, code: str) -> str:
    lines = page.splitlines()
    index = _line_index(lines, code)
    lines[index] = lines[index][4:]
    return "\n".join(lines)


#: Edits of the page that the recorded training run (a) must catch.
PAGE_DRIFTS = {
    "two lines swapped": lambda page: _swap_lines(page, "optimizer_step()", "optimizer_zero_grad()"),
    "an event removed": lambda page: page.replace("on_train_epoch_end()\n", "", 1),
    "a hook added": lambda page: _duplicate_line(page, "optimizer_zero_grad()"),
    "an event out of its loop": lambda page: _dedent_line(page, "on_eval_step_end(batch, batch_output, step)"),
    "a decision changed": lambda page: page.replace("if is_update_step and not", "if is_window_start and not"),
}


@pytest.mark.parametrize("drift", PAGE_DRIFTS)
def test_drifted_page_fails_the_comparison(training_run_log, drift):
    page = PAGE.read_text()
    drifted = PAGE_DRIFTS[drift](page)
    assert drifted != page, f"the drift {drift!r} changed nothing: the page no longer has the lines it edits"
    with pytest.raises(AssertionError, match="differ from the skeleton"):
        assert_same_sequence(training_run_log, expected_sequence(Run(), drifted))


def test_drifted_trainer_fails_the_comparison():
    class ExtraHookCall(Trainer):
        def optimizer_step(self):
            super().optimizer_step()
            self.scheduler_step()  # a second scheduler step, as a change of the loop might add

    log = record_training_run(base=ExtraHookCall, with_eval=False)
    with pytest.raises(AssertionError, match=r"\+scheduler_step"):
        assert_same_sequence(log, expected_sequence(Run(eval_batches=0)))


# ------------------------------------------------------------------------------------------------
# The reader of the skeleton
# ------------------------------------------------------------------------------------------------


def test_the_reader_follows_the_rules_of_the_page():
    lines = [
        "# f(x)",
        "on_init_end()  # a comment",
        "if is_update_step: optimizer_step()",
        "for step, batch in batches:",
    ]
    page = "```text\n" + "\n".join(lines) + "\n    g()\n```\n"
    procedures = parse_skeleton(page)
    assert [node.code for node in procedures["f"]] == [
        "on_init_end()",
        "if is_update_step:",
        "for step, batch in batches:",
    ]
    assert [node.code for node in procedures["f"][1].body] == ["optimizer_step()"]
    with pytest.raises(SkeletonError, match="indented by 2"):
        parse_skeleton("```text\n# f()\nfor a in b:\n  g()\n```\n")
    with pytest.raises(SkeletonError, match="uses a name this test does not know"):
        Expansion(parse_skeleton("```text\n# f()\nif mystery: on_init_end()\n```\n"), Run()).call("f")
