"""pytorch-accelerated 0.1.61's API works here: every public name, and each parameter of its public functions and
methods (with its default), exists, and the internals that scripts override or call keep working.

The lists of names and parameters were read from 0.1.61's source (its modules' classes, functions and constants, and
their signatures, with ``ast``), so that CI does not need the peer installed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
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

PEER_NAMES = {
    "trainer": [
        "DEFAULT_CALLBACKS",
        "Trainer",
        "TrainerPlaceholderValues",
        "TrainerWithTimmScheduler",
        "replace_trainer_placeholder_values",
    ],
    "callbacks": [
        "CallbackHandler",
        "CallbackMethodNotImplementedError",
        "ConvertSyncBatchNormCallback",
        "EarlyStoppingCallback",
        "LimitBatchesCallback",
        "LimitEvalStepsCallback",
        "LogMetricsCallback",
        "ModelEmaCallback",
        "MoveModulesToDeviceCallback",
        "PrintProgressCallback",
        "ProgressBarCallback",
        "SaveBestModelCallback",
        "SaveTrainingStateCallback",
        "StepBasedEvaluationCallback",
        "StopTrainingError",
        "TerminateOnNaNCallback",
        "TrainerCallback",
        "WSDCheckpointCallback",
        "get_default_callbacks",
    ],
    "tracking": ["InMemoryRunHistory", "LossTracker", "RunHistory"],
    "run_config": ["TrainerRunConfig"],
    "schedulers.cosine_scheduler": ["CosineLrScheduler"],
    "schedulers.wsd_scheduler": ["WSDLrScheduler", "estimate_checkpoint_steps"],
    "schedulers.scheduler_base": ["SchedulerBase", "StatefulSchedulerBase"],
    "finetuning": ["BN_MODULES", "Layer", "LayerGroup", "ModelFreezer"],
    "utils": [
        "DataLoaderSlice",
        "LIMIT_BATCHES_ENV_VAR",
        "LimitBatches",
        "ModelEma",
        "local_process_zero_first",
        "local_process_zero_only",
        "remove_padding",
        "worker_init_fn",
        "world_process_zero_only",
    ],
}
PEER_SIGNATURES = {
    ("trainer", "TrainerPlaceholderValues.placeholder_set"): [],
    ("trainer", "replace_trainer_placeholder_values"): [("trainer", "<required>"), ("instance", "<required>")],
    ("trainer", "Trainer.__init__"): [
        ("model", "<required>"),
        ("loss_func", "<required>"),
        ("optimizer", "<required>"),
        ("callbacks", "<expr>"),
        ("run_history", None),
    ],
    ("trainer", "Trainer.create_train_dataloader"): [("batch_size", "<required>"), ("train_dl_kwargs", None)],
    ("trainer", "Trainer.create_eval_dataloader"): [("batch_size", "<required>"), ("eval_dl_kwargs", None)],
    ("trainer", "Trainer.create_scheduler"): [],
    ("trainer", "Trainer.training_run_start"): [],
    ("trainer", "Trainer.train_epoch_start"): [],
    ("trainer", "Trainer.calculate_train_batch_loss"): [("batch", "<required>")],
    ("trainer", "Trainer.backward_step"): [("loss", "<required>")],
    ("trainer", "Trainer.optimizer_step"): [],
    ("trainer", "Trainer.scheduler_step"): [],
    ("trainer", "Trainer.optimizer_zero_grad"): [],
    ("trainer", "Trainer.train_epoch_end"): [],
    ("trainer", "Trainer.eval_epoch_start"): [],
    ("trainer", "Trainer.calculate_eval_batch_loss"): [("batch", "<required>")],
    ("trainer", "Trainer.eval_epoch_end"): [],
    ("trainer", "Trainer.training_run_epoch_end"): [],
    ("trainer", "Trainer.training_run_end"): [],
    ("trainer", "Trainer.evaluation_run_start"): [],
    ("trainer", "Trainer.evaluation_run_end"): [],
    ("trainer", "Trainer.train"): [
        ("train_dataset", "<required>"),
        ("num_epochs", "<required>"),
        ("eval_dataset", None),
        ("per_device_batch_size", 8),
        ("max_num_train_steps", None),
        ("gradient_accumulation_steps", 1),
        ("gradient_clip_value", None),
        ("create_scheduler_fn", None),
        ("train_dataloader_kwargs", None),
        ("eval_dataloader_kwargs", None),
        ("reset_run_history", True),
        ("collate_fn", None),
        ("resume_from", None),
    ],
    ("trainer", "Trainer.evaluate"): [
        ("dataset", None),
        ("per_device_batch_size", 8),
        ("dataloader_kwargs", None),
        ("collate_fn", None),
    ],
    ("trainer", "Trainer.get_default_train_dl_kwargs"): [("batch_size", "<required>")],
    ("trainer", "Trainer.get_default_eval_dl_kwargs"): [("batch_size", "<required>")],
    ("trainer", "Trainer.gather"): [("tensor", "<required>"), ("padding_value", None)],
    ("trainer", "Trainer.print"): [],
    ("trainer", "Trainer.save_checkpoint"): [
        ("save_path", "<required>"),
        ("checkpoint_kwargs", None),
        ("save_optimizer", True),
        ("save_scheduler", True),
        ("save_per_node", True),
    ],
    ("trainer", "Trainer.load_checkpoint"): [
        ("checkpoint_path", "<required>"),
        ("load_optimizer", True),
        ("load_scheduler", True),
    ],
    ("trainer", "Trainer.save_training_state"): [("output_dir", "<required>"), ("checkpoint_kwargs", None)],
    ("trainer", "Trainer.load_training_state"): [("input_dir", "<required>")],
    ("trainer", "Trainer.get_model"): [("keep_torch_compile", True)],
    ("trainer", "TrainerWithTimmScheduler.__init__"): [],
    ("trainer", "TrainerWithTimmScheduler.train_epoch_start"): [],
    ("trainer", "TrainerWithTimmScheduler.eval_epoch_end"): [],
    ("trainer", "TrainerWithTimmScheduler.scheduler_step"): [],
    ("callbacks", "get_default_callbacks"): [("progress_bar", True)],
    ("callbacks", "TrainerCallback.on_init_end"): [("trainer", "<required>")],
    ("callbacks", "TrainerCallback.on_training_run_start"): [("trainer", "<required>")],
    ("callbacks", "TrainerCallback.on_train_epoch_start"): [("trainer", "<required>")],
    ("callbacks", "TrainerCallback.on_train_step_start"): [("trainer", "<required>")],
    ("callbacks", "TrainerCallback.on_train_step_end"): [
        ("trainer", "<required>"),
        ("batch", "<required>"),
        ("batch_output", "<required>"),
    ],
    ("callbacks", "TrainerCallback.on_train_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "TrainerCallback.on_eval_epoch_start"): [("trainer", "<required>")],
    ("callbacks", "TrainerCallback.on_eval_step_start"): [("trainer", "<required>")],
    ("callbacks", "TrainerCallback.on_eval_step_end"): [
        ("trainer", "<required>"),
        ("batch", "<required>"),
        ("batch_output", "<required>"),
    ],
    ("callbacks", "TrainerCallback.on_eval_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "TrainerCallback.on_training_run_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "TrainerCallback.on_training_run_end"): [("trainer", "<required>")],
    ("callbacks", "TrainerCallback.on_evaluation_run_start"): [("trainer", "<required>")],
    ("callbacks", "TrainerCallback.on_evaluation_run_end"): [("trainer", "<required>")],
    ("callbacks", "TrainerCallback.on_stop_training_error"): [("trainer", "<required>")],
    ("callbacks", "CallbackHandler.__init__"): [("callbacks", "<required>")],
    ("callbacks", "CallbackHandler.add_callbacks"): [("callbacks", "<required>")],
    ("callbacks", "CallbackHandler.add_callback"): [("callback", "<required>")],
    ("callbacks", "CallbackHandler.clear_callbacks"): [],
    ("callbacks", "CallbackHandler.call_event"): [("event", "<required>")],
    ("callbacks", "LogMetricsCallback.on_train_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "LogMetricsCallback.on_eval_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "LogMetricsCallback.log_metrics"): [("trainer", "<required>"), ("metrics", "<required>")],
    ("callbacks", "ProgressBarCallback.__init__"): [],
    ("callbacks", "ProgressBarCallback.on_train_epoch_start"): [("trainer", "<required>")],
    ("callbacks", "ProgressBarCallback.on_train_step_end"): [("trainer", "<required>")],
    ("callbacks", "ProgressBarCallback.on_train_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "ProgressBarCallback.on_eval_epoch_start"): [("trainer", "<required>")],
    ("callbacks", "ProgressBarCallback.on_eval_step_end"): [("trainer", "<required>")],
    ("callbacks", "ProgressBarCallback.on_eval_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "PrintProgressCallback.on_training_run_start"): [("trainer", "<required>")],
    ("callbacks", "PrintProgressCallback.on_train_epoch_start"): [("trainer", "<required>")],
    ("callbacks", "PrintProgressCallback.on_training_run_end"): [("trainer", "<required>")],
    ("callbacks", "PrintProgressCallback.on_eval_epoch_start"): [("trainer", "<required>")],
    ("callbacks", "PrintProgressCallback.on_evaluation_run_start"): [("trainer", "<required>")],
    ("callbacks", "PrintProgressCallback.on_evaluation_run_end"): [("trainer", "<required>")],
    ("callbacks", "SaveBestModelCallback.__init__"): [
        ("save_path", "best_model.pt"),
        ("watch_metric", "eval_loss_epoch"),
        ("greater_is_better", False),
        ("reset_on_train", True),
        ("save_optimizer", True),
        ("save_scheduler", True),
        ("load_saved_checkpoint", True),
    ],
    ("callbacks", "SaveBestModelCallback.on_training_run_start"): [("args", "<required>")],
    ("callbacks", "SaveBestModelCallback.on_training_run_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "SaveBestModelCallback.on_training_run_end"): [("trainer", "<required>")],
    ("callbacks", "EarlyStoppingCallback.__init__"): [
        ("early_stopping_patience", 1),
        ("early_stopping_threshold", 0.01),
        ("watch_metric", "eval_loss_epoch"),
        ("greater_is_better", False),
        ("reset_on_train", True),
    ],
    ("callbacks", "EarlyStoppingCallback.on_training_run_start"): [("args", "<required>")],
    ("callbacks", "EarlyStoppingCallback.on_training_run_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "TerminateOnNaNCallback.__init__"): [],
    ("callbacks", "TerminateOnNaNCallback.check_for_nan_after_batch"): [("batch_output", "<required>"), ("step", None)],
    ("callbacks", "TerminateOnNaNCallback.on_train_step_end"): [
        ("trainer", "<required>"),
        ("batch_output", "<required>"),
    ],
    ("callbacks", "TerminateOnNaNCallback.on_eval_step_end"): [
        ("trainer", "<required>"),
        ("batch_output", "<required>"),
    ],
    ("callbacks", "TerminateOnNaNCallback.on_training_run_end"): [("trainer", "<required>")],
    ("callbacks", "MoveModulesToDeviceCallback.on_training_run_start"): [("trainer", "<required>")],
    ("callbacks", "MoveModulesToDeviceCallback.on_evaluation_run_start"): [("trainer", "<required>")],
    ("callbacks", "LimitBatchesCallback.__init__"): [("num_batches", "<required>")],
    ("callbacks", "LimitBatchesCallback.on_training_run_start"): [("trainer", "<required>")],
    ("callbacks", "LimitBatchesCallback.on_evaluation_run_start"): [("trainer", "<required>")],
    ("callbacks", "ModelEmaCallback.__init__"): [
        ("decay", 0.99),
        ("evaluate_during_training", True),
        ("save_path", "ema_model.pt"),
        ("watch_metric", "ema_model_eval_loss_epoch"),
        ("greater_is_better", False),
        ("model_ema", "<expr>"),
        ("callbacks", ()),
    ],
    ("callbacks", "ModelEmaCallback.on_training_run_start"): [("trainer", "<required>")],
    ("callbacks", "ModelEmaCallback.on_train_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "ModelEmaCallback.on_eval_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "ModelEmaCallback.on_training_run_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "ModelEmaCallback.on_training_run_end"): [("trainer", "<required>")],
    ("callbacks", "ConvertSyncBatchNormCallback.on_training_run_start"): [("trainer", "<required>")],
    ("callbacks", "StepBasedEvaluationCallback.__init__"): [("eval_every_n_steps", "<required>")],
    ("callbacks", "StepBasedEvaluationCallback.on_train_step_end"): [("trainer", "<required>"), ("step", "<required>")],
    ("callbacks", "LimitEvalStepsCallback.__init__"): [
        ("num_eval_steps", "<required>"),
        ("limit_intermediate_only", True),
    ],
    ("callbacks", "LimitEvalStepsCallback.on_eval_epoch_start"): [
        ("trainer", "<required>"),
        ("is_intermediate", False),
    ],
    ("callbacks", "LimitEvalStepsCallback.on_eval_epoch_end"): [("trainer", "<required>"), ("is_intermediate", False)],
    ("callbacks", "SaveTrainingStateCallback.__init__"): [
        ("save_dir", "training_states"),
        ("save_every_n_epochs", None),
        ("save_every_n_steps", None),
        ("save_at_end", True),
        ("max_checkpoints", None),
    ],
    ("callbacks", "SaveTrainingStateCallback.on_training_run_start"): [("trainer", "<required>")],
    ("callbacks", "SaveTrainingStateCallback.on_train_step_end"): [("trainer", "<required>"), ("step", "<required>")],
    ("callbacks", "SaveTrainingStateCallback.on_train_epoch_end"): [("trainer", "<required>")],
    ("callbacks", "SaveTrainingStateCallback.on_training_run_end"): [("trainer", "<required>")],
    ("callbacks", "WSDCheckpointCallback.__init__"): [
        ("save_dir", "checkpoints"),
        ("save_optimizer", True),
        ("save_scheduler", True),
        ("initial_checkpoint", None),
    ],
    ("callbacks", "WSDCheckpointCallback.on_training_run_start"): [("trainer", "<required>")],
    ("callbacks", "WSDCheckpointCallback.on_train_step_end"): [("trainer", "<required>"), ("step", "<required>")],
    ("callbacks", "WSDCheckpointCallback.on_training_run_end"): [("trainer", "<required>")],
    ("tracking", "RunHistory.get_metric_names"): [],
    ("tracking", "RunHistory.get_metric_values"): [("metric_name", "<required>")],
    ("tracking", "RunHistory.get_latest_metric"): [("metric_name", "<required>")],
    ("tracking", "RunHistory.set_metric_name_prefix"): [("prefix", "")],
    ("tracking", "RunHistory.update_metric"): [("metric_name", "<required>"), ("metric_value", "<required>")],
    ("tracking", "RunHistory.delete_metric"): [("metric_name", "<required>")],
    ("tracking", "RunHistory.reset"): [],
    ("tracking", "InMemoryRunHistory.__init__"): [],
    ("tracking", "InMemoryRunHistory.get_metric_names"): [],
    ("tracking", "InMemoryRunHistory.get_metric_values"): [("metric_name", "<required>")],
    ("tracking", "InMemoryRunHistory.get_latest_metric"): [("metric_name", "<required>")],
    ("tracking", "InMemoryRunHistory.update_metric"): [("metric_name", "<required>"), ("metric_value", "<required>")],
    ("tracking", "InMemoryRunHistory.set_metric_name_prefix"): [("prefix", "")],
    ("tracking", "InMemoryRunHistory.delete_metric"): [("metric_name", "<required>")],
    ("tracking", "InMemoryRunHistory.reset"): [],
    ("tracking", "LossTracker.__init__"): [],
    ("tracking", "LossTracker.reset"): [],
    ("tracking", "LossTracker.update"): [("loss_batch_value", "<required>"), ("batch_size", 1)],
    ("run_config", "TrainerRunConfig.to_dict"): [],
    ("schedulers.cosine_scheduler", "CosineLrScheduler.__init__"): [
        ("optimizer", "<required>"),
        ("total_num_epochs", "<required>"),
        ("num_update_steps_per_epoch", "<required>"),
        ("k_decay", 1.0),
        ("lr_min", 1e-06),
        ("min_lr_ratio", None),
        ("num_warmup_epochs", 0),
        ("warmup_starting_lr", 1e-06),
        ("warmup_starting_lr_ratio", None),
        ("num_cooldown_epochs", 0),
    ],
    ("schedulers.cosine_scheduler", "CosineLrScheduler.get_updated_values"): [("num_updates", "<required>")],
    ("schedulers.cosine_scheduler", "CosineLrScheduler.create_scheduler_fn"): [
        ("total_num_epochs", "<expr>"),
        ("num_update_steps_per_epoch", "<expr>"),
        ("k_decay", 1.0),
        ("lr_min", 1e-06),
        ("min_lr_ratio", None),
        ("num_warmup_epochs", 0),
        ("warmup_starting_lr", 1e-06),
        ("warmup_starting_lr_ratio", None),
        ("num_cooldown_epochs", 0),
    ],
    ("schedulers.cosine_scheduler", "CosineLrScheduler.state_dict"): [],
    ("schedulers.cosine_scheduler", "CosineLrScheduler.load_state_dict"): [("state_dict", "<required>")],
    ("schedulers.wsd_scheduler", "WSDLrScheduler.__init__"): [
        ("optimizer", "<required>"),
        ("num_epochs", None),
        ("num_update_steps_per_epoch", None),
        ("total_steps", None),
        ("num_warmup_steps", 0),
        ("decay_phase_ratio", 0.1),
        ("lr_min", 1e-06),
        ("warmup_starting_lr", 1e-06),
        ("use_inverse_sqrt_decay", True),
        ("num_checkpoints", 1),
        ("is_continuation_from_checkpoint", False),
    ],
    ("schedulers.wsd_scheduler", "WSDLrScheduler.get_checkpoint_steps"): [],
    ("schedulers.wsd_scheduler", "WSDLrScheduler.get_phase_info"): [("num_updates", "<required>")],
    ("schedulers.wsd_scheduler", "WSDLrScheduler.get_decay_info"): [],
    ("schedulers.wsd_scheduler", "WSDLrScheduler.get_current_step"): [],
    ("schedulers.wsd_scheduler", "WSDLrScheduler.get_current_phase_info"): [],
    ("schedulers.wsd_scheduler", "WSDLrScheduler.get_updated_values"): [("num_updates", "<required>")],
    ("schedulers.wsd_scheduler", "WSDLrScheduler.state_dict"): [],
    ("schedulers.wsd_scheduler", "WSDLrScheduler.load_state_dict"): [("state_dict", "<required>")],
    ("schedulers.wsd_scheduler", "WSDLrScheduler.create_scheduler_fn"): [
        ("total_num_epochs", "<expr>"),
        ("num_update_steps_per_epoch", "<expr>"),
        ("num_warmup_epochs", None),
        ("decay_phase_ratio", 0.1),
        ("lr_min", 1e-06),
        ("warmup_starting_lr", 1e-06),
        ("use_inverse_sqrt_decay", True),
        ("num_checkpoints", 1),
        ("is_continuation_from_checkpoint", False),
    ],
    ("schedulers.wsd_scheduler", "estimate_checkpoint_steps"): [("total_steps", "<required>"), ("num_checkpoints", 3)],
    ("schedulers.scheduler_base", "SchedulerBase.__init__"): [("optimizer", "<required>"), ("param_group_field", "lr")],
    ("schedulers.scheduler_base", "SchedulerBase.get_updated_values"): [("num_updates", "<required>")],
    ("schedulers.scheduler_base", "SchedulerBase.step_update"): [("num_updates", "<required>")],
    ("schedulers.scheduler_base", "SchedulerBase.state_dict"): [],
    ("schedulers.scheduler_base", "SchedulerBase.load_state_dict"): [("state_dict", "<required>")],
    ("schedulers.scheduler_base", "StatefulSchedulerBase.__init__"): [
        ("optimizer", "<required>"),
        ("param_group_field", "lr"),
    ],
    ("schedulers.scheduler_base", "StatefulSchedulerBase.step"): [],
    ("schedulers.scheduler_base", "StatefulSchedulerBase.state_dict"): [],
    ("schedulers.scheduler_base", "StatefulSchedulerBase.load_state_dict"): [("scheduler_state_dict", "<required>")],
    ("finetuning", "ModelFreezer.__init__"): [("model", "<required>"), ("freeze_batch_norms", False)],
    ("finetuning", "ModelFreezer.get_layer_groups"): [],
    ("finetuning", "ModelFreezer.get_layers"): [],
    ("finetuning", "ModelFreezer.get_trainable_parameters"): [],
    ("finetuning", "ModelFreezer.freeze"): [("from_index", 0), ("to_index", -2), ("set_modules_as_eval", False)],
    ("finetuning", "ModelFreezer.unfreeze"): [("from_index", -1), ("to_index", 0), ("set_modules_as_training", True)],
    ("utils", "LimitBatches.__init__"): [("num_batches", "<required>")],
    ("utils", "DataLoaderSlice.__init__"): [("dl", "<required>"), ("slice_size", "<required>")],
    ("utils", "local_process_zero_only"): [("func", "<required>")],
    ("utils", "local_process_zero_first"): [("func", "<required>")],
    ("utils", "world_process_zero_only"): [("func", "<required>")],
    ("utils", "ModelEma.__init__"): [("model", "<required>"), ("decay", 0.9999)],
    ("utils", "ModelEma.update_fn"): [("ema_model_weights", "<required>"), ("updated_model_weights", "<required>")],
    ("utils", "ModelEma.update"): [("model", "<required>")],
    ("utils", "ModelEma.set"): [("model", "<required>")],
    ("utils", "worker_init_fn"): [("worker_id", "<required>")],
    ("utils", "remove_padding"): [("padded_tensor", "<required>"), ("pad_value", "<required>")],
}


@pytest.mark.parametrize("module", sorted(PEER_NAMES))
def test_every_public_name_of_the_module_exists(module):
    imported = importlib.import_module(f"pytorch_accel_trainer.{module}")
    assert [name for name in PEER_NAMES[module] if not hasattr(imported, name)] == []


#: Defaults that differ on purpose, each listed in docs/differences.md.
DELIBERATE_DEFAULTS = {
    # get_model() returns the plain model (state_dict keys without "_orig_mod."), as checkpoints hold it
    (("trainer", "Trainer.get_model"), "keep_torch_compile"),
}


def _resolve(module, qualified_name):
    target = importlib.import_module(f"pytorch_accel_trainer.{module}")
    for part in qualified_name.split("."):
        target = getattr(target, part)
    return target


@pytest.mark.parametrize("key", sorted(PEER_SIGNATURES), ids=lambda key: f"{key[0]}.{key[1]}")
def test_peer_parameters_keep_their_defaults(key):
    module, qualified_name = key
    parameters = inspect.signature(_resolve(module, qualified_name)).parameters
    takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for name, default in PEER_SIGNATURES[key]:
        if name not in parameters:  # taken by **kwargs (events are called with keywords), or the peer's *args/**kwargs
            assert takes_any_keyword or name in ("args", "kwargs"), f"{qualified_name}() has no parameter {name!r}"
            continue
        ours = parameters[name].default
        if (key, name) in DELIBERATE_DEFAULTS or default == "<required>":
            continue  # required there; ours may give a default
        if default != "<expr>" and ours is not inspect.Parameter.empty:
            assert ours == default or (isinstance(default, tuple) and list(ours) == list(default)), (
                f"{qualified_name}({name}=...) defaults to {ours!r} here, {default!r} in pytorch-accelerated"
            )


# ------------------------------------------------------------------------------------------------
# Internals that pytorch-accelerated scripts override or call
# ------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _trainer(**kwargs):
    model = make_linear()
    return Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=(), **kwargs)


def test_stand_in_model_accepted_until_prepared():
    trainer = Trainer(
        "irrelevant", "irrelevant", "irrelevant", callbacks=()
    )  # as pytorch-accelerated's tests build one
    with pytest.raises(TypeError, match="model is a str; pass a torch.nn.Module"):
        trainer.train(linear_dataset(8), num_epochs=1)


def test_forward_backward_override_per_batch():
    """The loop calls an overridden _perform_forward_and_backward_passes once per batch."""
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


def test_create_run_config_takes_keywords():
    """_create_run_config takes train()'s arguments by keyword, as pytorch-accelerated's does."""
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


def test_replace_trainer_placeholder_values():
    """replace_trainer_placeholder_values takes the trainer and the factory."""
    trainer = _trainer()
    trainer.train(linear_dataset(12), num_epochs=4, per_device_batch_size=4)
    factory = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=TrainerPlaceholderValues.NUM_EPOCHS * 2)
    assert replace_trainer_placeholder_values(trainer, factory).keywords == {"step_size": 8}


def test_load_checkpoint_and_get_model(tmp_path):
    """load_checkpoint returns the whole checkpoint; get_model keeps torch.compile on request."""
    model = torch.compile(make_linear())  # compiled by the user: get_model() strips it unless asked to keep it
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    trainer.save_checkpoint(tmp_path / "model.pt", checkpoint_kwargs={"epoch": 3})
    checkpoint = trainer.load_checkpoint(tmp_path / "model.pt")
    assert checkpoint["epoch"] == 3 and set(checkpoint["model_state_dict"]) == {"weight", "bias"}
    assert isinstance(trainer.get_model(keep_torch_compile=True), torch._dynamo.eval_frame.OptimizedModule)
    assert not isinstance(trainer.get_model(), torch._dynamo.eval_frame.OptimizedModule)


def test_loss_tracker_api_for_numbers():
    """LossTracker keeps pytorch-accelerated's API for plain numbers."""
    tracker = LossTracker()
    for loss, size in [(105.5, 64), (94.7, 32), (98.0, 16)]:
        tracker.update(loss, batch_size=size)
    assert tracker.loss_value == 98.0 and tracker.running_count == 112
    assert tracker.average == pytest.approx((105.5 * 64 + 94.7 * 32 + 98.0 * 16) / 112, abs=0)
    tracker.update(torch.tensor(2.0))  # batch_size defaults to 1
    assert tracker.running_count == 113 and tracker.average == pytest.approx((tracker.total_loss / 113).item())


