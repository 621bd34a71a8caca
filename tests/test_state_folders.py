"""Training states are input too: confined to their folder, bounded, skipped when damaged, refused when of another
format, cleaned up, never pruned through a link, checked against the optimizer they are resumed into, and kept apart by
run: two runs never mix in one folder, and resume_from says what it found (real files, real runs)."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import textwrap
import zlib

import pytest
import torch
from conftest import launcher, regression_dataset
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state import files
from pytorch_accel_trainer.state.files import CHECKSUM, MANIFEST_NAME, TRAINER_FILE, file_digest
from pytorch_accel_trainer.state.training_state import (  # the public path
    StateFormatError,
    find_resumable_state,
    list_complete_states,
    verify_folder,
)

#: The size of a file outside every state folder: no error message may tell it.
SECRET_SIZE = 12345


def _run(save_dir, optimizer=torch.optim.SGD, num_epochs=1, crash=None, **callback_kwargs):
    """Train nn.Linear(4, 1) on 8 samples (4 updates an epoch), a state after each update, resuming from save_dir."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    callbacks = [SaveTrainingStateCallback(save_dir, save_every_n_steps=1, **{"save_at_end": False, **callback_kwargs})]
    callbacks += [crash] if crash else []
    trainer = Trainer(model, nn.MSELoss(), optimizer(model.parameters(), lr=0.01), callbacks=callbacks)
    trainer.train(regression_dataset(8), num_epochs=num_epochs, per_device_batch_size=2, resume_from=save_dir)
    return trainer


def _edit_manifest(folder, edit):
    path = folder / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _rehash(folder, name):
    """Forge the manifest entry of ``name`` so that the file's current contents check out."""
    size, digest = file_digest(folder / name)
    _edit_manifest(folder, lambda manifest: manifest["files"].__setitem__(name, {"size": size, CHECKSUM: digest}))


@pytest.fixture
def states(tmp_path):
    """A folder of four good states (after updates 1 to 4; one process's: one file each) and a secret file beside
    it."""
    parent = tmp_path / "states"
    _run(parent)
    (tmp_path / "secret").write_bytes(b"s" * SECRET_SIZE)
    assert [state.folder.name for state in list_complete_states(parent)][-1] == "step_4"
    return parent


def _list_outside(manifest, secret, name):
    manifest["files"][name] = {"size": SECRET_SIZE, CHECKSUM: file_digest(secret)[1]}


def _link_file(folder, secret):
    outside = secret.parent / "parts-copy.pt"  # the very bytes the manifest lists: the hash would check out
    shutil.copyfile(folder / "parts.pt", outside)
    (folder / "parts.pt").unlink()
    (folder / "parts.pt").symlink_to(outside)


def _link_manifest(folder, secret):
    outside = secret.parent / "manifest-copy.json"
    shutil.copyfile(folder / MANIFEST_NAME, outside)
    (folder / MANIFEST_NAME).unlink()
    (folder / MANIFEST_NAME).symlink_to(outside)


def _link_folder(folder, secret):
    outside = secret.parent / folder.name
    shutil.move(folder, outside)
    folder.symlink_to(outside, target_is_directory=True)


