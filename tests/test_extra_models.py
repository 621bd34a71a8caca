"""Extra models and optimizers (``Trainer.add_model``): prepared for each run and given back after it, updated with the
run's clipping, and kept in checkpoints and training states, from which a resume continues both models bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_bitwise_equal, linear_dataset, make_linear
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state.consolidate import full_weights
from pytorch_accel_trainer.state.shards import read_metadata
from pytorch_accel_trainer.state.training_state import list_complete_states, verify_folder


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients each step was given."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr)
        self.seen_gradients = []

    def step(self, closure=None):
        self.seen_gradients.append(
            [parameter.grad.clone() for group in self.param_groups for parameter in group["params"]]
        )
        return super().step(closure)


def critic_loss(critic: nn.Module, batch) -> torch.Tensor:
    return nn.functional.mse_loss(critic(batch[0]), batch[1])


class CriticTrainer(Trainer):
    """Fits y = 2x + 3 with its model, and updates an extra "critic" on every batch with ``update_extra_model``; a
    "teacher" without optimizer may be registered too.

    ``leave_gradients_on_critic``: first back-propagate another loss through the critic, as a GAN's generator loss
    flows through its discriminator; the update must not use those gradients.
    """

    def __init__(self, model, critic, critic_optimizer, teacher=None, leave_gradients_on_critic=False, **kwargs):
        super().__init__(
            model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), **{"callbacks": (), **kwargs}
        )
        self.add_model("critic", critic, critic_optimizer)
        if teacher is not None:
            self.add_model("teacher", teacher)
        self.leave_gradients_on_critic = leave_gradients_on_critic

    def train_epoch_start(self) -> None:
        super().train_epoch_start()
        self.extra_models["critic"].train()  # the trainer leaves the extras' mode to the subclass

    def calculate_train_batch_loss(self, batch) -> dict:
        critic = self.extra_models["critic"]
        if self.leave_gradients_on_critic:
            (100 * critic(batch[0]).sum()).backward()
        self.update_extra_model("critic", critic_loss(critic, batch))
        return super().calculate_train_batch_loss(batch)


def make_critic_trainer(
    seed: int = 0, critic_optimizer=torch.optim.Adam, with_teacher: bool = False, **kwargs
) -> CriticTrainer:
    torch.manual_seed(seed)
    critic = nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1))  # dropout: uses the RNG
    teacher = nn.Linear(1, 1) if with_teacher else None
    return CriticTrainer(make_linear(seed), critic, critic_optimizer(critic.parameters(), lr=0.01), teacher, **kwargs)


def make_plain_trainer() -> Trainer:
    model = make_linear()
    return Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())


def final_states(trainer: Trainer) -> dict:
    states = {
        "model": trainer.get_model().state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "extra_models": {name: trainer.get_extra_model(name).state_dict() for name in trainer.extra_models},
        "extra_optimizers": {name: optimizer.state_dict() for name, optimizer in trainer.extra_optimizers.items()},
    }
    return copy.deepcopy(states)


# ------------------------------------------------------------------------------------------------
# Preparation, and what a run gives back
# ------------------------------------------------------------------------------------------------


class RecordPreparedExtras(TrainerCallback):
    def __init__(self):
        self.seen = []

    def _record(self, trainer):
        prepared = [id(model) for model in trainer.accelerator._models]  # Accelerate's own list of what it prepared
        for name, model in trainer.extra_models.items():
            devices = {parameter.device for parameter in model.parameters()}
            self.seen.append((name, id(model) in prepared, devices == {trainer.device}))

    def on_training_run_start(self, trainer, **kwargs):
        self._record(trainer)

    def on_evaluation_run_start(self, trainer, **kwargs):
        self._record(trainer)


def test_extras_prepared_each_run_given_back():
    """Extras are prepared with the trainer's model in each run, and given back after it."""
    recorder = RecordPreparedExtras()
    trainer = make_critic_trainer(with_teacher=True, callbacks=[recorder])
    critic, teacher, critic_optimizer = (
        trainer.extra_models["critic"],
        trainer.extra_models["teacher"],
        trainer.extra_optimizers["critic"],
    )

    trainer.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)
    trainer.evaluate(linear_dataset(8), per_device_batch_size=4)
    trainer.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)  # prepared again, once

    assert recorder.seen == [("critic", True, True), ("teacher", True, True)] * 3
    assert trainer.extra_models == {"critic": critic, "teacher": teacher}  # the very modules passed to add_model
    assert trainer.extra_optimizers == {"critic": critic_optimizer} and type(critic_optimizer) is torch.optim.Adam
    assert critic_optimizer.state  # built by real steps
    assert trainer.get_extra_model("critic") is critic


