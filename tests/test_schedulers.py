"""Cosine and WSD schedulers with a real Trainer: the learning rate of each update, exact resume, 2 processes,
WSD checkpoints and continuations, argument errors, and the examples of docs/schedulers.md.

``train_wsd_on_processes`` is the scenario of the 2-process test (tests/scripts/scenarios.py runs it).
"""

from __future__ import annotations

import gc
import json
import math
import pathlib
import re
import runpy
import weakref

import pytest
import torch
from conftest import (
    assert_bitwise_equal,
    linear_dataset,
    make_linear,
    make_mlp,
    make_trainer,
    regression_dataset,
)
from torch import nn

from pytorch_accel_trainer import Trainer, TrainerPlaceholderValues
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.callbacks.wsd import WSDCheckpointCallback
from pytorch_accel_trainer.schedulers import (
    CosineLrScheduler,
    SchedulerArgumentError,
    WSDLrScheduler,
    create_stepped_once,
    estimate_checkpoint_steps,
)
from pytorch_accel_trainer.state.checkpointing import MODEL_KEY, load_checkpoint_file
from pytorch_accel_trainer.state.consolidate import full_weights
from pytorch_accel_trainer.state.training_state import find_resumable_state

ROOT = pathlib.Path(__file__).resolve().parents[1]


class LearningRateRecorder(TrainerCallback):
    """The learning rate of each optimizer update (numbered from 1), read before each of its micro-batches."""

    def __init__(self):
        self.by_update: dict[int, set] = {}

    def on_train_step_start(self, trainer, **kwargs):
        update = trainer.num_update_steps_completed + 1
        self.by_update.setdefault(update, set()).add(trainer.optimizer.param_groups[0]["lr"])

    def sequence(self) -> list:
        assert all(len(lrs) == 1 for lrs in self.by_update.values()), self.by_update  # one lr per window
        return [next(iter(self.by_update[update])) for update in sorted(self.by_update)]


class Crash(Exception):
    """Stands for the process dying."""


class CrashAfterUpdate(TrainerCallback):
    def __init__(self, update: int):
        self.update = update

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        if num_update_steps_completed == self.update:
            raise Crash()


def sqrt_decay(fraction: float, lr_min: float = 0.1) -> float:
    return lr_min + (1 - lr_min) * (1 - math.sqrt(fraction))


#: 16 samples, 4 updates per epoch, 4 epochs, warmup 1 epoch from 0, two checkpoints [8, 16], half of each
#: period decaying to a tenth: updates 5-8 and 13-16 decay, 9-12 are back at the base learning rate 0.1.
WSD_LRS = [0.0, 0.025, 0.05, 0.075] + [0.1 * sqrt_decay(t) for t in (0, 0.25, 0.5, 0.75)]
WSD_LRS += [0.1] * 4 + [0.1 * sqrt_decay(t) for t in (0, 0.25, 0.5, 0.75)]


def wsd_factory(**kwargs):
    arguments = {"num_warmup_epochs": 1, "warmup_starting_lr": 0.0, "decay_phase_ratio": 0.5, "lr_min": 0.1}
    return WSDLrScheduler.create_scheduler_fn(**{**arguments, "num_checkpoints": 2, **kwargs})


def train_linear(callbacks=(), num_epochs=4, per_device_batch_size=4, accumulation=1, **kwargs) -> Trainer:
    trainer = make_trainer(make_linear(), lr=0.1, callbacks=list(callbacks))
    trainer.train(
        linear_dataset(16),
        num_epochs=num_epochs,
        per_device_batch_size=per_device_batch_size,
        gradient_accumulation_steps=accumulation,
        **{"create_scheduler_fn": wsd_factory(), **kwargs},
    )
    return trainer