DAMAGES = {
    "position is a list": (
        lambda f, s: _edit_manifest(f, lambda m: m.update(position=[])),
        r"damaged manifest: position is \[\]; it must be a dict",
    ),
    "world_size of 10**10": (
        lambda f, s: _edit_manifest(f, lambda m: m.update(world_size=10**10)),
        r"world_size is 10000000000; it must be the number of rank files listed \(1\)",
    ),
    "a name going up": (
        lambda f, s: _edit_manifest(f, lambda m: _list_outside(m, s, "../../secret")),
        r"lists '\.\./\.\./secret', which is not a plain file name inside",
    ),
    "an absolute name": (
        lambda f, s: _edit_manifest(f, lambda m: _list_outside(m, s, str(s))),
        r"lists '/.*secret', which is not a plain file name inside",
    ),
    "a linked file": (
        _link_file,
        r"parts\.pt: a symbolic link; a state's files must be regular files in its folder",
    ),
    "a linked manifest": (_link_manifest, r"manifest\.json: a symbolic link"),
    "a linked state folder": (_link_folder, r"step_4: a symbolic link; states are read only from folders inside"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_newest_state_is_skipped(states, capsys, damage):
    """A damaged newest state is skipped, with a warning naming it, for the newest good one."""
    newest = states / "step_4"
    apply, problem = DAMAGES[damage]
    apply(newest, states.parent / "secret")
    with pytest.warns(
        UserWarning, match=r"Skipped a damaged training state \(resuming from \S*step_3\): \S*step_4[:/]"
    ) as warned:
        resumed = _run(states, num_epochs=2)
    assert any(re.search(problem, str(warning.message)) for warning in warned)
    assert not any(str(SECRET_SIZE) in str(warning.message) or "bytes" in str(warning.message) for warning in warned)
    assert "step_3 (after 3 optimizer updates)" in capsys.readouterr().out
    assert resumed.num_update_steps_completed == 8  # continued from the older state, to the end of epoch 2


def test_outside_file_name_is_no_oracle(states):
    """No oracle: a guessed size or hash of an outside file changes nothing in what the loader says."""
    folder, secret = states / "step_4", states.parent / "secret"
    messages = set()
    for entry in [
        {"size": SECRET_SIZE, CHECKSUM: file_digest(secret)[1]},
        {"size": SECRET_SIZE, CHECKSUM: "0" * 32},
    ]:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        manifest["files"]["../../secret"] = entry
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match="not a plain file name") as refused:
            verify_folder(folder)
        messages.add(str(refused.value))
    assert len(messages) == 1 and str(SECRET_SIZE) not in messages.pop()


BAD_FIELDS = [
    ("world_size", 0, r"world_size is 0; it must be the number of rank files listed \(1\)"),
    ("world_size", True, r"world_size is True"),
    ("world_size", 2, r"world_size is 2; it must be the number of rank files listed \(1\)"),
    ("num_update_steps_completed", "4", r"num_update_steps_completed is '4'; it must be a whole number >= 0"),
    (
        "position",
        {"loop_epoch": -1, "batches_seen": 0, "epoch_samples": 0, "rng_restore_point": "before_iterator"},
        r"position\['loop_epoch'\] is -1",
    ),
    (
        "position",
        {"loop_epoch": 0, "batches_seen": 2, "epoch_samples": -4, "rng_restore_point": "after_iterator"},
        r"position\['epoch_samples'\] is -4",
    ),
    (
        "position",
        {"loop_epoch": 0, "batches_seen": 2, "epoch_samples": 4, "rng_restore_point": "later"},
        r"position\['rng_restore_point'\] is 'later'; it must be one of \('before_iterator', 'after_iterator'\)",
    ),
    (
        "kinds",
        ["forever"],
        r"kinds is \['forever'\]; it must be a non-empty list of \('rolling', 'permanent', 'best'\)",
    ),
    ("run_facts", None, r"run_facts is None; it must be a dict"),
    ("files", [], r"files is a list; it must map each file name to its size and xxh3_128"),
    (
        "files",
        {"__0_0.distcp": {"size": -1, "xxh3_128": "0" * 32}},
        r"files\['__0_0\.distcp'\] is .*; it must be \{'size': a whole number >= 0, 'xxh3_128': 32 hex digits\}",
    ),
    ("files", {"__0_0.distcp": {"size": 1, "xxh3_128": "xyz"}}, r"files\['__0_0\.distcp'\] is .*'xyz'"),
    (  # a CRC32 as format 2 listed it, in a manifest that claims format 5
        "files",
        {"__0_0.distcp": {"size": 1, "crc32": "0" * 8}},
        r"files\['__0_0\.distcp'\] is .*'crc32'.*; it must be \{'size': .*'xxh3_128': 32 hex digits\}",
    ),
    (
        "files",
        {"rank_00000.pt": {"size": 1, "xxh3_128": "0" * 32}, "trainer_state.pt": {"size": 1, "xxh3_128": "0" * 32}},
        r"files lists no parts\.pt, which every training state of layout 'one_file' holds",
    ),
    (
        "files",
        {"rank_00000.pt": {"size": 1, "xxh3_128": "0" * 32}, "parts.pt": {"size": 1, "xxh3_128": "0" * 32}},
        r"files lists no trainer_state\.pt, which every training state of layout 'one_file' holds",
    ),
    ("layout", "zip", r"layout is 'zip'; it must be one of \('one_file', 'sharded', 'deepspeed'\)"),
    ("layout", ["one_file"], r"layout is \['one_file'\]; it must be one of"),
    ("layout", None, r"layout is None; it must be one of"),  # a manifest that names no layout
    ("layout", "sharded", r"files lists no \.metadata, which every training state of layout 'sharded' holds"),
]


@pytest.mark.parametrize(("name", "value", "problem"), BAD_FIELDS, ids=lambda value: str(value)[:20])
def test_manifest_fields_are_checked(states, name, value, problem):
    """Every manifest field is checked for type and range before use."""
    folder = states / "step_4"
    _edit_manifest(folder, lambda manifest: manifest.update({name: value}))
    with pytest.raises(CheckpointError, match=rf"{MANIFEST_NAME}: damaged manifest: {problem}"):
        verify_folder(folder)
    assert folder not in [state.folder for state in list_complete_states(states)]  # never pruned by a forged claim


class _Hostile:
    """Runs a shell command when unpickled: what a planted pickle does if anything unpickles it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def sharded_states(sharded_layout, states):
    """As ``states``, of the sharded layout (DCP's shards and metadata, as several processes write them)."""
    return states


def test_a_one_process_state_is_one_file_beside_its_own(states):
    """One process's state holds its model and optimizer in one torch file, beside its trainer and rank files."""
    state = list_complete_states(states)[-1]
    assert state.manifest["layout"] == "one_file"
    assert set(state.manifest["files"]) == {"parts.pt", "trainer_state.pt", "rank_00000.pt"}
    saved = torch.load(state.folder / "parts.pt", weights_only=True)
    assert set(saved) == {"model", "optimizer"} and set(saved["model"]) == {"weight", "bias"}


def test_a_manifest_of_one_file_names_one_process(states):
    """A one-file state is one process's: a manifest that says otherwise (rank files forged too) is damaged."""
    folder = states / "step_4"
    shutil.copyfile(folder / "rank_00000.pt", folder / "rank_00001.pt")
    _rehash(folder, "rank_00001.pt")
    _edit_manifest(folder, lambda manifest: manifest.update(world_size=2, run_facts={"world_size": 2}))
    with pytest.raises(CheckpointError, match=r"world_size is 2, but a state of layout 'one_file' is one process's"):
        verify_folder(folder)


def test_planted_pickle_never_runs(sharded_states):
    """A pickle planted as DCP's metadata (which DCP itself would unpickle) is a CheckpointError and never runs."""
    states = sharded_states
    folder, marker = states / "step_4", states.parent / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Hostile(marker)))
    _rehash(folder, ".metadata")  # a forged manifest: the file checks out, so it is read
    with pytest.raises(
        CheckpointError,
        match=(
            rf"step_4/\.metadata names {os.system.__module__}\.system, which DCP's metadata never holds; the state "
            r"was damaged or altered"
        ),
    ):
        _run(states, num_epochs=2)
    assert not marker.exists()


