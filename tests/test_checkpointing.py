"""Export checkpoints: one portable file, atomic, loadable with weights_only=True, and loadable into a model with
another head (``strict=False``) for fine-tuning."""

from __future__ import annotations

import errno
import functools
import math
import os
import re
import shutil
import signal
import subprocess
import textwrap
import warnings

import pytest
import torch
from conftest import classification_dataset, launcher, make_mlp, make_trainer, regression_dataset
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state import files
from pytorch_accel_trainer.state.checkpointing import MODEL_KEY, SkippedWeights, load_checkpoint_file


def _trained_trainer(**train_kwargs):
    model = make_mlp()
    trainer = Trainer(model, torch.nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=())
    trainer.train(regression_dataset(24), num_epochs=2, per_device_batch_size=4, **train_kwargs)
    return trainer


def test_round_trip_gives_the_same_loss(tmp_path):
    """A round trip, then evaluate, gives the same loss."""
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
    assert set(extras[MODEL_KEY]) == set(fresh.model.state_dict())  # the whole checkpoint, as pytorch-accelerated
    assert fresh.run_history.get_latest_metric("evaluation_loss") == trainer.run_history.get_latest_metric(
        "evaluation_loss"
    )
    assert fresh.optimizer.state_dict()["state"][0]["step"] == trainer.optimizer.state_dict()["state"][0]["step"]


def test_loads_weights_only_without_prefix(tmp_path):
    """A checkpoint loads with weights_only=True, and its keys have no wrapper prefix."""
    trainer = _trained_trainer()
    path = tmp_path / "model.pt"
    trainer.save_checkpoint(path, save_optimizer=False)
    checkpoint = torch.load(path, weights_only=True)
    assert set(checkpoint) == {MODEL_KEY}
    assert not any(key.startswith(("module.", "_orig_mod.")) for key in checkpoint[MODEL_KEY])
    assert [name for name in os.listdir(tmp_path)] == ["model.pt"]  # no temporary file left behind


def test_scheduler_state_round_trips(tmp_path):
    """The scheduler state round-trips once the trainer has a scheduler."""
    factory = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
    trainer = _trained_trainer(create_scheduler_fn=factory)
    trainer.save_checkpoint(tmp_path / "model.pt")
    other = _trained_trainer(create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=100))
    other.load_checkpoint(tmp_path / "model.pt")
    assert other.scheduler.state_dict() == trainer.scheduler.state_dict()


def test_pickle_values_refused_before_writing(tmp_path):
    """Values that need pickle are refused before writing."""
    trainer = _trained_trainer()
    with pytest.raises(
        TypeError,
        match=(
            r"checkpoint_kwargs\['config'\]\['fn'\] is a builtin_function_or_method, which cannot be loaded back "
            "without pickle"
        ),
    ):
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


def test_missing_or_foreign_files(tmp_path):
    """Missing or foreign files are clear errors."""
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


def test_compiled_model_saves_plain_keys(tmp_path):
    """A compiled model trains, and saves without _orig_mod keys."""
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


# ------------------------------------------------------------------------------------------------
# Temporaries of killed saves, a full disk
# ------------------------------------------------------------------------------------------------

