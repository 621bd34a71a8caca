"""pytorch-accelerated's documentation snippets, vendored in tests/peer_docs/, run unchanged but for the import rename.

pytorch-accelerated 0.1.61's ``docs/*.rst`` and ``README.md`` hold 25 code blocks: 13 complete (the quickstart
script, twice, and the callbacks, trainers, scheduler factories and schedulers a reader defines and then uses) and 12
fragments. The complete ones and the 4 fragments that can be executed (the notebook launch line, shown twice, and the
two pseudocode listings of "What goes on inside the Trainer?") are vendored in tests/peer_docs/, each with
``pytorch_accelerated`` renamed to ``pytorch_accel_trainer`` and nothing else changed. :data:`BLOCKS` accounts for
every block, including the 7 shell commands and the 1 script excerpt that are not run.

Each snippet runs with :func:`exec` in a fresh namespace that starts as ``peer_docs/prelude.py``'s ``prelude()``: the
model, data, optimizer, ``trainer`` and imports the snippet takes as given. Modules not installed here (torchvision,
mlflow) are stand-ins put into ``sys.modules``, so the snippet's import lines stay as written. The two MNIST scripts
run with ``PT_ACC_LIMIT_BATCHES`` set, as pytorch-accelerated suggests for a quick check of a script.

Five snippets cannot be used unchanged with pytorch-accelerated 0.1.61 itself: two import ``Partial`` from
``functools`` (one also spells ``TrainerPlaceHolderValues``); trainer.rst's ``TrainerWithMetrics`` calls
``Accuracy(num_classes=...)``, which torchmetrics rejects since 0.11; and the two schedulers of schedulers.rst leave
out the ``state_dict``/``load_state_dict`` that its ``StatefulSchedulerBase`` declares abstract. The first three
tests check that failure, then run the snippet with only the typo corrected or with the torchmetrics API the docs
were written for; the two schedulers run as written here, whose ``StatefulSchedulerBase`` gives those methods
defaults.
"""

from __future__ import annotations

import os
import pathlib
import sys
import textwrap
from functools import partial

import pandas as pd
import pytest
import torch
from conftest import load_module_from
from torch.optim import lr_scheduler

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer, TrainerPlaceholderValues
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.schedulers.scheduler_base import SchedulerBase
from pytorch_accel_trainer.utils import LIMIT_BATCHES_ENV_VAR

SNIPPETS = pathlib.Path(__file__).parent / "peer_docs"
#: An unpacked pytorch-accelerated 0.1.61 sdist (set PEER_SDIST_DIR to compare the snippets with its docs).
PEER_SDIST = pathlib.Path(os.environ.get("PEER_SDIST_DIR", "/tmp/pa-sdist/pytorch_accelerated-0.1.61"))
HEADER_END = "# ruff: noqa"


peer_prelude = load_module_from(SNIPPETS / "prelude.py", "peer_docs_prelude")  # beside the snippets it serves