def test_planted_pickle_in_a_shard_never_runs(sharded_states):
    """A pickle planted in a shard file, where a forged DCP metadata (of DCP's own classes) places a tensor, is a
    CheckpointError and never runs."""
    import io

    states = sharded_states
    from torch.distributed.checkpoint import FileSystemReader

    folder, marker = states / "step_4", states.parent / "pwned"
    payload = io.BytesIO()
    torch.save(_Hostile(marker), payload)  # as DCP writes each tensor: a torch file at an offset of the shard
    metadata = FileSystemReader(folder).read_metadata()  # the state's own metadata, trusted here
    for item in metadata.storage_data.values():
        item.offset, item.length = 0, len(payload.getvalue())
    (folder / "__0_0.distcp").write_bytes(payload.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(folder, "__0_0.distcp")  # a forged manifest: the files check out, so they are read
    _rehash(folder, ".metadata")
    with pytest.raises(CheckpointError, match=r"step_4\b.*; the state was damaged or altered"):
        _run(states, num_epochs=2)
    assert not marker.exists()


def test_resume_from_export_checkpoint_file(tmp_path):
    """Resuming from an export checkpoint file says it is one, and what to use."""
    model = nn.Linear(4, 1)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01), callbacks=())
    trainer.train(regression_dataset(8), num_epochs=1, per_device_batch_size=2)
    trainer.save_checkpoint(tmp_path / "model.pt")
    with pytest.raises(
        CheckpointError,
        match=(
            r"resume_from='.*model\.pt' is a file, not a training-state folder\. A file written by save_checkpoint is "
            r"an export checkpoint .*trainer\.load_checkpoint\(path\).*resume_from needs a training-state folder"
        ),
    ):
        trainer.train(regression_dataset(8), num_epochs=2, per_device_batch_size=2, resume_from=tmp_path / "model.pt")
    assert trainer.num_update_steps_completed == 4  # nothing was loaded or trained


