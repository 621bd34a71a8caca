"""utils: ModelEma, LimitBatches, DataLoaderSlice, the process decorators, worker_init_fn and remove_padding."""

from __future__ import annotations

import json
import os
import pathlib
import random
import runpy

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from conftest import linear_dataset, make_linear, make_mlp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import LimitBatchesCallback
from pytorch_accel_trainer.utils import (
    LIMIT_BATCHES_ENV_VAR,
    DataLoaderSlice,
    LimitBatches,
    ModelEma,
    local_process_zero_first,
    local_process_zero_only,
    remove_padding,
    seed_worker,
    worker_init_fn,
    world_process_zero_only,
)

# ----------------------------------------------------------------------------------------------------
# ModelEma
# ----------------------------------------------------------------------------------------------------


def _set_weights(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)


def test_model_ema_is_the_closed_form_average():
    """ModelEma after k updates is the closed-form average."""
    model, decay, values = make_mlp(), 0.8, [1.0, -2.0, 0.5, 3.0]
    initial = {name: tensor.double().clone() for name, tensor in model.state_dict().items()}
    ema = ModelEma(model, decay=decay)
    for value in values:
        _set_weights(model, value)
        ema.update(model)
    k = len(values)
    for name, tensor in ema.module.state_dict().items():
        # decay^k * w0 + sum_i (1 - decay) * decay^(k - i) * w_i
        expected = decay**k * initial[name] + sum((1 - decay) * decay ** (k - i) * v for i, v in enumerate(values, 1))
        torch.testing.assert_close(tensor.double(), expected, rtol=1e-6, atol=1e-6)


def test_model_ema_is_a_gradient_free_copy():
    """ModelEma is a gradient-free copy in eval mode, and calls its module."""
    model = make_mlp()
    model.train()
    model(torch.randn(2, 4)).sum().backward()  # the model has gradients: the copy must not
    ema = ModelEma(model)
    assert ema.decay == 0.9999 and not ema.module.training
    assert all(not p.requires_grad and p.grad is None for p in ema.module.parameters())
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(ema.module.parameters(), model.parameters()))
    inputs = torch.randn(3, 4)
    torch.testing.assert_close(ema(inputs), model(inputs).detach())
    assert set(ema.state_dict()) == {f"module.{name}" for name in model.state_dict()}  # as pytorch-accelerated's


def test_model_ema_averages_float_buffers():
    """ModelEma averages float buffers and copies the others."""
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    ema = ModelEma(model, decay=0.5)
    model.train()
    for _ in range(3):
        model(torch.randn(8, 2))
    ema.update(model)
    assert ema.module[1].num_batches_tracked.item() == 3  # copied; averaging an int buffer would truncate it
    torch.testing.assert_close(ema.module[1].running_mean, 0.5 * model[1].running_mean)  # started at 0


def test_model_ema_follows_a_wrapped_model():
    """ModelEma follows a wrapped model by parameter name."""
    model = make_mlp()
    compiled = torch.compile(model)  # nothing is compiled until it is called: only the wrapper is tested here
    ema = ModelEma(compiled, decay=0.5)
    assert set(ema.module.state_dict()) == set(model.state_dict())  # no "_orig_mod." prefix
    _set_weights(model, 1.0)
    ema.update(nn.DataParallel(model))  # a DataParallel wrapper (on CPU it calls the module), "module." names
    expected = {name: 0.5 * value + 0.5 for name, value in ModelEma(make_mlp()).module.state_dict().items()}
    for name, value in ema.module.state_dict().items():
        torch.testing.assert_close(value, expected[name])
    with pytest.raises(
        ValueError, match=r"The model does not have the tensors of the model the EMA was made from: it lacks \['0.bias'"
    ):
        ema.update(make_linear())


class TiedWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(3, 2)
        self.output = nn.Linear(2, 3, bias=False)
        self.output.weight = self.embedding.weight


def test_model_ema_averages_a_tied_weight_once():
    model = TiedWeights()
    initial = model.embedding.weight.detach().clone()
    ema = ModelEma(model, decay=0.5)
    _set_weights(model, 2.0)
    ema.update(model)
    torch.testing.assert_close(ema.module.embedding.weight, 0.5 * initial + 1.0)
    assert ema.module.output.weight is ema.module.embedding.weight


