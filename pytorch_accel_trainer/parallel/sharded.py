"""Training under Accelerate's FSDP and DeepSpeed plugins: full state dicts, and what the trainer must do differently.

Under FSDP each process holds a shard of every parameter (FSDP2: ``DTensor`` parameters; FSDP1: flat shards), so
``model.state_dict()`` is not a portable set of weights: the helpers here gather the full, unsharded state on the
main process (a collective: every process must call them) and load a full state back into the shards. DeepSpeed
steps, clips and accumulates inside ``Accelerator.backward``; the helpers make it step once per trainer update and
refuse settings it would silently ignore. ``docs/fsdp_deepspeed.md`` lists what was verified where.

Every helper is a no-op, or the plain single-device behaviour, outside FSDP and DeepSpeed.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional, cast

import accelerate
import torch
from accelerate import Accelerator, DistributedType

from pytorch_accel_trainer.parallel.accelerate_internals import mark_prepared
from pytorch_accel_trainer.parallel.layout import layout_of

# Where Accelerate.prepare refuses a device_placement argument.
_OWN_PLACEMENT_TYPES = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def is_fsdp(accelerator: Accelerator) -> bool:
    """Whether the model is prepared with FSDP (version 1 or 2)."""
    return accelerator.distributed_type == DistributedType.FSDP


def is_deepspeed(accelerator: Accelerator) -> bool:
    """Whether the model is prepared with DeepSpeed."""
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def deepspeed_engine(accelerator: Accelerator) -> Any:
    """DeepSpeed's engine of the prepared model, or ``None`` (outside DeepSpeed, or before ``prepare``)."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return None if wrapped is None else wrapped.engine


def _zero_stage(accelerator: Accelerator) -> int:
    return int(accelerator.state.deepspeed_plugin.zero_stage or 0)


def holds_distributed_tensors(accelerator: Accelerator) -> bool:
    """Whether the model's parameters are ``DTensor``s, each process holding a part of them: FSDP, or the tensor (or
    context) parallelism of a ``ParallelismConfig`` (alone too, where Accelerate runs no FSDP)."""
    return is_fsdp(accelerator) or layout_of(accelerator).model_group_size > 1


def holds_sharded_parameters(accelerator: Accelerator) -> bool:
    """Whether no single process holds the full parameters: FSDP, tensor parallelism, or DeepSpeed ZeRO stage 3."""
    return holds_distributed_tensors(accelerator) or (is_deepspeed(accelerator) and _zero_stage(accelerator) == 3)


def gathers_model_state(accelerator: Accelerator) -> bool:
    """Whether the model's state must be gathered (FSDP, tensor parallelism, ZeRO-3) or copied out of the engine's
    flat buffers (DeepSpeed, whose parameters share storage) for export, rather than read from the unwrapped model."""
    return holds_distributed_tensors(accelerator) or is_deepspeed(accelerator)


def warn_if_sharding_was_ignored(accelerator: Accelerator) -> None:
    """Warn when FSDP or DeepSpeed was asked for but Accelerate set up something else.

    Accelerate 1.15 turns FSDP (and DeepSpeed) on only for GPU-like devices: on the CPU (``ACCELERATE_USE_CPU=1``,
    ``--cpu``, or a machine without GPUs) it silently runs plain DDP over gloo, every process holding the whole
    model (``accelerate/state.py``, ``AcceleratorState.__init__``: the FSDP branch is reached only from
    ``MULTI_GPU``/``MULTI_XPU``/..., the DeepSpeed one only when ``not cpu``). Training is still correct, only not
    sharded; this says so instead of letting a memory estimate be wrong.
    """
    asked = [
        name
        for name, variable, kind in (
            ("FSDP", "ACCELERATE_USE_FSDP", DistributedType.FSDP),
            ("DeepSpeed", "ACCELERATE_USE_DEEPSPEED", DistributedType.DEEPSPEED),
        )
        if os.environ.get(variable, "false").lower() == "true" and accelerator.distributed_type != kind
    ]
    if asked:
        warnings.warn(
            f"{asked[0]} was asked for, but Accelerate set up {accelerator.distributed_type.value} on "
            f"{accelerator.device} with {accelerator.num_processes} process(es): Accelerate runs {asked[0]} only on "
            "GPUs (on the CPU it falls back to DDP, every process holding the whole model). Launch on GPUs to shard; "
            "see docs/fsdp_deepspeed.md.",
            stacklevel=2,
        )


