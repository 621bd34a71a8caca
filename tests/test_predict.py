"""Trainer.predict: every sample once, in the dataset's order, structured outputs, the chunked mode, its events."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest
import torch
from conftest import (
    CPU_PROCESSES_ENV,
    S3_ENV,
    RecordingCallback,
    StreamDataset,
    launcher,
    linear_dataset,
    make_linear,
    make_mlp,
    make_trainer,
    regression_dataset,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
from pytorch_accel_trainer.predictions import load_predictions


def identity_trainer(trainer_class=Trainer, callbacks=()) -> Trainer:
    """A trainer whose model predicts each sample's id: a Linear(1, 1) of weight 1 and bias 0."""
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(0.0)
    return trainer_class(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=callbacks)


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_one_process_every_sample_in_order(kind):
    trainer = identity_trainer()
    for size in (1, 2, 5, 8, 17):
        ids = torch.arange(size, dtype=torch.float32).unsqueeze(1)
        dataset = TensorDataset(ids) if kind == "map" else StreamDataset(TensorDataset(ids))
        for batch_size in (1, 3, 4):
            predicted = trainer.predict(dataset, per_device_batch_size=batch_size)
            assert predicted.shape == (size, 1)
            assert predicted[:, 0].tolist() == list(range(size)), (size, batch_size)