@pytest.mark.parametrize(
    "clipping", [{}, {"gradient_clip_value": 0.05}, {"gradient_clip_norm": 0.05}], ids=["none", "value", "norm"]
)
def test_update_steps_on_its_own_gradients(clipping):
    """An update steps on the loss's own gradients, clipped as the run clips."""
    dataset = linear_dataset(8)
    torch.manual_seed(1)
    critic = nn.Linear(1, 1)
    start = copy.deepcopy(critic)
    optimizer = RecordingSGD(critic.parameters(), lr=1.0)
    trainer = CriticTrainer(make_linear(), critic, optimizer, leave_gradients_on_critic=True)

    trainer.train(
        dataset, num_epochs=1, per_device_batch_size=8, train_dataloader_kwargs={"shuffle": False}, **clipping
    )

    # by hand: the gradients of this loss alone (not those another backward pass left), clipped as torch clips
    gradients = torch.autograd.grad(critic_loss(start, dataset.tensors), list(start.parameters()))
    assert max(gradient.abs().max() for gradient in gradients) > 0.1  # so that clipping at 0.05 changes them
    if "gradient_clip_value" in clipping:
        gradients = [gradient.clamp(-0.05, 0.05) for gradient in gradients]
    if "gradient_clip_norm" in clipping:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(gradient) for gradient in gradients]))
        gradients = [gradient * min(1.0, 0.05 / (norm.item() + 1e-6)) for gradient in gradients]
    (seen,) = optimizer.seen_gradients  # one batch: one update
    for given, expected in zip(seen, gradients):
        torch.testing.assert_close(given, expected)
    for parameter, before, expected in zip(critic.parameters(), start.parameters(), gradients):
        torch.testing.assert_close(parameter.detach(), before.detach() - expected)  # lr 1: one plain SGD step
        assert parameter.grad is None  # zeroed after the step


# ------------------------------------------------------------------------------------------------
# Export checkpoints
# ------------------------------------------------------------------------------------------------


def test_checkpoint_restores_both_models(tmp_path):
    """A checkpoint round trip restores both models and both optimizers."""
    trained = make_critic_trainer(seed=0, with_teacher=True)
    trained.train(linear_dataset(16), num_epochs=2, per_device_batch_size=4)
    trained.save_checkpoint(tmp_path / "run.pt")
    fresh = make_critic_trainer(seed=7, with_teacher=True)  # other weights, empty optimizer states
    assert not torch.equal(fresh.extra_models["teacher"].weight, trained.extra_models["teacher"].weight)

    checkpoint = fresh.load_checkpoint(tmp_path / "run.pt")

    assert set(checkpoint["extra_model_state_dicts"]) == {"critic", "teacher"}
    assert set(checkpoint["extra_optimizer_state_dicts"]) == {"critic"}
    assert_bitwise_equal(final_states(fresh), final_states(trained))


def test_checkpoint_without_optimizers(tmp_path):
    """A checkpoint without optimizers loads the extra models alone."""
    trained = make_critic_trainer(seed=0)
    trained.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)
    trained.save_checkpoint(tmp_path / "weights.pt", save_optimizer=False)
    fresh = make_critic_trainer(seed=7)

    fresh.load_checkpoint(tmp_path / "weights.pt")

    assert "extra_optimizer_state_dicts" not in torch.load(tmp_path / "weights.pt", weights_only=True)
    assert_bitwise_equal(final_states(fresh)["extra_models"], final_states(trained)["extra_models"])
    assert not fresh.extra_optimizers["critic"].state  # nothing was saved for it


