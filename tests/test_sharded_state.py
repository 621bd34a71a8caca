"""Sharded training states: written by every process at once (FSDP2 on the CPU over gloo), killed in the middle of a
save or of a background save, on a local folder and on S3, then resumed bit for bit; and made whole by
``pytorch-accel-trainer consolidate``."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import fsspec
import pytest
import torch
from conftest import CPU_PROCESSES_ENV, S3_ENV, assert_bitwise_equal, launcher
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.cli.commands import console_main
from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state.checkpointing import MODEL_KEY
from pytorch_accel_trainer.state.consolidate import consolidate, full_weights
from pytorch_accel_trainer.state.training_state import list_complete_states, verify_folder

SCRIPT = Path(__file__).parent / "scripts" / "sharded_state_run.py"


def _launch(config: dict, env=None) -> subprocess.CompletedProcess:
    """The run of ``config`` on 2 processes, forked from the warm launcher, which ends the other process when one dies
    (SIGTERM, as torchrun does)."""
    return subprocess.run(
        [*launcher(2), str(SCRIPT), json.dumps(config)],
        env=env or CPU_PROCESSES_ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _killed_then_resumed(tmp_path: Path, config: dict, env=None) -> subprocess.CompletedProcess:
    """Launch the run with ``config`` (which kills it in a save), then again to its end with an uninterrupted run."""
    killed = _launch({**config, "out": str(tmp_path)}, env)
    assert killed.returncode != 0, "the crash point was never reached"
    assert not (tmp_path / "weights.safetensors").exists()
    resumed = _launch({**config, "crash_at": None, "out": str(tmp_path), "reference": True}, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise_equal(load_file(tmp_path / "weights.safetensors"), load_file(tmp_path / "reference.safetensors"))
    return resumed


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_in_sharded_save_resumes_bitwise(tmp_path):
    """Both processes killed while writing their shards of the third state: the second resumes, bit for bit."""
    states = tmp_path / "states"
    resumed = _killed_then_resumed(tmp_path, {"save_dir": str(states), "crash_at": "write:shards", "crash_on_hit": 3})
    assert "Resuming from" in resumed.stdout and "step_4 (after 4 optimizer updates)" in resumed.stdout
    newest = list_complete_states(states)[-1]
    shards = sorted(name for name in newest.manifest["files"] if name.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # each process wrote its own shard
    assert verify_folder(newest.folder) and newest.manifest["world_size"] == 2
    # the state made whole on one process, without a process group: the run's final weights
    assert_bitwise_equal(full_weights(states), load_file(tmp_path / "weights.safetensors"))


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_in_background_upload_to_s3_resumes(tmp_path, s3_endpoint):
    """Background saves of both processes to S3, the main process killed while uploading the third state's manifest:
    the store holds its shards but no manifest, and the run resumes from the second state, bit for bit."""
    env = {**CPU_PROCESSES_ENV, **S3_ENV, "FSSPEC_S3_ENDPOINT_URL": s3_endpoint}
    url = "s3://states-bucket/sharded"
    config = {"save_dir": url, "asynchronous": True, "crash_at": "upload:manifest.json", "crash_on_hit": 3}
    resumed = _killed_then_resumed(tmp_path, config, env)
    assert f"Resuming from {url}/step_4 (after 4 optimizer updates)" in resumed.stdout
    store = fsspec.filesystem("s3", skip_instance_cache=True)
    final = sorted(path.rsplit("/", 1)[1] for path in store.ls("states-bucket/sharded/step_12", detail=False))
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "manifest.json"} <= set(final)


@pytest.mark.slow
@pytest.mark.distributed
def test_one_process_failing_its_part_fails_every_process(tmp_path):
    """Process 1 alone finds its disk full as it writes its part of the third state: both processes stop with an
    error at once (none waits for the other), and the earlier states are complete and untouched."""
    states = tmp_path / "states"
    config = {"save_dir": str(states), "out": str(tmp_path), "crash_at": "write:rank_00001.pt", "crash_on_hit": 3}
    failed = _launch({**config, "fail_rank": 1})
    assert failed.returncode != 0
    assert "Process 1 could not write its part of the training state step_6 (OSError" in failed.stderr
    assert [state.folder.name for state in list_complete_states(states)] == ["step_2", "step_4"]
    assert all(verify_folder(state.folder) for state in list_complete_states(states))


def _tiny_state(tmp_path: Path) -> tuple[Trainer, Path]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    trainer = Trainer(model, nn.MSELoss(), torch.optim.Adam(model.parameters(), lr=0.01), callbacks=[])
    x = torch.randn(16, 3)
    trainer.train(TensorDataset(x, x.sum(dim=1, keepdim=True)), num_epochs=1, per_device_batch_size=4)
    return trainer, trainer.save_training_state(tmp_path / "states")


@pytest.fixture(params=["one_file", "sharded"])
def layout(request) -> str:
    """The layout of the states the test writes on its one process: one file, or DCP's shards (as several write)."""
    if request.param == "sharded":
        request.getfixturevalue("sharded_layout")
    return request.param


