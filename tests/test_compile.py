"""Trainer(torch_compile=...): the model runs compiled in training and evaluation, and nothing outside sees it.

The ``aot_eager`` backend traces the model as torch.compile does, without generating code, so it is quick and
its results equal an uncompiled run's; inductor (``torch_compile=True``) compiles C++ with gcc on the CPU, which
takes tens of seconds on a cold cache, hence ``slow``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_mlp, make_trainer
from torch._dynamo.eval_frame import OptimizedModule
from torch.utils.data import TensorDataset

from pytorch_accel_trainer.callbacks import TrainerCallback

AOT_EAGER = {"backend": "aot_eager"}


def regression_dataset(num_samples: int, seed: int = 0) -> TensorDataset:
    """y = tanh(x . w), which make_mlp() (4 -> 8 tanh -> 1) fits in a few epochs."""
    x = torch.randn(num_samples, 4, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, torch.tanh(x @ torch.tensor([[1.0], [-2.0], [0.5], [1.5]])))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no graph or recompilation count is left over from another test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class RecordModelTypes(TrainerCallback):
    """Records the type of ``trainer.model`` during every training and evaluation step."""

    def __init__(self):
        self.train_types: set = set()
        self.eval_types: set = set()

    def on_train_step_end(self, trainer, **kwargs):
        self.train_types.add(type(trainer.model))

    def on_eval_step_end(self, trainer, **kwargs):
        self.eval_types.add(type(trainer.model))


def _train(torch_compile, callbacks=(), num_epochs: int = 3):
    trainer = make_trainer(make_mlp(), lr=0.2, callbacks=callbacks, torch_compile=torch_compile)
    trainer.train(
        regression_dataset(48),
        num_epochs=num_epochs,
        eval_dataset=regression_dataset(16, seed=1),
        per_device_batch_size=8,
    )
    return trainer


def _assert_no_compile_prefix(state_dict: dict) -> None:
    assert state_dict and not [key for key in state_dict if "_orig_mod" in key]


def _assert_same_run(compiled, eager, atol: float) -> None:
    for metric in ("train_loss_epoch", "eval_loss_epoch"):
        assert compiled.run_history.get_metric_values(metric) == pytest.approx(
            eager.run_history.get_metric_values(metric), rel=1e-5, abs=atol
        )
    torch.testing.assert_close(compiled.get_model().state_dict(), eager.get_model().state_dict(), rtol=1e-5, atol=atol)


def test_compiled_run_matches_uncompiled():
    """A compiled run trains compiled, and matches an uncompiled one."""
    recorder = RecordModelTypes()
    compiled = _train(AOT_EAGER, callbacks=[recorder])
    eager = _train(False)

    assert recorder.train_types == recorder.eval_types == {OptimizedModule}  # every step ran the compiled model
    losses = compiled.run_history.get_metric_values("train_loss_epoch")
    assert losses[-1] < 0.5 * losses[0]
    _assert_same_run(compiled, eager, atol=1e-6)


@pytest.mark.slow
def test_empty_options_use_defaults():
    """An empty options dict compiles with the defaults."""
    recorder = RecordModelTypes()
    _train({}, callbacks=[recorder], num_epochs=1)  # {} is "compile, no options" (inductor), not "off"

    assert recorder.train_types == {OptimizedModule}


def test_model_uncompiled_after_training():
    """After training, the model and its state_dict are uncompiled."""
    compiled = _train(AOT_EAGER)

    assert not isinstance(compiled.model, OptimizedModule)
    assert compiled.get_model() is compiled.model
    _assert_no_compile_prefix(compiled.model.state_dict())
    _assert_no_compile_prefix(compiled.get_model().state_dict())
    assert set(compiled.model.state_dict()) == set(make_mlp().state_dict())


def test_evaluate_compiled_equals_uncompiled():
    """evaluate() runs compiled, and equals the uncompiled loss."""
    compiled, eager = _train(AOT_EAGER), _train(False)
    recorder = RecordModelTypes()
    compiled.callback_handler.add_callback(recorder)

    compiled.evaluate(regression_dataset(20, seed=2))  # 20 = 8 + 8 + 4: a short last batch, a new shape
    eager.evaluate(regression_dataset(20, seed=2))

    assert recorder.eval_types == {OptimizedModule}
    assert not isinstance(compiled.model, OptimizedModule)
    assert compiled.run_history.get_latest_metric("evaluation_loss") == pytest.approx(
        eager.run_history.get_latest_metric("evaluation_loss"), rel=1e-6
    )


class SaveCheckpointMidRun(TrainerCallback):
    """Saves a checkpoint at the end of the first epoch, while ``trainer.model`` is the compiled module."""

    def __init__(self, path):
        self.path = path
        self.model_type = None
        self.state: dict = {}

    def on_training_run_epoch_end(self, trainer, **kwargs):
        if trainer.run_history.current_epoch == 1:
            self.model_type = type(trainer.model)
            trainer.save_checkpoint(self.path)
            self.state = {name: tensor.clone() for name, tensor in trainer.get_model().state_dict().items()}


def test_compiled_run_checkpoints_load_back(tmp_path):
    """Checkpoints saved during and after a compiled run load back."""
    saver = SaveCheckpointMidRun(tmp_path / "epoch1.pt")
    trainer = _train(AOT_EAGER, callbacks=[saver])
    trainer.save_checkpoint(tmp_path / "final.pt")

    assert saver.model_type is OptimizedModule  # saved while the model was compiled
    for name in ("epoch1.pt", "final.pt"):
        _assert_no_compile_prefix(torch.load(tmp_path / name, weights_only=True)["model_state_dict"])

    fresh = make_trainer(make_mlp(seed=1), lr=0.2, torch_compile=AOT_EAGER)
    fresh.load_checkpoint(tmp_path / "epoch1.pt")
    torch.testing.assert_close(fresh.get_model().state_dict(), saver.state, rtol=0, atol=0)
    fresh.load_checkpoint(tmp_path / "final.pt")  # loads into the uncompiled model, after a run too
    torch.testing.assert_close(fresh.get_model().state_dict(), trainer.get_model().state_dict(), rtol=0, atol=0)

    fresh.train(regression_dataset(48), num_epochs=1, per_device_batch_size=8)  # and trains on from there
    _assert_no_compile_prefix(fresh.get_model().state_dict())


class SaveTrainingStateAfterFirstEpoch(TrainerCallback):
    def __init__(self, path):
        self.path = path

    def on_training_run_epoch_end(self, trainer, **kwargs):
        if trainer.run_history.current_epoch == 1:
            trainer.save_training_state(self.path)  # taken at the end of the epoch, while the model is compiled


def test_compiled_run_resumes_exactly(tmp_path):
    """A compiled run resumes from a training state exactly."""
    uninterrupted = _train(AOT_EAGER, callbacks=[SaveTrainingStateAfterFirstEpoch(tmp_path / "states")])

    resumed = make_trainer(make_mlp(seed=1), lr=0.2, torch_compile=AOT_EAGER)
    resumed.train(
        regression_dataset(48),
        num_epochs=3,
        eval_dataset=regression_dataset(16, seed=1),
        per_device_batch_size=8,
        resume_from=tmp_path / "states",
    )

    assert resumed.run_history.get_metric_values("train_loss_epoch") == (
        uninterrupted.run_history.get_metric_values("train_loss_epoch")
    )
    torch.testing.assert_close(resumed.get_model().state_dict(), uninterrupted.get_model().state_dict(), rtol=0, atol=0)


def test_second_train_compiles_again():
    """A second train() compiles again, and continues."""
    recorder = RecordModelTypes()
    trainer = _train(AOT_EAGER, callbacks=[recorder])
    first_losses = trainer.run_history.get_metric_values("train_loss_epoch")
    recorder.train_types.clear()

    trainer.train(regression_dataset(48), num_epochs=2, per_device_batch_size=8)

    assert recorder.train_types == {OptimizedModule}
    assert not isinstance(trainer.model, OptimizedModule)
    second_losses = trainer.run_history.get_metric_values("train_loss_epoch")
    assert second_losses[-1] < first_losses[0]
    _assert_no_compile_prefix(trainer.model.state_dict())


@pytest.mark.parametrize("torch_compile", ["inductor", None, 1])
def test_torch_compile_must_be_a_bool_or_a_dict(torch_compile):
    with pytest.raises(
        TypeError,
        match=rf"^torch_compile={torch_compile!r} is not valid: pass True, False, or a dict of torch.compile arguments",
    ):
        make_trainer(make_mlp(), torch_compile=torch_compile)


@pytest.mark.slow
def test_inductor_end_to_end(tmp_path):
    """Inductor trains, evaluates, saves, and trains again."""
    recorder = RecordModelTypes()
    compiled = _train(True, callbacks=[recorder])
    eager = _train(False)

    assert recorder.train_types == recorder.eval_types == {OptimizedModule}
    losses = compiled.run_history.get_metric_values("train_loss_epoch")
    assert losses[-1] < 0.5 * losses[0]
    _assert_same_run(compiled, eager, atol=1e-5)  # generated C++ may round differently from eager kernels

    compiled.evaluate(regression_dataset(16, seed=1))
    assert compiled.run_history.get_latest_metric("evaluation_loss") == pytest.approx(
        compiled.run_history.get_latest_metric("eval_loss_epoch"), rel=1e-6
    )
    compiled.save_checkpoint(tmp_path / "model.pt")
    _assert_no_compile_prefix(torch.load(tmp_path / "model.pt", weights_only=True)["model_state_dict"])

    compiled.train(regression_dataset(48), num_epochs=1, per_device_batch_size=8)
    assert not isinstance(compiled.model, OptimizedModule)
    _assert_no_compile_prefix(compiled.get_model().state_dict())
