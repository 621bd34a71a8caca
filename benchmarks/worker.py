"""One measurement: one row on one workload, in a fresh process. ``run.py --worker ROW WORKLOAD`` calls this.

Every row trains the same model on the same data with the same seeds, for ``epochs`` epochs. The first epoch
is warm-up; the timed region runs from the start of epoch 2 to the end of the run (the last evaluation
included). Each row reports the marks below, and :func:`measure` turns them into the JSON line the parent
reads.

Marks, each a ``(time.perf_counter(), time.process_time())`` pair: ``first_epoch_start`` (the start of epoch 1:
everything before it is start-up), ``timed_start`` (the start of epoch 2), ``timed_end`` (the end of the run).
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import sys
import time

from workloads import TRAIN_SEED, make_datasets, make_loss_func, make_model, updates_per_epoch, workload_spec

#: The libraries each row imports; the worker times these imports (torch always comes first).
ROW_IMPORTS = {
    "torch_loop": [],
    "accelerate_loop": ["accelerate"],
    "trainer_default": ["pytorch_accel_trainer", "pytorch_accel_trainer.callbacks"],
    "trainer_no_callbacks": ["pytorch_accel_trainer", "pytorch_accel_trainer.callbacks"],
    "pytorch_accelerated": ["pytorch_accelerated", "pytorch_accelerated.callbacks"],
    "lightning": ["lightning"],
}
HAND_ROWS = ("torch_loop", "accelerate_loop")


def _now() -> tuple:
    """A mark: (wall clock, CPU time of this process); the CPU time leaves out time spent waiting for a CPU."""
    return time.perf_counter(), time.process_time()


def _rss_mb() -> float:
    """The current resident set size of this process, in MB."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):  # not Linux: the peak so far is the best we have
        return _peak_rss_mb()


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KB on Linux


def _import_row_libraries(row: str, spec: dict) -> None:
    import importlib

    import torch  # noqa: F401

    for module in ROW_IMPORTS[row]:
        importlib.import_module(module)
    if spec["progress"] and row in HAND_ROWS:
        import tqdm  # noqa: F401


def measure(row: str, workload: str, quick: bool, t0: float) -> dict:
    """Run ``row`` on ``workload`` in this process and return its measurements.

    Args:
        t0: ``time.perf_counter()`` at the very start of the worker, before any import but the standard
            library's.
    """
    spec = workload_spec(workload, quick)
    _import_row_libraries(row, spec)
    t_imports = time.perf_counter()
    rss_after_imports = _rss_mb()

    import torch

    torch.set_num_threads(1)
    datasets = make_datasets(spec)
    _first_optimizer_costs()
    rss_before_run = _rss_mb()
    functions = EVAL_FUNCTIONS if spec["phase"] == "evaluate" else ROW_FUNCTIONS
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        run_start = _now()
        marks, train_losses = functions[row](spec, *datasets)  # progress output goes nowhere, but is made
        run_end = _now()

    (start, start_cpu), (end, end_cpu) = marks["timed_start"], marks["timed_end"]
    timed_s, timed_cpu_s = end - start, end_cpu - start_cpu
    first_epoch_s = start - marks["first_epoch_start"][0]
    peak = _peak_rss_mb()
    losses_finite = all(math.isfinite(loss) for loss in train_losses)
    if spec["phase"] == "evaluate":  # nothing trains: the loss must only be a number
        trained = len(train_losses) == 1 and losses_finite
    else:
        trained = len(train_losses) == spec["epochs"] and losses_finite and train_losses[-1] < train_losses[0]
    return {
        "row": row,
        "workload": workload,
        "quick": quick,
        "us_per_step": timed_s / spec["timed_steps"] * 1e6,
        "cpu_us_per_step": timed_cpu_s / spec["timed_steps"] * 1e6,
        "timed_s": timed_s,
        "timed_steps": spec["timed_steps"],
        "first_epoch_us_per_step": first_epoch_s / spec["steps_per_epoch"] * 1e6,
        "import_ms": (t_imports - t0) * 1e3,
        "startup_ms": (marks["first_epoch_start"][0] - t0) * 1e3,
        "setup_ms": (marks["first_epoch_start"][0] - t_imports) * 1e3,
        "rss_after_imports_mb": rss_after_imports,
        "peak_rss_mb": peak,
        "rss_increase_mb": peak - rss_after_imports,
        "rss_before_run_mb": rss_before_run,
        "run_peak_increase_mb": peak - rss_before_run,
        "whole_run_us_per_step": (run_end[0] - run_start[0]) / spec["total_steps"] * 1e6,
        "whole_run_cpu_us_per_step": (run_end[1] - run_start[1]) / spec["total_steps"] * 1e6,
        "train_losses": train_losses,
        "trained": trained,
        "torch_threads": torch.get_num_threads(),
    }


