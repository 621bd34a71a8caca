"""Training states, checkpoints and weights in object storage through fsspec: ``memory://`` in this process, and a
real S3 endpoint (moto's server on localhost) through s3fs, as s3fs's own tests do."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import pytest
import torch
from conftest import S3_ENV, assert_bitwise_equal, regression_dataset
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveBestModelCallback, SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.cli.run_folder import RunFolderCallback
from pytorch_accel_trainer.errors import CheckpointError

fsspec = pytest.importorskip("fsspec")


def _run(save_dir, resume_from=None, stop_after=None, num_epochs=3, **callback_kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    callbacks = [
        SaveTrainingStateCallback(save_dir, **{"save_every_n_steps": 3, "max_checkpoints": 2, **callback_kwargs})
    ]
    if stop_after is not None:
        callbacks.append(CrashAfter(stop_after))
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=callbacks)
    trainer.train(
        regression_dataset(16),
        num_epochs=num_epochs,
        eval_dataset=regression_dataset(4, seed=1),
        per_device_batch_size=2,
        create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.8),
        resume_from=resume_from,
    )
    return trainer


class Crash(Exception):
    pass


class CrashAfter(TrainerCallback):
    def __init__(self, update):
        self.update = update

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        if num_update_steps_completed == self.update:
            raise Crash()


def _end_state(trainer):
    return {
        "model": trainer.get_model().state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "history": trainer.run_history.state_dict(),
    }


@pytest.fixture
def memory_store():
    store = fsspec.filesystem("memory")

    def clear():  # its files and its folders, which fsspec's memory store keeps apart
        store.store.clear()
        store.pseudo_dirs[:] = [""]

    clear()
    yield store
    clear()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_memory_store_states_resume_and_prune(tmp_path, memory_store, monkeypatch, asynchronous):
    """States in a memory:// store resume exactly, are pruned, and no local folder appears."""
    monkeypatch.chdir(tmp_path)
    reference = _end_state(_run(tmp_path / "reference"))
    url = "memory://bucket/states"
    with pytest.raises(Crash):  # an asynchronous save uploads in the background; the run's end waits for it
        _run(url, resume_from=url, stop_after=20, asynchronous=asynchronous)
    names = sorted(path.rsplit("/", 1)[1] for path in memory_store.ls("/bucket/states", detail=False))
    assert names == ["latest", "step_15", "step_18"]  # two rolling states, pruned in the store
    assert memory_store.cat_file("/bucket/states/latest") == b"step_18\n"
    resumed = _run(url, resume_from=url)
    assert_bitwise_equal(_end_state(resumed), reference)
    assert not os.path.exists(tmp_path / "memory:") and not os.path.exists("memory:")  # never a local folder


def test_a_partial_upload_is_never_resumed_from(tmp_path, memory_store, monkeypatch):
    from pytorch_accel_trainer.state import files

    reference = _end_state(_run(tmp_path / "reference"))
    url = "memory://bucket/partial"
    uploads = []

    def crash_in_the_third_upload(point):  # the process dies with step_9 uploaded but for its manifest
        uploads.append(point)
        if uploads.count("upload:trainer_state.pt") == 3:
            raise Crash()

    monkeypatch.setattr(files, "crash_point", crash_in_the_third_upload)
    with pytest.raises(Crash):
        _run(url, resume_from=url)
    monkeypatch.undo()
    assert not memory_store.exists("/bucket/partial/step_9/manifest.json") and memory_store.exists(
        "/bucket/partial/step_9/parts.pt"
    )
    resumed = _run(url, resume_from=url)  # from step_6, the newest complete state
    assert_bitwise_equal(_end_state(resumed), reference)


def test_checkpoints_and_weights_in_a_store(tmp_path, memory_store):
    from safetensors.torch import load_model

    trainer = _run("memory://bucket/more")
    trainer.save_checkpoint("memory://bucket/export/model.pt")
    trainer.save_weights("memory://bucket/export/model.safetensors")
    assert memory_store.exists("/bucket/export/model.pt") and memory_store.exists("/bucket/export/model.safetensors")
    other = Trainer(
        nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1)), nn.MSELoss(), None, callbacks=()
    )
    other.load_checkpoint("memory://bucket/export/model.pt", load_optimizer=False, load_scheduler=False)
    assert_bitwise_equal(other.get_model().state_dict(), trainer.get_model().state_dict())
    (tmp_path / "model.safetensors").write_bytes(memory_store.cat_file("/bucket/export/model.safetensors"))
    fresh = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    load_model(fresh, str(tmp_path / "model.safetensors"))
    assert_bitwise_equal(fresh.state_dict(), trainer.get_model().state_dict())


