"""Export checkpoints: one portable file, atomic, loadable with weights_only=True."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from conftest import make_mlp, make_trainer, regression_dataset
from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.checkpointing import MODEL_KEY, load_checkpoint_file


def _trained_trainer(**train_kwargs):
    model = make_mlp()
    trainer = Trainer(model, torch.nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=())
    trainer.train(regression_dataset(24), num_epochs=2, per_device_batch_size=4, **train_kwargs)
    return trainer


def test_round_trip_then_evaluate_gives_the_same_loss(tmp_path):
    trainer = _trained_trainer(create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3))
    eval_data = regression_dataset(12, seed=5)
    trainer.evaluate(eval_data, per_device_batch_size=5)
    path = tmp_path / "model.pt"
    trainer.save_checkpoint(path, checkpoint_kwargs={"epoch": 2, "note": "best", "values": [1.5, torch.ones(2)]})

    fresh_model = make_mlp(seed=123)
    fresh = Trainer(fresh_model, torch.nn.MSELoss(), torch.optim.AdamW(fresh_model.parameters(), lr=0.01), callbacks=())
    with pytest.warns(UserWarning, match="holds a scheduler state, but the trainer has no scheduler yet"):
        extras = fresh.load_checkpoint(path)
    fresh.evaluate(eval_data, per_device_batch_size=5)

    assert extras["epoch"] == 2 and extras["note"] == "best" and torch.equal(extras["values"][1], torch.ones(2))
    assert MODEL_KEY not in extras
    assert fresh.run_history.get_latest_metric("evaluation_loss") == trainer.run_history.get_latest_metric("evaluation_loss")
    assert fresh.optimizer.state_dict()["state"][0]["step"] == trainer.optimizer.state_dict()["state"][0]["step"]


def test_checkpoint_loads_with_weights_only_and_keys_have_no_wrapper_prefix(tmp_path):
    trainer = _trained_trainer()
    path = tmp_path / "model.pt"
    trainer.save_checkpoint(path, save_optimizer=False)
    checkpoint = torch.load(path, weights_only=True)
    assert set(checkpoint) == {MODEL_KEY}
    assert not any(key.startswith(("module.", "_orig_mod.")) for key in checkpoint[MODEL_KEY])
    assert [name for name in os.listdir(tmp_path)] == ["model.pt"]  # no temporary file left behind


def test_scheduler_state_round_trips_once_the_trainer_has_a_scheduler(tmp_path):
    factory = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
    trainer = _trained_trainer(create_scheduler_fn=factory)
    trainer.save_checkpoint(tmp_path / "model.pt")
    other = _trained_trainer(create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=100))
    other.load_checkpoint(tmp_path / "model.pt")
    assert other.scheduler.state_dict() == trainer.scheduler.state_dict()


def test_values_that_need_pickle_are_refused_before_writing(tmp_path):
    trainer = _trained_trainer()
    with pytest.raises(TypeError, match=r"checkpoint_kwargs\['config'\]\['fn'\] is a builtin_function_or_method, which cannot be loaded back without pickle"):
        trainer.save_checkpoint(tmp_path / "model.pt", checkpoint_kwargs={"config": {"fn": print}})
    with pytest.raises(ValueError, match="uses the key 'model_state_dict'"):
        trainer.save_checkpoint(tmp_path / "model.pt", checkpoint_kwargs={"model_state_dict": {}})
    assert not (tmp_path / "model.pt").exists()


def test_a_hostile_pickle_is_never_executed(tmp_path):
    class Hostile:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    path = tmp_path / "hostile.pt"
    torch.save({MODEL_KEY: {}, "payload": Hostile()}, path)
    with pytest.raises(ValueError, match="only pickle can rebuild"):
        load_checkpoint_file(path)
    assert not (tmp_path / "pwned").exists()


def test_missing_or_foreign_files_are_clear_errors(tmp_path):
    trainer = make_trainer(make_mlp())
    with pytest.raises(FileNotFoundError, match="No checkpoint file at"):
        trainer.load_checkpoint(tmp_path / "absent.pt")
    torch.save({"weights": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a trainer checkpoint"):
        trainer.load_checkpoint(tmp_path / "other.pt")


def test_overwriting_keeps_a_complete_file(tmp_path):
    trainer = make_trainer(make_mlp())
    trainer.train(regression_dataset(8), num_epochs=1, per_device_batch_size=4)
    path = tmp_path / "model.pt"
    trainer.save_checkpoint(path, checkpoint_kwargs={"version": 1})
    trainer.save_checkpoint(path, checkpoint_kwargs={"version": 2})
    assert trainer.load_checkpoint(path)["version"] == 2


def test_a_compiled_model_trains_and_saves_without_orig_mod_keys(tmp_path):
    model = make_mlp()
    compiled = torch.compile(model, backend="eager")  # the OptimizedModule wrapper, without a C++ build
    trainer = Trainer(compiled, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=())
    trainer.train(regression_dataset(8), num_epochs=1, per_device_batch_size=4)
    assert trainer.get_model() is model and trainer.model is compiled  # the next run is compiled too
    trainer.save_checkpoint(tmp_path / "model.pt")
    keys = torch.load(tmp_path / "model.pt", weights_only=True)[MODEL_KEY]
    assert set(keys) == set(model.state_dict())


def test_weights_export_as_safetensors(tmp_path):
    from safetensors.torch import load_model

    trainer = _trained_trainer()
    trainer.save_weights(tmp_path / "weights" / "model.safetensors")
    fresh = make_mlp(seed=7)
    load_model(fresh, str(tmp_path / "weights" / "model.safetensors"))
    for a, b in zip(fresh.parameters(), trainer.get_model().parameters()):
        assert torch.equal(a, b)