def _first_optimizer_costs() -> None:
    """Pay, before the run's marks, the one-off cost of torch's first optimizer: ``add_param_group`` imports
    ``torch._dynamo`` (and sympy) on its first call, about 1.1 s and 100 MB in every row alike. Left in, it would
    dilute every whole-run ratio toward 1 and hide the loop's own start-up among torch's."""
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


# ----------------------------------------------------------------------------------------------------
# Rows. Each returns (marks, train loss of each epoch).
# ----------------------------------------------------------------------------------------------------


def _one_cycle(optimizer, spec: dict, total_epochs: int, steps_per_epoch: int):
    import torch

    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=spec["max_lr"], epochs=total_epochs, steps_per_epoch=steps_per_epoch, cycle_momentum=False
    )


def _hand_loop(spec: dict, train_dataset, eval_dataset, use_accelerate: bool):
    """The loop people write by hand: plain PyTorch, or the same with an ``accelerate.Accelerator``.

    Like the trainer, it sums the loss on the device and reads it once per epoch, divides the loss by the
    accumulation steps before the backward pass, and steps the scheduler once per optimizer update.
    """
    import torch
    from torch.utils.data import DataLoader

    model = make_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    loss_func = make_loss_func(spec)
    torch.manual_seed(TRAIN_SEED)
    train_dl = DataLoader(train_dataset, batch_size=spec["batch_size"], shuffle=True)
    eval_dl = DataLoader(eval_dataset, batch_size=spec["batch_size"]) if eval_dataset is not None else None
    backward = torch.Tensor.backward
    if use_accelerate:
        from accelerate import Accelerator

        accelerator = Accelerator()
        model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
        if eval_dl is not None:
            eval_dl = accelerator.prepare(eval_dl)
        backward = accelerator.backward
    accumulation, steps_per_epoch = spec["accumulation"], len(train_dl)
    scheduler = _one_cycle(optimizer, spec, spec["epochs"], updates_per_epoch(spec)) if spec["scheduler"] else None
    if spec["progress"]:
        # tqdm.auto would pick tqdm.asyncio here, whose __init__ calls iter() on the DataLoader: an extra
        # iterator per epoch, which draws a seed from torch's RNG and so changes the shuffling.
        from tqdm import tqdm

    marks, train_losses, eval_losses = {}, [], []
    for epoch in range(1, spec["epochs"] + 1):
        if epoch == 1:
            marks["first_epoch_start"] = _now()
        elif epoch == 2:
            marks["timed_start"] = _now()
        model.train()
        loss_sum, count = torch.zeros(()), 0
        batches = train_dl
        if spec["progress"]:
            batches = tqdm(train_dl, desc=f"epoch {epoch} train", unit="batch", dynamic_ncols=True)
        for step, (xb, yb) in enumerate(batches):
            loss = loss_func(model(xb), yb)
            loss_sum += loss.detach() * yb.size(0)
            count += yb.size(0)
            backward(loss / accumulation if accumulation > 1 else loss)
            if (step + 1) % accumulation == 0 or step + 1 == steps_per_epoch:
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
        train_losses.append(loss_sum.item() / count)
        if eval_dl is not None:
            eval_losses.append(_hand_eval_epoch(model, eval_dl, loss_func))
    marks["timed_end"] = _now()
    return marks, train_losses


def _hand_eval_epoch(model, eval_dl, loss_func) -> float:
    """One evaluation epoch as written by hand: ``torch.no_grad()``, the loss summed on the device, read once."""
    import torch

    model.eval()
    eval_sum, eval_count = torch.zeros(()), 0
    with torch.no_grad():
        for xb, yb in eval_dl:
            eval_sum += loss_func(model(xb), yb) * yb.size(0)
            eval_count += yb.size(0)
    return eval_sum.item() / eval_count


