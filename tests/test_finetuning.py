"""finetuning.ModelFreezer and GradualUnfreezingCallback: which parameters train, on tiny real runs."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import regression_dataset
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import GradualUnfreezingCallback, TrainerCallback
from pytorch_accel_trainer.finetuning import BN_MODULES, Layer, LayerGroup, ModelFreezer, _module_is_batch_norm


def make_model() -> nn.Module:
    """Layer groups: 0 Linear, 1 BatchNorm1d, 2 Sequential(Linear, ReLU), 3 Linear."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 1))


def _snapshot(model):
    return {name: value.clone() for name, value in model.state_dict().items()}


def _changed(before, model):
    return {name for name, value in model.state_dict().items() if not torch.equal(value, before[name])}


def _train(model, callbacks=(), optimizer=None, num_epochs=1, **kwargs):
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = Trainer(model, nn.MSELoss(), optimizer, callbacks=callbacks)
    trainer.train(regression_dataset(32), num_epochs=num_epochs, per_device_batch_size=8, **kwargs)
    return trainer


def test_freeze_all_but_last_group():
    """freeze() by default freezes every group but the last, and leaves batch norms trainable."""
    model = make_model()
    freezer = ModelFreezer(model)
    freezer.freeze()
    assert [group.is_frozen for group in freezer.get_layer_groups()] == [True, False, True, False]
    assert [group.layer_group_idx for group in freezer.get_layer_groups()] == [(0, -4), (1, -3), (2, -2), (3, -1)]
    assert [layer.is_frozen for layer in freezer.get_layers()] == [True, False, True, False, False]
    before = _snapshot(model)
    _train(model)
    trained = {"1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked", "3.weight", "3.bias"}
    assert _changed(before, model) == trained


def test_frozen_batch_norms_keep_statistics():
    """Frozen batch norms in eval mode keep their statistics through training."""
    model = make_model()
    freezer = ModelFreezer(model, freeze_batch_norms=True)
    freezer.freeze(to_index=-2, set_modules_as_eval=True)
    before = _snapshot(model)
    keep_eval = GradualUnfreezingCallback(freezer, {}, keep_frozen_layers_in_eval=True)
    _train(model, callbacks=[keep_eval], num_epochs=2)  # train_epoch_start puts the model in training mode
    assert _changed(before, model) == {"3.weight", "3.bias"}


def test_unfreeze_returns_parameters_by_group():
    """unfreeze() returns the parameters it unfroze, by group."""
    model = make_model()
    freezer = ModelFreezer(model)
    freezer.freeze(from_index=0, to_index=2)
    unfrozen = freezer.unfreeze(from_index=-2, to_index=-1)  # groups 2 and 3; 3 was not frozen
    assert list(unfrozen) == [2] and unfrozen[2]["params"] == [model[2][0].weight, model[2][0].bias]
    assert freezer.get_trainable_parameters() == [p for i in (1, 2, 3) for p in model[i].parameters()]
    assert freezer.unfreeze() == {0: {"params": [model[0].weight, model[0].bias]}}


def test_bad_index_and_groupless_model():
    """An index out of range, and a model without groups, are errors."""
    freezer = ModelFreezer(make_model())
    with pytest.raises(
        IndexError,
        match="Layer group index 4 is out of range: the model has 4 layer groups, so pass an index from -4 to 3",
    ):
        freezer.freeze(to_index=4)
    with pytest.raises(ValueError, match=r"The model \(Linear\) has no child modules"):
        ModelFreezer(nn.Linear(2, 2))


def test_finetuning_is_the_public_module():
    """finetuning is the public module of the one freezer."""
    assert ModelFreezer.__module__ == "pytorch_accel_trainer.finetuning"  # one freezer, in one module
    assert Layer._fields == LayerGroup._fields == ("layer_group_idx", "module", "is_frozen")
    assert [_module_is_batch_norm(m) for m in (nn.BatchNorm1d(2), nn.SyncBatchNorm(2), nn.LayerNorm(2))] == [
        True,
        True,
        False,
    ]
    assert BN_MODULES == (nn.modules.batchnorm._BatchNorm,)


def test_convert_idxs_and_freeze_bn():
    """convert_idxs orders the indexes and makes them positive; freeze_bn is the option."""
    freezer = ModelFreezer(make_model(), freeze_batch_norms=True)
    assert [freezer._convert_idxs(*pair) for pair in [(0, 3), (3, 0), (-2, -1), (-1, -2), (0, -1)]] == [(0, 3)] * 2 + [
        (2, 3)
    ] * 2 + [(0, 3)]
    assert freezer.freeze_bn is True
    freezer.freeze_bn = False
    assert freezer.freeze_batch_norms is False