#: Every code block of the peer's docs and README, numbered in order per file: the vendored snippet, or why not.
BLOCKS = {
    ("README.md", 1): "fragment: shell, pip install",
    ("README.md", 2): "fragment: shell, pip install with extras",
    ("README.md", 3): "readme_train_mnist.py",
    ("installation.rst", 1): "fragment: shell, pip install",
    ("installation.rst", 2): "fragment: shell, pip install with extras",
    ("quickstart.rst", 1): "quickstart_train_mnist.py",
    ("quickstart.rst", 2): "fragment: shell, accelerate config",
    ("quickstart.rst", 3): "fragment: shell, accelerate launch",
    ("quickstart.rst", 4): "fragment: shell, python / torch.distributed launch",
    ("quickstart.rst", 5): "quickstart_notebook_launcher.py",
    ("quickstart.rst", 6): "fragment: the last two lines of quickstart.rst's block 1, which runs them",
    ("quickstart.rst", 7): "quickstart_notebook_launcher.py",  # the same line as block 5
    ("callbacks.rst", 1): "callbacks_classification_metrics.py",
    ("callbacks.rst", 2): "callbacks_azureml_logger.py",
    ("callbacks.rst", 3): "callbacks_save_predictions.py",
    ("callbacks.rst", 4): "callbacks_custom_event.py",
    ("trainer.rst", 1): "trainer_step_lr.py",
    ("trainer.rst", 2): "trainer_step_lr_placeholder.py",
    ("trainer.rst", 3): "trainer_cosine_scheduler.py",
    ("trainer.rst", 4): "trainer_resume_from.py",
    ("trainer.rst", 5): "trainer_with_metrics.py",
    ("trainer.rst", 6): "trainer_training_run_pseudocode.py",
    ("trainer.rst", 7): "trainer_evaluation_run_pseudocode.py",
    ("schedulers.rst", 1): "schedulers_milestone_lr.py",
    ("schedulers.rst", 2): "schedulers_step_wd.py",
}
#: The typos in the peer's docs that stop a snippet from running anywhere, and their corrections.
DOC_TYPOS = {
    "from functools import Partial": "from functools import partial",
    "TrainerPlaceHolderValues": "TrainerPlaceholderValues",
}
MNIST_BATCHES = 2


# --- reading the snippets ---------------------------------------------------------------------------------------


def snippet_text(name: str) -> str:
    """The vendored snippet, without its attribution header."""
    text = (SNIPPETS / name).read_text()
    return text[text.index(HEADER_END) + len(HEADER_END) + 1 :]


def run_snippet(name: str, namespace: dict, text: str | None = None) -> dict:
    """Execute the snippet in ``namespace`` (tracebacks name the vendored file) and return the namespace."""
    code = compile(snippet_text(name) if text is None else text, str(SNIPPETS / name), "exec")
    exec(code, namespace)  # noqa: S102  (the vendored doc snippet, the point of this module)
    return namespace


def with_doc_typos_fixed(name: str) -> str:
    text = snippet_text(name)
    for typo, correction in DOC_TYPOS.items():
        text = text.replace(typo, correction)
    return text


def rst_literal_blocks(text: str) -> list:
    """The literal blocks (``::`` at a paragraph's end) of an rst file: (first line number, dedented text)."""
    lines, blocks, index = text.splitlines(), [], 0
    while index < len(lines):
        line = lines[index]
        if not (line.rstrip().endswith("::") and not line.lstrip().startswith(".. ")):
            index += 1
            continue
        indent = len(line) - len(line.lstrip())
        start = index + 1
        while start < len(lines) and not lines[start].strip():
            start += 1
        end = start
        while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        body = "\n".join(body_line.rstrip() for body_line in lines[start:end])
        blocks.append((start + 1, textwrap.dedent(body).strip("\n")))
        index = end
    return blocks


def markdown_code_blocks(text: str) -> list:
    """The fenced code blocks of a markdown file: (first line number, text)."""
    lines, blocks, index = text.splitlines(), [], 0
    while index < len(lines):
        if lines[index].startswith("```"):
            end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
            blocks.append((index + 2, "\n".join(line.rstrip() for line in lines[index + 1 : end]).strip("\n")))
            index = end
        index += 1
    return blocks


def peer_doc_blocks() -> dict:
    """{(file name, block number): block text} over the peer's docs/*.rst and README.md."""
    blocks = {}
    for path in [*sorted((PEER_SDIST / "docs").glob("*.rst")), PEER_SDIST / "README.md"]:
        found = markdown_code_blocks(path.read_text()) if path.suffix == ".md" else rst_literal_blocks(path.read_text())
        for number, (_, text) in enumerate(found, start=1):
            blocks[(path.name, number)] = text
    return blocks


# --- helpers for the runs ---------------------------------------------------------------------------------------


class LearningRates(TrainerCallback):
    """Records the optimizer's first learning rate at the start of every training step (the rate that step uses)."""

    def __init__(self):
        self.values: list[float] = []

    def on_train_step_start(self, trainer, **kwargs):
        self.values.append(trainer.optimizer.param_groups[0]["lr"])