def test_checkpoint_must_hold_the_extras(tmp_path):
    """A checkpoint must hold exactly the registered extras; otherwise nothing is loaded."""
    plain = make_plain_trainer()
    plain.save_checkpoint(tmp_path / "plain.pt")
    make_critic_trainer(seed=3).save_checkpoint(tmp_path / "critic.pt")
    with_critic = make_critic_trainer(seed=0)
    weights_before = final_states(with_critic)

    with pytest.raises(
        ValueError,
        match=(
            r"holds the extra models \[\], but this trainer has \['critic'\]: 'critic' is not in it "
            r".*Register the same extra models"
        ),
    ):
        with_critic.load_checkpoint(tmp_path / "plain.pt")
    assert_bitwise_equal(final_states(with_critic), weights_before)  # refused before anything was loaded
    with pytest.raises(
        ValueError,
        match=(
            r"holds the extra models \['critic'\], but this trainer has \[\]: 'critic' is not registered "
            r"\(its saved state would be dropped\).*torch.load"
        ),
    ):
        plain.load_checkpoint(tmp_path / "critic.pt")


def test_extra_without_optimizer_state(tmp_path):
    """A checkpoint whose extra has no optimizer state loads with load_optimizer=False."""
    untrained_critic = make_plain_trainer()
    untrained_critic.add_model("critic", make_critic_trainer(seed=3).extra_models["critic"])  # no optimizer
    untrained_critic.save_checkpoint(tmp_path / "run.pt")
    trainer = make_critic_trainer(seed=0)

    with pytest.raises(
        ValueError,
        match=(
            r"holds the extra optimizers \[\], but this trainer has \['critic'\]"
            r".*pass load_optimizer=False to load the weights alone"
        ),
    ):
        trainer.load_checkpoint(tmp_path / "run.pt")
    trainer.load_checkpoint(tmp_path / "run.pt", load_optimizer=False)

    assert_bitwise_equal(final_states(trainer)["extra_models"], final_states(untrained_critic)["extra_models"])


def test_checkpoint_kwargs_reserve_extra_keys(tmp_path):
    """checkpoint_kwargs cannot use the extras' keys."""
    trainer = make_critic_trainer()
    with pytest.raises(ValueError, match="checkpoint_kwargs uses the key 'extra_model_state_dicts'.*rename it"):
        trainer.save_checkpoint(tmp_path / "run.pt", checkpoint_kwargs={"extra_model_state_dicts": 1})


# ------------------------------------------------------------------------------------------------
# Training states
# ------------------------------------------------------------------------------------------------


class Crash(Exception):
    """Stands for the process dying."""


class CrashAtStep(TrainerCallback):
    """Raises at ``step`` of ``epoch``, after the critic's update on that batch and before the model's."""

    def __init__(self, epoch: int, step: int):
        self.epoch, self.step = epoch, step

    def on_train_step_end(self, trainer, step, **kwargs):
        if (trainer.run_history.current_epoch, step) == (self.epoch, self.step):
            raise Crash()


def run_with_states(save_dir, crash=None, accumulation=1, asynchronous=False) -> CriticTrainer:
    callbacks = [SaveTrainingStateCallback(save_dir, save_every_n_steps=1, asynchronous=asynchronous)]
    trainer = make_critic_trainer(callbacks=callbacks + ([crash] if crash else []))
    trainer.train(
        linear_dataset(22),
        num_epochs=3,
        per_device_batch_size=4,
        gradient_accumulation_steps=accumulation,
        gradient_clip_norm=1.0,
        resume_from=save_dir,
    )
    return trainer


@pytest.mark.parametrize(
    ("accumulation", "asynchronous"), [(1, False), (2, False), (1, True)], ids=["sync", "sync-accumulation", "async"]
)
def test_resumed_run_equals_uninterrupted(tmp_path, accumulation, asynchronous):
    """A resumed run equals an uninterrupted one bit for bit, for both models and optimizers."""
    reference = final_states(
        run_with_states(tmp_path / "reference", accumulation=accumulation, asynchronous=asynchronous)
    )

    with pytest.raises(Crash):  # in a window of 2 the critic has stepped on batches the saved state has not seen
        run_with_states(tmp_path / "states", CrashAtStep(epoch=2, step=3), accumulation, asynchronous)
    resumed = run_with_states(tmp_path / "states", accumulation=accumulation, asynchronous=asynchronous)

    assert_bitwise_equal(final_states(resumed), reference)
    newest = list_complete_states(tmp_path / "states")[-1]
    assert newest.folder.name == "final"  # saved as the run ended: the critic's final weights
    assert_bitwise_equal(full_weights(newest.folder, "extra_model:critic"), reference["extra_models"]["critic"])
    saved = torch.load(newest.folder / "parts.pt", weights_only=True)["extra_optimizer:critic"]["state"]
    assert all("exp_avg" in saved[name] for name in ("0.weight", "0.bias", "3.weight"))


