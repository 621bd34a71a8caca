"""ProgressBarCallback (what the bar shows, when it refreshes, and that it never syncs) and LogMetricsCallback."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
import tqdm.std
from conftest import launcher, linear_dataset, make_linear, make_trainer
from sync_counter import make_sync_counting_trainer

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer, console
from pytorch_accel_trainer.callbacks import (
    EarlyStoppingCallback,
    LogMetricsCallback,
    PrintProgressCallback,
    ProgressBarCallback,
    StepBasedEvaluationCallback,
    TrainerCallback,
)


class PostfixProbe(TrainerCallback):
    """Placed after the bar: records each batch loss and the bar's postfix after each step."""

    def __init__(self, bar: ProgressBarCallback):
        self.bar, self.losses, self.postfixes = bar, [], []

    def on_train_step_end(self, trainer, batch_output, **kwargs):
        self.losses.append(batch_output["loss"].item())
        self.postfixes.append(self._postfix())

    def on_train_epoch_end(self, trainer, **kwargs):
        self.epoch_end_postfix = self._postfix()

    def _postfix(self) -> dict:
        return dict(item.split("=") for item in self.bar.pbar.postfix.split(", ")) if self.bar.pbar.postfix else {}


def test_shows_loss_lr_and_throughput(capsys):
    """Shows the interval loss, learning rate and throughput every n steps."""
    bar = ProgressBarCallback(refresh_every_n_steps=4)
    probe = PostfixProbe(bar)
    trainer = make_trainer(make_linear(), lr=0.1, callbacks=[bar, probe])
    trainer.train(linear_dataset(64), num_epochs=1, per_device_batch_size=4)

    assert probe.postfixes[:3] == [{}, {}, {}]  # nothing before the first refresh
    for refresh_step in (3, 7, 11, 15):
        shown = probe.postfixes[refresh_step]
        interval = probe.losses[refresh_step - 3 : refresh_step + 1]
        assert shown["loss"] == f"{sum(interval) / 4:.4g}"
        assert shown["lr"] == "0.1" and float(shown["samples/s"]) > 0
    assert probe.postfixes[5] == probe.postfixes[4]  # unchanged between refreshes
    final_loss = trainer.run_history.get_latest_metric("train_loss_epoch")
    assert probe.epoch_end_postfix["loss"] == f"{final_loss:.4g}"  # the epoch's loss, once it ends


@pytest.mark.parametrize("mininterval", ["0", "60"])
def test_postfix_refreshed_when_bar_is_drawn(monkeypatch, mininterval):
    """By default the loss, learning rate and throughput are refreshed when tqdm draws the bar again (at most every
    ``mininterval`` seconds): more often, no one would see them."""

    class Bar(tqdm.std.tqdm):  # "0": drawn again at every batch; "60": never within the epoch
        def __init__(self, *args, **kwargs):
            super().__init__(*args, mininterval=float(mininterval), **kwargs)

    monkeypatch.setattr(console, "_TQDM_CLASS", Bar)
    bar = ProgressBarCallback()
    probe = PostfixProbe(bar)
    trainer = make_trainer(make_linear(), callbacks=[bar, probe])
    trainer.train(linear_dataset(45), num_epochs=1, per_device_batch_size=1)
    if mininterval == "0":
        assert all({"loss", "lr", "samples/s"} <= set(postfix) for postfix in probe.postfixes)
        assert [postfix["loss"] for postfix in probe.postfixes] == [f"{loss:.4g}" for loss in probe.losses]
    else:
        assert probe.postfixes == [{}] * 45  # not drawn again: nothing computed for it
    final_loss = trainer.run_history.get_latest_metric("train_loss_epoch")
    assert probe.epoch_end_postfix["loss"] == f"{final_loss:.4g}"  # the epoch's loss, once it ends


