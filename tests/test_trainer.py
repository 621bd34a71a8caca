"""The Trainer's skeleton: hook and event order, run limits, evaluation and the public API."""

from __future__ import annotations

import dataclasses
import functools
import sys

import pytest
import torch
from conftest import (
    RecordingCallback,
    StreamDataset,
    assert_bitwise_equal,
    linear_dataset,
    make_linear,
    make_mlp,
    make_trainer,
    regression_dataset,
)
from torch import nn

from pytorch_accel_trainer import Trainer, TrainerPlaceholderValues
from pytorch_accel_trainer.callbacks import StopTrainingError, TrainerCallback
from pytorch_accel_trainer.run_config import TrainerRunConfig

HOOKS = (
    "create_train_dataloader",
    "create_eval_dataloader",
    "create_scheduler",
    "training_run_start",
    "train_epoch_start",
    "calculate_train_batch_loss",
    "backward_step",
    "optimizer_step",
    "scheduler_step",
    "optimizer_zero_grad",
    "train_epoch_end",
    "eval_epoch_start",
    "calculate_eval_batch_loss",
    "eval_epoch_end",
    "training_run_epoch_end",
    "training_run_end",
    "evaluation_run_start",
    "evaluation_run_end",
)


def _recording_trainer_class(log: list) -> type:
    def wrap(name):
        def hook(self, *args, **kwargs):
            log.append(name)
            return getattr(Trainer, name)(self, *args, **kwargs)

        return hook

    return type("RecordingTrainer", (Trainer,), {name: wrap(name) for name in HOOKS})


def _documented_training_run(num_epochs, train_batches, eval_batches, accumulation=1, with_scheduler=True):
    """The sequence of the pseudocode in docs/inside_the_trainer.md ("What goes on inside the Trainer?")."""
    sequence = ["create_train_dataloader", "create_eval_dataloader"]
    sequence += ["create_scheduler"] if with_scheduler else []
    sequence += ["training_run_start", "on_training_run_start"]
    for _ in range(num_epochs):
        sequence += ["train_epoch_start", "on_train_epoch_start"]
        for step in range(train_batches):
            sequence += ["on_train_step_start", "calculate_train_batch_loss", "on_train_step_end", "backward_step"]
            if (step + 1) % accumulation == 0 or step + 1 == train_batches:
                sequence += ["optimizer_step", "scheduler_step", "optimizer_zero_grad", "on_optimizer_step_end"]
        sequence += ["train_epoch_end", "on_train_epoch_end", "eval_epoch_start", "on_eval_epoch_start"]
        sequence += ["on_eval_step_start", "calculate_eval_batch_loss", "on_eval_step_end"] * eval_batches
        sequence += ["eval_epoch_end", "on_eval_epoch_end", "training_run_epoch_end", "on_training_run_epoch_end"]
    return sequence + ["training_run_end", "on_training_run_end"]


def _shared_log_callback(log):
    recorder = RecordingCallback()
    recorder.events = log
    return recorder


@pytest.mark.parametrize("accumulation", [1, 2])
def test_training_run_follows_documented_order(accumulation):
    log: list = []
    trainer = make_trainer(
        make_linear(), callbacks=[_shared_log_callback(log)], trainer_class=_recording_trainer_class(log)
    )
    assert log == ["on_init_end"]
    log.clear()

    trainer.train(
        linear_dataset(6),
        num_epochs=2,
        eval_dataset=linear_dataset(4),
        per_device_batch_size=2,
        gradient_accumulation_steps=accumulation,
        create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1),
    )

    assert log == _documented_training_run(2, train_batches=3, eval_batches=2, accumulation=accumulation)


def test_evaluation_run_follows_documented_order():
    log: list = []
    trainer = make_trainer(
        make_linear(), callbacks=[_shared_log_callback(log)], trainer_class=_recording_trainer_class(log)
    )
    log.clear()
    trainer.evaluate(linear_dataset(5), per_device_batch_size=2)
    expected = ["create_eval_dataloader", "evaluation_run_start", "on_evaluation_run_start", "eval_epoch_start"]
    expected += ["on_eval_epoch_start"] + ["on_eval_step_start", "calculate_eval_batch_loss", "on_eval_step_end"] * 3
    expected += ["eval_epoch_end", "on_eval_epoch_end", "evaluation_run_end", "on_evaluation_run_end"]
    assert log == expected