def test_resume_into_another_optimizer(states):
    """Resuming into another optimizer is refused, naming both, before any step."""

    class NoStep(TrainerCallback):
        def on_train_step_start(self, trainer, **kwargs):
            raise AssertionError("training resumed")

    with pytest.raises(
        CheckpointError,
        match=(
            r"step_4 does not fit this trainer's optimizer: it was saved by the optimizer SGD, but this "
            r"trainer's optimizer is Adam\. Resume with the optimizer the state was saved with"
        ),
    ):
        _run(states, optimizer=torch.optim.Adam, num_epochs=2, crash=NoStep())


def test_resume_into_other_param_groups(states):
    """Resuming into other parameter groups of the same optimizer class is refused, naming both."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    two_groups = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.01)
    trainer = Trainer(model, nn.MSELoss(), two_groups, callbacks=())
    with pytest.raises(
        CheckpointError,
        match=r"its parameter groups hold \[2\] parameters, but those of this trainer's SGD hold \[1, 1\]",
    ):
        trainer.train(regression_dataset(8), num_epochs=2, per_device_batch_size=2, resume_from=states)
    assert _run(states, num_epochs=2).num_update_steps_completed == 8


def test_trainer_file_without_optimizer_class(states):
    """A trainer file without the optimizer class is refused as altered."""
    folder = states / "step_4"
    shared = torch.load(folder / TRAINER_FILE, weights_only=True)
    del shared["optimizer_class"]  # every state of the format read stores it
    torch.save(shared, folder / TRAINER_FILE)
    _rehash(folder, TRAINER_FILE)
    altered = r"step_4/trainer_state\.pt: not a trainer state \(it must hold .*, optimizer_class\); it was altered"
    with pytest.raises(CheckpointError, match=altered):
        _run(folder, num_epochs=2)  # the state itself: refused
    with pytest.warns(UserWarning, match=rf"Skipped a damaged training state \(resuming from .*step_3\): .*{altered}"):
        _run(states, num_epochs=2)  # in a folder of states: skipped for the newest good one


# ------------------------------------------------------------------------------------------------
# States of another format version: one clear error, before anything is loaded
# ------------------------------------------------------------------------------------------------


def _as_format_2(folder):
    """Rewrite a state's manifest as the development versions of format 2 wrote it: a CRC32 per file."""

    def downgrade(manifest):
        manifest["format_version"] = 2
        manifest["files"] = {
            name: {"size": entry["size"], "crc32": f"{zlib.crc32((folder / name).read_bytes()):08x}"}
            for name, entry in manifest["files"].items()
        }

    _edit_manifest(folder, downgrade)


def _format_2_refusal(folder) -> str:
    return (
        rf"{re.escape(str(folder))} is a training state of format version 2; this version of pytorch_accel_trainer "
        r"reads format version 5 only\. Resume it with the version that wrote it, or start the run again without it "
        r"\(move the folder away, or pass another resume_from\)\. Nothing was loaded from it\."
    )


class _NoStep(TrainerCallback):
    def on_train_step_start(self, trainer, **kwargs):
        raise AssertionError("training resumed")


def test_format_2_state_is_refused(states):
    """A state of format 2 is refused, naming it, the versions and the fix, before anything is loaded."""
    folder = states / "step_4"
    _as_format_2(folder)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    initial = [parameter.detach().clone() for parameter in model.parameters()]
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01), callbacks=[_NoStep()])
    with pytest.raises(StateFormatError, match=_format_2_refusal(folder)):
        trainer.train(regression_dataset(8), num_epochs=2, per_device_batch_size=2, resume_from=folder)
    with pytest.raises(StateFormatError, match=_format_2_refusal(folder)):
        trainer.load_training_state(folder)
    assert all(torch.equal(now, before) for now, before in zip(model.parameters(), initial))  # step_4's weights differ
    assert trainer.num_update_steps_completed == 0
    assert issubclass(StateFormatError, CheckpointError)  # caught as every other training-state problem


def test_older_format_states_are_skipped(states):
    """Older-format states beside good ones are skipped with a warning that says so, and never pruned."""
    for name in ("step_1", "step_2"):
        _as_format_2(states / name)
    with pytest.warns(UserWarning) as warned:
        resumed = _run(states, num_epochs=2, max_checkpoints=1)
    messages = [str(warning.message) for warning in warned if "Skipped" in str(warning.message)]
    prefix = r"Skipped a training state of another format \(resuming from \S*step_4\): "
    assert len(messages) == 2
    for name in ("step_1", "step_2"):
        assert any(re.fullmatch(prefix + _format_2_refusal(states / name), message) for message in messages), messages
    assert resumed.num_update_steps_completed == 8
    assert (states / "step_1").is_dir() and (states / "step_2").is_dir()  # another format: left for the user
    assert [state.folder.name for state in list_complete_states(states)] == ["step_8"]