def test_model_ema_dtype_and_replaced_tensors():
    """ModelEma casts to its own dtype, and follows tensors replaced between updates."""
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    ema = ModelEma(model, decay=0.5, device="cpu")
    initial = ema.module[0].weight.detach().double().clone()
    _set_weights(model, 1.0)
    ema.update(model)  # the pairs of tensors are kept for the next update...
    ema.module.double()  # ...but the average now lives in float64: new buffers, parameters with new data
    model.double().float()  # and the model's buffers are new tensors too
    _set_weights(model, 3.0)
    model[1].running_mean.fill_(4.0)
    ema.update(model)
    assert ema.module[0].weight.dtype == torch.float64
    torch.testing.assert_close(ema.module[0].weight, 0.25 * initial + 0.25 * 1.0 + 0.5 * 3.0)
    torch.testing.assert_close(
        ema.module[1].running_mean, torch.full((2,), 2.0, dtype=torch.float64)
    )  # 0, then 0, then 4


def test_model_ema_update_fn_and_set():
    """An overridden update_fn is used, and set copies the weights."""

    class KeepTheLargest(ModelEma):
        def update_fn(self, ema_model_weights, updated_model_weights):
            return torch.maximum(ema_model_weights, updated_model_weights)

    model = make_linear()
    ema = KeepTheLargest(model, decay=0.5)
    _set_weights(model, 100.0)
    ema.update(model)
    assert torch.all(ema.module.weight == 100.0)
    _set_weights(model, -1.0)
    ema.set(model)
    assert torch.all(ema.module.weight == -1.0)


@pytest.mark.parametrize("decay", [-0.1, 1.5, True, "0.9"])
def test_model_ema_decay_must_be_from_zero_to_one(decay):
    with pytest.raises(ValueError, match=f"decay is {decay!r}; pass a number from 0 to 1"):
        ModelEma(make_linear(), decay=decay)


# ----------------------------------------------------------------------------------------------------
# LimitBatches and DataLoaderSlice
# ----------------------------------------------------------------------------------------------------


def _has_limit(trainer: Trainer, num_batches: int) -> bool:
    return any(
        isinstance(c, LimitBatchesCallback) and c.num_batches == num_batches for c in trainer.callback_handler.callbacks
    )


def test_limit_batches_adds_the_callback(monkeypatch):
    """LimitBatches adds the callback and restores the environment."""
    monkeypatch.delenv(LIMIT_BATCHES_ENV_VAR, raising=False)
    model = make_linear()
    with LimitBatches(3) as limit:
        assert os.environ[LIMIT_BATCHES_ENV_VAR] == "3" and limit.num_batches == 3
        trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1))
        with LimitBatches(1):  # nested: the outer value comes back
            assert os.environ[LIMIT_BATCHES_ENV_VAR] == "1"
        assert os.environ[LIMIT_BATCHES_ENV_VAR] == "3"
    assert LIMIT_BATCHES_ENV_VAR not in os.environ
    assert _has_limit(trainer, 3)
    trainer.train(linear_dataset(64), num_epochs=1, per_device_batch_size=4)
    assert trainer.num_update_steps_completed == 3  # 3 of the 16 batches

    monkeypatch.setenv(LIMIT_BATCHES_ENV_VAR, "7")
    with pytest.raises(KeyError), LimitBatches(2):
        raise KeyError("an error inside the block")
    assert os.environ[LIMIT_BATCHES_ENV_VAR] == "7"  # a value set before is put back, not deleted


@pytest.mark.parametrize("num_batches", [0, -1, 2.5, True])
def test_limit_batches_needs_a_positive_int(num_batches):
    with pytest.raises(ValueError, match=f"num_batches is {num_batches!r}; pass a positive whole number"):
        LimitBatches(num_batches)


def test_dataloader_slice_first_batches():
    """A DataLoaderSlice yields its first batches and passes set_epoch through."""
    accelerator = Accelerator(cpu=True)
    dataloader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2))
    sliced = DataLoaderSlice(dataloader, 3)
    assert len(sliced) == 3 and len(DataLoaderSlice(dataloader, 50)) == 5
    assert [batch[0].tolist() for batch in sliced] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert not accelerator.gradient_state.in_dataloader  # the pass stopped early, and ended as a full one does
    sliced.set_epoch(4)
    assert dataloader.iteration == 4
    assert not hasattr(DataLoaderSlice([1, 2], 1), "set_epoch")  # only where the wrapped dataloader has it
    assert (sliced.dl, sliced.slice_size) == (dataloader, 3)
    with pytest.raises(TypeError, match="the wrapped dataloader has no __len__"):
        len(DataLoaderSlice(iter([1, 2, 3]), 2))