_STOPPED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from pytorch_accel_trainer.state.checkpointing import save_checkpoint_file

    write = torch.save

    def write_then_stop(obj, handle):  # the file is written but not renamed: die, or stay alive
        write(obj, handle)
        handle.flush()
        if sys.argv[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        print("writing", flush=True)
        sys.stdin.read()  # alive until the test closes this pipe, then gone at once, the file never renamed
        os._exit(0)

    torch.save = write_then_stop
    save_checkpoint_file({"model_state_dict": {"weight": torch.ones(3)}}, sys.argv[1])
    """
)


def _temporaries(folder):
    return sorted(name for name in os.listdir(folder) if ".tmp-" in name)


def test_later_save_removes_stale_temporaries(tmp_path):
    """A later save removes the temporaries of killed saves, and never a live one's."""
    trainer = _trained_trainer()
    live = subprocess.Popen(
        [*launcher(1), "-c", _STOPPED_SAVE, str(tmp_path / "live.pt"), "live"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert live.stdout.readline().strip() == "writing"
        killed = subprocess.run(
            [*launcher(1), "-c", _STOPPED_SAVE, str(tmp_path / "killed.pt"), "kill"], capture_output=True, text=True
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        (live_temporary,) = [name for name in _temporaries(tmp_path) if name.startswith(".live.pt.tmp-")]
        assert [name for name in _temporaries(tmp_path) if name.startswith(".killed.pt.tmp-")]
        trainer.save_checkpoint(tmp_path / "model.pt")
        assert _temporaries(tmp_path) == [live_temporary]  # the killed save's is gone, the live one's is untouched
    finally:  # its launch (forked, tests/conftest.py's launcher) exits once the process is gone
        live.stdin.close()
        live.wait(timeout=60)
    trainer.save_checkpoint(tmp_path / "model.pt")
    assert _temporaries(tmp_path) == [] and sorted(os.listdir(tmp_path)) == ["model.pt"]


def test_full_disk_is_enospc_error(tmp_path, monkeypatch):
    """A full disk is an ENOSPC error naming the file, and the old file stays. The write goes to /dev/full, a real
    device that is always full, so the kernel's own ENOSPC reaches the save. (A small full filesystem cannot be mounted
    here: torch.save is redirected to the device instead.)"""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    trainer = _trained_trainer()
    path = tmp_path / "model.pt"
    trainer.save_checkpoint(path, checkpoint_kwargs={"version": 1})
    write = torch.save

    def write_to_full_device(obj, handle):
        with open("/dev/full", "wb") as full:
            write(obj, full)

    monkeypatch.setattr(torch, "save", write_to_full_device)
    with pytest.raises(
        OSError, match=rf"no space left on {re.escape(str(path))}: the checkpoint was not written"
    ) as raised:
        trainer.save_checkpoint(path, checkpoint_kwargs={"version": 2})
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert _temporaries(tmp_path) == [] and trainer.load_checkpoint(path)["version"] == 1


def test_torch_enforce_fail_becomes_enospc(tmp_path, monkeypatch):
    """torch's "enforce fail" on a full disk becomes the same ENOSPC error. torch's own writer (given a path) reports a
    full disk as "enforce fail at inline_container.cc ... unexpected pos", without an errno: the message is taken from a
    real write to /dev/full, then raised by a patched torch.save while shutil.disk_usage reports the disk full (a mock:
    no full filesystem can be made here)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with pytest.raises(RuntimeError, match="enforce fail at inline_container.cc") as real:
        torch.save({"weight": torch.zeros(100_000)}, "/dev/full")
    trainer = _trained_trainer()

    def fail(obj, handle):
        handle.write(b"partial")
        raise real.value

    monkeypatch.setattr(torch, "save", fail)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10**9, 10**9, 0))
    with pytest.raises(
        OSError, match=r"no space left on .*model\.pt: .*RuntimeError: \[enforce fail at inline_container\.cc"
    ):
        trainer.save_checkpoint(tmp_path / "model.pt")
    assert os.listdir(tmp_path) == []  # the partial temporary is removed


def test_other_write_errors_not_full_disk(tmp_path, monkeypatch):
    """Other write errors are not reported as a full disk."""
    trainer = _trained_trainer()

    def fail(obj, handle):
        raise RuntimeError("something else")

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(RuntimeError, match="^something else$"):
        trainer.save_checkpoint(tmp_path / "model.pt")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_truncated_or_empty_file(tmp_path, damage):
    """A truncated or empty file is a clear error."""
    _trained_trainer().save_checkpoint(tmp_path / "model.pt")
    data = (tmp_path / "model.pt").read_bytes()
    (tmp_path / "model.pt").write_bytes(data[: len(data) // 2] if damage == "truncated" else b"")
    with pytest.raises(
        ValueError,
        match=r"model\.pt' is not a readable checkpoint \(.*\): pass a file written by Trainer\.save_checkpoint",
    ):
        load_checkpoint_file(tmp_path / "model.pt")


@pytest.mark.parametrize("full_file", ["trainer_state.pt", "parts.pt", "__0_0.distcp"])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_full_disk_during_state_save(tmp_path, request, monkeypatch, asynchronous, full_file):
    """A full disk during a training-state save is an ENOSPC error, and the earlier states stay. The write of one of its
    files (the shared torch file, the parts file, or a sharded state's shard, written through DCP) goes to /dev/full, so
    the kernel's own ENOSPC reaches the save (synchronous, and the background writer of an asynchronous one, whose error
    the end of train() raises); the partial state folder is removed, the earlier state resumes."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    if full_file == "__0_0.distcp":
        request.getfixturevalue("sharded_layout")
    import builtins
    from pathlib import Path

    from pytorch_accel_trainer.callbacks import TrainerCallback
    from pytorch_accel_trainer.state import parts, shards, training_state

    def send_to_full_device():
        write = parts.save_tensors_file

        def save_to_full_device(obj, path):
            if path.name != full_file:
                return write(obj, path)
            with open("/dev/full", "wb") as full:
                torch.save(obj, full)

        def open_full_device(path, *args, **kwargs):  # the files DCP writes, through shards' file system
            return builtins.open("/dev/full" if Path(path).name == full_file else path, *args, **kwargs)

        monkeypatch.setattr(parts, "save_tensors_file", save_to_full_device)
        monkeypatch.setattr(shards, "open", open_full_device, raising=False)

    if asynchronous:

        class SaveInBackground(TrainerCallback):
            def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
                if num_update_steps_completed == 1:
                    trainer.save_training_state(tmp_path, name="before")
                elif num_update_steps_completed == 2:
                    send_to_full_device()
                    trainer.save_training_state(tmp_path, name="after", asynchronous=True)

        model = make_mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        trainer = Trainer(model, torch.nn.MSELoss(), optimizer, callbacks=[SaveInBackground()])
        with pytest.raises(CheckpointError, match=r"The asynchronous save of a training state failed") as failed:
            trainer.train(regression_dataset(24), num_epochs=1, per_device_batch_size=4)
        error = failed.value.__cause__
    else:
        trainer = _trained_trainer()
        trainer.save_training_state(tmp_path, name="before")
        send_to_full_device()
        with pytest.raises(OSError) as raised:
            trainer.save_training_state(tmp_path, name="after")
        error = raised.value
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC, repr(error)
    assert re.search(
        r"no space left on \S*after: the training state was not written .*the earlier states in", str(error)
    )
    monkeypatch.undo()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["before", "latest"]  # no partial folder left
    assert training_state.find_resumable_state(tmp_path).folder == tmp_path / "before"


# A checkpoint loaded into a model with another head (strict=False), as Hezar's init_weights_from ----------------------


def _cross_entropy_trainer(model, lr=0.5):
    return make_trainer(model, lr=lr, loss_func=nn.CrossEntropyLoss())


def _backbone_and_head(num_classes: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, num_classes))


def _pretrained_checkpoint(tmp_path):
    pretrained = _backbone_and_head(num_classes=10, seed=0)
    trainer = _cross_entropy_trainer(pretrained, lr=0.3)  # the file's optimizer state has lr 0.3
    trainer.train(classification_dataset(16), num_epochs=1, per_device_batch_size=8)
    path = tmp_path / "pretrained.pt"
    trainer.save_checkpoint(path)
    return path, trainer.get_model()


def test_other_head_is_refused_naming_keys(tmp_path):
    """A checkpoint into a model with another head is refused, naming the keys; nothing is loaded."""
    path, _ = _pretrained_checkpoint(tmp_path)
    model = _backbone_and_head(num_classes=3, seed=1)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    trainer = _cross_entropy_trainer(model)
    with pytest.raises(CheckpointError, match=r"2\.weight \(file \(10, 8\), model \(3, 8\)\).*strict=False"):
        trainer.load_checkpoint(path)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())  # nothing loaded


def test_new_head_loads_the_backbone(tmp_path):
    """strict=False into a model with a new head loads the backbone, says what it skipped, and trains."""
    path, pretrained = _pretrained_checkpoint(tmp_path)
    model = _backbone_and_head(num_classes=3, seed=1)
    head_before = model[2].weight.clone()
    trainer = _cross_entropy_trainer(model)
    with pytest.warns(UserWarning, match=r"skipped: shapes differ: 2\.weight.*optimizer state was not loaded"):
        checkpoint = trainer.load_checkpoint(path, strict=False)
    skipped = checkpoint["skipped_weights"]
    assert skipped == SkippedWeights(mismatched_shapes={"2.weight": ((10, 8), (3, 8)), "2.bias": ((10,), (3,))})
    assert torch.equal(model[0].weight, pretrained[0].weight) and torch.equal(model[0].bias, pretrained[0].bias)
    assert torch.equal(model[2].weight, head_before)  # the new head keeps its own initialisation
    assert trainer.optimizer.param_groups[0]["lr"] == 0.5  # the old model's optimizer state was not loaded
    result = trainer.train(classification_dataset(30), num_epochs=2, per_device_batch_size=8)
    assert math.isfinite(result.metrics["train_loss_epoch"])


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "_orig_mod.module."])
@pytest.mark.parametrize("strict", [True, False])
def test_a_file_saved_from_a_wrapped_model_loads_every_weight(tmp_path, prefix, strict):
    """A file whose every name has DDP's ``module.`` (or torch.compile's ``_orig_mod.``) loads every weight, strict
    or not, with no warning."""
    saved = _backbone_and_head(num_classes=3, seed=0)
    path = tmp_path / "hand_loop.pt"
    torch.save({MODEL_KEY: {prefix + name: value for name, value in saved.state_dict().items()}}, path)
    model = _backbone_and_head(num_classes=3, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing was skipped: no warning
        checkpoint = _cross_entropy_trainer(model).load_checkpoint(path, strict=strict)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in saved.state_dict().items())
    assert not checkpoint.get("skipped_weights")


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("other", ["another model", "every shape differs"])
def test_a_file_with_no_weight_that_fits_is_refused(tmp_path, strict, other):
    """A file of which no weight fits the model is a CheckpointError naming both sides, with strict=False too (not a
    warning over a load of nothing), and the model is unchanged."""
    if other == "another model":
        saved = nn.Sequential(nn.Conv1d(1, 2, 3))
        expected = (
            r"none of its 2 names is one of the model's \(the file has conv\.weight, conv\.bias; the model has 0\."
        )
        state = {"conv." + name.split(".")[1]: value for name, value in saved.state_dict().items()}
    else:
        saved = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4))
        expected = r"every one of its 4 shared names has another shape \(shapes differ: 0\.weight \(file \(5, 3\)"
        state = saved.state_dict()
    path = tmp_path / "other.pt"
    torch.save({MODEL_KEY: state}, path)
    model = _backbone_and_head(num_classes=3, seed=1)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=expected + r".*Nothing was loaded"):
        _cross_entropy_trainer(model).load_checkpoint(path, strict=strict)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())


