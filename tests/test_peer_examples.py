"""pytorch-accelerated's core examples, vendored in tests/peer_examples/, run unchanged but for two kinds of line.

Each file there is pytorch-accelerated 0.1.61's ``examples/core/<name>.py`` with its imports renamed to
``pytorch_accel_trainer`` and MNIST taken from ``tiny_mnist`` (a local stand-in) instead of torchvision; its header
says so. The examples run with ``PT_ACC_LIMIT_BATCHES=3`` (three batches per epoch), as pytorch-accelerated suggests
for a quick check of a script.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import subprocess

import pytest
from conftest import launcher

from pytorch_accel_trainer.utils import LIMIT_BATCHES_ENV_VAR

EXAMPLES = pathlib.Path(__file__).parent / "peer_examples"
VENDORED = (
    "custom_callback_event.py",
    "train_mnist.py",
    "train_with_metrics_in_callback.py",
    "train_with_metrics_in_loop.py",
)
#: pytorch-accelerated 0.1.61's examples/core, where an unpacked sdist has them (set PEER_EXAMPLES_DIR to compare).
PEER_SOURCE = os.environ.get("PEER_EXAMPLES_DIR", "/tmp/pa-sdist/pytorch_accelerated-0.1.61/examples/core")
BATCHES = 3


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setenv(LIMIT_BATCHES_ENV_VAR, str(BATCHES))
    monkeypatch.syspath_prepend(str(EXAMPLES))  # for `from tiny_mnist import ...`, as when the script runs


def _load(name: str) -> dict:
    """The example's module namespace, without running its ``if __name__ == "__main__"`` block."""
    return runpy.run_path(str(EXAMPLES / name), run_name=f"peer_example_{pathlib.Path(name).stem}")


def _printed_metric_names(output: str) -> list:
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


def test_only_imports_and_data_differ():
    """Against the published examples when they are at hand (not in CI): every other line is the same."""
    if not os.path.isdir(PEER_SOURCE):
        pytest.skip(f"pytorch-accelerated's examples are not at {PEER_SOURCE} (set PEER_EXAMPLES_DIR)")
    for path in (EXAMPLES / name for name in VENDORED):
        ours = path.read_text().splitlines()
        ours = ours[ours.index("# ruff: noqa") + 1 :]
        theirs = pathlib.Path(PEER_SOURCE, path.name).read_text().splitlines()[1:]
        differing = [(a, b) for a, b in zip(theirs, ours) if a != b]
        assert len(ours) == len(theirs)
        for theirs_line, our_line in differing:
            assert theirs_line.replace("pytorch_accelerated", "pytorch_accel_trainer") == our_line or (
                "torchvision" in theirs_line and our_line.startswith("from tiny_mnist import ")
            ), (path.name, theirs_line, our_line)


def test_train_mnist(quick, capsys):
    _load("train_mnist.py")["main"]()
    output = capsys.readouterr().out
    assert _printed_metric_names(output) == ["train_loss_epoch", "eval_loss_epoch"] * 2 + ["evaluation_loss"]
    assert "Finished 2 epochs in " in output and "\nevaluation · " in output


@pytest.mark.parametrize("name", ["train_with_metrics_in_callback.py", "train_with_metrics_in_loop.py"])
def test_train_with_metrics(quick, capsys, name):
    _load(name)["main"]()
    printed = _printed_metric_names(capsys.readouterr().out)
    for metric in ("accuracy", "precision", "recall"):
        assert printed.count(metric) == 3  # after each of the two training epochs, and after evaluate()


def test_custom_callback_event(quick, capsys, monkeypatch):
    example = _load("custom_callback_event.py")
    verify = example["VerifyBatchCallback"].verify_train_batch
    calls = []

    def counted(self, trainer, xb, yb):
        calls.append(xb.shape)
        verify(self, trainer, xb, yb)  # asserts the batch's shape

    monkeypatch.setattr(example["VerifyBatchCallback"], "verify_train_batch", counted)
    example["main"]()
    assert len(calls) == 8 * BATCHES and set(calls) == {(32, 1, 28, 28)}  # every training batch of the 8 epochs
    assert _printed_metric_names(capsys.readouterr().out).count("eval_loss_epoch") == 8


@pytest.mark.slow
def test_custom_event_example_as_a_script():
    env = {**os.environ, LIMIT_BATCHES_ENV_VAR: "2"}
    result = subprocess.run(
        [*launcher(1), str(EXAMPLES / "custom_callback_event.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line.split(" · ")[0] for line in result.stdout.splitlines() if line.startswith("epoch ")] == [
        f"epoch {k}/8" for k in range(1, 9)
    ]
    assert "Finished 8 epochs in " in result.stdout