# ------------------------------------------------------------------------------------------------
# The learning rate of each update, with a real Trainer
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("batch_size", "accumulation"), [(4, 1), (2, 2)])
def test_cosine_learning_rate_per_update(batch_size, accumulation):
    """12 updates (3 epochs of 4), 4 of warmup from 0, 4 of cosine from 0.1 to 0.01, 4 held at 0.01; with
    accumulation the schedule counts updates, not batches."""
    recorder = LearningRateRecorder()
    factory = CosineLrScheduler.create_scheduler_fn(
        num_warmup_epochs=1, num_cooldown_epochs=1, warmup_starting_lr=0.0, lr_min=0.01
    )
    trainer = make_trainer(make_linear(), lr=0.1, callbacks=[recorder])
    trainer.train(
        linear_dataset(16),
        num_epochs=3,
        per_device_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        create_scheduler_fn=factory,
    )
    cosine = [0.01 + 0.09 * (1 + math.cos(math.pi * t / 4)) / 2 for t in range(4)]
    assert recorder.sequence() == pytest.approx([0.0, 0.025, 0.05, 0.075, *cosine, 0.01, 0.01, 0.01, 0.01], rel=1e-12)
    assert type(trainer.scheduler) is CosineLrScheduler  # stepped by the trainer itself, never by Accelerate's wrapper
    assert trainer.scheduler.get_updated_values(trainer.num_update_steps_completed) == [
        trainer.optimizer.param_groups[0]["lr"]
    ]
    assert trainer.scheduler.state_dict()["num_updates"] == trainer.num_update_steps_completed == 12


def test_cosine_warmup_ratio_is_linear():
    """A warmup given as a ratio rises linearly to the base learning rate."""
    optimizer = torch.optim.SGD(make_linear().parameters(), lr=0.2)
    scheduler = CosineLrScheduler(optimizer, 4, 5, num_warmup_epochs=1, warmup_starting_lr_ratio=0.1)
    assert [scheduler.get_updated_values(n)[0] for n in range(6)] == pytest.approx(
        [0.02, 0.056, 0.092, 0.128, 0.164, 0.2]
    )
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02)  # the value for 0 updates, before any step


@pytest.mark.parametrize(("batch_size", "accumulation"), [(4, 1), (2, 2)])
def test_wsd_learning_rate_per_update(batch_size, accumulation):
    """WSD gives each update its learning rate, also with gradient accumulation."""
    recorder = LearningRateRecorder()
    trainer = train_linear([recorder], per_device_batch_size=batch_size, accumulation=accumulation)
    assert recorder.sequence() == pytest.approx(WSD_LRS, rel=1e-12)
    assert trainer.scheduler.get_checkpoint_steps() == [8, 16]
    assert trainer.scheduler.get_current_step() == trainer.num_update_steps_completed == 16


def test_wsd_inverse_proportional_decay():
    recorder = LearningRateRecorder()
    train_linear([recorder], create_scheduler_fn=wsd_factory(use_inverse_sqrt_decay=False, num_checkpoints=1))
    decay = [0.1 / (1 + 9 * t) for t in (0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875)]  # lr_min = 0.1
    assert recorder.sequence() == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1, 0.1, 0.1, 0.1, *decay], rel=1e-12)


# ------------------------------------------------------------------------------------------------
# State and exact resume
# ------------------------------------------------------------------------------------------------

SCHEDULERS = {
    "cosine": CosineLrScheduler.create_scheduler_fn(num_warmup_epochs=1, lr_min=1e-4),
    "wsd": WSDLrScheduler.create_scheduler_fn(num_warmup_epochs=1, num_checkpoints=2, decay_phase_ratio=0.25),
}


def _resumable_run(save_dir, scheduler, recorder, crash=None, **save_kwargs) -> Trainer:
    model = make_mlp()
    callbacks = [recorder, SaveTrainingStateCallback(save_dir, save_on_signals=(), **save_kwargs)]
    callbacks += [crash] if crash is not None else []
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=callbacks)
    trainer.train(
        regression_dataset(16),
        num_epochs=3,
        per_device_batch_size=2,
        gradient_accumulation_steps=2,
        create_scheduler_fn=SCHEDULERS[scheduler],
        resume_from=save_dir,
    )
    return trainer


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize(
    ("save_kwargs", "crash_after"),
    [({"save_every_n_steps": 1, "save_every_n_epochs": None}, 6), ({"save_every_n_epochs": 1}, 9)],
    ids=["inside-an-epoch", "between-epochs"],
)
def test_resume_continues_the_schedule(tmp_path, scheduler, save_kwargs, crash_after):
    """Save then resume continues the schedule bit for bit."""
    reference_lrs = LearningRateRecorder()
    reference = _resumable_run(tmp_path / "reference", scheduler, reference_lrs, **save_kwargs)
    resumed_lrs = LearningRateRecorder()
    with pytest.raises(Crash):
        _resumable_run(tmp_path / "run", scheduler, resumed_lrs, crash=CrashAfterUpdate(crash_after), **save_kwargs)
    resumed = _resumable_run(tmp_path / "run", scheduler, resumed_lrs, **save_kwargs)

    assert resumed_lrs.sequence() == reference_lrs.sequence()  # the updates made twice used the same lr too
    assert len(reference_lrs.sequence()) == reference.num_update_steps_completed == 12
    assert_bitwise_equal(resumed.get_model().state_dict(), reference.get_model().state_dict())
    assert_bitwise_equal(resumed.optimizer.state_dict(), reference.optimizer.state_dict())
    assert resumed.scheduler.state_dict() == reference.scheduler.state_dict()