def test_consolidate_writes_the_full_weights(tmp_path, capsys, layout):
    trainer, state = _tiny_state(tmp_path)
    expected = trainer.get_model().state_dict()
    assert console_main(["consolidate", str(tmp_path / "states"), str(tmp_path / "model.safetensors")]) == 0
    assert f"to {tmp_path / 'model.safetensors'}" in capsys.readouterr().out
    assert_bitwise_equal(load_file(tmp_path / "model.safetensors"), expected)
    assert console_main(["consolidate", str(state), str(tmp_path / "model.pt")]) == 0
    fresh = Trainer(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), nn.MSELoss(), None, callbacks=[])
    fresh.load_checkpoint(tmp_path / "model.pt", load_optimizer=False)
    assert_bitwise_equal(fresh.get_model().state_dict(), expected)


def test_consolidate_refuses_bad_outputs_and_damaged_states(tmp_path, capsys, layout):
    _, state = _tiny_state(tmp_path)
    assert console_main(["consolidate", str(state), str(tmp_path / "model.bin")]) == 2
    assert "is not a file name ending in one of .safetensors" in capsys.readouterr().err
    shard = state / ("parts.pt" if layout == "one_file" else "__0_0.distcp")
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{re.escape(shard.name)}: its XXH3-128 does not match the manifest"):
        full_weights(state)
    assert not (tmp_path / "model.safetensors").exists()


def test_consolidate_never_overwrites_a_file_nor_writes_inside_a_state(tmp_path, capsys):
    _, state = _tiny_state(tmp_path)
    kept = tmp_path / "m.safetensors"
    kept.write_text("keep")
    assert console_main(["consolidate", str(state), str(kept)]) == 2
    assert f"{str(kept)!r} already exists: consolidate never overwrites a file" in capsys.readouterr().err
    assert kept.read_text() == "keep"
    rank_file = state / "rank_00000.pt"
    before = rank_file.read_bytes()
    for inside in (rank_file, state / "model.pt"):
        with pytest.raises(ValueError, match=r"is in the training state .*: write the weights outside it"):
            consolidate(tmp_path / "states", inside)
    assert rank_file.read_bytes() == before and not (state / "model.pt").exists()
    verify_folder(state)  # the state is untouched


def test_consolidate_expands_home_and_variables_in_both_paths(tmp_path, monkeypatch):
    trainer, _ = _tiny_state(tmp_path)
    expected = trainer.get_model().state_dict()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OUTDIR", str(tmp_path / "outdir"))
    monkeypatch.setenv("STATES", str(tmp_path / "states"))
    consolidate("$STATES", "~/out/m.safetensors")
    consolidate("${STATES}", "$OUTDIR/m.pt")
    assert_bitwise_equal(load_file(tmp_path / "home" / "out" / "m.safetensors"), expected)
    assert_bitwise_equal(torch.load(tmp_path / "outdir" / "m.pt", weights_only=True)[MODEL_KEY], expected)
    (tmp_path / "home" / "states").symlink_to(tmp_path / "states")
    assert console_main(["consolidate", "~/states", "$OUTDIR/again.safetensors"]) == 0
    assert not any(os.path.lexists(tmp_path / name) for name in ("~", "$OUTDIR", "$STATES", "s3:"))
    with pytest.raises(ValueError, match=r"names the environment variable \$NOT_SET_HERE, which is not set"):
        consolidate("$STATES", "$NOT_SET_HERE/m.pt")
    with pytest.raises(ValueError, match=r"looks like a URL of a s3:// store that lost a slash"):
        consolidate("$STATES", "s3:/bucket/m.safetensors")


def test_consolidate_writes_models_only_never_an_optimizer(tmp_path):
    _, state = _tiny_state(tmp_path)
    for part in ("optimizer", "extra_optimizer:critic", "extra_model:"):
        with pytest.raises(ValueError, match=rf"--part {part!r} is not a model: .*'model' or 'extra_model:NAME'"):
            consolidate(state, tmp_path / "opt.pt", part)
    assert not (tmp_path / "opt.pt").exists()