def test_folder_of_older_formats_only_stops(states):
    """A folder of older-format states only stops, listing each, rather than starting over."""
    for folder in list(states.iterdir()):
        if folder.is_dir():
            _as_format_2(folder)
    with pytest.raises(
        CheckpointError,
        match=(
            r"holds 4 training state\(s\) and none can be resumed, so the run was not restarted from scratch:\n"
            r"(  \S*step_\d is a training state of format version 2; .*\n){4}Move those folders away to start over"
        ),
    ):
        _run(states, num_epochs=2)


@pytest.mark.parametrize(
    ("version", "problem"),
    [
        (
            6,
            r"step_4 is a training state of format version 6; this version of pytorch_accel_trainer reads format "
            r"version 5 only\. Resume it with the version that wrote it, or start the run again without it",
        ),
        (
            4,  # the tensors one shard per process through DCP, for one process too
            r"step_4 is a training state of format version 4; this version of pytorch_accel_trainer reads format "
            r"version 5 only\. Resume it with the version that wrote it",
        ),
        (
            3,  # the whole model and optimizer in one file each
            r"step_4 is a training state of format version 3; this version of pytorch_accel_trainer reads format "
            r"version 5 only\. Resume it with the version that wrote it",
        ),
        (1, r"step_4 is a training state of format version 1; this version of pytorch_accel_trainer reads format"),
        ("5", r"manifest\.json: damaged manifest: format_version is '5'; it must be 5\."),
        (None, r"manifest\.json: damaged manifest: format_version is None; it must be 5\."),
    ],
)
def test_other_format_versions_are_refused(states, version, problem):
    folder = states / "step_4"
    _edit_manifest(folder, lambda manifest: manifest.update(format_version=version))
    with pytest.raises(CheckpointError, match=problem) as refused:
        verify_folder(folder)
    assert isinstance(refused.value, StateFormatError) == isinstance(version, int)


# ------------------------------------------------------------------------------------------------
# Temporaries of killed saves; pruning
# ------------------------------------------------------------------------------------------------

_STOPPED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from torch import nn
    from pytorch_accel_trainer import Trainer
    from pytorch_accel_trainer.state import files

    def stop(name):  # in the middle of a save: die, or stay alive writing
        if name == "write:trainer_state.pt":  # its parts written
            if sys.argv[2] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            print("writing", flush=True)
            sys.stdin.read()  # alive until the test closes this pipe, then gone at once, the save unfinished
            os._exit(0)

    files.crash_point = stop
    model = nn.Linear(1, 1)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    samples = int(sys.argv[3])
    data = torch.utils.data.TensorDataset(torch.ones(samples, 1), torch.ones(samples, 1))
    trainer.train(data, num_epochs=1, per_device_batch_size=1)
    trainer.save_training_state(sys.argv[1])
    """
)


def _claim_from_another_host(parent):
    """Make the claim of ``parent`` that of a job on another node, whose process cannot be checked from here."""
    claim = json.loads((parent / ".claim").read_text())
    (parent / ".claim").write_text(json.dumps({**claim, "host": "another-node"}))


def test_later_save_removes_killed_temporaries(tmp_path):
    """A later save removes the temporary folders of killed saves, and never a live save's: not even that of a job
    whose claim of the folder was taken over from another host (whose liveness cannot be checked)."""
    parent = tmp_path / "states"
    live = subprocess.Popen(
        [*launcher(1), "-c", _STOPPED_SAVE, str(parent), "live", "9"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert live.stdout.readline().strip() == "writing"
        _claim_from_another_host(parent)  # a live job of this host would be refused: tests/test_state_claims.py
        killed = subprocess.run(
            [*launcher(1), "-c", _STOPPED_SAVE, str(parent), "kill", "6"], capture_output=True, text=True
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        left = {path.name for path in parent.iterdir()}
        assert left == {".claim", ".tmp-checkpoint-00000006", ".tmp-checkpoint-00000009"}  # .claim: the killed job's
        assert _run(parent).num_update_steps_completed == 4  # saves after updates 1 to 4
        left = {path.name for path in parent.iterdir() if path.name.startswith(".tmp-")}
        assert left == {".tmp-checkpoint-00000009"}  # the killed save's is gone, the live one's is untouched
        assert "parts.pt" in {path.name for path in (parent / ".tmp-checkpoint-00000009").iterdir()}
    finally:  # its launch (forked, tests/conftest.py's launcher) exits once the process is gone
        live.stdin.close()
        live.wait(timeout=60)
    _run(parent, num_epochs=2)
    assert not [path for path in parent.iterdir() if path.name.startswith(".tmp-")]


def test_symlinked_parent_or_state(tmp_path):
    """A symlinked parent or state never ends a run, nor is deleted through."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    _run(tmp_path / "link", max_checkpoints=2)  # a save_dir that is a link: pruned inside its target
    assert sorted(state.folder.name for state in list_complete_states(real)) == ["step_3", "step_4"]
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(real / "step_3", outside / "step_3")
    (real / "step_3").symlink_to(outside / "step_3", target_is_directory=True)
    with pytest.warns(
        UserWarning, match=r"Skipped a damaged training state \(resuming from \S*step_4\): \S*step_3: a symbolic link"
    ):
        _run(tmp_path / "link", num_epochs=2, max_checkpoints=2)
    assert verify_folder(outside / "step_3")  # the link's target is never pruned
    assert (real / "step_3").is_symlink()
    assert sorted(state.folder.name for state in list_complete_states(real)) == ["step_7", "step_8"]