def torch_loop(spec, train_dataset, eval_dataset):
    return _hand_loop(spec, train_dataset, eval_dataset, use_accelerate=False)


def accelerate_loop(spec, train_dataset, eval_dataset):
    return _hand_loop(spec, train_dataset, eval_dataset, use_accelerate=True)


def _timing_callback(base_class):
    """A callback on epoch-level events only, so that it adds no per-step cost (pytorch-accelerated API)."""

    class TimingCallback(base_class):
        def __init__(self):
            self.marks = {}

        def on_train_epoch_start(self, trainer, **kwargs):
            epoch = trainer.run_history.current_epoch
            if epoch == 1:
                self.marks["first_epoch_start"] = _now()
            elif epoch == 2:
                self.marks["timed_start"] = _now()

        def on_training_run_end(self, trainer, **kwargs):
            self.marks["timed_end"] = _now()

    return TimingCallback()


def _accel_trainer_row(spec, train_dataset, eval_dataset, trainer_module, callbacks_module, default_callbacks):
    """A pytorch-accelerated style ``Trainer`` (ours or the original), with its default dataloader settings."""
    import functools

    import torch

    placeholders = trainer_module.TrainerPlaceholderValues
    timing = _timing_callback(callbacks_module.TrainerCallback)
    model = make_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    callbacks = [timing, *trainer_module.DEFAULT_CALLBACKS] if default_callbacks else [timing]
    trainer = trainer_module.Trainer(model, loss_func=make_loss_func(spec), optimizer=optimizer, callbacks=callbacks)
    create_scheduler_fn = None
    if spec["scheduler"]:
        create_scheduler_fn = functools.partial(
            torch.optim.lr_scheduler.OneCycleLR,
            max_lr=spec["max_lr"],
            epochs=placeholders.NUM_EPOCHS,
            steps_per_epoch=placeholders.NUM_UPDATE_STEPS_PER_EPOCH,
            cycle_momentum=False,
        )
    torch.manual_seed(TRAIN_SEED)  # the trainers seed themselves too; this covers one that would not
    trainer.train(
        train_dataset=train_dataset,
        num_epochs=spec["epochs"],
        eval_dataset=eval_dataset,
        per_device_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["accumulation"],
        create_scheduler_fn=create_scheduler_fn,
    )
    losses = [float(loss) for loss in trainer.run_history.get_metric_values("train_loss_epoch")]
    if trainer_module.__name__.startswith("pytorch_accelerated") and spec["accumulation"] > 1:
        losses = [loss * spec["accumulation"] for loss in losses]  # it logs the loss divided by the accumulation
    return timing.marks, losses


def trainer_default(spec, train_dataset, eval_dataset):
    import pytorch_accel_trainer
    import pytorch_accel_trainer.callbacks

    trainer_module, callbacks_module = pytorch_accel_trainer, pytorch_accel_trainer.callbacks
    return _accel_trainer_row(spec, train_dataset, eval_dataset, trainer_module, callbacks_module, True)


def trainer_no_callbacks(spec, train_dataset, eval_dataset):
    import pytorch_accel_trainer
    import pytorch_accel_trainer.callbacks

    trainer_module, callbacks_module = pytorch_accel_trainer, pytorch_accel_trainer.callbacks
    return _accel_trainer_row(spec, train_dataset, eval_dataset, trainer_module, callbacks_module, False)


def pytorch_accelerated(spec, train_dataset, eval_dataset):
    import pytorch_accelerated as trainer_module
    import pytorch_accelerated.callbacks as callbacks_module

    if not hasattr(trainer_module, "DEFAULT_CALLBACKS"):
        import pytorch_accelerated.trainer

        trainer_module.DEFAULT_CALLBACKS = pytorch_accelerated.trainer.DEFAULT_CALLBACKS
    return _accel_trainer_row(spec, train_dataset, eval_dataset, trainer_module, callbacks_module, True)