def test_save_best_model_writes_to_a_store(memory_store):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    callback = SaveBestModelCallback(save_path="memory://bucket/best/model.pt", watch_metric="eval_loss_epoch")
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=[callback])
    trainer.train(
        regression_dataset(8), num_epochs=2, eval_dataset=regression_dataset(4, seed=1), per_device_batch_size=4
    )
    assert memory_store.exists("/bucket/best/model.pt")


@pytest.mark.parametrize("store", ["memory", "s3"])
def test_consolidate_reads_and_writes_a_store(tmp_path, monkeypatch, request, store):
    """A state in object storage is consolidated from its URL, into a URL; no local folder of the URL's name."""
    from safetensors.torch import load

    from pytorch_accel_trainer.cli.commands import console_main

    request.getfixturevalue("memory_store" if store == "memory" else "s3_endpoint")
    bucket = "memory://bucket" if store == "memory" else "s3://states-bucket"
    monkeypatch.chdir(tmp_path)
    trainer = _run(f"{bucket}/consolidated", num_epochs=1)
    command = ["consolidate", f"{bucket}/consolidated", f"{bucket}/export/m.safetensors"]
    assert console_main(command) == 0
    written = fsspec.filesystem(store, skip_instance_cache=True).cat_file(f"{bucket}/export/m.safetensors")
    assert_bitwise_equal(load(written), trainer.get_model().state_dict())
    assert console_main(command) == 2  # never overwritten
    assert not os.path.exists(tmp_path / f"{store}:")


@pytest.mark.parametrize(
    ("url", "error", "message"),
    [
        ("gs://bucket/states", ImportError, r"'gs://bucket/states\S*' needs gcsfs .*: pip install gcsfs"),
        ("az://container/states", ImportError, r"needs adlfs .*: pip install adlfs"),
        ("nosuch://bucket/states", ValueError, r"fsspec knows no store nosuch://"),
    ],
)
def test_url_of_uninstalled_store_is_an_error(tmp_path, monkeypatch, url, error, message):
    """A URL whose store is not installed is one clear error, never a local folder."""
    monkeypatch.chdir(tmp_path)
    for package in ("gcsfs", "adlfs"):
        if package in message and importlib.util.find_spec(package) is not None:
            pytest.skip(f"{package} is installed here")
    for make in (  # each place that takes a URL says so when it is given, before any work
        lambda: SaveTrainingStateCallback(url),
        lambda: SaveBestModelCallback(save_path=f"{url}/best.pt"),
        lambda: RunFolderCallback(url),
        lambda: _run(tmp_path / "local", resume_from=url),
        lambda: _run(tmp_path / "local", num_epochs=1).save_checkpoint(f"{url}/model.pt"),
    ):
        with pytest.raises(error, match=message):
            make()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["local"]  # never a folder named after the URL


def test_no_fsspec_url_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # as if it were not installed
    with pytest.raises(
        ImportError, match=r"'s3://bucket/states' is an object-storage URL, which needs fsspec s3fs: pip"
    ):
        SaveTrainingStateCallback("s3://bucket/states")


# ------------------------------------------------------------------------------------------------
# A real S3 endpoint: moto's server on localhost, through s3fs
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_s3_states_save_prune_and_resume(tmp_path, s3_endpoint):
    reference = _end_state(_run(tmp_path / "reference"))
    url = "s3://states-bucket/in-process"
    with pytest.raises(Crash):
        _run(url, resume_from=url, stop_after=20)
    store = fsspec.filesystem("s3", skip_instance_cache=True)
    names = sorted(path.rsplit("/", 1)[1] for path in store.ls("states-bucket/in-process", detail=False))
    assert names == ["latest", "step_15", "step_18"]
    resumed = _run(url, resume_from=url)
    assert_bitwise_equal(_end_state(resumed), reference)


