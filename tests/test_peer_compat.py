"""pytorch-accelerated 0.1.61's internals that scripts override or call keep working (issue 16), done correctly."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import linear_dataset, make_linear
from torch import nn

from pytorch_accel_trainer import Trainer, TrainerPlaceholderValues
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback
from pytorch_accel_trainer.state.training_state import find_resumable_state
from pytorch_accel_trainer.tracking import InMemoryRunHistory, LossTracker
from pytorch_accel_trainer.trainer import replace_trainer_placeholder_values

ROOT = Path(__file__).resolve().parents[1]


def _trainer(**kwargs):
    model = make_linear()
    return Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=(), **kwargs)


def test_a_stand_in_model_is_accepted_until_the_trainer_prepares_it():
    trainer = Trainer(
        "irrelevant", "irrelevant", "irrelevant", callbacks=()
    )  # as pytorch-accelerated's tests build one
    with pytest.raises(TypeError, match="model is a str; pass a torch.nn.Module"):
        trainer.train(linear_dataset(8), num_epochs=1)


def test_the_loop_calls_an_overridden_perform_forward_and_backward_passes_once_per_batch():
    calls = []

    class Counting(Trainer):
        def _perform_forward_and_backward_passes(self, batch, step):  # pytorch-accelerated's signature
            calls.append(step)
            super()._perform_forward_and_backward_passes(batch, step)  # no window flag: the trainer works it out

    model = make_linear()
    trainer = Counting(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    trainer.train(linear_dataset(10), num_epochs=1, per_device_batch_size=2, gradient_accumulation_steps=2)
    assert calls == [0, 1, 2, 3, 4]
    assert trainer.num_update_steps_completed == 3  # windows (0, 1), (2, 3) and the partial (4,)


def test_create_run_config_takes_train_arguments_by_keyword_as_pytorch_accelerated():
    trainer = _trainer()
    trainer.train(linear_dataset(12), num_epochs=1, per_device_batch_size=4)
    config = trainer._create_run_config(
        per_device_batch_size=4,
        num_epochs=5,
        gradient_accumulation_steps=1,
        max_num_train_steps=None,
        gradient_clip_value=None,
    )
    assert (config.num_epochs, config.num_update_steps_per_epoch, config.max_num_train_steps) == (5, 3, 15)


def test_replace_trainer_placeholder_values_takes_the_trainer_and_the_factory():
    trainer = _trainer()
    trainer.train(linear_dataset(12), num_epochs=4, per_device_batch_size=4)
    factory = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=TrainerPlaceholderValues.NUM_EPOCHS * 2)
    assert replace_trainer_placeholder_values(trainer, factory).keywords == {"step_size": 8}


def test_load_checkpoint_returns_the_whole_checkpoint_and_get_model_keeps_compile_on_request(tmp_path):
    model = torch.compile(make_linear())  # compiled by the user: get_model() strips it unless asked to keep it
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    trainer.save_checkpoint(tmp_path / "model.pt", checkpoint_kwargs={"epoch": 3})
    checkpoint = trainer.load_checkpoint(tmp_path / "model.pt")
    assert checkpoint["epoch"] == 3 and set(checkpoint["model_state_dict"]) == {"weight", "bias"}
    assert isinstance(trainer.get_model(keep_torch_compile=True), torch._dynamo.eval_frame.OptimizedModule)
    assert not isinstance(trainer.get_model(), torch._dynamo.eval_frame.OptimizedModule)


def test_loss_tracker_keeps_pytorch_accelerated_api_for_numbers():
    tracker = LossTracker()
    for loss, size in [(105.5, 64), (94.7, 32), (98.0, 16)]:
        tracker.update(loss, batch_size=size)
    assert tracker.loss_value == 98.0 and tracker.running_count == 112
    assert tracker.average == pytest.approx((105.5 * 64 + 94.7 * 32 + 98.0 * 16) / 112, abs=0)
    tracker.update(torch.tensor(2.0))  # batch_size defaults to 1
    assert tracker.running_count == 113 and tracker.average == pytest.approx((tracker.total_loss / 113).item())


def test_run_history_unknown_metric_is_both_a_key_error_and_a_value_error_and_epochs_can_be_set():
    history = InMemoryRunHistory()
    for error in (KeyError, ValueError):
        with pytest.raises(error, match="No metric named 'acc'"):
            history.get_latest_metric("acc")
    history._set_epoch(5)
    history._increment_epoch()
    assert history.current_epoch == 6
    with pytest.raises(ValueError, match="epoch is 0; epochs are counted from 1"):
        history._set_epoch(0)


def test_training_state_folders_are_named_as_pytorch_accelerated_and_resume_from_one_of_them(tmp_path):
    def run(num_epochs, resume_from=None):
        model = make_linear()
        callback = SaveTrainingStateCallback(tmp_path, save_every_n_epochs=2, save_every_n_steps=5)
        trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=[callback])
        trainer.train(linear_dataset(8), num_epochs=num_epochs, per_device_batch_size=4, resume_from=resume_from)
        return trainer

    first = run(4)
    names = sorted(path.name for path in tmp_path.iterdir() if path.is_dir())
    assert names == ["epoch_2", "epoch_4", "final", "step_5"]  # 2 updates per epoch; final always, as documented
    resumed = run(6, resume_from=tmp_path / "epoch_2")  # as pytorch-accelerated's docs resume
    assert resumed.num_update_steps_completed == 12
    names = sorted(path.name for path in tmp_path.iterdir() if path.is_dir())
    assert "epoch_4-2" in names and "final-2" in names and "epoch_6" in names  # nothing overwritten
    assert find_resumable_state(tmp_path).manifest["num_update_steps_completed"] == 12  # newest by updates
    assert first.num_update_steps_completed == 8


def test_a_state_name_that_is_not_a_plain_folder_name_is_refused(tmp_path):
    trainer = _trainer()
    trainer.train(linear_dataset(8), num_epochs=1)
    for name in ("a/b", "latest", ".tmp-x", ""):
        with pytest.raises(ValueError, match=r"is not a training-state folder name: pass one plain folder name"):
            trainer.save_training_state(tmp_path, name=name)
    assert trainer.save_training_state(tmp_path, name="before_decay").name == "before_decay"
    assert find_resumable_state(tmp_path).folder.name == "before_decay"  # found by its manifest


def test_the_peer_suite_runner_script_documents_its_command():
    completed = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "peer" / "run_peer_suite.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "run_peer_suite.py" in completed.stdout and "--sdist" in completed.stdout


class _TimmLikeScheduler:
    """The two methods of a timm scheduler that the trainer calls, recorded."""

    def __init__(self, optimizer):
        self.optimizer, self.calls = optimizer, []

    def step(self, epoch, metric=None):
        self.calls.append(("step", epoch))

    def step_update(self, num_updates, metric=None):
        self.calls.append(("step_update", num_updates))


def test_trainer_with_timm_scheduler_counts_updates_of_the_run_and_steps_each_epoch_without_eval_data():
    from pytorch_accel_trainer.trainer import TrainerWithTimmScheduler

    model = make_linear()
    trainer = TrainerWithTimmScheduler(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    trainer.train(
        linear_dataset(12),
        num_epochs=2,
        per_device_batch_size=2,
        gradient_accumulation_steps=2,
        create_scheduler_fn=_TimmLikeScheduler,
    )
    epoch_of_updates = [("step_update", n) for n in (1, 2, 3)]
    assert trainer.scheduler.calls == [
        *epoch_of_updates,
        ("step", 1),
        *[("step_update", n) for n in (4, 5, 6)],
        ("step", 2),
    ]
    assert trainer.num_updates == 6


def test_a_trainer_subclass_declares_its_own_on_event_for_its_callbacks():
    from pytorch_accel_trainer.callbacks import TrainerCallback

    class Counter(TrainerCallback):
        calls = 0

        def on_my_event(self, trainer, **kwargs):
            Counter.calls += 1

    class TrainerWithMyEvent(Trainer):
        callback_events = ("on_my_event",)

        def train_epoch_end(self):
            self.callback_handler.call_event("on_my_event", self)

    model = make_linear()
    trainer = TrainerWithMyEvent(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[Counter])
    trainer.train(linear_dataset(8), num_epochs=2)
    assert Counter.calls == 2
    plain = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[Counter])
    with pytest.warns(UserWarning, match="'on_my_event', which is not a trainer event and was never called"):
        plain.train(linear_dataset(8), num_epochs=1)  # a plain Trainer never fires it: said once the run ends


def test_overrides_of_create_scheduler_and_the_two_preparation_halves_are_called():
    calls = []

    class CustomTrainer(Trainer):
        def create_scheduler(self):  # no create_scheduler_fn, as seed 003 describes
            calls.append("create_scheduler")
            return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)

        def _prepare_model_and_optimizer(self):
            calls.append("model_and_optimizer")
            super()._prepare_model_and_optimizer()

        def _prepare_dataloaders(self):
            calls.append("dataloaders")
            super()._prepare_dataloaders()

    model = make_linear()
    trainer = CustomTrainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.8), callbacks=())
    trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4, eval_dataset=linear_dataset(4))
    assert calls == ["model_and_optimizer", "dataloaders", "create_scheduler"]
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.8 * 0.5**2)  # stepped after each of 2 updates
    assert len(trainer.train_dataloader) == 2 and len(trainer.eval_dataloader) == 1  # prepared by the halves