def test_shows_lr_of_every_param_group():
    """Shows the learning rate of every parameter group."""
    model = make_linear()
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.01}], lr=0.1)
    bar = ProgressBarCallback(refresh_every_n_steps=2)
    probe = PostfixProbe(bar)
    Trainer(model, torch.nn.MSELoss(), optimizer, callbacks=[bar, probe]).train(
        linear_dataset(8), num_epochs=1, per_device_batch_size=4
    )
    assert probe.postfixes[-1]["lr"] == "0.1,0.01"


def test_refreshing_every_step_makes_no_sync(monkeypatch):
    """Refreshing every step makes no host-device sync."""
    trainer, reads = make_sync_counting_trainer(
        monkeypatch, make_linear(), callbacks=[ProgressBarCallback(refresh_every_n_steps=1)]
    )
    trainer.train(linear_dataset(64), num_epochs=2, per_device_batch_size=4)
    assert trainer.num_update_steps_completed == 32 and reads == []


def test_intermediate_evaluation_bar(capsys):
    """An intermediate evaluation gets its own bar; the epochs' bar counts its evaluation."""
    trainer = make_trainer(
        make_linear(), callbacks=[StepBasedEvaluationCallback(3), ProgressBarCallback(refresh_every_n_steps=2)]
    )
    trainer.train(linear_dataset(32), num_epochs=1, eval_dataset=linear_dataset(8), per_device_batch_size=4)
    err = capsys.readouterr().err
    assert "epoch 1/1:   0%|          | 0/10" in err  # 8 training and 2 evaluation batches on one bar
    assert err.count("eval:   0%|          | 0/2") == 2  # the intermediate evaluations after updates 3 and 6


def test_verbose_bars_are_pytorch_accelerateds(capsys):
    trainer = make_trainer(make_linear(), callbacks=[ProgressBarCallback(verbose=True)])
    trainer.train(linear_dataset(32), num_epochs=1, eval_dataset=linear_dataset(8), per_device_batch_size=4)
    err = capsys.readouterr().err
    assert "epoch 1 train: 100%" in err and "8/8" in err and "eval: 100%" in err


def test_refresh_every_n_steps_must_be_positive():
    with pytest.raises(ValueError, match="refresh_every_n_steps is 0; pass a positive whole number of batches"):
        ProgressBarCallback(refresh_every_n_steps=0)


def _printed_metric_names(output: str) -> list:
    return [line.split(": ")[0] for line in output.splitlines() if ": " in line]