# ----------------------------------------------------------------------------------------------------
# Process decorators, worker seeds, padding
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("decorator", [local_process_zero_only, local_process_zero_first, world_process_zero_only])
def test_process_decorators_on_one_process(decorator):
    """The process decorators call the function once on one process."""
    calls = []

    @decorator
    def add(a, b=1):
        """Adds."""
        calls.append((a, b))
        return a + b

    assert add(2, b=3) == 5 and calls == [(2, 3)]
    assert add.__name__ == "add" and add.__doc__ == "Adds."

    @decorator
    def fails():
        raise KeyError("its own error")

    with pytest.raises(KeyError, match="its own error"):
        fails()


def test_worker_init_fn_seeds_numpy_and_random():
    """worker_init_fn is seed_worker, and seeds numpy and random from torch."""
    assert worker_init_fn is seed_worker

    def draw():
        worker_init_fn(0)
        return np.random.rand(), random.random()

    torch.manual_seed(5)
    first = draw()
    torch.manual_seed(5)
    assert draw() == first
    torch.manual_seed(6)
    assert draw() != first


@pytest.mark.parametrize(
    ("padded", "expected"),
    [
        ([0, 1, -1, 2, -1], [0, 1, 2]),
        ([[0, 1], [-1, -1], [-1, 2]], [[0, 1], [-1, 2]]),  # only rows made entirely of padding go
        ([[[0, 1], [1, 2]], [[-1, -1], [-1, -1]]], [[[0, 1], [1, 2]]]),
    ],
)
def test_remove_padding_drops_padding_rows(padded, expected):
    """remove_padding drops the rows made only of padding."""
    assert torch.equal(remove_padding(torch.tensor(padded), -1), torch.tensor(expected))


# ----------------------------------------------------------------------------------------------------
# Two processes
# ----------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("process_decorators")
def test_process_decorators_on_two_processes(two_process_scenarios):
    """On two processes the decorators order the calls, and an error on the main process hangs no one
    (tests/scripts/distributed_utils.py)."""
    folder = two_process_scenarios.folder("process_decorators")
    first, second = (json.loads((folder / f"utils.rank{rank}").read_text()) for rank in range(2))
    assert (folder / "utils.log").read_text() == "rank 0\nrank 1\n"  # local_process_zero_first: rank 0 first
    assert first["num_processes"] == 2 and first["cache"] == second["cache"] == "ready"  # each rank: its own result
    assert (first["report"], second["report"]) == ("report from rank 0", None)  # world_process_zero_only
    assert first["error"] == "ValueError: boom"  # its own error where it ran; the other rank did not wait forever
    assert second["error"].startswith(
        "RuntimeError: fails_on_the_main_process raised on the main process (ValueError: boom), so this process stops"
    )  # the others name the error, not only the function
    # ModelEma made from and updated with a DistributedDataParallel model: unwrapped names, each rank its own model
    assert first["ema_keys"] == second["ema_keys"] == ["bias", "weight"]
    assert first["initial_weight"][0] == pytest.approx(second["initial_weight"][0], abs=1e-6)  # the same model
    assert [w - v for w, v in zip(second["ema_weight"][0], first["ema_weight"][0])] == pytest.approx([0.5, 0.5])


# ----------------------------------------------------------------------------------------------------
# The documentation
# ----------------------------------------------------------------------------------------------------

DOCS_PAGE = pathlib.Path(__file__).parents[1] / "docs" / "utils.md"


@pytest.mark.parametrize("index", range(DOCS_PAGE.read_text().count("```python")))
def test_each_code_block_of_the_utils_page_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(LIMIT_BATCHES_ENV_VAR, raising=False)
    block = DOCS_PAGE.read_text().split("```python")[index + 1].split("```")[0]
    script = tmp_path / f"utils_md_block_{index}.py"
    script.write_text(block)
    runpy.run_path(str(script), run_name="docs_block")