# ------------------------------------------------------------------------------------------------
# Validation at the start of a run
# ------------------------------------------------------------------------------------------------


def validate_sharded_run(accelerator: Accelerator, run_config) -> None:
    """Refuse, before the first step, the settings FSDP or DeepSpeed would get wrong or silently ignore.

    Call it in ``train()`` once the model is prepared and the run config built.

    Raises:
        ValueError: under DeepSpeed, a ``gradient_clip_value``, a ``gradient_clip_norm`` that differs from the
            clipping DeepSpeed applies itself (Accelerate sets an unset ``gradient_clipping`` to 1.0), or a
            DeepSpeed ``gradient_accumulation_steps`` other than 1 (the trainer accumulates itself).
    """
    if not is_deepspeed(accelerator):
        return  # FSDP: clipping (see clip_gradients_by_value) and accumulation stay the trainer's own
    engine = deepspeed_engine(accelerator)
    if engine is None:
        return  # an evaluation run: no optimizer, nothing is stepped
    if run_config.gradient_clip_value is not None:
        raise ValueError(
            f"gradient_clip_value={run_config.gradient_clip_value} cannot be applied under DeepSpeed, which clips "
            "gradients itself, by norm only, inside its optimizer step. Use gradient_clip_norm, matching DeepSpeed's "
            "gradient_clipping."
        )
    deepspeed_clip = float(engine.gradient_clipping() or 0.0)
    trainer_clip = float(run_config.gradient_clip_norm or 0.0)
    if deepspeed_clip != trainer_clip:
        raise ValueError(
            f"DeepSpeed clips the gradient norm to gradient_clipping={deepspeed_clip} (0 is off) inside its own step, "
            f"but train() got gradient_clip_norm={run_config.gradient_clip_norm}; the trainer cannot clip under "
            f"DeepSpeed. Pass gradient_clip_norm={deepspeed_clip if deepspeed_clip else None} to train(), or set the "
            f"DeepSpeed clipping to {trainer_clip}: accelerate launch --gradient_clipping {trainer_clip} (a value "
            'above 0), or "gradient_clipping": 0.0 in a --deepspeed_config_file to turn it off (Accelerate replaces '
            "an unset, 'auto' or 0 --gradient_clipping with 1.0)."
        )
    deepspeed_accumulation = engine.gradient_accumulation_steps()
    if deepspeed_accumulation != 1:
        raise ValueError(
            f"The DeepSpeed config has gradient_accumulation_steps={deepspeed_accumulation}; DeepSpeed would divide "
            f"each loss by it on top of the trainer's own accumulation (gradient_accumulation_steps="
            f"{run_config.gradient_accumulation_steps} in train()). Set it to 1 in the DeepSpeed config (or drop "
            "accelerate launch --gradient_accumulation_steps) and pass the accumulation to train()."
        )


def validate_gradients_visible(accelerator: Accelerator, purpose: str) -> None:
    """Refuse to read or rescale ``parameter.grad`` under DeepSpeed, which keeps gradients in its own buffers.

    Under DeepSpeed the optimizer has already stepped when the trainer's update begins (inside
    ``Accelerator.backward`` of the window's last micro-batch), and ZeRO holds the gradients in partitioned
    buffers: rescaling ``parameter.grad`` there would silently do nothing.

    Raises:
        ValueError: under DeepSpeed, naming ``purpose``.
    """
    if is_deepspeed(accelerator):
        raise ValueError(
            f"{purpose} needs the gradients in parameter.grad before the optimizer step, but DeepSpeed steps inside "
            "backward and keeps the gradients in its own buffers. Return a loss averaged over the batch without "
            "num_items_in_batch, or train with FSDP or DDP."
        )


# ------------------------------------------------------------------------------------------------
# Steps
# ------------------------------------------------------------------------------------------------