def test_verbose_log_metrics_current_run(capsys):
    """Verbose LogMetricsCallback prints only the metrics of the current run."""
    trainer = make_trainer(make_linear(), callbacks=[LogMetricsCallback(verbose=True)])
    trainer.train(linear_dataset(8), num_epochs=1, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    assert _printed_metric_names(capsys.readouterr().out) == ["train_loss_epoch", "eval_loss_epoch"]
    trainer.evaluate(linear_dataset(4), per_device_batch_size=4)
    assert _printed_metric_names(capsys.readouterr().out) == ["evaluation_loss"]  # not the training run's eval loss
    trainer.train(linear_dataset(8), num_epochs=1, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    assert _printed_metric_names(capsys.readouterr().out) == ["train_loss_epoch", "eval_loss_epoch"]


# The default console: one line per epoch --------------------------------------------------------------------------

EPOCH_LINE = re.compile(
    r"^epoch (\d+)/3 · [\d.e+-]+s · \d+ samples/s · train_loss_epoch: ([\d.e+-]+) · eval_loss_epoch: ([\d.e+-]+)$"
)


def test_default_callbacks_print_summary_lines(capsys):
    """The default callbacks print a start line, one summary line per epoch, and an end line."""
    trainer = make_trainer(make_linear(), callbacks=DEFAULT_CALLBACKS)
    trainer.train(linear_dataset(64), num_epochs=3, eval_dataset=linear_dataset(16), per_device_batch_size=8)
    model_line, *lines = capsys.readouterr().out.splitlines()
    assert model_line == "Model Linear · 2 parameters, 2 trainable · 0.000 MiB · float32 weights"
    assert lines[0] == "Training 3 epochs of 8 updates, batches of 8 (1 process, cpu)"
    epochs = [EPOCH_LINE.match(line) for line in lines[1:4]]
    assert all(epochs) and [int(match[1]) for match in epochs] == [1, 2, 3]
    history = trainer.run_history
    for match, train_loss, eval_loss in zip(
        epochs, history.get_metric_values("train_loss_epoch"), history.get_metric_values("eval_loss_epoch")
    ):
        assert (match[2], match[3]) == (f"{train_loss:.4g}", f"{eval_loss:.4g}")  # 4 significant digits
    assert re.match(r"^Finished 3 epochs in [\d.e+-]+s \(24 updates\)$", lines[4]) and len(lines) == 5


def test_end_line_gives_the_best_value(capsys):
    """The end line gives the best monitored value; an evaluation run prints one line."""
    trainer = make_trainer(
        make_linear(), callbacks=(*DEFAULT_CALLBACKS, EarlyStoppingCallback(early_stopping_patience=5))
    )
    trainer.train(linear_dataset(32), num_epochs=2, eval_dataset=linear_dataset(16), per_device_batch_size=8)
    best = min(trainer.run_history.get_metric_values("eval_loss_epoch"))
    assert capsys.readouterr().out.splitlines()[-1].endswith(f"· best eval_loss_epoch: {best:.4g}")
    trainer.evaluate(linear_dataset(16), per_device_batch_size=8)
    loss = trainer.run_history.get_latest_metric("evaluation_loss")
    assert re.fullmatch(
        rf"evaluation · [\d.e+-]+s · evaluation_loss: {re.escape(f'{loss:.4g}')}\n", capsys.readouterr().out
    )


def test_verbose_callbacks_print_peer_lines(capsys):
    """Verbose callbacks print pytorch-accelerated's lines."""
    verbose = [PrintProgressCallback(verbose=True), LogMetricsCallback(verbose=True)]
    make_trainer(make_linear(), callbacks=verbose).train(
        linear_dataset(16), num_epochs=2, eval_dataset=linear_dataset(8), per_device_batch_size=8
    )
    out = capsys.readouterr().out
    assert "Starting training run" in out and "Starting epoch 2" in out and "Finishing training run" in out
    assert _printed_metric_names(out) == ["train_loss_epoch", "eval_loss_epoch"] * 2


def test_log_metrics_override_gets_peer_calls(capsys):
    """A log_metrics override gets the same calls as in pytorch-accelerated."""

    class Collect(LogMetricsCallback):
        def __init__(self):
            super().__init__()
            self.calls = []

        def log_metrics(self, trainer, metrics):
            self.calls.append(sorted(metrics))

    collect = Collect()
    make_trainer(make_linear(), callbacks=[collect]).train(
        linear_dataset(16), num_epochs=2, eval_dataset=linear_dataset(8), per_device_batch_size=8
    )
    assert collect.calls == [["train_loss_epoch"], ["eval_loss_epoch"]] * 2
    assert all(line.startswith("epoch ") and "loss" not in line for line in capsys.readouterr().out.splitlines())


def test_outside_notebook_bar_is_text():
    """Outside a notebook, the bar is tqdm's text bar."""
    import tqdm.notebook
    import tqdm.std

    from pytorch_accel_trainer.console import progress_bar_class

    chosen = progress_bar_class()  # outside a notebook: the text bar, never the widget
    assert issubclass(chosen, tqdm.std.tqdm) and not issubclass(chosen, tqdm.notebook.tqdm_notebook)


def test_script_bar_imports_no_notebook():
    """A script pays nothing for notebooks: choosing its bar imports neither ipywidgets nor IPython (about 0.1 s
    at each run's start where they are installed, as the test extra installs them)."""
    code = (
        "import sys\n"
        "from pytorch_accel_trainer.console import progress_bar_class\n"
        "chosen = progress_bar_class()\n"
        "print(chosen.__module__, sorted(name for name in ('ipywidgets', 'IPython') if name in sys.modules))\n"
    )
    completed = subprocess.run([*launcher(1), "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.split() == ["tqdm.std", "[]"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("console_output")
def test_two_processes_print_each_line_once(one_process_scenarios, two_process_scenarios):
    """What 1 and 2 processes print while training with the default callbacks (tests/scripts/console_run.py)."""
    single, double = (
        [line for line in launch.printed("console_output").splitlines() if not line.startswith("[")]
        for launch in (one_process_scenarios, two_process_scenarios)
    )
    assert len(single) == len(double) == 5  # the model, start, 2 epochs, end
    assert (
        double[0].startswith("Model ")
        and double[1] == "Training 2 epochs of 8 updates, batches of 8 (2 processes, cpu)"
    )
    assert [line.split(" · ")[0] for line in double[2:4]] == ["epoch 1/2", "epoch 2/2"]


def test_verbose_default_callbacks_output(capsys):
    """get_default_callbacks(verbose=True) gives the earlier output."""
    from pytorch_accel_trainer.callbacks import get_default_callbacks

    trainer = make_trainer(make_linear(), callbacks=get_default_callbacks(verbose=True))
    trainer.train(linear_dataset(8), num_epochs=1, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    captured = capsys.readouterr()
    assert (
        "Starting epoch 1" in captured.out
        and "\ntrain_loss_epoch: " in captured.out
        and "epoch 1 train: 100%" in captured.err
    )


# The model summary -------------------------------------------------------------------------------------------------


def test_model_summary_counts():
    """The model summary counts parameters, trainable ones, size and precision."""
    from pytorch_accel_trainer.utils import model_summary_line, model_summary_table

    model = torch.nn.Sequential(torch.nn.Linear(100, 20), torch.nn.ReLU(), torch.nn.Linear(20, 1))
    model[0].requires_grad_(False)  # 2020 frozen parameters of 2041
    model.register_buffer("steps", torch.zeros(256, dtype=torch.float64))  # 2 KiB of buffer, counted in the size
    mebibytes = (2041 * 4 + 256 * 8) / 2**20
    assert model_summary_line(model) == (
        f"Model Sequential · 2.0 K parameters, 21 trainable · {mebibytes:.3f} MiB · float32 weights"
    )
    assert model_summary_line(model, "bf16").endswith(" · bf16 mixed precision, float32 weights")
    table = model_summary_table(model).splitlines()
    assert [line.split()[:3] for line in table] == [
        ["name", "type", "params"],
        ["0", "0", "Linear"],
        ["1", "1", "ReLU"],
        ["2", "2", "Linear"],
        ["total", "Sequential", "2.0"],
    ]
    assert table[1].split()[3:5] == ["2.0", "K"] and table[1].split()[5] == "0"  # Linear(100, 20): all frozen


def test_full_summary_table_and_none(capsys):
    """The full summary prints a table; None prints no model line."""
    full = make_trainer(make_linear(), callbacks=[PrintProgressCallback(model_summary="full")])
    full.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Model Linear · 2 parameters") and lines[1].split() == [
        "name",
        "type",
        "params",
        "trainable",
        "MiB",
    ]
    assert lines[2].split()[:2] == ["total", "Linear"] and lines[3].startswith("Training 1 epoch of")
    quiet = make_trainer(make_linear(), callbacks=[PrintProgressCallback(model_summary=None)])
    quiet.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)
    assert capsys.readouterr().out.startswith("Training 1 epoch of")
    with pytest.raises(ValueError, match="model_summary='table' is not valid"):
        PrintProgressCallback(model_summary="table")


def test_a_model_whose_parameters_cannot_be_counted_gets_no_summary():
    """A stand-in model (pytorch-accelerated's own tests use Mock models) gets no summary line instead of a
    TypeError: a summary never stops a run."""
    from unittest.mock import Mock

    trainer = make_trainer(make_linear())
    progress = PrintProgressCallback(model_summary="full")
    assert len(progress._summary(trainer)) == 2  # the line and the table
    trainer.get_model = lambda: Mock(spec=torch.nn.Module)  # its parameters() is a Mock: nothing to iterate
    assert progress._summary(trainer) == []