def test_a_missing_bucket_is_found_before_the_first_batch(tmp_path, s3_endpoint):
    """A missing or mistyped bucket (of a saving callback, or of a time budget's save at the run's end) is an OSError
    naming the URL and the store's answer before the first batch, not at the first save."""
    for callbacks, arguments in (
        ([SaveTrainingStateCallback("s3://states-bukcet/states")], {}),
        ([], {"max_time": 60, "max_time_save_dir": "s3://no-such-bucket/states"}),
    ):
        read = []
        model = nn.Linear(4, 1)
        trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=callbacks)
        with pytest.raises(
            OSError, match=r"'s3://(states-bukcet|no-such-bucket)/states' \(.*\) cannot be written \(.*bucket"
        ):
            trainer.train(_Recorded(regression_dataset(8), read), num_epochs=1, per_device_batch_size=4, **arguments)
        assert read == [] and trainer.num_update_steps_completed == 0


class _Recorded(torch.utils.data.Dataset):
    def __init__(self, dataset, read):
        self.dataset, self.read = dataset, read

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        self.read.append(index)
        return self.dataset[index]


@pytest.mark.slow
def test_killed_mid_upload_to_s3_resumes(tmp_path, s3_endpoint):
    """A process killed mid-upload to S3 resumes from the last complete state, bit for bit."""
    import json
    import signal
    import subprocess
    from pathlib import Path

    from conftest import CPU_PROCESSES_ENV, launcher

    script = Path(__file__).parent / "scripts" / "resume_run.py"
    env = {**CPU_PROCESSES_ENV, **S3_ENV, "FSSPEC_S3_ENDPOINT_URL": s3_endpoint}
    config = {"save_dir": "s3://states-bucket/killed", "out": str(tmp_path / "out.pt"), "save_every": 2}
    # SIGKILL while the third state's trainer_state.pt is uploaded: its parts are in the store, its manifest is not
    killed = subprocess.run(
        [*launcher(1), str(script), json.dumps({**config, "crash_at": "upload:trainer_state.pt", "crash_on_hit": 3})],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    store = fsspec.filesystem("s3", skip_instance_cache=True)
    assert store.exists("states-bucket/killed/step_6/parts.pt")
    assert store.exists("states-bucket/killed/step_6/rank_00000.pt")
    assert not store.exists("states-bucket/killed/step_6/manifest.json")
    resumed = subprocess.run(
        [*launcher(1), str(script), json.dumps({**config, "reference_out": str(tmp_path / "reference.pt")})],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from s3://states-bucket/killed/step_4 (after 4 optimizer updates)" in resumed.stdout
    assert_bitwise_equal(
        torch.load(tmp_path / "out.pt", weights_only=True), torch.load(tmp_path / "reference.pt", weights_only=True)
    )


def test_url_of_missing_state_is_an_error(memory_store):
    """A URL naming a missing state beside others is an error, not a new run."""
    _run("memory://bucket/named", num_epochs=1)
    with pytest.raises(
        FileNotFoundError, match=r"'memory://bucket/named/step_5' holds no training state, but .*'final'"
    ):
        _run("memory://bucket/named", resume_from="memory://bucket/named/step_5")


@pytest.mark.parametrize(
    "url, message",
    [
        ("s3://", r"'s3://' names a store but no bucket or folder in it: write the whole URL, e.g. 's3://my-bucket"),
        ("memory://", r"'memory://' names a store but no bucket"),
        (
            "s3:/bucket/states",
            r"'s3:/bucket/states' looks like a URL of a s3:// store that lost a slash .* 's3://bucket/states'",
        ),
        (str(__import__("pathlib").Path("memory://bucket") / "states"), r"'memory:/bucket/states' looks like a URL"),
    ],
)
def test_a_url_never_becomes_a_local_folder(tmp_path, monkeypatch, url, message):
    """A URL without a bucket, or one that lost a slash (``str(Path("s3://bucket") / "states")``), is a ValueError
    naming it, for each place a training state goes or comes from; nothing is written to ``./s3:``."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        SaveTrainingStateCallback(url)
    model = nn.Linear(4, 1)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    for argument in ({"resume_from": url}, {"max_time": 60, "max_time_save_dir": url}):
        with pytest.raises(ValueError, match=message):
            trainer.train(regression_dataset(8), num_epochs=1, per_device_batch_size=4, **argument)
    with pytest.raises(ValueError, match=message):
        trainer.save_checkpoint(url)
    assert list(tmp_path.iterdir()) == [] and trainer.num_update_steps_completed == 0


def test_a_store_folder_with_files_but_no_state_is_an_error(memory_store):
    """``resume_from`` a URL folder that holds objects but no training state is the CheckpointError a local folder
    gives, not a new run; what a first save cut short leaves (a state folder without its manifest, ``latest``) is
    still a new run."""
    memory_store.pipe_file("/bucket/stray/notes.txt", b"not a state")
    with pytest.raises(
        CheckpointError, match=r"resume_from='memory://bucket/stray' holds notes.txt but no training state"
    ):
        _run("memory://bucket/new", resume_from="memory://bucket/stray", num_epochs=1)
    assert not memory_store.exists("/bucket/new")
    memory_store.pipe_file("/bucket/cut/step_3/parts.pt", b"partial")
    memory_store.pipe_file("/bucket/cut/latest", b"step_3\n")
    trainer = _run("memory://bucket/cut", resume_from="memory://bucket/cut", num_epochs=1)
    assert trainer.num_update_steps_completed == 8


def test_a_run_folder_url_resumes_from_its_states(memory_store, capsys):
    """A run folder given as a URL resumes from its ``training_states`` (it does not start over), as a local run
    folder does."""
    reference = _end_state(_run("memory://bucket/reference"))
    memory_store.pipe_file("/bucket/runs/r1/config.yaml", b"lr: 0.01\n")
    with pytest.raises(Crash):
        _run("memory://bucket/runs/r1/training_states", stop_after=20)
    resumed = _run("memory://bucket/runs/r1/training_states", resume_from="memory://bucket/runs/r1")
    assert "Resuming from memory://bucket/runs/r1/training_states/step_18" in capsys.readouterr().out
    assert_bitwise_equal(_end_state(resumed), reference)


def test_a_run_folder_in_a_store(memory_store):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    callback = RunFolderCallback("memory://bucket/runs", run_name="first", config_text="lr: 0.05\n")
    for _ in range(2):  # a second run of that name gets first-2: nothing is overwritten
        trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=[callback])
        trainer.train(regression_dataset(8), num_epochs=2, per_device_batch_size=4)
        callback.folder = None
    names = sorted(path.rsplit("/", 1)[1] for path in memory_store.find("/bucket/runs/first"))
    assert names == ["config.yaml", "history.csv", "history.png", "model.safetensors", "run_config.json"]
    assert memory_store.exists("/bucket/runs/first-2/model.safetensors")
    assert memory_store.cat_file("/bucket/runs/first/config.yaml") == b"lr: 0.05\n"


def test_load_training_state_from_a_store(memory_store):
    trainer = _run("memory://bucket/loaded", num_epochs=1)
    other = _run("memory://bucket/other", num_epochs=1)  # the same model, trained on its own
    with torch.no_grad():
        for parameter in other.get_model().parameters():
            parameter.add_(1.0)
    other.load_training_state("memory://bucket/loaded")  # the newest state: final
    assert_bitwise_equal(other.get_model().state_dict(), trainer.get_model().state_dict())
    assert other.num_update_steps_completed == trainer.num_update_steps_completed


def test_damaged_state_in_store_is_skipped(memory_store):
    """A damaged state in a store is skipped with a warning; a store with no good state is an error."""
    _run("memory://bucket/damaged", num_epochs=1)  # 8 updates: step_6 and final kept
    memory_store.pipe_file("/bucket/damaged/final/parts.pt", b"not the state's parts")
    with pytest.warns(
        UserWarning, match=r"Skipped a damaged training state \(resuming from memory://bucket/damaged/step_6"
    ):
        resumed = _run("memory://bucket/damaged", resume_from="memory://bucket/damaged", num_epochs=1)
    assert resumed.num_update_steps_completed == 8  # the two updates after step_6 again
    for name in memory_store.ls("/bucket/damaged", detail=False):
        if memory_store.isdir(name):
            memory_store.pipe_file(f"{name}/parts.pt", b"damaged")
    with pytest.raises(CheckpointError, match=r"memory://bucket/damaged holds \d training state\(s\) and none can be"):
        _run("memory://bucket/damaged", resume_from="memory://bucket/damaged")