def test_state_without_optimizer_sets_lr():
    """A scheduler state loaded without its optimizer state still sets the learning rate."""
    optimizer = torch.optim.SGD(make_linear().parameters(), lr=0.1)
    scheduler = create_stepped_once(
        WSDLrScheduler, optimizer, total_steps=20, num_warmup_steps=10, warmup_starting_lr=0.0
    )
    for _ in range(5):
        scheduler.step()
    state = scheduler.state_dict()
    fresh = torch.optim.SGD(make_linear().parameters(), lr=0.1)
    restored = create_stepped_once(WSDLrScheduler, fresh, total_steps=20, num_warmup_steps=10, warmup_starting_lr=0.0)
    restored.load_state_dict(state)
    assert restored.get_current_step() == 5
    assert fresh.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_a_deleted_scheduler_is_freed():
    """pytorch-accelerated's lru_cache on a method kept the last scheduler, its optimizer and model alive."""
    scheduler = WSDLrScheduler(torch.optim.SGD(make_linear().parameters(), lr=0.1), total_steps=100, num_checkpoints=2)
    scheduler.step()
    scheduler._get_checkpoint_info.cache_clear()  # kept for code written for pytorch-accelerated
    reference = weakref.ref(scheduler)
    del scheduler
    gc.collect()
    assert reference() is None


@pytest.mark.parametrize(
    ("total_steps", "num_checkpoints", "expected"),
    [
        (100, 1, [100]),
        (100_000, 2, [50_000, 100_000]),
        (200_000, 3, [50_000, 100_000, 200_000]),
        (200_000, 4, [25_000, 50_000, 100_000, 200_000]),
        (50, 3, [12, 25, 50]),
    ],
)
def test_checkpoint_steps_double_to_the_end(total_steps, num_checkpoints, expected):
    """estimate_checkpoint_steps: the steps double, and the last ends the schedule."""
    assert estimate_checkpoint_steps(total_steps, num_checkpoints) == expected


# ------------------------------------------------------------------------------------------------
# Two processes step the scheduler once per update, as one process does
# ------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("wsd_schedule")
def test_two_processes_same_lr_as_one(one_process_scenarios, two_process_scenarios):
    """Global batch 4: 1 process x 4 against 2 processes x 1 x 2 accumulation steps; 16 updates each."""
    single, double = (launch.read_json("wsd_schedule") for launch in (one_process_scenarios, two_process_scenarios))
    assert double["num_processes"] == 2 and double["ranks_agree"]
    assert double["lrs"] == single["lrs"] == pytest.approx(WSD_LRS, rel=1e-12)
    assert double["scheduler_step"] == single["scheduler_step"] == 16
    torch.testing.assert_close(
        torch.tensor(double["parameters"]), torch.tensor(single["parameters"]), rtol=1e-5, atol=1e-6
    )


def train_wsd_on_processes(folder: pathlib.Path, per_device_batch_size: int, accumulation: int) -> None:
    """Train the WSD run on the processes of the launch; the main process writes ``folder/result.json``."""
    recorder = LearningRateRecorder()
    trainer = train_linear(
        [recorder],
        per_device_batch_size=per_device_batch_size,
        accumulation=accumulation,
        train_dataloader_kwargs={"shuffle": False},
    )
    lrs = torch.tensor(recorder.sequence() + [float(trainer.scheduler.get_current_step())], dtype=torch.float64)
    gathered = trainer.gather(lrs.unsqueeze(0))
    parameters = torch.cat([p.detach().flatten() for p in trainer.get_model().parameters()])
    result = {
        "num_processes": trainer.run_config.num_processes,
        "ranks_agree": bool((gathered == gathered[0]).all()),
        "lrs": recorder.sequence(),
        "scheduler_step": trainer.scheduler.get_current_step(),
        "parameters": parameters.tolist(),
    }
    if trainer.run_config.is_world_process_zero:
        (folder / "result.json").write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------