def test_eval_mode_flags_do_what_they_say():
    """Freezing into eval mode freezes; unfreezing without training mode unfreezes. pytorch-accelerated passes its two
    flags to its layer helper in swapped order, so there freeze(set_modules_as_eval=True) leaves the parameters
    trainable; here each flag does what it says."""
    model = make_model()
    freezer = ModelFreezer(model, freeze_batch_norms=True)
    freezer.freeze(from_index=0, to_index=2, set_modules_as_eval=True)
    assert freezer.get_trainable_parameters() == list(model[3].parameters())
    assert [m.training for m in (model[0], model[1], model[2][0], model[2][1], model[3])] == [
        False,
        False,
        False,
        False,
        True,
    ]
    unfrozen = freezer.unfreeze(set_modules_as_training=False)
    assert sorted(unfrozen) == [0, 1, 2] and freezer.get_trainable_parameters() == list(model.parameters())
    assert not model[0].training  # mode left as it was
    assert all(
        not layer.is_frozen for layer in freezer.get_layers() if next(layer.module.parameters(), None) is not None
    )


class OwnParameterAndChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.linear = nn.Linear(2, 2)


def test_parent_with_own_parameters_is_layer():
    """A module with parameters of its own and children is a layer too. pytorch-accelerated's layers are the leaf
    modules only, so it never freezes ``scale`` here."""
    model = nn.Sequential(OwnParameterAndChild(), nn.Linear(2, 1))
    freezer = ModelFreezer(model)
    freezer.freeze()
    assert freezer.get_trainable_parameters() == list(model[1].parameters())
    assert [type(layer.module).__name__ for layer in freezer.get_layers()] == [
        "OwnParameterAndChild",
        "Linear",
        "Linear",
    ]


class EpochSnapshots(TrainerCallback):
    def __init__(self):
        self.by_epoch = {}

    def on_train_epoch_end(self, trainer, **kwargs):
        self.by_epoch[trainer.run_history.current_epoch] = _snapshot(trainer.get_model())


def test_gradual_unfreezing_by_epoch():
    """GradualUnfreezingCallback trains each group from its epoch on, with the optimizer it has."""
    model = make_model()
    freezer = ModelFreezer(model)
    freezer.freeze()
    snapshots = EpochSnapshots()
    before = _snapshot(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # over all parameters, frozen ones included
    _train(model, [GradualUnfreezingCallback(freezer, {2: -2, 3: 0}), snapshots], optimizer, num_epochs=3)
    changed_by_epoch = []
    previous = before
    for epoch in (1, 2, 3):
        state = snapshots.by_epoch[epoch]
        changed_by_epoch.append({name.split(".")[0] for name in state if not torch.equal(state[name], previous[name])})
        previous = state
    assert changed_by_epoch == [{"1", "3"}, {"1", "2", "3"}, {"0", "1", "2", "3"}]
    assert len(optimizer.param_groups) == 1  # nothing to add: a scheduler would stay valid


def test_missing_parameters_added_as_a_group():
    """Parameters the optimizer lacks are added as a group, with the given options."""
    model = make_model()
    freezer = ModelFreezer(model)
    freezer.freeze()
    optimizer = torch.optim.SGD(freezer.get_trainable_parameters(), lr=0.05)
    _train(
        model,
        [GradualUnfreezingCallback(freezer, {2: 0}, new_param_group_kwargs={"lr": 0.01})],
        optimizer,
        num_epochs=2,
    )
    assert [group["lr"] for group in optimizer.param_groups] == [0.05, 0.01]
    assert optimizer.param_groups[1]["params"] == [model[0].weight, model[0].bias, model[2][0].weight, model[2][0].bias]


def test_group_unknown_to_scheduler_refused():
    """Adding a group that a scheduler would not know is refused before training."""
    model = make_model()
    freezer = ModelFreezer(model)
    freezer.freeze()
    optimizer = torch.optim.SGD(freezer.get_trainable_parameters(), lr=0.05)
    scheduler = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1)
    with pytest.raises(
        ValueError,
        match="which the learning-rate scheduler does not know. Create the optimizer over all of model.parameters",
    ):
        _train(
            model, [GradualUnfreezingCallback(freezer, {2: 0})], optimizer, num_epochs=2, create_scheduler_fn=scheduler
        )


def test_other_model_and_bad_schedule():
    """A freezer of another model, and a bad schedule, are refused."""
    freezer = ModelFreezer(make_model())
    with pytest.raises(ValueError, match="freezer holds another model than the trainer's"):
        _train(make_model(), [GradualUnfreezingCallback(freezer, {2: 0})])
    with pytest.raises(ValueError, match="unfreeze_at_epochs has the epoch 0; epochs are whole numbers from 1"):
        GradualUnfreezingCallback(freezer, {0: -1})
    with pytest.raises(TypeError, match=r"unfreeze_at_epochs is a list; pass a dict \{epoch: from_index\}"):
        GradualUnfreezingCallback(freezer, [2])