def lightning(spec, train_dataset, eval_dataset):
    """Lightning with its defaults (progress bar included), except those that write files (logger, checkpoints)
    and the one-off model summary and sanity validation."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = make_model(spec)
            self.loss_func = make_loss_func(spec)
            self.epoch_losses: list = []
            self._loss_sum, self._count = torch.zeros(()), 0

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            loss = self.loss_func(self.model(xb), yb)
            self._loss_sum += loss.detach() * yb.size(0)
            self._count += yb.size(0)
            return loss

        def on_train_epoch_end(self):
            self.epoch_losses.append(self._loss_sum.item() / self._count)
            self._loss_sum, self._count = torch.zeros(()), 0

        def validation_step(self, batch, batch_idx):
            xb, yb = batch
            return self.loss_func(self.model(xb), yb)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=spec["lr"])
            if not spec["scheduler"]:
                return optimizer
            scheduler = _one_cycle(optimizer, spec, spec["epochs"], updates_per_epoch(spec))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Timing(L.Callback):
        def __init__(self):
            self.marks = {}

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                self.marks["first_epoch_start"] = _now()
            elif trainer.current_epoch == 1:
                self.marks["timed_start"] = _now()

        def on_train_end(self, trainer, pl_module):
            self.marks["timed_end"] = _now()

    module, timing = Module(), Timing()
    torch.manual_seed(TRAIN_SEED)
    train_dl = DataLoader(train_dataset, batch_size=spec["batch_size"], shuffle=True)
    eval_dl = DataLoader(eval_dataset, batch_size=spec["batch_size"]) if eval_dataset is not None else None
    trainer = L.Trainer(
        max_epochs=spec["epochs"],
        accelerator="cpu",
        devices=1,
        callbacks=[timing],
        accumulate_grad_batches=spec["accumulation"],
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=train_dl, val_dataloaders=eval_dl)
    return timing.marks, module.epoch_losses


# ----------------------------------------------------------------------------------------------------
# Evaluation rows (workloads whose phase is "evaluate"): one evaluation of the eval set, nothing trained. Each
# returns (marks, [the mean eval loss]).
# ----------------------------------------------------------------------------------------------------


def _hand_eval(spec: dict, train_dataset, eval_dataset, use_accelerate: bool):
    """The evaluation loop people write by hand, alone (nothing trained before it)."""
    from torch.utils.data import DataLoader

    model, loss_func = make_model(spec), make_loss_func(spec)
    eval_dl = DataLoader(eval_dataset, batch_size=spec["batch_size"])
    if use_accelerate:
        from accelerate import Accelerator

        accelerator = Accelerator()
        model, eval_dl = accelerator.prepare(model, eval_dl)
    marks = {"first_epoch_start": _now()}
    marks["timed_start"] = marks["first_epoch_start"]
    loss = _hand_eval_epoch(model, eval_dl, loss_func)
    marks["timed_end"] = _now()
    return marks, [loss]


def _trainer_eval(spec: dict, eval_dataset, trainer_module, callbacks_module, default_callbacks: bool):
    """``Trainer.evaluate`` of a pytorch-accelerated style trainer (ours or the original)."""
    timing = _timing_callback(callbacks_module.TrainerCallback)
    callbacks = [timing, *trainer_module.DEFAULT_CALLBACKS] if default_callbacks else [timing]
    model = make_model(spec)
    trainer = trainer_module.Trainer(model, loss_func=make_loss_func(spec), optimizer=None, callbacks=callbacks)
    start = _now()
    trainer.evaluate(eval_dataset, per_device_batch_size=spec["batch_size"])
    marks = {"first_epoch_start": start, "timed_start": start, "timed_end": _now()}
    history = trainer.run_history
    name = "evaluation_loss" if "evaluation_loss" in history.get_metric_names() else "eval_loss_epoch"
    return marks, [float(history.get_latest_metric(name))]


def _our_modules():
    import pytorch_accel_trainer
    import pytorch_accel_trainer.callbacks

    return pytorch_accel_trainer, pytorch_accel_trainer.callbacks


def _pytorch_accelerated_modules():
    import pytorch_accelerated
    import pytorch_accelerated.callbacks
    import pytorch_accelerated.trainer

    return pytorch_accelerated.trainer, pytorch_accelerated.callbacks


def _lightning_eval(spec: dict, train_dataset, eval_dataset):
    """``lightning.Trainer.validate`` with the settings of the ``lightning`` training row."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.loss_func = make_model(spec), make_loss_func(spec)
            self.loss_sum, self.count = torch.zeros(()), 0

        def validation_step(self, batch, batch_idx):
            xb, yb = batch
            self.loss_sum += self.loss_func(self.model(xb), yb) * yb.size(0)
            self.count += yb.size(0)

    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_model_summary=False)
    start = _now()
    trainer.validate(module, DataLoader(eval_dataset, batch_size=spec["batch_size"]), verbose=False)
    marks = {"first_epoch_start": start, "timed_start": start, "timed_end": _now()}
    return marks, [module.loss_sum.item() / module.count]