def test_consolidate_reads_the_model_tensors_alone(tmp_path, monkeypatch, sharded_layout):
    """The model's tensors are read from a sharded state, not the optimizer's (a one-file state's are memory-mapped:
    only the model's are read); the docs that describe consolidate's memory say so."""
    import torch.distributed.checkpoint as dcp

    _, state = _tiny_state(tmp_path)
    read = []
    original = dcp.load

    def recording_load(state_dict, **kwargs):
        read.extend(state_dict)
        return original(state_dict, **kwargs)

    monkeypatch.setattr(dcp, "load", recording_load)
    full_weights(state)
    assert read and all(name.startswith("model/") for name in read)
    docs = Path(__file__).resolve().parents[1] / "docs"
    for page in ("config.md", "training_state.md", "fsdp_deepspeed.md"):
        text = " ".join((docs / page).read_text().split())
        assert "the optimizer's state is not read" in text, page


def test_consolidate_refuses_standard_input_files_and_folders_without_a_state(tmp_path, capsys):
    _, state = _tiny_state(tmp_path)
    output = str(tmp_path / "m.safetensors")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("not a state")
    for given, problem in (
        ("-", "is standard input"),
        ("/dev/stdin", "is not a folder"),
        (str(state / "rank_00000.pt"), "is not a folder but a file"),
        (str(tmp_path / "notes"), "holds no training state"),
    ):
        assert console_main(["consolidate", given, output]) == 2
        error = capsys.readouterr().err
        assert f"consolidate: STATE {given!r} {problem}" in error
        assert "resume_from" not in error and "load_checkpoint" not in error
    assert not (tmp_path / "m.safetensors").exists()


def test_consolidate_reads_the_training_states_of_a_run_folder(tmp_path, layout):
    trainer, _ = _tiny_state(tmp_path / "run" / "ignored")
    run = tmp_path / "run"
    (run / "ignored" / "states").rename(run / "training_states")
    (run / "ignored").rmdir()
    (run / "config.yaml").write_text("model: x\n")
    consolidate(run, tmp_path / "m.safetensors")
    assert_bitwise_equal(load_file(tmp_path / "m.safetensors"), trainer.get_model().state_dict())


def test_consolidate_refuses_a_folder_as_output_with_a_name_it_takes(tmp_path, capsys):
    _, state = _tiny_state(tmp_path)
    folder = tmp_path / "out.safetensors"
    folder.mkdir()
    assert console_main(["consolidate", str(state), str(folder)]) == 2
    error = capsys.readouterr().err
    suggested = re.search(r"e\.g\. '([^']+)'", error)
    assert f"{str(folder)!r} is a folder" in error and suggested and suggested.group(1) != str(folder)
    assert console_main(["consolidate", str(state), suggested.group(1)]) == 0