def set_deepspeed_gradient_sync(accelerator: Accelerator, is_update_step: bool) -> None:
    """Under DeepSpeed, make the coming ``Accelerator.backward`` step the optimizer only if it ends a window.

    Accelerate's DeepSpeed wrapper calls ``engine.step()`` (clip, optimizer step, zero grad) in every
    ``backward`` while ``accelerator.sync_gradients`` is true, which it always is outside
    ``Accelerator.accumulate``; the trainer accumulates itself, so without this DeepSpeed would update the
    weights after every micro-batch. Call it before each ``backward_step``; elsewhere it does nothing.
    """
    if is_deepspeed(accelerator):
        accelerator.sync_gradients = is_update_step


def clip_gradients_by_value(accelerator: Accelerator, parameters, clip_value: float) -> None:
    """Clip each gradient element to ``[-clip_value, clip_value]``; under FSDP too.

    ``Accelerator.clip_grad_value_`` raises under FSDP. Clipping element by element commutes with sharding (FSDP
    reduce-scatters the gradients before the update, so each shard holds its final values), so torch's
    ``clip_grad_value_`` on the shards is exact; gradients of an fp16 run are unscaled first.
    """
    if is_fsdp(accelerator):
        accelerator.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value=clip_value)
    else:
        accelerator.clip_grad_value_(parameters, clip_value=clip_value)


def as_plain_tensor(norm: Any) -> Optional[torch.Tensor]:
    """A gradient norm as a plain tensor: FSDP2 returns a replicated ``DTensor``, DeepSpeed a float (or ``None``)."""
    if norm is None:
        return None
    if not isinstance(norm, torch.Tensor):
        return torch.tensor(float(norm))
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(norm, DTensor):
            return norm.full_tensor()  # replicated on every process: no communication
    return norm


def _is_sharded_by_fsdp2(accelerator: Accelerator, component: Any) -> bool:
    if not isinstance(component, torch.nn.Module) or not accelerator.is_fsdp2:
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(accelerator.unwrap_model(component, keep_torch_compile=False), FSDPModule)


def _validate_not_prepared_by_deepspeed(accelerator: Accelerator, components: list) -> None:
    """Refuse to prepare again what DeepSpeed already turned into an engine (a second train() or evaluate())."""
    if not is_deepspeed(accelerator):
        return
    for component in components:
        if component is not None and type(component).__module__.startswith("deepspeed."):
            raise ValueError(
                f"Under DeepSpeed a Trainer prepares its model and optimizer once: the optimizer is now DeepSpeed's "
                f"{type(component).__name__}, from which Accelerate cannot build a new engine (the old one is "
                "released when preparing again). Evaluate within the run with train(eval_dataset=...), or create a "
                "new Trainer with a new optimizer for another train() or evaluate(), loading the weights saved with "
                "save_checkpoint(..., save_optimizer=False)."
            )


# ------------------------------------------------------------------------------------------------
# Tensor parallelism (a ParallelismConfig with tp_size > 1)
# ------------------------------------------------------------------------------------------------