# WSDCheckpointCallback
# ------------------------------------------------------------------------------------------------


class KeepWeights(TrainerCallback):
    """A copy of the weights after each optimizer update."""

    def __init__(self):
        self.after_update: dict[int, dict] = {}

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        state = trainer.get_model().state_dict()
        self.after_update[num_update_steps_completed] = {name: value.clone() for name, value in state.items()}


def test_wsd_callback_saves_around_decays(tmp_path):
    """WSDCheckpointCallback saves a state before each decay and an export after it."""
    weights = KeepWeights()
    trainer = train_linear([weights, WSDCheckpointCallback(tmp_path)])  # updates 5-8 and 13-16 decay

    saved = sorted(path.name for path in tmp_path.iterdir())
    assert saved == [
        "checkpoint_12_wsd_pre_decay",
        "checkpoint_16_wsd_post_decay.pt",
        "checkpoint_4_wsd_pre_decay",
        "checkpoint_8_wsd_post_decay.pt",
    ]
    for step in (4, 12):
        state = find_resumable_state(tmp_path / f"checkpoint_{step}_wsd_pre_decay")
        assert state.manifest["num_update_steps_completed"] == step
        assert_bitwise_equal(full_weights(state.folder), weights.after_update[step])
    for step in (8, 16):
        export = load_checkpoint_file(tmp_path / f"checkpoint_{step}_wsd_post_decay.pt")
        assert (export["step"], export["checkpoint_type"], export["total_steps"]) == (step, "wsd_post_decay", 16)
        assert_bitwise_equal(export[MODEL_KEY], weights.after_update[step])
    assert_bitwise_equal(export[MODEL_KEY], trainer.get_model().state_dict())


def test_wsd_continuation_from_pre_decay_state(tmp_path):
    """A continuation from a pre-decay state holds, then decays over its own length."""
    train_linear([WSDCheckpointCallback(tmp_path / "first")])
    pre_decay = tmp_path / "first" / "checkpoint_12_wsd_pre_decay"
    saved_weights = full_weights(find_resumable_state(pre_decay).folder)
    weights, recorder = KeepWeights(), LearningRateRecorder()

    class WeightsAtStart(TrainerCallback):
        def on_train_epoch_start(self, trainer, **kwargs):
            weights.after_update.setdefault(0, {k: v.clone() for k, v in trainer.get_model().state_dict().items()})

    callbacks = [WSDCheckpointCallback(tmp_path / "second", initial_checkpoint=pre_decay), WeightsAtStart(), recorder]
    trainer = train_linear(
        callbacks, num_epochs=2, create_scheduler_fn=wsd_factory(is_continuation_from_checkpoint=True)
    )

    assert_bitwise_equal(weights.after_update[0], saved_weights)
    # 8 updates, no warmup, checkpoints [4, 8] each half stable, half decaying (the saved schedule's shape)
    period = [0.1, 0.1, 0.1 * sqrt_decay(0), 0.1 * sqrt_decay(0.5)]
    assert recorder.sequence() == pytest.approx(period + period, rel=1e-12)
    assert trainer.num_update_steps_completed == 8 and trainer.scheduler.get_checkpoint_steps() == [4, 8]
    assert (tmp_path / "second" / "checkpoint_8_wsd_post_decay.pt").is_file()


def test_resume_after_last_update_exports(tmp_path):
    """A run resumed after its last update still writes its final export."""
    states = tmp_path / "states"
    train_linear(
        [WSDCheckpointCallback(tmp_path), SaveTrainingStateCallback(states, save_on_signals=())], resume_from=states
    )
    final_export = tmp_path / "checkpoint_16_wsd_post_decay.pt"
    final_export.unlink()  # as if the process died right after the state of the last update was written
    resumed = train_linear(
        [WSDCheckpointCallback(tmp_path), SaveTrainingStateCallback(states, save_on_signals=())], resume_from=states
    )
    assert resumed.num_update_steps_completed == 16
    assert_bitwise_equal(load_checkpoint_file(final_export)[MODEL_KEY], resumed.get_model().state_dict())