def test_unprunable_state_is_left_with_warning(tmp_path, monkeypatch):
    """A state that cannot be pruned is left with a warning, and the run goes on."""
    parent, outside = tmp_path / "states", tmp_path / "outside"

    def swap_for_a_link(name):  # the folder to prune becomes a link at that moment: rmtree refuses it (OSError)
        if name == "prune:step_1":
            shutil.move(parent / "step_1", outside)
            (parent / "step_1").symlink_to(outside, target_is_directory=True)

    monkeypatch.setattr(files, "crash_point", swap_for_a_link)
    with pytest.warns(
        UserWarning, match=r"Could not prune the training state \S*step_1 \(.*symbolic link.*\); it is left in place"
    ):
        trainer = _run(parent, max_checkpoints=2)
    assert trainer.num_update_steps_completed == 4 and verify_folder(outside)
    with pytest.warns(UserWarning, match=r"step_1: a symbolic link"):  # left in place, never read through
        assert find_resumable_state(parent).folder.name == "step_4"


def test_other_kind_of_state_is_refused(tmp_path):
    """pytorch-accelerated's training states are Accelerate save_state folders: resuming one must not start over."""
    import pytest
    import torch
    from torch import nn

    from pytorch_accel_trainer import Trainer
    from pytorch_accel_trainer.errors import CheckpointError

    folder = tmp_path / "epoch_5"
    folder.mkdir()
    (folder / "random_states_0.pkl").write_bytes(b"")
    (folder / "model.safetensors").write_bytes(b"")
    model = nn.Linear(1, 1)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    data = torch.utils.data.TensorDataset(torch.zeros(4, 1), torch.zeros(4, 1))
    with pytest.raises(
        CheckpointError,
        match=r"holds \['random_states_0.pkl', 'model.safetensors'\] but no training state of this trainer",
    ):
        trainer.train(data, num_epochs=1, resume_from=folder)


# ------------------------------------------------------------------------------------------------
# Runs: every state knows its run; two runs never mix in one folder; resume_from says what it found
# ------------------------------------------------------------------------------------------------


class DieAtEpoch(Exception):
    """Stands for the process dying."""


class DieAt(TrainerCallback):
    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, **kwargs):
        if trainer.run_history.current_epoch == self.epoch:
            raise DieAtEpoch()


def _trainer(save_dir, lr, die_at=None, **callback_kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    callbacks = [SaveTrainingStateCallback(save_dir, save_every_n_epochs=1, **callback_kwargs)]
    if die_at is not None:
        callbacks.append(DieAt(die_at))
    return Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=lr), callbacks=callbacks)


def _train(trainer, resume_from=None, num_epochs=6):
    trainer.train(regression_dataset(8), num_epochs=num_epochs, per_device_batch_size=2, resume_from=resume_from)


def _manifests(folder):
    return {path.parent.name: json.loads(path.read_text()) for path in folder.glob(f"*/{MANIFEST_NAME}")}