def holds_dtensor_parameters(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (split by a tensor-parallel plan, or sharded by FSDP2)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def apply_transformers_tensor_parallel_plan(model: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
    """Split a transformers model on ``device_mesh["tp"]`` by its own tensor-parallel plan (``model.tp_plan``);
    the default of ``Trainer.parallelize_model``.

    transformers 5 applies the plan at load time only (``from_pretrained(..., tp_plan="auto")``, on a mesh of its
    own); on an existing model it takes ``model._resolve_parallel_plans`` (private: it expands the plan's ``*``
    wildcards) and ``transformers.distributed.tensor_parallel.apply_tensor_parallelism``. The parameters the plan
    leaves out (norm weights) stay plain tensors: transformers' styles return local tensors, so they must.

    Raises:
        ValueError: ``model`` has no tensor-parallel plan, or the installed transformers cannot apply one to an
            existing model; the message says to override ``Trainer.parallelize_model``.
    """
    tp_size = device_mesh["tp"].size()
    override = (
        "override Trainer.parallelize_model(model, device_mesh) to split it, e.g. with torch's "
        "parallelize_module(model, device_mesh['tp'], {'fc1': ColwiseParallel(), 'fc2': RowwiseParallel()}) "
        "(torch.distributed.tensor.parallel), and return the model."
    )
    if not getattr(model, "tp_plan", None):
        raise ValueError(
            f"ParallelismConfig(tp_size={tp_size}) splits every layer across {tp_size} processes, but "
            f"{type(model).__name__} has no tensor-parallel plan (only transformers models carry one): {override}"
        )
    try:
        from transformers.distributed import DistributedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError as error:
        raise ValueError(
            f"The installed transformers cannot apply a tensor-parallel plan here ({error}): {override}"
        ) from error
    resolve = getattr(model, "_resolve_parallel_plans", None)
    if not callable(resolve):
        raise ValueError(
            f"The installed transformers has no {type(model).__name__}._resolve_parallel_plans, which applying its "
            f"tensor-parallel plan to an existing model needs: {override}"
        )
    distributed_config = DistributedConfig(tp_size=tp_size)
    plan, _, _ = resolve(distributed_config)
    apply_tensor_parallelism(model, device_mesh["tp"], plan)
    cast(Any, model).config.distributed_config = distributed_config  # as from_pretrained(tp_plan=...) records it
    return model


def record_tensor_parallel_size(model: torch.nn.Module, tp_size: int) -> None:
    """Say on ``model`` that it is split across ``tp_size`` processes, where Accelerate's ``prepare`` asks
    (tensor parallelism alone: ``model.tp_size``, or a transformers model's ``config.distributed_config``, which
    :func:`apply_transformers_tensor_parallel_plan` sets)."""
    if isinstance(getattr(type(model), "tp_size", None), property):
        return  # a transformers model: read from its config.distributed_config
    model.tp_size = tp_size  # type: ignore[assignment]


def swap_optimizer_parameters(optimizers: list, names_by_id: dict, model: torch.nn.Module) -> None:
    """Point each optimizer at ``model``'s parameters of the same names, after torch replaced them.

    ``parallelize_module`` and ``fully_shard`` replace a module's ``nn.Parameter``s with new ``DTensor`` ones; an
    optimizer made before (the trainer's case: the user makes it before the Trainer, so before the device mesh)
    would keep the old tensors and train nothing. ``names_by_id`` maps ``id()`` of each old parameter to its name.

    Raises:
        ValueError: an optimizer already has state (a loaded ``state_dict``), which cannot follow the swap.
    """
    parameters = dict(model.named_parameters())
    for optimizer in optimizers:
        if optimizer is None:
            continue
        optimizer = _torch_optimizer(optimizer)
        if optimizer.state:
            raise ValueError(
                f"The {type(optimizer).__name__} already has state for {len(optimizer.state)} parameters, which "
                "cannot follow the model's parameters into their tensor-parallel (DTensor) form. Create the optimizer "
                "without loading a state_dict; resume with train(resume_from=...) instead."
            )
        for group in optimizer.param_groups:
            group["params"] = [parameters[names_by_id[id(p)]] if id(p) in names_by_id else p for p in group["params"]]


def parameter_names_by_id(model: torch.nn.Module) -> dict:
    """``id()`` of each parameter of ``model`` -> its name, for :func:`swap_optimizer_parameters`."""
    return {id(parameter): name for name, parameter in model.named_parameters()}


def _shard_tensor_parallel_models(accelerator: Accelerator, components: list) -> None:
    """Shard each model of ``components`` with FSDP2 over the data-parallel dims, for a layout with tensor parallelism
    (FSDP2 x TP), and point the optimizers of ``components`` at the sharded parameters.

    Accelerate 1.15's ``prepare`` fails here: its ``_prepare_tp`` imports ``ReplicateParallel`` from
    ``transformers.integrations.tensor_parallel``, which transformers 5 no longer has (an ``ImportError`` on GPUs
    too). Accelerate's public ``fsdp2_prepare_model`` shards as ``prepare`` would (the plugin's wrap policy,
    resharding, mixed precision, the mesh's FSDP dims); the models are then registered as already prepared.
    """
    from accelerate.utils import fsdp2_prepare_model

    optimizers = [component for component in components if isinstance(component, torch.optim.Optimizer)]
    for index, component in enumerate(components):
        if not isinstance(component, torch.nn.Module) or _is_sharded_by_fsdp2(accelerator, component):
            continue
        names_by_id = parameter_names_by_id(component)
        components[index] = fsdp2_prepare_model(accelerator, component)
        swap_optimizer_parameters(optimizers, names_by_id, components[index])
        mark_prepared(components[index])


def _needs_own_fsdp2_sharding(accelerator: Accelerator, components: list) -> bool:
    config = getattr(accelerator, "parallelism_config", None)
    has_optimizer = any(isinstance(component, torch.optim.Optimizer) for component in components)
    return accelerator.is_fsdp2 and config is not None and config.tp_enabled and has_optimizer


def prepare_components(accelerator: Accelerator, components: list, device_placement: Optional[list] = None) -> list:
    """Return ``components`` with each one that is not ``None`` replaced by what ``accelerator.prepare`` made of it.

    ``device_placement`` gives one entry per component (as ``Accelerator.prepare`` takes it); it is left out under
    DeepSpeed and Megatron-LM, where Accelerate refuses it (and places everything itself).

    Under FSDP2 a model that an earlier ``prepare`` (an earlier ``train()`` or ``evaluate()``) already sharded is
    kept as it is and its optimizer only registered again: Accelerate 1.15 cannot shard a model twice (on the
    third ``prepare`` its swap of the optimizer's parameters fails with a ``KeyError``). FSDP2 also needs a model
    and an optimizer together: a model without one (an evaluation-only trainer) is left unsharded, whole on each
    process, which evaluation needs no collective for. Under FSDP2 x tensor parallelism the models are sharded here
    (:func:`_shard_tensor_parallel_models`: Accelerate's own ``prepare`` fails on them), then kept as sharded ones.
    """
    components = list(components)
    _validate_not_prepared_by_deepspeed(accelerator, components)
    if _needs_own_fsdp2_sharding(accelerator, components):
        _shard_tensor_parallel_models(accelerator, components)  # then registered as sharded, below
    keep_sharded = any(_is_sharded_by_fsdp2(accelerator, component) for component in components)
    has_optimizer = any(isinstance(component, torch.optim.Optimizer) for component in components)
    keep_whole = accelerator.is_fsdp2 and not keep_sharded and not has_optimizer
    kept = [
        index
        for index, component in enumerate(components)
        if (keep_sharded or keep_whole) and isinstance(component, (torch.nn.Module, torch.optim.Optimizer))
    ]
    present = [index for index, component in enumerate(components) if component is not None and index not in kept]
    if present:
        options = {}
        if device_placement is not None and accelerator.distributed_type not in _OWN_PLACEMENT_TYPES:
            options["device_placement"] = [device_placement[index] for index in present]
        prepared = accelerator.prepare(*(components[index] for index in present), **options)
        prepared = tuple(prepared) if isinstance(prepared, (tuple, list)) else (prepared,)  # a list under FSDP2
        for index, component in zip(present, prepared):
            components[index] = component
    for index in kept:
        if isinstance(components[index], torch.optim.Optimizer):
            components[index] = accelerator.prepare_optimizer(components[index], device_placement=False)
        elif keep_whole:
            components[index] = components[index].to(accelerator.device)
        else:  # registered again, as prepare does (Accelerate's clipping looks for it there), and kept as it is
            _register_sharded_model(accelerator, components[index])
    return components


def _register_sharded_model(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Give Accelerate back a model it sharded in an earlier ``prepare``: ``prepare_model`` returns a model it
    prepared as it is, only listing it again."""
    registered = accelerator.prepare_model(model, device_placement=False)
    if registered is not model:
        raise RuntimeError(
            f"accelerate {accelerate.__version__} wrapped the model that FSDP2 had already sharded in an earlier "
            f"train() or evaluate() (into {type(registered).__name__}) instead of keeping it as it is. Create a new "
            "Trainer for each run under FSDP2, or install the Accelerate release this pytorch-accel-trainer was "
            "tested with (docs/versions.md)."
        )


def unwrap_distributed_model(
    accelerator: Accelerator, model: torch.nn.Module, keep_torch_compile: bool
) -> torch.nn.Module:
    """``accelerator.unwrap_model``, except that an FSDP1 root is kept.

    Unwrapping an FSDP1 model leaves the user's module holding views of this process's flat shards (empty for the
    parameters other processes hold): it can neither run nor be prepared again. FSDP2 shards the user's module in
    place, so unwrapping it is harmless.
    """
    if is_fsdp(accelerator) and not accelerator.is_fsdp2:
        return model if keep_torch_compile else getattr(model, "_orig_mod", model)
    return accelerator.unwrap_model(model, keep_torch_compile=keep_torch_compile)


# ------------------------------------------------------------------------------------------------
# Full (unsharded) state dicts
# ------------------------------------------------------------------------------------------------


def _prepared_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The model as Accelerate prepared it, even after the trainer unwrapped it: DeepSpeed's engine, else the model
    without the trainer's ``torch.compile`` wrapper (the trainer keeps an FSDP1 root; FSDP2 shards in place)."""
    engine = deepspeed_engine(accelerator)
    if engine is not None:
        target = accelerator.unwrap_model(model, keep_torch_compile=False)
        unwrapped_engine = accelerator.unwrap_model(engine, keep_torch_compile=False)
        return engine if model is engine or unwrapped_engine is target else model
    compiled = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)  # not getattr: FSDP1 forwards attributes
    return cast(torch.nn.Module, model._orig_mod) if compiled else model


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    while hasattr(optimizer, "optimizer") and isinstance(optimizer.optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # Accelerate's wrapper around the user's optimizer
    return optimizer


def _sharded_for_loading(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The prepared model, each FSDP2 module of it back in its sharded state.

    FSDP2 keeps the root module's parameters unsharded after a forward pass until a backward pass reshards them: after
    a training run's evaluation epoch, or the check of the first evaluation batch that ``train()`` runs before it loads
    a resumed state. torch's ``set_model_state_dict`` reads the parameters as they are then (plain tensors) but loads
    into them resharded (DTensors), and fails; resharded first, it loads.
    """
    from torch.distributed.fsdp import FSDPModule

    prepared = _prepared_model(accelerator, model)
    for module in prepared.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return prepared


def _full_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def get_full_model_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict:
    """Return the model's full state dict, with the names and shapes of the plain model, on the CPU.

    Under FSDP or DeepSpeed ZeRO-3 this gathers the shards: a collective that every process must call, and only
    the main process receives the weights (the others get ``{}``); under tensor parallelism too (its ``DTensor``
    parameters gathered whole). Otherwise it is the unwrapped model's ``state_dict()`` on every process.
    """
    if holds_distributed_tensors(accelerator):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(_prepared_model(accelerator, model), options=_full_options(cpu_offload=True))
    if is_deepspeed(accelerator) and deepspeed_engine(accelerator) is not None:
        # ZeRO-3: consolidated on the main process (a collective); else copies of views into the engine's buffers
        state = accelerator.get_state_dict(_prepared_model(accelerator, model))
        return state if accelerator.is_main_process or not holds_sharded_parameters(accelerator) else {}
    return accelerator.unwrap_model(model, keep_torch_compile=False).state_dict()


def load_full_model_state_dict(accelerator: Accelerator, model: torch.nn.Module, state_dict: dict) -> None:
    """Load a full state dict (as :func:`get_full_model_state_dict` returns) into the model, strictly.

    Under FSDP or tensor parallelism every process must call it, each with the full state dict; each keeps its own
    shard.

    Raises:
        RuntimeError: the keys or shapes do not fit the model.
    """
    if holds_distributed_tensors(accelerator):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        incompatible = set_model_state_dict(
            _sharded_for_loading(accelerator, model), state_dict, options=_full_options(strict=True)
        )
        if incompatible.missing_keys or incompatible.unexpected_keys:
            raise RuntimeError(
                f"missing keys {incompatible.missing_keys}, unexpected keys {incompatible.unexpected_keys}"
            )
        return
    if holds_sharded_parameters(accelerator):
        raise NotImplementedError(
            "Loading a full state dict into a DeepSpeed ZeRO-3 model is not supported by the trainer: load the weights "
            "into the model before Trainer(...) prepares it, or use ZeRO stage 1 or 2."
        )
    accelerator.unwrap_model(model, keep_torch_compile=False).load_state_dict(state_dict)


def get_full_optimizer_state_dict(accelerator: Accelerator, model: torch.nn.Module, optimizer) -> dict:
    """Return the optimizer's full state dict in torch's plain format (parameters numbered in order).

    The numbering is that of ``optimizer.state_dict()`` for the same optimizer over the unsharded model, so the
    result loads into a plain optimizer. Under FSDP or tensor parallelism this gathers the shards: every process must
    call it, and only the main process receives the state (the others get ``{}``).

    Raises:
        ValueError: under DeepSpeed, whose optimizer state is partitioned in its own format.
    """
    if is_deepspeed(accelerator):
        raise ValueError(
            "Under DeepSpeed the optimizer state is partitioned in DeepSpeed's own format, which the trainer's "
            "checkpoints do not hold: save without it (save_checkpoint(..., save_optimizer=False)), or save the "
            "whole run with trainer._accelerator.save_state(folder) (DeepSpeed's checkpoint)."
        )
    if not holds_distributed_tensors(accelerator):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    prepared = _prepared_model(accelerator, model)
    # torch types the whole dict as one union of value types; "state" and "param_groups" hold what torch documents
    state: dict[str, Any] = get_optimizer_state_dict(
        prepared, _torch_optimizer(optimizer), options=_full_options(cpu_offload=True)
    )
    if not accelerator.is_main_process:
        return {}
    order = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: position for position, name in enumerate(order)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]
        ],
    }


def load_full_optimizer_state_dict(
    accelerator: Accelerator, model: torch.nn.Module, optimizer, state_dict: dict
) -> None:
    """Load a state dict in torch's plain format (as :func:`get_full_optimizer_state_dict` returns).

    Under FSDP or tensor parallelism every process must call it, each with the full state dict; each keeps its own
    shard.
    """
    if is_deepspeed(accelerator):
        raise ValueError(
            "Under DeepSpeed the optimizer state is partitioned in DeepSpeed's own format, and the trainer's "
            "checkpoints cannot be loaded into it: pass load_optimizer=False, or restore the whole run with "
            "trainer._accelerator.load_state(folder) from a folder written by save_state."
        )
    if not holds_distributed_tensors(accelerator):
        optimizer.load_state_dict(state_dict)
        return
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    prepared, inner = _sharded_for_loading(accelerator, model), _torch_optimizer(optimizer)
    # torch names each parameter of the live optimizer as it names the saved ones (this process's shards: no gather)
    live: dict[str, Any] = get_optimizer_state_dict(prepared, inner)  # as in get_full_optimizer_state_dict
    order = [name for group in live["param_groups"] for name in group["params"]]
    by_name: dict[str, Any] = {
        "state": {order[position]: value for position, value in state_dict["state"].items()},
        "param_groups": [
            {**group, "params": [order[position] for position in group["params"]]}
            for group in state_dict["param_groups"]
        ],
    }
    set_optimizer_state_dict(prepared, inner, optim_state_dict=by_name, options=_full_options())


def state_module(accelerator: Accelerator, prepared: torch.nn.Module, unwrapped: torch.nn.Module) -> torch.nn.Module:
    """The module whose tensors a training state holds: under FSDP the prepared one, each FSDP2 module of it resharded
    (its ``DTensor`` shards, written one shard per process: after an evaluation FSDP2 keeps the root's parameters
    whole until the next backward pass), else the user's own module, without the wrappers (DDP's) that rename its
    parameters."""
    return _sharded_for_loading(accelerator, prepared) if is_fsdp(accelerator) else unwrapped


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The user's torch optimizer inside Accelerate's wrapper."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer):
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer


def writes_on_this_process(accelerator: Accelerator, save_per_node: bool) -> bool:
    """Whether this process writes an export file: once per node, or on the main process only.

    A gathered (sharded) state reaches the main process only, so it alone writes.
    """
    if save_per_node and not holds_sharded_parameters(accelerator):
        return accelerator.is_local_main_process
    return accelerator.is_main_process