def test_interrupted_continuation_resumes(tmp_path):
    """An interrupted continuation resumes exactly, without loading its initial checkpoint again."""
    train_linear([WSDCheckpointCallback(tmp_path / "first")])
    pre_decay = tmp_path / "first" / "checkpoint_12_wsd_pre_decay"

    def continuation(save_dir, recorder, crash=()):
        callbacks = [
            # each run its own folder: a new run refuses one that holds another run's states
            WSDCheckpointCallback(tmp_path / f"second-{save_dir.name}", initial_checkpoint=pre_decay),
            recorder,
            *crash,
            SaveTrainingStateCallback(save_dir, save_every_n_steps=1, save_on_signals=()),
        ]
        factory = wsd_factory(is_continuation_from_checkpoint=True)
        return train_linear(callbacks, num_epochs=2, create_scheduler_fn=factory, resume_from=save_dir)

    reference_lrs, resumed_lrs = LearningRateRecorder(), LearningRateRecorder()
    reference = continuation(tmp_path / "reference", reference_lrs)
    with pytest.raises(Crash):
        continuation(tmp_path / "run", resumed_lrs, crash=[CrashAfterUpdate(5)])
    resumed = continuation(tmp_path / "run", resumed_lrs)
    assert resumed_lrs.sequence() == reference_lrs.sequence()
    assert_bitwise_equal(resumed.get_model().state_dict(), reference.get_model().state_dict())
    assert resumed.scheduler.state_dict() == reference.scheduler.state_dict()


def test_wsd_continuation_from_export(tmp_path):
    """A continuation from a post-decay export starts a new stable phase and writes its own final export."""
    train_linear([WSDCheckpointCallback(tmp_path)])
    export = tmp_path / "checkpoint_16_wsd_post_decay.pt"
    recorder = LearningRateRecorder()
    callback = WSDCheckpointCallback(tmp_path / "more", initial_checkpoint=export)
    train_linear(
        [callback, recorder], num_epochs=1, create_scheduler_fn=wsd_factory(is_continuation_from_checkpoint=True)
    )
    assert recorder.sequence()[0] == 0.1  # a new stable phase, although the export's optimizer holds the decayed lr
    assert callback.last_checkpoint_step == 4  # the continuation's own final export


def test_wsd_callback_refuses_what_cannot_work(tmp_path):
    with pytest.raises(ValueError, match="needs a scheduler with get_checkpoint_steps and get_decay_info"):
        train_linear([WSDCheckpointCallback(tmp_path)], create_scheduler_fn=CosineLrScheduler.create_scheduler_fn())
    with pytest.raises(FileNotFoundError, match="initial_checkpoint='.*absent'.*no such file or folder"):
        train_linear([WSDCheckpointCallback(tmp_path, initial_checkpoint=tmp_path / "absent")])
    with pytest.raises(ValueError, match="the scheduler was not created for a continuation"):
        train_linear([WSDCheckpointCallback(tmp_path, initial_checkpoint=tmp_path)])
    with pytest.raises(TypeError, match="save_optimizer='yes'"):
        WSDCheckpointCallback(tmp_path, save_optimizer="yes")
    with pytest.warns(UserWarning, match="ends at update 12 but this run stops after 10 updates"):
        train_linear([WSDCheckpointCallback(tmp_path / "short")], max_num_train_steps=10)


# ------------------------------------------------------------------------------------------------
# Arguments checked at the boundary
# ------------------------------------------------------------------------------------------------