def eval_accuracy(model, dataset) -> float:
    images, labels = dataset.tensors
    with torch.no_grad():
        return (model(images).argmax(dim=-1) == labels).float().mean().item()


def printed_metric_names(output: str) -> list:
    """The metric names printed, in order.

    From the epoch summary lines (``epoch 2/8 · 0.1s · train_loss_epoch: 0.5 · ...``) and the evaluation line of the
    default console.
    """
    return [
        part.split(": ")[0]
        for line in output.splitlines()
        for part in line.split(" · ")
        if ": " in part and not part.startswith("best ")
    ]


@pytest.fixture
def names() -> dict:
    return peer_prelude.prelude()


@pytest.fixture
def torchvision(monkeypatch):
    for module_name, module in peer_prelude.torchvision_stand_in().items():
        monkeypatch.setitem(sys.modules, module_name, module)
    monkeypatch.setenv(LIMIT_BATCHES_ENV_VAR, str(MNIST_BATCHES))


# --- the docs themselves ----------------------------------------------------------------------------------------


def test_vendored_snippets_listed_and_attributed():
    vendored = {name for name in BLOCKS.values() if name.endswith(".py")}
    assert vendored == {path.name for path in SNIPPETS.glob("*.py")} - {"prelude.py"}
    for name in vendored:
        header = (SNIPPETS / name).read_text().split(HEADER_END)[0]
        assert header.startswith("# Copyright © 2021 Chris Hughes\n# Vendored from pytorch-accelerated 0.1.61, "), name
        assert "Apache License 2.0" in header, name


def test_every_docs_block_is_vendored():
    """Every code block is vendored unchanged or named a fragment (against the published docs, not in CI)."""
    if not PEER_SDIST.is_dir():
        pytest.skip(f"pytorch-accelerated's sdist is not unpacked at {PEER_SDIST} (set PEER_SDIST_DIR)")
    blocks = peer_doc_blocks()
    assert sorted(blocks) == sorted(BLOCKS)
    for key, name in BLOCKS.items():
        if name.endswith(".py"):
            assert snippet_text(name).rstrip("\n") == blocks[key].replace(
                "pytorch_accelerated", "pytorch_accel_trainer"
            ), key