EVAL_FUNCTIONS = {
    "torch_loop": lambda spec, train, evaluation: _hand_eval(spec, train, evaluation, use_accelerate=False),
    "accelerate_loop": lambda spec, train, evaluation: _hand_eval(spec, train, evaluation, use_accelerate=True),
    "trainer_default": lambda spec, train, evaluation: _trainer_eval(spec, evaluation, *_our_modules(), True),
    "trainer_no_callbacks": lambda spec, train, evaluation: _trainer_eval(spec, evaluation, *_our_modules(), False),
    "pytorch_accelerated": lambda spec, train, evaluation: _trainer_eval(
        spec, evaluation, *_pytorch_accelerated_modules(), True
    ),
    "lightning": _lightning_eval,
}


ROW_FUNCTIONS = {
    "torch_loop": torch_loop,
    "accelerate_loop": accelerate_loop,
    "trainer_default": trainer_default,
    "trainer_no_callbacks": trainer_no_callbacks,
    "pytorch_accelerated": pytorch_accelerated,
    "lightning": lightning,
}


def measure_paired(row: str, workload: str, quick: bool, pairs: int) -> dict:
    """Alternate ``row`` and the torch loop in this one process, ``pairs`` runs of each, and return their ratios.

    The fresh-process rows of :func:`measure` are fair for start-up and memory, but each ratio compares two
    processes that ran seconds apart, on a host whose speed drifts (other tenants, frequency): on the
    reference machine the same row varies by up to 1.7x between processes. Here the two runs of a pair follow
    each other within a second, in the same process, with their order swapped from one pair to the next, so
    drift cancels out. Both rows get one untimed warm-up run first.
    """
    from workloads import BASELINE_ROW

    spec = workload_spec(workload, quick)
    _import_row_libraries(BASELINE_ROW, spec)
    _import_row_libraries(row, spec)

    import torch

    torch.set_num_threads(1)
    datasets = make_datasets(spec)

    def timed_run(name: str) -> tuple:
        """The run's wall and CPU µs per timed step, and its epoch losses."""
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
            marks, train_losses = ROW_FUNCTIONS[name](spec, *datasets)
        (wall_start, cpu_start), (wall_end, cpu_end) = marks["timed_start"], marks["timed_end"]
        steps = spec["timed_steps"]
        return (wall_end - wall_start) / steps * 1e6, (cpu_end - cpu_start) / steps * 1e6, train_losses

    timed_run(BASELINE_ROW), timed_run(row)  # warm-up: lazy initialisation, caches, first-call costs
    runs: dict[str, list] = {BASELINE_ROW: [], row: []}
    trained = True
    for index in range(pairs):
        order = (BASELINE_ROW, row) if index % 2 == 0 else (row, BASELINE_ROW)
        for name in order:
            runs[name].append(timed_run(name))
        losses = runs[row][-1][2]
        trained = trained and all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    ours, base = runs[row], runs[BASELINE_ROW]
    return {
        "row": row,
        "workload": workload,
        "pairs": pairs,
        "ratios": [run[0] / base_run[0] for run, base_run in zip(ours, base)],
        # the time this process ran on a core: without the time it waited for one, which a busy machine adds
        "cpu_ratios": [run[1] / base_run[1] for run, base_run in zip(ours, base)],
        "row_us_per_step": [run[0] for run in ours],
        "baseline_us_per_step": [run[0] for run in base],
        "trained": trained,
    }