@pytest.mark.parametrize("layout", ["one_file", "sharded"])
def test_extras_files_verified_by_manifest(tmp_path, request, layout):
    """The bytes of the extra optimizer's state (in the parts file, or in DCP's shards) are verified by the manifest."""
    if layout == "sharded":
        request.getfixturevalue("sharded_layout")
    run_with_states(tmp_path)
    folder = list_complete_states(tmp_path)[-1].folder
    if layout == "sharded":
        (info,) = [
            info
            for index, info in read_metadata(folder).storage_data.items()
            if index.fqn == "extra_optimizer:critic/state/0.weight/exp_avg"
        ]
        path, offset, length = folder / info.relative_path, info.offset, info.length
    else:
        saved = torch.load(folder / "parts.pt", weights_only=True)
        tensor_bytes = saved["extra_optimizer:critic"]["state"]["0.weight"]["exp_avg"].numpy().tobytes()
        path = folder / "parts.pt"
        offset, length = path.read_bytes().index(tensor_bytes), len(tensor_bytes)
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    with pytest.raises(CheckpointError, match=rf"{path.name}: its XXH3-128 does not match the manifest"):
        verify_folder(folder)


def test_state_must_hold_the_extras(tmp_path):
    """A state must hold exactly the registered extras."""
    run_with_states(tmp_path / "critic")
    plain = make_plain_trainer()
    with pytest.raises(
        CheckpointError,
        match=(
            r"does not fit this trainer: it holds the extra models \['critic'\], but this trainer has \[\]: "
            r"'critic' is not registered.*add_model"
        ),
    ):
        plain.load_training_state(tmp_path / "critic")

    plain.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)
    plain.save_training_state(tmp_path / "plain")
    with pytest.raises(
        CheckpointError, match=r"holds the extra models \[\], but this trainer has \['critic'\]: 'critic' is not in it"
    ):
        make_critic_trainer().load_training_state(tmp_path / "plain")


@pytest.mark.parametrize("other", [torch.optim.SGD, torch.optim.AdamW])  # AdamW keeps the tensors Adam keeps
def test_state_refuses_other_optimizer_class(tmp_path, other):
    """A state refuses an extra optimizer of another class, naming both."""
    run_with_states(tmp_path)
    trainer = make_critic_trainer(critic_optimizer=other)
    with pytest.raises(
        CheckpointError,
        match=(
            r"does not fit the optimizer of the extra model 'critic': it was saved by the optimizer Adam, but this "
            rf"trainer's optimizer is {other.__name__}"
        ),
    ):
        trainer.load_training_state(tmp_path)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def _add_model_errors():
    linear = nn.Linear(1, 1)
    return [
        (
            lambda t: t.add_model(3, nn.Linear(1, 1)),
            TypeError,
            r"add_model\(name=3\): the name is a int; pass a string",
        ),
        (lambda t: t.add_model("my critic", nn.Linear(1, 1)), ValueError, "not a Python identifier"),
        (lambda t: t.add_model("model", nn.Linear(1, 1)), ValueError, "'model' is the trainer's own model"),
        (
            lambda t: t.add_model("critic", nn.Linear(1, 1)),
            ValueError,
            r"already registered under 'critic' \(registered: \['critic'\]\)",
        ),
        (lambda t: t.add_model("other", "net"), TypeError, "the model is a str; pass a torch.nn.Module"),
        (lambda t: t.add_model("other", t.model), ValueError, "already the trainer's model"),
        (lambda t: t.add_model("other", t.extra_models["critic"]), ValueError, "already registered as 'critic'"),
        (lambda t: t.add_model("other", linear, "sgd"), TypeError, "the optimizer is a str"),
        (lambda t: t.add_model("other", linear, t.optimizer), ValueError, "already the trainer's optimizer"),
        (
            lambda t: t.add_model("other", linear, torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)),
            ValueError,
            r"2 of the optimizer's parameters are not the model's.*SGD\(model.parameters\(\)",
        ),
        (
            lambda t: t.update_extra_model("critc", torch.ones(1, requires_grad=True)),
            ValueError,
            r"no extra model is registered under 'critc'; the registered ones are \['critic'\]",
        ),
        (
            lambda t: t.update_extra_model("critic", torch.ones(1, requires_grad=True)),
            RuntimeError,
            "outside a training run",
        ),
    ]


