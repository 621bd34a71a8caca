"""plot_run_history: an image of every metric by epoch, from a tiny real run."""

from __future__ import annotations

import sys

import pytest
from conftest import linear_dataset, make_linear, make_trainer
from PIL import Image

from pytorch_accel_trainer.plotting import plot_run_history

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def history():
    trainer = make_trainer(make_linear())
    trainer.train(linear_dataset(16), num_epochs=3, eval_dataset=linear_dataset(8, seed=1), per_device_batch_size=4)
    trainer.run_history.update_metric("per_class", [0.1, 0.2])  # not a number: left out of the plot
    return trainer.run_history


def test_png_has_one_panel_per_metric(tmp_path, history):
    """Writes a valid PNG with one panel per numeric metric."""
    path = tmp_path / "history.png"
    figure = plot_run_history(history, path)
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    with Image.open(path) as image:
        image.verify()
    panels = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["eval_loss_epoch", "train_loss_epoch"]
    epochs, losses = panels[1].lines[0].get_data()
    assert list(epochs) == [1, 2, 3] and list(losses) == history.get_metric_values("train_loss_epoch")


def test_plots_chosen_metrics_refuses_unknown(tmp_path, history):
    figure = plot_run_history(history, tmp_path / "one.svg", metric_names=["eval_loss_epoch"])
    assert [ax.get_title() for ax in figure.axes] == ["eval_loss_epoch"]
    with pytest.raises(
        ValueError,
        match=r"No metric named 'accuracy' in the run history; "
        r"the metrics recorded are \['eval_loss_epoch', 'per_class', 'train_loss_epoch'\]",
    ):
        plot_run_history(history, metric_names=["accuracy"])
    with pytest.raises(ValueError, match=r"None of the metrics \['per_class'\] holds numbers to plot"):
        plot_run_history(history, metric_names=["per_class"])


def test_without_matplotlib_names_the_extra(monkeypatch, history):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    with pytest.raises(ImportError, match=r'pip install "pytorch-accel-trainer\[plot\]"'):
        plot_run_history(history)