@pytest.fixture
def two_process_report(two_process_scenarios):
    """What each of 2 processes got (tests/scripts/predict_run.py): the whole matrix (sizes 1-17 x batch sizes 1-4,
    map-style and iterable), the chunked mode, lr_find and two searches whose trials run on both processes."""
    return [two_process_scenarios.read_json("predict_every_case", f"result.rank{rank}.json") for rank in range(2)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("predict_every_case")
def test_two_processes_every_sample_in_order(two_process_report):
    """Two processes predict every sample once, in order, on each process."""
    for report in two_process_report:
        assert report["num_processes"] == 2
        assert len(report["cases"]) == 17 * 4 * 2
        for name, case in report["cases"].items():
            size = int(name.split("size=")[1].split()[0])
            assert case["ids"] == [float(i) for i in range(size)], name
            assert case["pair"] == [case["ids"], [2 * i for i in case["ids"]]], name
        # 13 samples gathered 4 a step, a chunk once 5 are pending: 8, then 5
        assert report["chunk_files"] == ["chunk-000000.pt", "chunk-000001.pt", "predictions.json"]
    first, second = two_process_report
    assert first["lr_find"] == second["lr_find"] and first["lr_find"]["suggestion"] is not None


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("predict_every_case")
def test_two_processes_return_the_folder_complete(two_process_report):
    """predict(output_dir=...) returns on every process only once the main process has written the whole folder:
    the other process, well ahead of a main process slowed down after each batch, reads it back at once, as
    docs/howto.md's "Get predictions" does; a memory:// folder, which only the main process would hold, is refused on
    both before any batch."""
    for report in two_process_report:
        assert report["chunked_equal"] is True, report["chunked_equal"]
        assert report["memory_store"].startswith("'memory://predictions-2' (output_dir) is fsspec's in-memory store")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("predict_every_case")
def test_search_trials_run_on_every_process(two_process_report):
    """tune() on 2 processes runs each trial on every process and prunes them together (in the predictions' launch)."""
    pytest.importorskip("optuna")
    main, other = (report["tune"] for report in two_process_report)
    assert main == {"pruned": ["PRUNED", [1]], "complete": ["COMPLETE", True], "num_processes": 2}
    assert other == {}  # the other process ran the trials; only the main one talks to Optuna


def test_structured_outputs_keep_their_structure():
    class Structured(Trainer):
        def calculate_predict_batch_output(self, batch, batch_idx):  # Lightning's predict_step(batch, batch_idx)
            outputs = self.model(batch[0])
            indices = torch.full_like(outputs[:, 0], batch_idx)
            return {"outputs": outputs, "pair": (outputs.argmax(dim=1), outputs.sigmoid()), "batch": indices}

    dataset = regression_dataset(10)
    trainer = make_trainer(make_mlp(), trainer_class=Structured)
    predicted = trainer.predict(dataset, per_device_batch_size=3)
    expected = trainer.model(dataset.tensors[0]).detach()
    assert set(predicted) == {"outputs", "pair", "batch"} and isinstance(predicted["pair"], tuple)
    assert predicted["batch"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert torch.allclose(predicted["outputs"], expected)
    assert torch.equal(predicted["pair"][1], predicted["outputs"].sigmoid())


def test_chunked_mode_matches_in_memory(tmp_path):
    """The chunked mode writes what predict returns in memory."""
    trainer = make_trainer(make_mlp())
    dataset = regression_dataset(23)
    in_memory = trainer.predict(dataset, per_device_batch_size=4)
    folder = trainer.predict(dataset, per_device_batch_size=4, output_dir=tmp_path / "predictions", chunk_size=8)
    assert folder == tmp_path / "predictions"
    assert sorted(path.name for path in folder.iterdir()) == [
        *(f"chunk-{i:06d}.pt" for i in range(3)),  # 8, 8 and the last 7 samples
        "predictions.json",
    ]
    assert torch.equal(load_predictions(folder), in_memory)
    with pytest.raises(FileExistsError, match="never overwrites"):
        trainer.predict(dataset, output_dir=folder)
    (folder / "predictions.json").unlink()  # as an interrupted prediction leaves it
    with pytest.raises(FileNotFoundError, match="did not finish"):
        load_predictions(folder)


def test_predict_events_and_training_modes():
    """predict fires its events and no evaluation event, and restores the training modes."""
    recorder = RecordingCallback()
    trainer = make_trainer(make_mlp(), callbacks=[recorder])
    trainer.model.train()
    trainer.model[0].eval()  # a frozen layer, in evaluation mode on purpose
    trainer.predict(regression_dataset(5), per_device_batch_size=2)
    assert recorder.events[1:] == ["on_predict_run_start", *["on_predict_step_end"] * 3, "on_predict_run_end"]
    assert trainer.model.training and not trainer.model[0].training


def test_default_callbacks_while_predicting(capsys):
    """The default callbacks show a progress bar while predicting, and print nothing."""
    trainer = make_trainer(make_linear(), callbacks=DEFAULT_CALLBACKS)
    trainer.predict(linear_dataset(10), per_device_batch_size=4)
    captured = capsys.readouterr()
    assert "predict:" in captured.err and "0/3 " in captured.err and captured.out == ""  # a bar of 3 batches
    assert trainer.predict_dataloader is None  # only while predicting


def test_predict_after_training_on_tensors():
    trainer = make_trainer(make_linear())
    dataset = linear_dataset(16)
    trainer.train(dataset, num_epochs=1, per_device_batch_size=4)
    inputs = dataset.tensors[0]
    predicted = trainer.predict(inputs, per_device_batch_size=5)  # a plain tensor: each sample a row
    assert torch.allclose(predicted, trainer.model(inputs).detach())
    loader = DataLoader(TensorDataset(inputs), batch_size=6)  # a DataLoader is used as it is
    assert torch.equal(trainer.predict(loader), predicted)


def test_predict_refuses_bad_arguments():
    """predict refuses bad arguments and bad outputs, each with one clear error."""
    trainer = make_trainer(make_linear())
    with pytest.raises(ValueError, match="per_device_batch_size=0 is not valid"):
        trainer.predict(linear_dataset(4), per_device_batch_size=0)
    with pytest.raises(ValueError, match="chunk_size=-1 is not valid"):
        trainer.predict(linear_dataset(4), chunk_size=-1)

    class Scalar(Trainer):
        def calculate_predict_batch_output(self, batch):
            return self.model(batch[0]).mean()

    with pytest.raises(TypeError, match="0-d tensor"):
        make_trainer(make_linear(), trainer_class=Scalar).predict(linear_dataset(4))

    class Strings(Trainer):
        def calculate_predict_batch_output(self, batch):
            return {"labels": ["a"] * len(batch[0])}

    with pytest.raises(TypeError, match=r"list at \['labels'\]|str at \['labels'\]"):
        make_trainer(make_linear(), trainer_class=Strings).predict(linear_dataset(4))


def test_predict_without_optimizer_or_loss():
    model = make_mlp()
    predictor = Trainer(model, loss_func=None, optimizer=None, callbacks=())
    dataset = regression_dataset(7)
    assert torch.allclose(predictor.predict(dataset, per_device_batch_size=2), model(dataset.tensors[0]).detach())


def shape_changes(outputs, batch_idx):
    return {"outputs": outputs.repeat(1, batch_idx + 1)}  # (n, 1), then (n, 2): a sequence padded per batch


def keys_change(outputs, batch_idx):
    return {"outputs": outputs} if batch_idx == 0 else {"logits": outputs}


def length_changes(outputs, batch_idx):
    return (outputs,) * (batch_idx + 1)


@pytest.mark.parametrize(
    ("make_output", "message"),
    [
        (shape_changes, r"a tensor of shape \(3, 2\) at \['outputs'\] for batch 1, where batch 0 gave a tensor of "),
        (keys_change, r"a dict with the keys \['logits'\] for batch 1, where batch 0 gave a dict with the keys "),
        (length_changes, r"a tuple or list of 2 items for batch 1, where batch 0 gave a tuple or list of 1 items"),
    ],
)
def test_a_batch_of_another_structure_is_refused_as_it_arrives(make_output, message):
    """A prediction whose shape (beyond the batch dimension), keys or length differs from the first batch's is refused
    at that batch, naming the hook, the batch, what was expected and what came: not by torch.cat or a KeyError in the
    join after every batch has run."""

    class Changing(Trainer):
        def calculate_predict_batch_output(self, batch, batch_idx):
            return make_output(self.model(batch[0]), batch_idx)

    recorder = RecordingCallback()
    trainer = make_trainer(make_linear(), trainer_class=Changing, callbacks=[recorder])
    with pytest.raises(ValueError, match=rf"calculate_predict_batch_output returned {message}"):
        trainer.predict(linear_dataset(9), per_device_batch_size=3)
    assert recorder.events.count("on_predict_step_end") == 1  # batch 0 only: batch 2 never ran


def test_the_first_dimension_may_change():
    """The last batch is smaller: only the first dimension may change, and does."""
    trainer = make_trainer(make_mlp())
    predicted = trainer.predict(regression_dataset(10), per_device_batch_size=4)
    assert predicted.shape == (10, 1)


@pytest.mark.parametrize("output_dir", [None, "predictions"])
def test_a_stream_of_no_sample_predicts_none(tmp_path, output_dir):
    """A stream that yields nothing gives None (with output_dir, a folder that loads as None), as documented; an empty
    sized dataset is refused before any work, as train() and evaluate() refuse one."""
    trainer = make_trainer(make_linear())
    empty = StreamDataset(linear_dataset(0))
    if output_dir is None:
        assert trainer.predict(empty) is None
    else:
        assert load_predictions(trainer.predict(empty, output_dir=tmp_path / output_dir)) is None
    with pytest.raises(ValueError, match=r"dataset is empty \(len\(dataset\) == 0\)"):
        trainer.predict(linear_dataset(0))


def test_output_dir_url_is_written_to_the_store(tmp_path, monkeypatch):
    """A URL as output_dir is a folder in that store (fsspec), read back by load_predictions; never a local folder
    named 'memory:'."""
    fsspec = pytest.importorskip("fsspec")
    monkeypatch.chdir(tmp_path)
    url = f"memory://predictions-{tmp_path.name}/run"
    trainer = make_trainer(make_mlp())
    dataset = regression_dataset(11)
    folder = trainer.predict(dataset, per_device_batch_size=4, output_dir=url + "/", chunk_size=5)
    assert folder == url and not any(tmp_path.iterdir())
    store = fsspec.filesystem("memory")
    assert sorted(path.rsplit("/", 1)[1] for path in store.ls(f"/predictions-{tmp_path.name}/run", detail=False)) == [
        "chunk-000000.pt",
        "chunk-000001.pt",
        "predictions.json",
    ]
    assert torch.equal(load_predictions(url), trainer.predict(dataset, per_device_batch_size=4))
    with pytest.raises(FileExistsError, match=rf"output_dir='{url}' already exists"):
        trainer.predict(dataset, output_dir=url)
    with pytest.raises(FileNotFoundError, match="has no predictions.json"):
        load_predictions(f"memory://predictions-{tmp_path.name}/elsewhere")


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_write_predictions_to_s3_and_read_them_back(tmp_path, s3_endpoint):
    """predict(output_dir="s3://...") on 2 processes: the main process writes the chunks to the store, and every
    process, well ahead of a main process slowed down after each batch, reads the complete folder back as soon as
    predict() returns, in the dataset's order."""
    url = f"s3://states-bucket/predictions-{tmp_path.name}"
    env = {**CPU_PROCESSES_ENV, **S3_ENV, "FSSPEC_S3_ENDPOINT_URL": s3_endpoint}
    script = pathlib.Path(__file__).parent / "scripts" / "predict_store.py"
    completed = subprocess.run(
        [*launcher(2), str(script), url, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert reports == [{"written": url, "read": [float(i) for i in range(13)]}] * 2
    assert not (tmp_path / "s3:").exists()


@pytest.mark.parametrize(
    ("output_dir", "error", "message"),
    [
        ("predictions.pt", ValueError, r"output_dir='predictions.pt' names a file \(.pt\), but output_dir is a folder"),
        ("predictions.PTH", ValueError, r"names a file \(.PTH\)"),
        ("memory:/bucket/predictions", ValueError, "looks like a URL of a memory:// store that lost a slash"),
        ("nostore://bucket/predictions", ValueError, "fsspec knows no store nostore://"),
    ],
)
def test_output_dir_refused_before_any_batch(tmp_path, monkeypatch, output_dir, error, message):
    """A file's name, or a URL no process can write, is refused before any batch runs, and nothing is written."""
    pytest.importorskip("fsspec")
    monkeypatch.chdir(tmp_path)
    recorder = RecordingCallback()
    trainer = make_trainer(make_linear(), callbacks=[recorder])
    with pytest.raises(error, match=message):
        trainer.predict(linear_dataset(4), output_dir=output_dir)
    assert "on_predict_run_start" not in recorder.events and not any(tmp_path.iterdir())


@pytest.fixture
def tiny_predict_command(tmp_path, monkeypatch):
    """The start of a `predict` command line of the tiny config (tests/config_data/tiny.py), run from tests/."""
    import pathlib

    import yaml
    from config_data.tiny import TINY_CONFIG

    monkeypatch.chdir(pathlib.Path(__file__).parent)  # the config's import paths resolve from here
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({**TINY_CONFIG, "trainer": {"seed": 1}}))
    return ["predict", "--config", str(config), "--output"]


def test_cli_output_suffix_says_file_or_folder(tmp_path, tiny_predict_command):
    """`predict --output`: .pt and .pth are one file (torch.load reads it: the tensor predict returns); no suffix or a
    trailing / a folder of chunks; any other suffix is refused as ambiguous. cli.main returns the path written."""
    from pytorch_accel_trainer.cli import main
    from pytorch_accel_trainer.cli.config import ConfigError

    written = {name: main([*tiny_predict_command, str(tmp_path / name)]) for name in ("a.pt", "b.pth", "c")}
    assert written == {name: tmp_path / name for name in ("a.pt", "b.pth", "c")}
    expected = torch.load(tmp_path / "a.pt", weights_only=True)
    assert isinstance(expected, torch.Tensor) and expected.shape == (32, 1)
    assert torch.equal(torch.load(tmp_path / "b.pth", weights_only=True), expected)
    assert (tmp_path / "c").is_dir() and torch.equal(load_predictions(tmp_path / "c"), expected)
    assert main([*tiny_predict_command, str(tmp_path / "d.v2") + "/"]) == tmp_path / "d.v2"  # a folder, as asked
    with pytest.raises(ConfigError, match=r"ends in .bin, which names neither a file of predictions nor a folder"):
        main([*tiny_predict_command, str(tmp_path / "e.bin")])
    assert not (tmp_path / "e.bin").exists()


def test_cli_output_url_is_written_to_the_store(tmp_path, tiny_predict_command):
    """`predict --output` with a URL writes the file, or the folder of chunks, in that store; nothing local."""
    fsspec = pytest.importorskip("fsspec")
    from pytorch_accel_trainer.cli import main
    from pytorch_accel_trainer.cli.config import ConfigError

    bucket = f"memory://cli-{tmp_path.name}"
    assert main([*tiny_predict_command, f"{bucket}/preds.pt"]) == f"{bucket}/preds.pt"
    with fsspec.open(f"{bucket}/preds.pt", "rb") as file:
        in_file = torch.load(file, weights_only=True)
    assert main([*tiny_predict_command, f"{bucket}/chunks/"]) == f"{bucket}/chunks"
    assert torch.equal(load_predictions(f"{bucket}/chunks"), in_file)
    with pytest.raises(ConfigError, match="already exists"):
        main([*tiny_predict_command, f"{bucket}/preds.pt"])
    assert not os.path.exists("memory:")  # never a local folder (the current folder is tests/)