# --- quickstart.rst and README.md ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["quickstart_train_mnist.py", "readme_train_mnist.py"])
def test_quickstart_trains_and_evaluates(names, torchvision, capsys, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MNIST(os.getcwd(), download=True): the stand-in reads and writes nothing
    run_snippet(name, names)  # __name__ == "__main__": the script's main() runs
    output = capsys.readouterr().out
    assert printed_metric_names(output) == ["train_loss_epoch", "eval_loss_epoch"] * 8 + ["evaluation_loss"]
    assert "Finished 8 epochs in " in output and "\nevaluation · " in output


def test_quickstart_under_notebook_launcher(names, torchvision, capsys):
    names["__name__"] = "quickstart"  # defines main() without calling it, as in a notebook cell
    run_snippet("quickstart_train_mnist.py", names)
    run_snippet("quickstart_notebook_launcher.py", names)  # notebook_launcher(main, num_processes=num_gpus)
    output = capsys.readouterr().out
    assert printed_metric_names(output).count("eval_loss_epoch") == 8 and "\nevaluation · " in output


# --- callbacks.rst ------------------------------------------------------------------------------------------------


def test_classification_metrics_callback(names, capsys):
    """The classification metrics callback records its metrics."""
    run_snippet("callbacks_classification_metrics.py", names)
    metrics = names["ClassificationMetricsCallback"](num_classes=peer_prelude.NUM_CLASSES)
    trainer = Trainer(names["model"], names["loss_func"], names["optimizer"], callbacks=(metrics, *DEFAULT_CALLBACKS))
    trainer.train(
        train_dataset=names["train_dataset"], eval_dataset=names["eval_dataset"], num_epochs=3, per_device_batch_size=8
    )
    for metric in ("accuracy", "precision", "recall"):
        assert len(trainer.run_history.get_metric_values(metric)) == 3
    final_accuracy = eval_accuracy(names["model"], names["eval_dataset"])
    assert trainer.run_history.get_latest_metric("accuracy").item() == pytest.approx(final_accuracy)
    assert final_accuracy > 0.9  # the classes are learnable: the metrics describe a trained model
    trainer.evaluate(dataset=names["eval_dataset"], per_device_batch_size=8)  # on_evaluation_run_start, then eval
    assert trainer.run_history.get_latest_metric("accuracy").item() == pytest.approx(final_accuracy)
    assert printed_metric_names(capsys.readouterr().out).count("accuracy") == 4  # each eval epoch, then evaluate()


@pytest.fixture
def mlflow(monkeypatch):
    stand_in = peer_prelude.mlflow_stand_in()
    monkeypatch.setitem(sys.modules, "mlflow", stand_in)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:./mlruns")
    return stand_in


def test_azureml_logger_sends_epoch_metrics(names, mlflow):
    run_snippet("callbacks_azureml_logger.py", names)
    trainer = Trainer(
        names["model"], names["loss_func"], names["optimizer"], callbacks=(names["AzureMLLoggerCallback"](),)
    )
    trainer.train(
        train_dataset=names["train_dataset"], eval_dataset=names["eval_dataset"], num_epochs=2, per_device_batch_size=8
    )
    assert mlflow.tracking_uris == ["file:./mlruns"]
    assert len(mlflow.tags) == 1 and mlflow.tags[0]["num_epochs"] == 2
    history = trainer.run_history
    train_losses, eval_losses = (
        history.get_metric_values("train_loss_epoch"),
        history.get_metric_values("eval_loss_epoch"),
    )
    assert mlflow.logged_metrics == [
        {"train_loss_epoch": train_losses[0]},
        {"eval_loss_epoch": eval_losses[0]},
        {"train_loss_epoch": train_losses[1]},
        {"eval_loss_epoch": eval_losses[1]},
    ]


def test_azureml_logger_after_evaluation(names, mlflow):
    """The AzureML logger sends every epoch's metrics after an evaluation run too."""
    run_snippet("callbacks_azureml_logger.py", names)
    trainer = Trainer(
        names["model"], names["loss_func"], names["optimizer"], callbacks=(names["AzureMLLoggerCallback"](),)
    )
    datasets = {"train_dataset": names["train_dataset"], "eval_dataset": names["eval_dataset"]}
    trainer.train(**datasets, num_epochs=2, per_device_batch_size=8)
    trainer.evaluate(dataset=names["eval_dataset"], per_device_batch_size=8)
    del mlflow.logged_metrics[:]
    trainer.train(**datasets, num_epochs=2, per_device_batch_size=8)
    assert [list(metrics) for metrics in mlflow.logged_metrics] == [["train_loss_epoch"], ["eval_loss_epoch"]] * 2


def test_save_predictions_callback(names, tmp_path, monkeypatch):
    """The save-predictions callback writes the evaluation predictions."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()  # the callback's default './outputs/valid_predictions.csv'; pandas makes no folders
    run_snippet("callbacks_save_predictions.py", names)
    trainer = Trainer(
        names["model"], names["loss_func"], names["optimizer"], callbacks=(names["SavePredictionsCallback"](),)
    )
    trainer.train(
        train_dataset=names["train_dataset"], eval_dataset=names["eval_dataset"], num_epochs=1, per_device_batch_size=8
    )
    saved = pd.read_csv(tmp_path / "outputs" / "valid_predictions.csv")
    images, labels = names["eval_dataset"].tensors
    with torch.no_grad():
        predictions = names["model"](images).argmax(dim=-1)
    assert saved["prediction"].tolist() == predictions.tolist()
    assert saved["targets"].tolist() == labels.tolist()


def test_custom_event_reaches_callback(names, monkeypatch):
    """A custom callback event reaches the callback every step."""
    run_snippet("callbacks_custom_event.py", names)
    verify = names["VerifyBatchCallback"].verify_train_batch
    shapes = []

    def counted(self, trainer, xb, yb):
        shapes.append(tuple(xb.shape))
        verify(self, trainer, xb, yb)  # the snippet's own asserts on the batch

    monkeypatch.setattr(names["VerifyBatchCallback"], "verify_train_batch", counted)
    trainer = names["TrainerWithCustomCallbackEvent"](
        names["model"], names["loss_func"], names["optimizer"], callbacks=(names["VerifyBatchCallback"](),)
    )
    trainer.train(train_dataset=names["train_dataset"], num_epochs=2, per_device_batch_size=8)
    assert shapes == [(8, 1, 28, 28)] * 16  # 64 samples in batches of 8, twice


# --- trainer.rst --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["trainer_step_lr.py", "trainer_step_lr_placeholder.py"])
def test_scheduler_snippets_fail_on_docs_typo(names, name):
    """`from functools import Partial` fails before any library code runs, under pytorch-accelerated too."""
    with pytest.raises(ImportError, match="cannot import name 'Partial' from 'functools'"):
        run_snippet(name, names)


def test_step_lr_factory_steps_every_batch(names):
    """trainer.rst: with `step_size=7`, StepLR counts batches, so the rate falls after 7 updates, not 7 epochs."""
    run_snippet("trainer_step_lr.py", names, text=with_doc_typos_fixed("trainer_step_lr.py"))
    rates = LearningRates()
    trainer = Trainer(names["model"], names["loss_func"], names["optimizer"], callbacks=(rates,))
    trainer.train(
        train_dataset=names["train_dataset"],
        num_epochs=2,
        per_device_batch_size=8,
        create_scheduler_fn=names["create_scheduler_fn"],
    )
    lr = peer_prelude.LEARNING_RATE
    assert rates.values == pytest.approx([lr] * 7 + [lr * 0.1] * 7 + [lr * 0.01] * 2)


def test_the_placeholder_step_size_counts_epochs(names):
    """`NUM_UPDATE_STEPS_PER_EPOCH * 7` resolves to 56 updates (8 per epoch): the rate falls after the 7th epoch."""
    run_snippet("trainer_step_lr_placeholder.py", names, text=with_doc_typos_fixed("trainer_step_lr_placeholder.py"))
    rates = LearningRates()
    trainer = Trainer(names["model"], names["loss_func"], names["optimizer"], callbacks=(rates,))
    trainer.train(
        train_dataset=names["train_dataset"],
        num_epochs=8,
        per_device_batch_size=8,
        create_scheduler_fn=names["create_scheduler_fn"],
    )
    assert trainer.scheduler.step_size == 56
    lr = peer_prelude.LEARNING_RATE
    assert rates.values == pytest.approx([lr] * 56 + [lr * 0.1] * 8)


def test_cosine_factory_warmup_and_cooldown(names):
    """The cosine scheduler factory warms up, anneals and cools down."""
    rates = LearningRates()
    names["trainer"] = Trainer(names["model"], names["loss_func"], names["optimizer"], callbacks=(rates,))
    run_snippet("trainer_cosine_scheduler.py", names)  # 12 epochs of 8 updates: 5 warm-up, 2 cosine, 5 cool-down
    lr, values = peer_prelude.LEARNING_RATE, rates.values
    assert len(values) == 96 and values[0] == pytest.approx(1e-6)  # warmup_starting_lr
    peak = values.index(max(values))
    assert max(values) == pytest.approx(lr, rel=0.01) and 40 <= peak <= 41
    assert values[: peak + 1] == sorted(values[: peak + 1]) and values[peak:] == sorted(values[peak:], reverse=True)
    assert values[-39:] == pytest.approx([1e-6] * 39)  # cool-down at lr_min


def test_resume_from_saved_state_finishes(names, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    names["trainer"].train(train_dataset=names["dataset"], num_epochs=2)  # "Save during training": a run to save
    capsys.readouterr()
    run_snippet("trainer_resume_from.py", names)
    assert (tmp_path / "checkpoints" / "step_5000").is_dir()
    epochs = [line.split(" · ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    assert epochs == [f"epoch {epoch}/10" for epoch in range(3, 11)]  # "resumes from the saved epoch"
    assert len(names["trainer"].run_history.get_metric_values("train_loss_epoch")) == 10  # the history is kept


def test_metrics_snippet_predates_torchmetrics(names):
    """`Accuracy(num_classes=...)` without `task`: torchmetrics rejects it, whichever trainer is used."""
    run_snippet("trainer_with_metrics.py", names)
    with pytest.raises(TypeError, match="task"):
        names["TrainerWithMetrics"](peer_prelude.NUM_CLASSES, names["model"], names["loss_func"], names["optimizer"])


def test_metrics_snippet_on_older_torchmetrics(names, monkeypatch, capsys):
    """The trainer-with-metrics snippet records its metrics with the torchmetrics it was written for."""
    monkeypatch.setitem(sys.modules, "torchmetrics", peer_prelude.torchmetrics_before_0_11())
    run_snippet("trainer_with_metrics.py", names)
    trainer = names["TrainerWithMetrics"](
        peer_prelude.NUM_CLASSES, names["model"], names["loss_func"], names["optimizer"]
    )
    trainer.train(
        train_dataset=names["train_dataset"], eval_dataset=names["eval_dataset"], num_epochs=3, per_device_batch_size=8
    )
    for metric in ("accuracy", "precision", "recall"):
        assert len(trainer.run_history.get_metric_values(metric)) == 3
    final_accuracy = eval_accuracy(names["model"], names["eval_dataset"])
    assert (
        trainer.run_history.get_latest_metric("accuracy").item() == pytest.approx(final_accuracy)
        and final_accuracy > 0.9
    )
    assert printed_metric_names(capsys.readouterr().out).count("recall") == 3


def pseudocode_calls(name: str, loops: dict) -> list:
    """The hooks and events the pseudocode calls, in order: it runs with each called name bound to a recorder.

    ``loops`` binds what the pseudocode iterates over: ``num_epochs`` and what each dataloader factory returns.
    """
    calls = []

    class Recorder(dict):
        def __missing__(self, called):
            def record(*args, **kwargs):
                calls.append(called)
                return loops.get(called, {"loss": None})

            return record

    exec(compile(snippet_text(name), str(SNIPPETS / name), "exec"), {}, Recorder(num_epochs=loops["num_epochs"]))  # noqa: S102
    return calls


def recording_trainer(names: dict, called: set, calls: list, **kwargs) -> Trainer:
    """A Trainer whose hooks and callback events named in ``called`` append their name to ``calls``."""

    def hook(name):
        def method(self, *args, **kwargs):
            calls.append(name)
            return getattr(Trainer, name)(self, *args, **kwargs)

        return method

    def event(name):
        def method(self, trainer, **kwargs):
            calls.append(name)

        return method

    hooks = {name: hook(name) for name in called if not name.startswith("on_")}
    events = {name: event(name) for name in called if name.startswith("on_")}
    trainer_class = type("RecordingTrainer", (Trainer,), hooks)
    callback = type("RecordingCallback", (TrainerCallback,), events)()
    return trainer_class(names["model"], names["loss_func"], names["optimizer"], callbacks=(callback,), **kwargs)


def test_training_run_documented_order(names):
    """A training run calls the hooks and events in the documented order."""
    expected = pseudocode_calls(
        "trainer_training_run_pseudocode.py",
        {"num_epochs": range(2), "create_train_dataloader": range(3), "create_eval_dataloader": range(2)},
    )
    calls = []
    trainer = recording_trainer(names, set(expected), calls)
    train_dataset, eval_dataset = peer_prelude.image_dataset(24, seed=1), peer_prelude.image_dataset(16, seed=2)
    scheduler_fn = partial(lr_scheduler.StepLR, step_size=1)
    trainer.train(
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        num_epochs=2,
        per_device_batch_size=8,
        create_scheduler_fn=scheduler_fn,
    )
    assert calls == expected


def test_evaluation_run_documented_order(names):
    """An evaluation run calls the hooks and events in the documented order."""
    expected = pseudocode_calls(
        "trainer_evaluation_run_pseudocode.py", {"num_epochs": None, "create_eval_dataloader": range(3)}
    )
    calls = []
    trainer = recording_trainer(names, set(expected), calls)
    trainer.evaluate(dataset=peer_prelude.image_dataset(24, seed=2), per_device_batch_size=8)
    assert calls == expected


# --- schedulers.rst -----------------------------------------------------------------------------------------------
# pytorch-accelerated's stateful schedulers count from -1: the n-th step() passes num_updates = n - 1.
# Its StatefulSchedulerBase declares state_dict and load_state_dict abstract, and the docs' two examples define
# neither, so they cannot be created as written, in pytorch-accelerated 0.1.61 too. The tests of their schedules
# complete them with SchedulerBase's pair (every attribute but the optimizer), the snippet itself unchanged.

SCHEDULER_SNIPPETS = {"schedulers_milestone_lr.py": "MilestoneLrScheduler", "schedulers_step_wd.py": "StepWdScheduler"}


def with_state_dict(scheduler_class: type) -> type:
    methods = {"state_dict": SchedulerBase.state_dict, "load_state_dict": SchedulerBase.load_state_dict}
    return type(scheduler_class.__name__, (scheduler_class,), methods)


@pytest.mark.parametrize("name", sorted(SCHEDULER_SNIPPETS))
def test_docs_schedulers_create_as_written(names, name):
    run_snippet(name, names)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, weight_decay=0.1)
    scheduler = names[SCHEDULER_SNIPPETS[name]](optimizer)
    scheduler.load_state_dict(scheduler.state_dict())


def test_milestone_scheduler_halves_rate(names):
    """The milestone scheduler halves the rate of every parameter group at each milestone."""
    run_snippet("schedulers_milestone_lr.py", names)
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in (1.0, 0.5)]
    optimizer = torch.optim.SGD(groups)
    scheduler = with_state_dict(names["MilestoneLrScheduler"])(optimizer, num_steps_per_epoch=2)  # at 4, 8, 10
    rates = []
    for _ in range(12):
        optimizer.step()
        scheduler.step()
        rates.append([group["lr"] for group in optimizer.param_groups])
    halvings = [sum(milestone <= step for milestone in (4, 8, 10)) for step in range(12)]
    assert rates == [[1.0 * 0.5**count, 0.5 * 0.5**count] for count in halvings]  # powers of 2: exact


def test_milestone_scheduler_counts_epochs(names):
    run_snippet("schedulers_milestone_lr.py", names)
    rates = LearningRates()
    trainer = Trainer(names["model"], names["loss_func"], names["optimizer"], callbacks=(rates,))
    scheduler_class = with_state_dict(names["MilestoneLrScheduler"])
    scheduler_fn = partial(scheduler_class, num_steps_per_epoch=TrainerPlaceholderValues.NUM_UPDATE_STEPS_PER_EPOCH)
    trainer.train(
        train_dataset=names["train_dataset"], num_epochs=6, per_device_batch_size=8, create_scheduler_fn=scheduler_fn
    )
    milestones = (16, 32, 40)  # epochs 2, 4 and 5 of 8 updates; step s runs after s scheduler steps (num_updates s - 1)
    expected = [peer_prelude.LEARNING_RATE * 0.5 ** sum(m <= s - 1 for m in milestones) for s in range(48)]
    assert rates.values == pytest.approx(expected)


def test_weight_decay_scheduler_grows_decay(names):
    """The weight decay scheduler grows the decay every n updates."""
    run_snippet("schedulers_step_wd.py", names)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, weight_decay=0.1)
    scheduler = with_state_dict(names["StepWdScheduler"])(optimizer, n=3, gamma=1.1)
    decays = []
    for _ in range(10):
        optimizer.step()
        scheduler.step()
        decays.append(optimizer.param_groups[0]["weight_decay"])
    assert decays == pytest.approx([0.1 * 1.1 ** (step // 3) for step in range(10)])
    assert optimizer.param_groups[0]["lr"] == 0.1  # only the scheduled field changes