def _optimizer(lr=0.1):
    return torch.optim.SGD(make_linear().parameters(), lr=lr)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_num_epochs": 0}, r"total_num_epochs is 0; pass a whole number >= 1\."),
        ({"num_update_steps_per_epoch": 2.5}, r"num_update_steps_per_epoch is 2.5; pass a whole number >= 1\."),
        ({"num_warmup_epochs": -1}, r"num_warmup_epochs is -1; pass a number >= 0\."),
        ({"k_decay": 0}, r"k_decay is 0; pass a number > 0\."),
        ({"min_lr_ratio": 1.5}, r"min_lr_ratio is 1.5; pass a number >= 0 and <= 1 or None\."),
        ({"num_warmup_epochs": 3, "num_cooldown_epochs": 3}, r"are longer than total_num_epochs=5.*shorten the warmup"),
        ({"total_num_epochs": TrainerPlaceholderValues.NUM_EPOCHS}, r"placeholder .* pass the number itself"),
    ],
)
def test_cosine_arguments_are_checked(kwargs, message):
    with pytest.raises(SchedulerArgumentError, match=message):
        CosineLrScheduler(_optimizer(), **{"total_num_epochs": 5, "num_update_steps_per_epoch": 10, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_checkpoints": 0}, r"num_checkpoints is 0; pass a whole number >= 1\."),
        ({"decay_phase_ratio": 1.5}, r"decay_phase_ratio is 1.5; pass a number >= 0 and <= 1\."),
        ({"num_warmup_steps": -1}, r"num_warmup_steps is -1; pass a whole number >= 0 or None\."),
        ({"num_warmup_steps": 200}, r"num_warmup_steps=200 is longer than the schedule's 100 steps"),
        ({"lr_min": 0, "use_inverse_sqrt_decay": False}, r"divides by lr_min; pass a positive lr_min"),
        ({"total_steps": 3, "num_checkpoints": 3}, r"num_checkpoints=3 needs at least 4 steps.*total_steps is 3"),
        ({"num_epochs": 2}, r"total_steps=100 was given with num_epochs=2.*pass either total_steps"),
        ({"total_steps": None}, r"The schedule's length is unknown.*pass total_steps"),
        ({"warmup_starting_lr": 1.0}, r"warmup_starting_lr=1.0 is above the largest base learning rate 0.1"),
        ({"use_inverse_sqrt_decay": "yes"}, r"use_inverse_sqrt_decay is 'yes'; pass True or False\."),
    ],
)
def test_wsd_arguments_are_checked(kwargs, message):
    with pytest.raises(SchedulerArgumentError, match=message):
        WSDLrScheduler(_optimizer(), **{"total_steps": 100, **kwargs})


def test_argument_errors_keep_assertion_error():
    """Argument errors are ValueErrors, and AssertionErrors as pytorch-accelerated's asserts raised."""
    with pytest.raises(ValueError):
        WSDLrScheduler(_optimizer(), total_steps=0)
    with pytest.raises(AssertionError):  # pytorch-accelerated asserted
        WSDLrScheduler(_optimizer(), total_steps=0)


def test_factories_check_arguments_early():
    """The scheduler factories check their arguments when created, not when called."""
    with pytest.raises(SchedulerArgumentError, match=r"num_warmup_epochs is -1"):
        CosineLrScheduler.create_scheduler_fn(num_warmup_epochs=-1)
    with pytest.raises(SchedulerArgumentError, match=r"num_warmup_epochs is 0.5; pass a whole number"):
        WSDLrScheduler.create_scheduler_fn(num_warmup_epochs=0.5)


def test_a_state_of_another_scheduler_is_refused():
    cosine = CosineLrScheduler(_optimizer(), total_num_epochs=2, num_update_steps_per_epoch=5)
    wsd = WSDLrScheduler(_optimizer(), total_steps=10)
    with pytest.raises(ValueError, match=r"Not a WSDLrScheduler state: unexpected keys \['k_decay'"):
        wsd.load_state_dict(cosine.state_dict())
    with pytest.raises(ValueError, match=r"Not a CosineLrScheduler state: unexpected keys \['checkpoint_decay_info'"):
        cosine.load_state_dict(wsd.state_dict())


# ------------------------------------------------------------------------------------------------
# The documentation's examples run as written
# ------------------------------------------------------------------------------------------------

DOC_BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "schedulers.md").read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("index", range(len(DOC_BLOCKS)))
def test_docs_examples_run(tmp_path, monkeypatch, index):
    monkeypatch.chdir(tmp_path)
    needed = range(index) if "# uses the files of the blocks above" in DOC_BLOCKS[index] else []
    for number in [*needed, index]:
        script = tmp_path / f"schedulers_md_block_{number}.py"
        script.write_text(DOC_BLOCKS[number])
        runpy.run_path(str(script), run_name="__main__")
