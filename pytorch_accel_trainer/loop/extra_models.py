"""Models and optimizers a trainer runs beside its own (a GAN's discriminator, a teacher, an EMA of another model).

Two parts. :class:`ExtraModelsMixin`, a mixin of :class:`~pytorch_accel_trainer.trainer.Trainer` with the public
methods: :meth:`~ExtraModelsMixin.add_model` registers an extra model (and its optimizer) under a name, and
:meth:`~ExtraModelsMixin.update_extra_model` makes one update of it from a loss. And functions over the trainer's
``extra_models`` / ``extra_optimizers`` dicts, which the trainer calls: it prepares the extras with Accelerate in each
``train()`` and ``evaluate()``, together with its own model (same device, same processes, same mixed precision),
unwraps them at the end of the run, and keeps them in ``save_checkpoint`` / ``load_checkpoint``. The files of a
training state that hold the extras are written and read by ``state/folder.py`` and ``async_save.py``
(``state/files.py`` names them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from accelerate import Accelerator

from pytorch_accel_trainer.loop.trainer_parts import describe_extras_difference
from pytorch_accel_trainer.parallel.layout import layout_of
from pytorch_accel_trainer.parallel.sharded import inner_optimizer, is_deepspeed, is_fsdp
from pytorch_accel_trainer.run_config import get_run_config
from pytorch_accel_trainer.state.checkpointing import EXTRA_MODELS_KEY, EXTRA_OPTIMIZERS_KEY, OPTIMIZER_KEY

if TYPE_CHECKING:
    from pytorch_accel_trainer.loop.run_state import RunState
    from pytorch_accel_trainer.run_config import TrainerRunConfig

#: Names an extra model cannot take: the trainer's own model is ``model`` (in checkpoints and states alike).
RESERVED_NAMES = ("model",)


class ExtraModelsMixin:
    """Registers the extra models and optimizers of a Trainer, and updates them; calls none of the Trainer's private
    methods (the trainer prepares, unwraps, saves and loads the extras with this module's functions)."""

    # What the mixin reads from the Trainer, which sets each of them (declared for type checkers).
    extra_models: dict
    extra_optimizers: dict
    model: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    loss_func: Any
    run_state: RunState
    run_config: Optional[TrainerRunConfig]
    calls_torch_directly: bool
    if TYPE_CHECKING:

        @property
        def accelerator(self) -> Accelerator: ...

    # ------------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------------

    def add_model(self, name: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Register a model (and its optimizer) that the trainer runs beside its own.

        Register before ``train()`` or ``evaluate()``, e.g. in a subclass's ``__init__`` after ``super().__init__``.
        From then on, in every run:

        - the model and optimizer are prepared with Accelerate together with the trainer's own (same device and
          processes, ``DistributedDataParallel`` where the trainer's model gets it, same mixed precision), and
          ``extra_models[name]`` / ``extra_optimizers[name]`` hold the prepared objects; at the end of the run they
          hold the model and optimizer passed here again, as ``trainer.model`` does;
        - :meth:`update_extra_model` makes one update from a loss (backward, the run's clipping, step, zero grad);
        - ``save_checkpoint`` / ``load_checkpoint`` and training states (``save_training_state``,
          ``train(resume_from=...)``) include the model and the optimizer state, and a resume restores them exactly.

        The trainer never calls the model itself and leaves its train/eval mode to you (``model.train()`` in
        ``train_epoch_start``, for instance). Not under FSDP, DeepSpeed or tensor parallelism, where the trainer
        prepares one model.

        Args:
            name: a Python identifier other than ``"model"``, unique in this trainer: the key in ``extra_models``,
                ``extra_optimizers``, checkpoints and training states (``extra_model-<name>.safetensors``).
            model: the module.
            optimizer: an optimizer over the model's parameters, or ``None`` for a model that is not trained
                (a teacher, a frozen encoder): it is still prepared, saved and restored.

        Raises:
            TypeError: ``name`` is not a string, ``model`` not a module or ``optimizer`` not an optimizer.
            ValueError: the name is taken or not an identifier, the model or optimizer is already the trainer's, or
                the optimizer holds parameters of another model.
            RuntimeError: a training run is under way, or the trainer runs under FSDP, DeepSpeed or tensor
                parallelism.

        Example::

            class GANTrainer(Trainer):
                def __init__(self, generator, discriminator, generator_optimizer, discriminator_optimizer, **kwargs):
                    super().__init__(generator, nn.BCEWithLogitsLoss(), generator_optimizer, **kwargs)
                    self.add_model("discriminator", discriminator, discriminator_optimizer)
        """
        self._validate_extra_name(name)
        self._validate_extra_model(name, model, optimizer)
        self._validate_extras_supported(name)
        self.extra_models[name] = model
        if optimizer is not None:
            self.extra_optimizers[name] = optimizer

    def get_extra_model(self, name: str, keep_torch_compile: bool = False) -> torch.nn.Module:
        """Return the extra model ``name`` without its distributed (and ``torch.compile``) wrappers, as
        :meth:`get_model` returns the trainer's: its ``state_dict()`` has the plain module's keys, during a run too."""
        model = self._registered_extra(name, "get_extra_model")
        return self.accelerator.unwrap_model(model, keep_torch_compile=keep_torch_compile)

    def update_extra_model(self, name: str, loss: torch.Tensor) -> None:
        """Make one update of the extra model ``name`` from ``loss``, during a training run.

        In order: zero its gradients (those other backward passes left on it, e.g. the generator's loss flowing
        through a GAN's discriminator, are not this update's), back-propagate ``loss`` (through Accelerate, which
        scales it under fp16), clip its gradients with the run's ``gradient_clip_norm`` / ``gradient_clip_value``,
        step its optimizer and zero its gradients. Gradient accumulation does not apply: the model steps on every
        call, and under several processes its gradients are averaged across them on every call. The scheduler of
        ``train()`` steps the trainer's own optimizer only.

        Compute ``loss`` from tensors cut off from the trainer's model where it should not learn from it
        (``fake.detach()``): the backward pass reaches every tensor the loss depends on.

        Args:
            name: a name registered with :meth:`add_model` together with an optimizer.
            loss: a scalar tensor that requires gradients.

        Raises:
            ValueError: ``name`` is not registered, has no optimizer, or the loss does not require gradients; or fp16
                with gradient accumulation (their shared gradient scaler would change the trainer's accumulated
                gradients).
            RuntimeError: no training run is under way.

        Example::

            loss = self.loss_func(self.extra_models["discriminator"](points), targets)
            self.update_extra_model("discriminator", loss)
        """
        model, optimizer = self._extra_model_and_optimizer(name)
        self._validate_extra_update(name, loss)
        optimizer.zero_grad()
        if self.calls_torch_directly:  # no scaler, no DeepSpeed: Accelerate's backward would only call this
            loss.backward()
        else:
            self.accelerator.backward(loss)
        self._clip_extra_gradients(model, optimizer)
        optimizer.step()
        optimizer.zero_grad()

    # ------------------------------------------------------------------------------------------------
    # Validation, at add_model and update_extra_model
    # ------------------------------------------------------------------------------------------------

    def _validate_extra_name(self, name) -> None:
        if not isinstance(name, str):
            raise TypeError(
                f"add_model(name={name!r}): the name is a {type(name).__name__}; pass a string, e.g. 'discriminator'."
            )
        if not name.isidentifier():
            raise ValueError(
                f"add_model(name={name!r}): the name is not a Python identifier, and it names the model's files in "
                "training states. Use letters, digits and underscores, not starting with a digit, e.g. 'discriminator'."
            )
        if name in RESERVED_NAMES:
            raise ValueError(
                f"add_model(name={name!r}): {name!r} is the trainer's own model (trainer.model, 'model_state_dict' in "
                "checkpoints). Give the extra model a name of its own, e.g. 'discriminator'."
            )
        if name in self.extra_models:
            raise ValueError(
                f"add_model(name={name!r}): an extra model is already registered under {name!r} (registered: "
                f"{sorted(self.extra_models)}). Pick another name, or create a new trainer to replace it."
            )

    def _validate_extra_model(self, name: str, model, optimizer) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"add_model({name!r}, model={model!r}): the model is a {type(model).__name__}; pass a torch.nn.Module."
            )
        if any(model is self._registered_or_own(other) for other in (None, *self.extra_models)):
            raise ValueError(
                f"add_model({name!r}, model): this module is already {self._owner_of(model)}, so it would be prepared, "
                "updated and saved twice. Register each model once (a copy, copy.deepcopy(model), for a second one)."
            )
        if optimizer is None:
            return  # a model that is not trained: prepared, saved and restored all the same
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"add_model({name!r}, model, optimizer={optimizer!r}): the optimizer is a {type(optimizer).__name__}; "
                "pass a torch.optim.Optimizer over the model's parameters, or None for a model that is not trained."
            )
        if any(
            inner_optimizer(optimizer) is inner_optimizer(other)
            for other in (self.optimizer, *self.extra_optimizers.values())
            if other is not None
        ):
            raise ValueError(
                f"add_model({name!r}, model, optimizer): this optimizer is already the trainer's optimizer or another "
                "extra model's. Give each model an optimizer of its own, built from its parameters."
            )
        own = {id(parameter) for parameter in model.parameters()}
        held = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        foreign = sum(1 for parameter in held if id(parameter) not in own)
        if foreign:
            raise ValueError(
                f"add_model({name!r}, model, optimizer={type(optimizer).__name__}): {foreign} of the optimizer's "
                "parameters are not the model's, so they would be stepped without being prepared or saved with it. "
                "Build the optimizer from this model's parameters: "
                f"{type(optimizer).__name__}(model.parameters(), ...)."
            )

    def _validate_extras_supported(self, name: str) -> None:
        if self.run_state.in_training_run:
            raise RuntimeError(
                f"add_model({name!r}, ...) was called during a training run, after the trainer prepared its models. "
                "Register extra models before train() or evaluate(), e.g. in your Trainer subclass's __init__."
            )
        kinds = (
            ("FSDP", is_fsdp(self.accelerator)),
            ("DeepSpeed", is_deepspeed(self.accelerator)),
            ("tensor parallel", layout_of(self.accelerator).tp > 1),
        )
        sharding = next((kind for kind, applies in kinds if applies), None)
        if sharding is not None:
            raise RuntimeError(
                f"add_model({name!r}, ...): this trainer runs under {sharding}, "
                "where the trainer prepares, gathers and saves one model; extra models are supported with one process "
                "or DistributedDataParallel only. Combine the models into one nn.Module to train them under sharding."
            )

    def _validate_extra_update(self, name: str, loss) -> None:
        if not self.run_state.in_training_run:
            raise RuntimeError(
                f"update_extra_model({name!r}, loss) was called outside a training run: it clips with the run's "
                "gradient_clip_norm / gradient_clip_value and steps the optimizer the run prepared. Call it from a "
                "training hook, e.g. calculate_train_batch_loss."
            )
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"update_extra_model({name!r}, loss={loss!r}): the loss is a {type(loss).__name__}; pass the loss "
                "tensor itself, not loss.item()."
            )
        if not loss.requires_grad:  # an attribute read, no sync
            raise ValueError(
                f"update_extra_model({name!r}, loss): the loss does not require gradients (requires_grad=False), so "
                f"the update would change nothing. Compute it from the outputs of extra_models[{name!r}], outside "
                "torch.no_grad() and without .detach()."
            )
        accumulation_steps = get_run_config(self).gradient_accumulation_steps
        if self.accelerator.scaler is not None and accumulation_steps > 1:
            raise ValueError(
                f"update_extra_model({name!r}, loss) under fp16 with gradient_accumulation_steps="
                f"{accumulation_steps}: the extra model's step updates the gradient scaler "
                "it shares with the trainer's optimizer, inside the trainer's accumulation window, which would rescale "
                "the gradients accumulated so far. Use mixed_precision='bf16', or gradient_accumulation_steps=1."
            )

    def _registered_extra(self, name: str, method: str) -> torch.nn.Module:
        if name not in self.extra_models:
            raise ValueError(
                f"{method}({name!r}): no extra model is registered under {name!r}; the registered ones are "
                f"{sorted(self.extra_models)}. Register it first with trainer.add_model({name!r}, model, optimizer)."
            )
        return self.extra_models[name]

    def _extra_model_and_optimizer(self, name: str) -> tuple:
        model = self._registered_extra(name, "update_extra_model")
        if name not in self.extra_optimizers:
            raise ValueError(
                f"update_extra_model({name!r}, loss): {name!r} was registered without an optimizer, so there is "
                f"nothing to step. Pass one to add_model({name!r}, model, optimizer), or use the model without "
                "updating it (a teacher)."
            )
        return model, self.extra_optimizers[name]

    def _registered_or_own(self, name: Optional[str]) -> torch.nn.Module:
        """The trainer's model (``name=None``) or an extra one, as the user passed it."""
        model = self.model if name is None else self.extra_models[name]
        if not isinstance(model, torch.nn.Module):
            return model  # a stand-in model, refused where Accelerate prepares it
        return self.accelerator.unwrap_model(model, keep_torch_compile=True)

    def _owner_of(self, model: torch.nn.Module) -> str:
        if model is self._registered_or_own(None):
            return "the trainer's model"
        return next(f"registered as {name!r}" for name in self.extra_models if model is self._registered_or_own(name))

    def _clip_extra_gradients(self, model: torch.nn.Module, optimizer) -> None:
        """Clip an extra model's gradients by the run's norm and/or value (the same arithmetic as the trainer's own
        clipping, ``accumulation.clip_gradients``). Under fp16 only this optimizer's gradients are unscaled first:
        Accelerate's ``clip_grad_norm_`` would unscale every prepared optimizer, the trainer's included, in the
        middle of its accumulation window. Extra models are never sharded, so torch's clipping is exact."""
        config = get_run_config(self)
        clip_norm, clip_value = config.gradient_clip_norm, config.gradient_clip_value
        if clip_norm is None and clip_value is None:
            return  # nothing asked for: the default run
        self.accelerator.unscale_gradients(optimizer=optimizer)  # a no-op without an fp16 gradient scaler
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=clip_value)


# ------------------------------------------------------------------------------------------------
# Preparation and unwrapping (the Trainer's _prepare, training_run_end, evaluation_run_end)
# ------------------------------------------------------------------------------------------------


def unwrapped_extras(accelerator: Accelerator, extra_models: dict, extra_optimizers: dict) -> list:
    """The extra models, then their optimizers, in registration order, out of any earlier run's wrappers, for
    Accelerate to prepare with the trainer's own."""
    unwrap_extras(accelerator, extra_models, extra_optimizers)  # left wrapped by a run whose training_run_end was
    return [*extra_models.values(), *extra_optimizers.values()]  # overridden: wrapped once


def store_prepared_extras(
    extra_models: dict, extra_optimizers: dict, prepared: list, calls_torch_directly: bool
) -> None:
    """Put what Accelerate made of :func:`unwrapped_extras` in ``extra_models`` / ``extra_optimizers``."""
    models, optimizers = prepared[: len(extra_models)], prepared[len(extra_models) :]
    extra_models.update(zip(list(extra_models), models))
    if calls_torch_directly:  # as the trainer's own: the wrapper's step and zero_grad would only call torch
        optimizers = [inner_optimizer(optimizer) for optimizer in optimizers]
    extra_optimizers.update(zip(list(extra_optimizers), optimizers))


def unwrap_extras(accelerator: Accelerator, extra_models: dict, extra_optimizers: dict) -> None:
    """Put the models and optimizers passed to ``add_model`` back, out of the run's wrappers."""
    for name, model in list(extra_models.items()):  # keeps a torch.compile wrapper the user made
        extra_models[name] = accelerator.unwrap_model(model, keep_torch_compile=True)
    for name, optimizer in list(extra_optimizers.items()):
        extra_optimizers[name] = inner_optimizer(optimizer)


# ------------------------------------------------------------------------------------------------
# Export checkpoints (save_checkpoint, load_checkpoint in persistence.py)
# ------------------------------------------------------------------------------------------------


def extra_checkpoint_entries(
    accelerator: Accelerator, extra_models: dict, extra_optimizers: dict, save_optimizer: bool
) -> dict:
    """The extras' entries of an export checkpoint; ``{}`` without extras, so that such files are unchanged."""
    entries = {}
    if extra_models:
        entries[EXTRA_MODELS_KEY] = {
            name: accelerator.unwrap_model(model, keep_torch_compile=False).state_dict()
            for name, model in extra_models.items()
        }
    if save_optimizer and extra_optimizers:
        entries[EXTRA_OPTIMIZERS_KEY] = {
            name: inner_optimizer(optimizer).state_dict() for name, optimizer in extra_optimizers.items()
        }
    return entries


def validate_extra_checkpoint_entries(
    checkpoint: dict, checkpoint_path: Any, load_optimizer: bool, extra_models: dict, extra_optimizers: dict
) -> None:
    """Refuse a checkpoint whose extras are not exactly those registered, before anything is loaded: a registered
    model would silently keep its weights, or a saved one be silently dropped."""
    kinds = [("models", EXTRA_MODELS_KEY, extra_models)]
    if load_optimizer and (OPTIMIZER_KEY in checkpoint or EXTRA_OPTIMIZERS_KEY in checkpoint):  # saved with them
        kinds.append(("optimizers", EXTRA_OPTIMIZERS_KEY, extra_optimizers))
    for kind, key, registered in kinds:
        saved = checkpoint.get(key, {})
        if not isinstance(saved, dict) or not all(isinstance(state, dict) for state in saved.values()):
            raise ValueError(
                f"{str(checkpoint_path)!r}: its {key!r} entry is not a dict of state dicts; pass a file written by "
                "Trainer.save_checkpoint."
            )
        mismatch = describe_extras_difference(kind, saved, registered)
        if mismatch is not None:
            weights_alone = " (or pass load_optimizer=False to load the weights alone)" if kind == "optimizers" else ""
            raise ValueError(
                f"{str(checkpoint_path)!r} does not fit this trainer: {mismatch}. Register the same extra models "
                f"and optimizers with add_model(name, model, optimizer) before load_checkpoint{weights_alone}; to "
                "load only part of the file, read it with torch.load(path, weights_only=True) and load the state "
                "dicts you need."
            )


def load_extra_checkpoint_entries(
    checkpoint: dict, load_optimizer: bool, accelerator: Accelerator, extra_models: dict, extra_optimizers: dict
) -> None:
    """Load the extras of a checkpoint checked by :func:`validate_extra_checkpoint_entries`."""
    for name, state in checkpoint.get(EXTRA_MODELS_KEY, {}).items():
        accelerator.unwrap_model(extra_models[name], keep_torch_compile=False).load_state_dict(state)
    if load_optimizer:
        for name, state in checkpoint.get(EXTRA_OPTIMIZERS_KEY, {}).items():
            inner_optimizer(extra_optimizers[name]).load_state_dict(state)


def validate_model_on_device(model: torch.nn.Module, device: torch.device, argument: str) -> None:
    """Refuse a module whose parameters are not on the run's ``device``: its forward pass over the run's batches
    would fail with torch's device-mismatch error, which names neither the module nor the fix."""

    def elsewhere(found: torch.device) -> bool:
        if found.type != device.type:
            return True
        return found.index is not None and device.index is not None and found.index != device.index

    wrong = sorted({str(parameter.device) for parameter in model.parameters() if elsewhere(parameter.device)})
    if wrong:
        raise ValueError(
            f"{argument} has parameters on {', '.join(wrong)}, but this run's batches are on {device}: move the "
            "module to the trainer's device first (module.to(trainer.device))."
        )