def test_new_run_refuses_another_runs_folder(tmp_path):
    """A new run refuses a folder holding another run's states, before any step."""
    ck = tmp_path / "ck"
    _train(_trainer(ck, lr=0.1, max_checkpoints=3))  # run A
    a_states = _manifests(ck)
    assert sorted(a_states) == ["epoch_5", "epoch_6", "final"]
    assert len({manifest["run_id"] for manifest in a_states.values()}) == 1  # each state names its run
    trainer_b = _trainer(ck, lr=0.5, max_checkpoints=3)
    weights_before = trainer_b.model.weight.detach().clone()
    with pytest.raises(
        CheckpointError,
        match=(
            r"(?s)ck holds training states of another run \(epoch_5, epoch_6, final \(run [0-9a-f]{32}\)\), and this "
            r"run is a new run \(no state resumed\).*another folder.*resume_from=.*ck'.*allow_other_runs=True"
        ),
    ):
        _train(trainer_b)
    assert torch.equal(trainer_b.model.weight, weights_before)  # refused before any step
    assert _manifests(ck) == a_states


def test_two_runs_in_one_folder_kept_apart(tmp_path, capsys):
    """Run B in run A's folder (allowed explicitly), with max_checkpoints, dies in epoch 4;
    its resume continues B (B's learning rate, B's update count), and neither run prunes the other's states."""
    ck = tmp_path / "ck"
    _train(_trainer(ck, lr=0.1, max_checkpoints=3))  # run A: 6 epochs of 4 updates
    a_states = _manifests(ck)
    with pytest.raises(DieAtEpoch):
        _train(_trainer(ck, lr=0.5, die_at=4, max_checkpoints=3, allow_other_runs=True))  # run B
    states = _manifests(ck)
    b_states = {name: manifest for name, manifest in states.items() if name not in a_states}
    assert sorted(b_states) == ["epoch_1", "epoch_2", "epoch_3"]  # not pruned for A's later ones
    assert {name: states[name] for name in a_states} == a_states  # A's untouched
    (b_run,) = {manifest["run_id"] for manifest in b_states.values()}
    assert (ck / "latest").read_text().strip() == "epoch_3"
    capsys.readouterr()
    resumed = _trainer(ck, lr=0.3, max_checkpoints=3, allow_other_runs=True)
    with pytest.warns(UserWarning, match=r"also holds the states of other runs \(epoch_5, epoch_6, final"):
        resumed.train(regression_dataset(8), 4, per_device_batch_size=2, resume_from=ck, allow_resume_changes=True)
    printed = capsys.readouterr().out
    assert (
        f"Resuming from {ck / 'epoch_3'} (after 12 optimizer updates) at the start of epoch 4, run {b_run}" in printed
    )
    assert "optimizer param_groups[0]['lr']: saved 0.5, now 0.3" in printed  # B's optimizer state, not A's (0.1)
    assert resumed.num_update_steps_completed == 16
    states = _manifests(ck)
    assert {name: states[name] for name in a_states} == a_states  # B's pruning left A's states alone
    assert sorted(name for name in states if states[name]["run_id"] == b_run) == ["epoch_3", "epoch_4", "final-2"]


def test_state_without_run_id_is_refused(tmp_path):
    """Every state names its run: a manifest without ``run_id`` is a damaged one, skipped like any other."""
    ck = tmp_path / "ck"
    _train(_trainer(ck, lr=0.1), num_epochs=2)
    for path in ck.glob(f"*/{MANIFEST_NAME}"):
        manifest = json.loads(path.read_text())
        del manifest["run_id"]
        path.write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError, match=r"final/manifest\.json: damaged manifest: run_id is None; it must be 32 hex"
    ):
        _train(_trainer(ck, lr=0.1), resume_from=ck, num_epochs=3)


def test_resume_from_says_what_it_found(tmp_path, capsys):
    """Only an absent or empty folder starts a new run; a run folder means its states."""
    trainer = _trainer(tmp_path / "ck", lr=0.1)
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("not a state")
    with pytest.raises(CheckpointError, match=r"resume_from='.*stray' holds notes.txt but no training state"):
        _train(trainer, resume_from=stray)
    link = tmp_path / "link"
    link.symlink_to(stray)
    with pytest.raises(CheckpointError, match="holds notes.txt but no training state"):
        _train(trainer, resume_from=link)
    run_folder = tmp_path / "runs" / "x"
    _train(_trainer(run_folder / "training_states", lr=0.1), num_epochs=1)
    (run_folder / "config.yaml").write_text("model: {}\n")
    resumed = _trainer(run_folder / "training_states", lr=0.1)
    _train(resumed, resume_from=run_folder, num_epochs=2)
    assert f"from {run_folder / 'training_states' / 'final'} (after 4 optimizer updates" in capsys.readouterr().out
    assert resumed.num_update_steps_completed == 8
    empty = tmp_path / "empty"
    empty.mkdir()
    _train(_trainer(empty, lr=0.1), resume_from=empty, num_epochs=1)
    assert "empty' holds no training state yet: starting a new run." in capsys.readouterr().out