def test_run_history_errors_and_set_epoch():
    """An unknown metric is both a KeyError and a ValueError, and the epoch can be set."""
    history = InMemoryRunHistory()
    for error in (KeyError, ValueError):
        with pytest.raises(error, match="No metric named 'acc'"):
            history.get_latest_metric("acc")
    history._set_epoch(5)
    history._increment_epoch()
    assert history.current_epoch == 6
    with pytest.raises(ValueError, match="epoch is 0; epochs are counted from 1"):
        history._set_epoch(0)


def test_state_folder_names_and_resume(tmp_path):
    """Training-state folders are named as pytorch-accelerated names them, and resume from one of them."""

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


def test_state_name_must_be_a_folder_name(tmp_path):
    trainer = _trainer()
    trainer.train(linear_dataset(8), num_epochs=1)
    for name in ("a/b", "latest", ".tmp-x", ""):
        with pytest.raises(ValueError, match=r"is not a training-state folder name: pass one plain folder name"):
            trainer.save_training_state(tmp_path, name=name)
    assert trainer.save_training_state(tmp_path, name="before_decay").name == "before_decay"
    assert find_resumable_state(tmp_path).folder.name == "before_decay"  # found by its manifest


def test_peer_suite_runner_documents_command():
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


def test_trainer_with_timm_scheduler():
    """TrainerWithTimmScheduler counts the run's updates and steps each epoch, without eval data."""
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


def test_subclass_declares_its_own_event():
    """A Trainer subclass declares its own on_ event for its callbacks."""
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


def test_create_and_prepare_overrides_run():
    """Overrides of create_scheduler and of the two preparation halves are called."""
    calls = []

    class CustomTrainer(Trainer):
        def create_scheduler(self):  # no create_scheduler_fn: an override builds the scheduler
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