@pytest.mark.parametrize(("call", "error", "message"), _add_model_errors())
def test_add_and_update_refuse_mistakes(call, error, message):
    """add_model and update_extra_model refuse mistakes, with the fix."""
    trainer = make_critic_trainer()
    with pytest.raises(error, match=message):
        call(trainer)


def test_update_needs_optimizer_and_gradients():
    """update_extra_model needs an optimizer, and a loss with gradients."""

    class Teacher(CriticTrainer):
        loss_transform = staticmethod(lambda loss: loss)

        def calculate_train_batch_loss(self, batch):
            self.update_extra_model(
                self.updated, self.loss_transform(critic_loss(self.extra_models[self.updated], batch))
            )
            return Trainer.calculate_train_batch_loss(self, batch)

    trainer = make_critic_trainer(with_teacher=True)
    trainer.__class__ = Teacher
    trainer.updated = "teacher"
    with pytest.raises(ValueError, match=r"'teacher' was registered without an optimizer, so there is nothing to step"):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)
    trainer.updated, trainer.loss_transform = "critic", lambda loss: loss.detach()
    with pytest.raises(ValueError, match=r"the loss does not require gradients \(requires_grad=False\)"):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)
    trainer.loss_transform = lambda loss: loss.item()
    with pytest.raises(TypeError, match="the loss is a float; pass the loss tensor itself"):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)


def test_add_model_during_a_run_is_refused():
    class LateRegistration(CriticTrainer):
        def training_run_start(self):
            self.add_model("late", nn.Linear(1, 1))

    torch.manual_seed(0)
    critic = nn.Linear(1, 1)
    trainer = LateRegistration(make_linear(), critic, torch.optim.SGD(critic.parameters(), lr=0.1))
    with pytest.raises(
        RuntimeError, match=r"add_model\('late', ...\) was called during a training run.*before train\(\)"
    ):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)


# ------------------------------------------------------------------------------------------------
# Two processes (gloo on the CPU)
# ------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("extra_model")
def test_two_processes_train_extra_in_ddp(one_process_scenarios, two_process_scenarios):
    """Two processes wrap the extra model in DDP, and train it as one process with the same global batch
    (tests/scripts/extra_models_run.py: batches of 8 on one process, 4 on each of two)."""
    single, double = (
        torch.load(launch.folder("extra_model") / "result.pt", weights_only=True)
        for launch in (one_process_scenarios, two_process_scenarios)
    )

    assert single["seen_types"] == ["Sequential"] and double["seen_types"] == ["DistributedDataParallel"]
    assert double["num_processes"] == 2 and double["ranks_agree"]  # the critic's gradients are averaged across them
    assert double["after_run_is_the_module_passed"] and double["after_run_optimizer_is_the_one_passed"]
    for name in ("model", "critic"):  # half the batch on each process: the same updates as one process
        torch.testing.assert_close(double["states"][name], single["states"][name], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("extra_model_reference", "extra_model_crashed", "extra_model_resumed")
def test_two_processes_resume_both_models(two_process_scenarios):
    """Two processes resume both models and both optimizers bit for bit: a run that raised after 5 updates (standing
    for the processes dying), then one that resumes from the training states it saved, equal one uninterrupted run."""
    crashed = two_process_scenarios.errors("extra_model_crashed")
    assert len(crashed) == 2 and all("Crash: crashed after 5 updates" in traceback for traceback in crashed)
    assert not (two_process_scenarios.root / "extra_model_crashed" / "result.pt").exists()
    reference, resumed = (
        torch.load(two_process_scenarios.folder(scenario) / "result.pt", weights_only=True)
        for scenario in ("extra_model_reference", "extra_model_resumed")
    )

    assert "Resuming from" in two_process_scenarios.printed("extra_model_resumed")
    assert_bitwise_equal(resumed["states"], reference["states"])