def test_one_sided_keys_listed_fit_is_silent(tmp_path):
    """Keys on one side only are listed; a file that fits loads silently, optimizer state included."""
    path, pretrained = _pretrained_checkpoint(tmp_path)
    torch.manual_seed(2)
    deeper = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 10), nn.Tanh(), nn.Linear(10, 4))
    trainer = _cross_entropy_trainer(deeper)
    with pytest.warns(UserWarning, match=r"not in the file \(the model keeps its own\): 4\.weight, 4\.bias"):
        skipped = trainer.load_checkpoint(path, strict=False)["skipped_weights"]
    assert skipped.missing_keys == ["4.weight", "4.bias"] and not skipped.mismatched_shapes
    smaller = _cross_entropy_trainer(nn.Sequential(nn.Linear(2, 8)))
    with pytest.warns(UserWarning, match=r"not in the model \(ignored\): 2\.weight, 2\.bias"):
        assert smaller.load_checkpoint(path, strict=False)["skipped_weights"].unexpected_keys == ["2.weight", "2.bias"]
    same = _cross_entropy_trainer(_backbone_and_head(num_classes=10, seed=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint = same.load_checkpoint(path, strict=False)
    assert not checkpoint["skipped_weights"] and same.optimizer.param_groups[0]["lr"] == 0.3  # all fits: all loaded
    assert torch.equal(same.get_model()[2].weight, pretrained[2].weight)