def test_a_typo_in_a_state_name_is_an_error_not_a_new_run(tmp_path):
    """``resume_from`` a state that does not exist, beside others (``states/epoch_30`` where ``states/`` holds
    ``epoch_1`` and ``final``), is a FileNotFoundError listing them, as for a URL, not a new run. A missing folder
    whose parent holds no state still starts one (a preemptible job's first start)."""
    states = tmp_path / "states"
    _train(_trainer(states, lr=0.1), num_epochs=2)
    trainer = _trainer(tmp_path / "other", lr=0.1)
    with pytest.raises(
        FileNotFoundError,
        match=r"'.*states/epoch_30' does not exist, but .* holds the training states "
        r"\['epoch_1', 'epoch_2', 'final'\]: pass one of those",
    ):
        _train(trainer, resume_from=states / "epoch_30")
    assert trainer.num_update_steps_completed == 0 and list((tmp_path / "other").iterdir()) == []  # nothing saved
    _train(trainer, resume_from=tmp_path / "first_start" / "states", num_epochs=1)
    assert trainer.num_update_steps_completed == 4


def test_paths_expand_home_and_environment_variables(tmp_path, monkeypatch, capsys):
    """``~`` and ``$VARIABLE`` in a path are expanded as a shell would (no folder named ``~`` or ``$HOME`` in the
    working folder); a variable that is not set is a ValueError before any step."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.chdir(tmp_path)
    _train(_trainer("~/states", lr=0.1), num_epochs=1)
    assert (tmp_path / "home" / "states" / "final" / MANIFEST_NAME).is_file()
    trainer = _trainer("$SCRATCH/states", lr=0.1)
    _train(trainer, resume_from="~/states", num_epochs=2)
    assert f"Resuming from {tmp_path / 'home' / 'states' / 'final'}" in capsys.readouterr().out
    assert (tmp_path / "scratch" / "states" / "final" / MANIFEST_NAME).is_file()
    trainer = _trainer(tmp_path / "scratch" / "other", lr=0.1)
    with pytest.raises(
        ValueError, match=r"'\$NOT_SET/states' names the environment variable \$NOT_SET, which is not set"
    ):
        _train(trainer, resume_from="$NOT_SET/states")
    with pytest.raises(ValueError, match=r"names the environment variable \$\{NOT_SET\}"):
        SaveTrainingStateCallback("${NOT_SET}/states")
    assert trainer.num_update_steps_completed == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["home", "scratch"]  # no '~', '$HOME' nor '$NOT_SET'


def test_edited_older_manifest_is_skipped(tmp_path):
    """A manifest edited to look newer than its files is a damaged state, skipped as
    docs/training_state.md says, and the newest good state is resumed."""
    ck = tmp_path / "ck"
    _train(_trainer(ck, lr=0.1, save_at_end=False), num_epochs=2)
    path = ck / "epoch_1" / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["num_update_steps_completed"] = 999
    path.write_text(json.dumps(manifest))
    trainer = _trainer(ck, lr=0.1, save_at_end=False)
    with pytest.warns(UserWarning, match=r"(?s)Skipped a damaged training state \(resuming from .*epoch_2\).*epoch_1"):
        _train(trainer, resume_from=ck, num_epochs=3)
    assert trainer.num_update_steps_completed == 12


def test_second_train_call_is_not_refused(tmp_path, capsys):
    """Progressive unfreezing: one script, one trainer and callback, train() twice without resume_from."""
    ck = tmp_path / "ck"
    trainer = _trainer(ck, lr=0.1)
    _train(trainer, num_epochs=1)
    _train(trainer, num_epochs=2)
    runs = {name: manifest["run_id"] for name, manifest in _manifests(ck).items()}
    assert sorted(runs) == ["epoch_1", "epoch_1-2", "epoch_2", "final", "final-2"]
    assert runs["epoch_1"] == runs["final"] != runs["epoch_1-2"] == runs["epoch_2"] == runs["final-2"]
    capsys.readouterr()
    with pytest.warns(UserWarning, match=r"also holds the states of other runs \(epoch_1, final \(run"):
        _train(_trainer(ck, lr=0.1), resume_from=ck, num_epochs=3)  # the second call's run, saved last
    assert (
        f"Resuming from {ck / 'final-2'} (after 8 optimizer updates) at the start of epoch 3, run {runs['final-2']}"
        in capsys.readouterr().out
    )