def test_fits_a_line_and_records_losses():
    model = make_linear()
    trainer = make_trainer(model)
    trainer.train(linear_dataset(64), num_epochs=6, eval_dataset=linear_dataset(32, seed=1), per_device_batch_size=8)
    assert model.weight.item() == pytest.approx(2.0, abs=1e-3)
    assert model.bias.item() == pytest.approx(3.0, abs=1e-3)
    train_losses = trainer.run_history.get_metric_values("train_loss_epoch")
    assert len(train_losses) == 6 and train_losses[-1] < train_losses[0] / 100
    assert trainer.run_history.get_latest_metric("eval_loss_epoch") < 1e-5
    assert trainer.run_history.current_epoch == 7


def test_modes_set_by_epoch_start_hooks(recorder):
    """Train mode and eval mode are set by the epoch-start hooks."""
    modes = []

    class ModeSpy(TrainerCallback):
        def on_train_step_start(self, trainer, **kwargs):
            modes.append(("train", trainer.model.training))

        def on_eval_step_start(self, trainer, **kwargs):
            modes.append(("eval", trainer.model.training))

    trainer = make_trainer(make_linear(), callbacks=[ModeSpy])
    trainer.train(linear_dataset(4), num_epochs=1, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    assert modes == [("train", True), ("eval", False)]


@pytest.mark.parametrize(
    ("num_epochs", "max_steps", "expected_steps", "expected_epochs"),
    [(10, 5, 5, 2), (1, 100, 3, 1), (None, 7, 7, 3), (2, None, 6, 2)],
)
def test_first_of_epochs_and_max_steps_ends(num_epochs, max_steps, expected_steps, expected_epochs):
    """Whichever of num_epochs and max_num_train_steps comes first ends the run."""
    trainer = make_trainer(make_linear())
    trainer.train(linear_dataset(6), num_epochs=num_epochs, per_device_batch_size=2, max_num_train_steps=max_steps)
    assert trainer.num_update_steps_completed == expected_steps
    assert trainer.run_config.max_num_train_steps == expected_steps
    assert trainer.run_config.num_epochs == expected_epochs
    assert len(trainer.run_history.get_metric_values("train_loss_epoch")) == expected_epochs


def test_unsized_dataset_trains_with_max_steps():
    trainer = make_trainer(make_linear())
    trainer.train(StreamDataset(linear_dataset(10)), num_epochs=None, max_num_train_steps=12, per_device_batch_size=4)
    assert trainer.num_update_steps_completed == 12  # 3 batches per pass, so 4 passes
    assert trainer.run_config.num_update_steps_per_epoch is None
    assert len(trainer.run_history.get_metric_values("train_loss_epoch")) == 4


def test_unsized_dataset_refuses_placeholder():
    """A dataset without len refuses a placeholder that needs its length."""
    trainer = make_trainer(make_linear())
    factory = functools.partial(
        torch.optim.lr_scheduler.OneCycleLR,
        max_lr=0.1,
        epochs=2,
        steps_per_epoch=TrainerPlaceholderValues.NUM_UPDATE_STEPS_PER_EPOCH,
    )
    with pytest.raises(ValueError, match="NUM_UPDATE_STEPS_PER_EPOCH, whose value is unknown"):
        trainer.train(
            StreamDataset(linear_dataset(10)), num_epochs=2, per_device_batch_size=4, create_scheduler_fn=factory
        )


def test_stop_training_error_ends_the_run_cleanly():
    class StopAfterFirstEpoch(RecordingCallback):
        def on_train_epoch_end(self, trainer, **kwargs):
            super().on_train_epoch_end(trainer)
            raise StopTrainingError("enough")

    callback = StopAfterFirstEpoch()
    trainer = make_trainer(make_linear(), callbacks=[callback])
    trainer.train(linear_dataset(4), num_epochs=5, eval_dataset=linear_dataset(4), per_device_batch_size=2)
    assert callback.events.count("on_train_epoch_end") == 1
    assert "on_eval_epoch_start" not in callback.events
    assert callback.events[-2:] == ["on_stop_training_error", "on_training_run_end"]
    assert trainer.run_history.current_epoch == 1


def test_evaluate_keeps_the_training_history():
    """evaluate records the evaluation loss and keeps the training history."""
    trainer = make_trainer(make_linear())
    trainer.train(linear_dataset(8), num_epochs=2, per_device_batch_size=4)
    trainer.evaluate(linear_dataset(6, seed=3), per_device_batch_size=4)
    names = trainer.run_history.get_metric_names()
    assert {"train_loss_epoch", "evaluation_loss"} <= names
    assert len(trainer.run_history.get_metric_values("train_loss_epoch")) == 2
    model = trainer.get_model()
    x, y = linear_dataset(6, seed=3).tensors
    expected = nn.functional.mse_loss(model(x), y).item()
    assert trainer.run_history.get_latest_metric("evaluation_loss") == pytest.approx(expected, rel=1e-5)


def test_evaluate_defaults_to_last_eval_data():
    """evaluate defaults to the last eval dataset, and refuses to run without any."""
    trainer = make_trainer(make_linear())
    with pytest.raises(ValueError, match=r"evaluate\(\) received no dataset"):
        trainer.evaluate()
    trainer.train(linear_dataset(4), num_epochs=1, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    trainer.evaluate()
    assert len(trainer.run_history.get_metric_values("evaluation_loss")) == 1


def test_extra_output_keys_reach_step_end():
    seen = []

    class WithExtras(Trainer):
        def calculate_train_batch_loss(self, batch):
            output = super().calculate_train_batch_loss(batch)
            return {**output, "extra": "value"}

    class Spy(TrainerCallback):
        def on_train_step_end(self, trainer, batch, batch_output, step, **kwargs):
            seen.append((step, batch_output["extra"], batch_output["loss"].requires_grad))

    trainer = make_trainer(make_linear(), callbacks=[Spy], trainer_class=WithExtras)
    trainer.train(linear_dataset(4), num_epochs=1, per_device_batch_size=2)
    assert seen == [(0, "value", True), (1, "value", True)]


def test_same_seed_gives_the_same_run():
    """The same seed gives the same run, and another seed does not."""

    def run(seed):
        model = make_mlp()
        make_trainer(model, seed=seed).train(regression_dataset(16), num_epochs=2, per_device_batch_size=4)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


def test_default_dataloader_workers():
    """The default dataloaders use no workers, and workers persist when asked."""
    trainer = make_trainer(make_linear())
    assert trainer.get_default_train_dl_kwargs(4)["num_workers"] == 0
    assert trainer.get_default_eval_dl_kwargs(4)["num_workers"] == 0
    trainer.train(linear_dataset(8), num_epochs=2, per_device_batch_size=4, train_dataloader_kwargs={"num_workers": 1})
    assert trainer.run_config.train_dl_kwargs["persistent_workers"] is True
    assert trainer.run_config.train_per_device_batch_size == 4


def test_dataloader_workers_end_with_their_run():
    """The workers a run's dataloaders keep between epochs end with the run (a train() stopped inside its epoch, an
    evaluate(), a predict()), not whenever the garbage collector frees the dataloaders; a dataloader iterated again
    starts new ones."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    trainer = make_trainer(make_linear())
    workers = {"num_workers": 2}
    trainer.train(
        linear_dataset(16),
        num_epochs=2,
        eval_dataset=linear_dataset(8),
        per_device_batch_size=2,
        max_num_train_steps=3,  # inside the first epoch: the training dataloader's workers are busy prefetching
        train_dataloader_kwargs=workers,
        eval_dataloader_kwargs=workers,
    )
    assert set(multiprocessing.active_children()) == before
    assert len(list(trainer.train_dataloader)) == 8  # iterated again: new workers, every batch
    trainer.evaluate(linear_dataset(8), per_device_batch_size=2, dataloader_kwargs=workers)
    trainer.predict(linear_dataset(8), per_device_batch_size=2, dataloader_kwargs=workers)
    assert set(multiprocessing.active_children()) == before


def test_run_config_frozen_with_peer_fields():
    """The run config is frozen and has pytorch-accelerated's fields."""
    trainer = make_trainer(make_linear())
    trainer.train(linear_dataset(10), num_epochs=2, per_device_batch_size=4, gradient_accumulation_steps=2)
    config = trainer.run_config
    assert isinstance(config, TrainerRunConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_epochs = 3
    assert (config.num_update_steps_per_epoch, config.train_total_batch_size, config.num_processes) == (2, 8, 1)
    assert config["num_epochs"] == 2
    assert not config.is_distributed and config.is_world_process_zero and config.is_local_process_zero
    assert config.mixed_precision == "no"


def test_model_unwrapped_after_a_run():
    """The model is unwrapped after a run, and get_model and device work."""
    model = make_linear()
    trainer = make_trainer(model)
    trainer.train(linear_dataset(4), num_epochs=1, per_device_batch_size=2)
    assert trainer.model is model and trainer.get_model() is model
    assert trainer.device == torch.device("cpu")
    trainer.train(linear_dataset(4), num_epochs=1, per_device_batch_size=2)  # a second run prepares again
    assert trainer.model is model


def test_gather_and_print_on_one_process(capsys):
    trainer = make_trainer(make_linear())
    trainer.train(linear_dataset(4), num_epochs=1, per_device_batch_size=2)
    assert torch.equal(trainer.gather(torch.tensor([1, 2])), torch.tensor([1, 2]))
    assert torch.equal(trainer.gather(torch.tensor([1, -1]), padding_value=-1), torch.tensor([1]))
    trainer.print("hello")
    assert "hello" in capsys.readouterr().out


def test_print_writes_each_line_in_one_call(monkeypatch):
    """With unbuffered output (PYTHONUNBUFFERED=1, usual in containers) each write reaches the shared terminal or log
    at once: a line written in pieces, as ``print`` writes it, lets another process's output land inside it."""
    writes = []

    class Stream:
        def write(self, text):
            writes.append(text)

        def flush(self):
            writes.append("<flush>")

    trainer = make_trainer(make_linear())
    monkeypatch.setattr(sys, "stdout", Stream())
    trainer.print("Saved training state", "final-2")
    trainer.print(1, 2.5, sep=", ", end="!\n", flush=True)
    trainer.print()
    assert writes == ["Saved training state final-2\n", "1, 2.5!\n", "<flush>", "\n"]


def test_callbacks_may_be_classes_or_instances(recorder):
    trainer = make_trainer(make_linear(), callbacks=[RecordingCallback, TrainerCallback()])
    assert [type(cb).__name__ for cb in trainer.callback_handler] == ["RecordingCallback", "TrainerCallback"]


def test_run_starts_from_clean_gradients():
    """A run starts from clean gradients and fresh dataloader settings."""

    def run(leftover_gradients):
        model = make_mlp()
        trainer = make_trainer(model)
        trainer.train(regression_dataset(8), num_epochs=1, eval_dataset=regression_dataset(4), per_device_batch_size=4)
        for parameter in model.parameters():  # as if a run had stopped inside an accumulation window
            parameter.grad = torch.ones_like(parameter) if leftover_gradients else None
        trainer.train(regression_dataset(8), num_epochs=1, per_device_batch_size=4)
        return trainer, torch.cat([p.detach().flatten() for p in model.parameters()])

    trainer, with_leftovers = run(leftover_gradients=True)
    _, without = run(leftover_gradients=False)
    assert torch.equal(with_leftovers, without)
    assert trainer.run_config.eval_dl_kwargs is None  # not the previous run's
    trainer.evaluate(regression_dataset(4))
    assert trainer.run_config.train_dl_kwargs is None


def test_evaluate_keeps_train_collate_fn():
    """evaluate without a dataset keeps the collate function of train."""
    collated = []

    def collate(samples):
        collated.append(len(samples))
        return torch.utils.data.default_collate(samples)

    trainer = make_trainer(make_linear())
    trainer.train(
        linear_dataset(4), num_epochs=1, eval_dataset=linear_dataset(4), per_device_batch_size=4, collate_fn=collate
    )
    collated.clear()
    trainer.evaluate(per_device_batch_size=2)
    assert collated == [2, 2]


def test_missing_optimizer_keeps_history():
    """A missing optimizer is refused before the history is reset."""
    trainer = make_trainer(make_linear())
    trainer.train(linear_dataset(4), num_epochs=1, per_device_batch_size=4)
    trainer.optimizer = None
    with pytest.raises(ValueError, match="no optimizer"):
        trainer.train(linear_dataset(4), num_epochs=1, per_device_batch_size=4)
    assert trainer.run_history.get_metric_values("train_loss_epoch")


@pytest.mark.parametrize("dataset", [linear_dataset(10), StreamDataset(linear_dataset(10))], ids=["sized", "stream"])
def test_forward_backward_override_arguments(dataset):
    """Overrides of the forward and backward step get the window flag, or pytorch-accelerated's arguments."""
    flags, legacy_steps = [], []

    class TakesTheFlag(Trainer):
        def _perform_forward_and_backward_passes(self, batch, step, is_update_step=None, **kwargs):
            flags.append((step, is_update_step))
            super()._perform_forward_and_backward_passes(batch, step, is_update_step, **kwargs)

    class PytorchAccelerated(Trainer):
        def _perform_forward_and_backward_passes(self, batch, step):  # pytorch-accelerated's signature
            legacy_steps.append(step)
            super()._perform_forward_and_backward_passes(batch, step)

    trainers = [make_trainer(make_linear(), trainer_class=cls) for cls in (Trainer, TakesTheFlag, PytorchAccelerated)]
    for trainer in trainers:
        trainer.train(dataset, num_epochs=1, per_device_batch_size=2, gradient_accumulation_steps=2)
    assert flags == [(0, False), (1, True), (2, False), (3, True), (4, True)]  # the last batch closes its window
    assert legacy_steps == [0, 1, 2, 3, 4] and trainers[2].num_update_steps_completed == 3
    for trainer in trainers[1:]:  # same updates on one process, sized or not
        assert_bitwise_equal(trainer.get_model().state_dict(), trainers[0].get_model().state_dict())


def test_step_overrides_are_read_once_not_rewritten():
    """What the step's overrides accept is read as the trainer is constructed: the class stays as written, and an
    override with pytorch-accelerated's (batch, step) finds the loop's window flag in the run state (the last batch of
    a stream closes its window), which its super() call uses."""
    flags = []

    class PytorchAccelerated(Trainer):
        def _perform_forward_and_backward_passes(self, batch, step):
            flags.append((step, self.run_state.closes_window))
            super()._perform_forward_and_backward_passes(batch, step)

    written = PytorchAccelerated.__dict__["_perform_forward_and_backward_passes"]
    trainer = make_trainer(make_linear(), trainer_class=PytorchAccelerated)
    stream = StreamDataset(linear_dataset(10))
    trainer.train(stream, num_epochs=1, per_device_batch_size=2, gradient_accumulation_steps=2)
    assert PytorchAccelerated.__dict__["_perform_forward_and_backward_passes"] is written
    assert flags == [(0, False), (1, True), (2, False), (3, True), (4, True)]


@pytest.mark.parametrize(
    "event, raised_from_train, steps_run",
    [
        ("on_training_run_start", True, 0),  # starts a run: no agreement point follows, raised at once
        ("on_train_step_start", False, 2),  # inside the epochs: held until the update that closes the window
        ("on_train_step_end", False, 2),
        ("on_eval_epoch_end", False, 8),  # held until the end of the epoch: its 8 steps ran
    ],
)
def test_callback_stop_waits_for_agreement(event, raised_from_train, steps_run):
    """A stop from a callback is held until the processes agree, unless it starts or ends a run."""

    class StopAt(RecordingCallback):
        pass

    def stop(self, trainer, **kwargs):
        self.events.append(event)
        raise StopTrainingError(f"stop in {event}")

    setattr(StopAt, event, stop)
    callback = StopAt()
    trainer = make_trainer(make_linear(), callbacks=[callback])
    run = functools.partial(
        trainer.train,
        linear_dataset(16),
        num_epochs=2,
        eval_dataset=linear_dataset(4),
        per_device_batch_size=2,
        gradient_accumulation_steps=2,
    )
    if raised_from_train:
        with pytest.raises(StopTrainingError, match=f"stop in {event}"):
            run()
    else:
        run()
        assert callback.events[-2:] == ["on_stop_training_error", "on_training_run_end"]
    assert callback.events.count("on_train_step_start") == steps_run
    assert trainer.run_state.stop_request is None and not trainer.run_state.in_training_run


def test_evaluation_state_in_run_state():
    """Evaluation state lives in the run state, and eval_batch_real_rows is read-only."""
    trainer = make_trainer(make_linear())
    trainer.train(linear_dataset(8), num_epochs=1, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    assert trainer.eval_batch_real_rows is None and trainer.run_state.eval_batch_real_rows is None
    assert float(trainer.run_state.eval_loss_tracker.average) == pytest.approx(
        trainer.run_history.get_latest_metric("eval_loss_epoch")
    )
    with pytest.raises(AttributeError):
        trainer.eval_batch_real_rows = 2