def test_a_planted_pickle_in_the_metadata_never_runs(tmp_path, sharded_layout):
    """DCP pickles its .metadata; the reader rebuilds DCP's own classes only, so a planted payload is refused."""
    import pickle

    from pytorch_accel_trainer.state.files import DamagedStateError
    from pytorch_accel_trainer.state.shards import read_metadata

    _, state = _tiny_state(tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (state / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(DamagedStateError, match=r"\.metadata names posix\.system, which DCP's metadata never holds"):
        read_metadata(state)
    assert not marker.exists()


def test_metadata_cannot_point_outside_the_state(tmp_path, sharded_layout):
    """A forged .metadata (its manifest entry forged too) that places the tensors in a file outside the state's folder
    is refused: nothing outside the folder is read."""
    import pickle

    from pytorch_accel_trainer.state.files import MANIFEST_NAME, file_digest
    from pytorch_accel_trainer.state.shards import read_metadata

    _, state = _tiny_state(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "__0_0.distcp").write_bytes((state / "__0_0.distcp").read_bytes())
    metadata = read_metadata(state)
    for info in metadata.storage_data.values():
        info.relative_path = "../outside/__0_0.distcp"
    (state / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = json.loads((state / MANIFEST_NAME).read_text())
    size, digest = file_digest(state / ".metadata")
    manifest["files"][".metadata"] = {"size": size, "xxh3_128": digest}
    (state / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"places a tensor in '\.\./outside/__0_0\.distcp', which is not a shard"):
        full_weights(state)


# ------------------------------------------------------------------------------------------------
# DeepSpeed's layout, with a stand-in engine (DeepSpeed itself: tests/test_fsdp.py)
# ------------------------------------------------------------------------------------------------


class _StandInCheckpointEngine:
    """DeepSpeed's torch checkpoint engine, as far as a training state uses it."""

    def is_decoupled(self):
        return False

    def save(self, state_dict, path):
        torch.save(state_dict, path)


class _StandInEngine:
    """Writes one optimizer file through its checkpoint engine, as ``DeepSpeedEngine.save_checkpoint`` does."""

    def __init__(self, stage=2):
        self.checkpoint_engine, self.stage, self.loaded = _StandInCheckpointEngine(), stage, []

    def zero_optimization_stage(self):
        return self.stage

    def save_checkpoint(self, save_dir, tag, save_latest):
        path = os.path.join(save_dir, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        self.checkpoint_engine.save({"partition": torch.arange(4.0)}, path)

    def load_checkpoint(self, load_dir, tag, **kwargs):
        self.loaded.append(torch.load(os.path.join(load_dir, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt")))
        return load_dir, {}


def _write_engine_state(parent: Path, engine) -> Path:
    from pytorch_accel_trainer.state.deepspeed_engine import FACTS_KEY, DeepSpeedEngineState
    from pytorch_accel_trainer.state.folder import write_training_state
    from pytorch_accel_trainer.state.parts import Processes, StateContent

    engine_state = DeepSpeedEngineState(engine, world_size=1)
    position = {"loop_epoch": 0, "batches_seen": 1, "epoch_samples": 8, "rng_restore_point": "after_iterator"}
    fields = {"num_update_steps_completed": 1, "position": position, "kinds": ["rolling"], "run_facts": {}}
    content = StateContent({}, {FACTS_KEY: engine_state.facts()}, {}, engine_state)
    return write_training_state(parent, content, {**fields, "run_id": "0" * 32}, Processes(), "checkpoint-1")


def test_an_engine_writes_its_own_checksummed_files_into_the_state(tmp_path):
    """The engine's files lie in the state's folder, listed in the manifest (layout ``deepspeed``) with the checksum
    computed as they were written; a changed byte is refused; the engine loads only from a verified folder."""
    from pytorch_accel_trainer.state.deepspeed_engine import DeepSpeedEngineState

    engine = _StandInEngine()
    folder = _write_engine_state(tmp_path / "states", engine)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["layout"] == "deepspeed"
    assert set(manifest["files"]) == {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "trainer_state.pt", "rank_00000.pt"}
    assert "save" not in vars(engine.checkpoint_engine)  # its own writer again after the save
    DeepSpeedEngineState(engine, 1).load(verify_folder(folder).folder)
    assert torch.equal(engine.loaded[0]["partition"], torch.arange(4.0))

    optimizer_file = folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    damaged = bytearray(optimizer_file.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    optimizer_file.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt: its XXH3-128 does not"):
        verify_folder(folder)


def test_an_engine_state_resumes_on_its_stage_and_processes_only(tmp_path):
    """Another ZeRO stage or number of processes, no DeepSpeed, or DeepSpeed for another layout's state: refused."""
    from pytorch_accel_trainer.state.deepspeed_engine import DeepSpeedEngineState, check_engine_fits

    stored = verify_folder(_write_engine_state(tmp_path / "states", _StandInEngine(stage=2)))
    saved = {"zero_stage": 2, "world_size": 1}
    check_engine_fits(stored, saved, DeepSpeedEngineState(_StandInEngine(stage=2), 1))
    with pytest.raises(CheckpointError, match=r"ZeRO stage 2 on 1 process\(es\), but this run uses ZeRO stage 3 on 1"):
        check_engine_fits(stored, saved, DeepSpeedEngineState(_StandInEngine(stage=3), 1))
    with pytest.raises(CheckpointError, match="ds_to_universal"):
        check_engine_fits(stored, saved, DeepSpeedEngineState(_StandInEngine(stage=2), 2))
    with pytest.raises(CheckpointError, match="this run does not use DeepSpeed"):
        check_engine_fits(stored, saved, None)

    other = stored.__class__(stored.folder, {**stored.manifest, "layout": "one_file"})  # another layout's state
    with pytest.raises(CheckpointError, match="was not saved under DeepSpeed"):
        check_engine_fits(other, None, DeepSpeedEngineState(_StandInEngine(), 1))
