"""The checks of ``benchmarks/gpu_checks/run.py``, each run in a fresh process (Accelerate sets the mixed precision
once per process):

    python benchmarks/gpu_checks/checks.py NAME [--smoke] [--result FILE]

Each check prints what it does, then writes its outcome as JSON to ``FILE``: ``status`` (PASS, FAIL or SKIPPED),
``summary`` (one line of figures, or the reason), ``figures`` (every raw measurement) and ``environment``. Without
``--smoke`` every check needs CUDA; ``--smoke`` runs tiny sizes on the CPU and never judges a timing. What each
check measures and its goal: benchmarks/README.md ("GPU checks").
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import gc
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pytorch_accel_trainer
from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.loop import safe_points
from pytorch_accel_trainer.state import async_save

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
PACKAGE_DIR = str(Path(pytorch_accel_trainer.__file__).resolve().parent)

#: Trainer/hand-written time of the timed epochs at most this (within 3 %).
THROUGHPUT_GOAL = 1.03
#: The trainer's extra peak CUDA memory over the hand-written loop, in units of one step's logits, at most this.
MEMORY_GOAL = 0.1
#: The stall of an asynchronous training-state save, as a fraction of a synchronous one's, at most this.
ASYNC_STALL_GOAL = 0.5
#: The training time an asynchronous save costs (the run's extra time per save), as a fraction of a synchronous one's.
ASYNC_LOST_GOAL = 0.1
#: What torch says when ``set_sync_debug_mode`` catches a synchronisation.
SYNC_MESSAGE = "synchronizing CUDA operation"
#: The seed of the trainer (its default), used for the hand-written loops' shuffling too.
SEED = 42


# ------------------------------------------------------------------------------------------------
# Outcomes, devices, timing
# ------------------------------------------------------------------------------------------------


def outcome(status: str, summary: str, **figures) -> dict:
    """A check's result: ``status`` PASS, FAIL or SKIPPED, a one-line ``summary``, and its raw ``figures``."""
    return {"status": status, "summary": summary, "figures": figures}


def passed_if(condition: bool, summary: str, failure: str, **figures) -> dict:
    """PASS with ``summary``, or FAIL with ``failure`` before it."""
    return outcome("PASS", summary, **figures) if condition else outcome("FAIL", f"{failure}; {summary}", **figures)


def has_cuda() -> bool:
    return torch.cuda.is_available()


def get_device() -> torch.device:
    return torch.device("cuda" if has_cuda() else "cpu")


def synchronize() -> None:
    """Wait for the work queued on the GPU, so that a wall-clock mark covers it (nothing to wait for on the CPU)."""
    if has_cuda():
        torch.cuda.synchronize()


def create_optimizer(model: nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA: its step takes fp16's inf check on the device, where the default (foreach) one makes
    ``GradScaler.step`` read it back, a host-device sync every step, by torch's design and not the trainer's."""
    return torch.optim.AdamW(model.parameters(), lr=lr, **({"fused": True} if has_cuda() else {}))


class EpochTimer(TrainerCallback):
    """Times every training epoch of a run, the device synchronised at both ends (the epoch's end comes after its
    one read of the loss, as in the hand-written loops)."""

    def __init__(self):
        self.seconds: list = []
        self._start = 0.0

    def on_train_epoch_start(self, trainer, **kwargs):
        synchronize()
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer, **kwargs):
        synchronize()
        self.seconds.append(time.perf_counter() - self._start)


def decreased(losses: list) -> bool:
    return len(losses) >= 2 and losses[-1] < losses[0]


# ------------------------------------------------------------------------------------------------
# The token workload: a small causal transformer, compute-bound on an H100 at the full sizes
# ------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention (``scaled_dot_product_attention``) and a GELU MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.projection = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, width // self.heads)
        query, key, value = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


@dataclass(frozen=True)
class TokenWorkload:
    """Sequences of ``length`` tokens whose targets are a fixed map of the tokens (learnt in a few steps), and a
    causal transformer over them; one epoch is ``steps_per_epoch`` batches, the first epoch of a run is warm-up."""

    vocab: int
    width: int
    depth: int
    heads: int
    length: int
    batch_size: int
    steps_per_epoch: int
    epochs: int

    def create_dataset(self, num_batches: Optional[int] = None, seed: int = 0) -> TensorDataset:
        generator = torch.Generator().manual_seed(seed)
        count = (num_batches or self.steps_per_epoch) * self.batch_size
        tokens = torch.randint(self.vocab, (count, self.length), generator=generator)
        return TensorDataset(tokens, (tokens * 7 + 3) % self.vocab)

    def create_model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        blocks = [Block(self.width, self.heads) for _ in range(self.depth)]
        return nn.Sequential(
            nn.Embedding(self.vocab, self.width), *blocks, nn.LayerNorm(self.width), nn.Linear(self.width, self.vocab)
        )

    @property
    def timed_steps(self) -> int:
        return self.steps_per_epoch * (self.epochs - 1)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


#: About 20 ms a step on an H100 in bf16 (6.2 TFLOP a step: 59 M weights in matrix products, 16,384 tokens); a batch
#: is 32 sequences, so collating it costs the host next to nothing. Smoke: the same code, tiny.
THROUGHPUT_WORKLOAD = {
    False: TokenWorkload(
        vocab=8192, width=1024, depth=4, heads=16, length=512, batch_size=32, steps_per_epoch=40, epochs=3
    ),
    True: TokenWorkload(vocab=64, width=32, depth=1, heads=2, length=16, batch_size=4, steps_per_epoch=4, epochs=2),
}
#: Two blocks: inductor compiles them in well under a minute on the GPU machine. Smoke: aot_eager (see check_compile).
COMPILE_WORKLOAD = {
    False: TokenWorkload(
        vocab=8192, width=1024, depth=2, heads=16, length=512, batch_size=32, steps_per_epoch=30, epochs=3
    ),
    True: TokenWorkload(vocab=64, width=32, depth=1, heads=2, length=16, batch_size=4, steps_per_epoch=4, epochs=2),
}
#: Epochs of 64 steps: TerminateOnNaNCallback's read every 100 steps, a sync by design, never falls inside them.
#: 2048 tokens a batch: the Embedding's backward takes torch's direct kernel (up to 3072 indices), not the sorting
#: one, so that a sync found is the trainer's, not the model's.
SYNC_WORKLOAD = TokenWorkload(
    vocab=1024, width=256, depth=2, heads=4, length=128, batch_size=16, steps_per_epoch=64, epochs=2
)


# ------------------------------------------------------------------------------------------------
# 1. Throughput: Trainer.train against a hand-written AMP loop
# ------------------------------------------------------------------------------------------------


def train_by_hand(workload: TokenWorkload, dataset, model: nn.Module, precision: str) -> tuple:
    """The AMP loop one would write: pinned batches copied without blocking, autocast around the forward pass, the
    loss in float32, a GradScaler for fp16, the loss summed on the device and read once per epoch. Returns each
    epoch's seconds (device synchronised at both ends) and mean loss."""
    device = get_device()
    model.to(device)
    optimizer = create_optimizer(model)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    loader = DataLoader(
        dataset,
        batch_size=workload.batch_size,
        shuffle=True,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(SEED),
    )
    seconds, losses = [], []
    for _ in range(workload.epochs):
        synchronize()
        start = time.perf_counter()
        model.train()
        total = torch.zeros((), device=device)
        for inputs, targets in loader:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                logits = model(inputs)
            loss = token_cross_entropy(logits.float(), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            total += loss.detach()
        losses.append(total.item() / len(loader))  # the epoch's one host-device sync
        synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds, losses


def train_with_trainer(workload: TokenWorkload, dataset, model: nn.Module, precision: str, **trainer_kwargs) -> tuple:
    """``Trainer.train`` with the default callbacks on the same model and data; as :func:`train_by_hand`."""
    timer = EpochTimer()
    trainer = Trainer(
        model,
        token_cross_entropy,
        create_optimizer(model),
        callbacks=(timer, *DEFAULT_CALLBACKS),
        mixed_precision=precision,
        **trainer_kwargs,
    )
    trainer.train(dataset, num_epochs=workload.epochs, per_device_batch_size=workload.batch_size)
    return timer.seconds, trainer.run_history.get_metric_values("train_loss_epoch")


def check_throughput(precision: str, smoke: bool) -> dict:
    if precision == "fp16" and not has_cuda():
        return outcome("SKIPPED", "fp16 needs CUDA (the trainer refuses it on the CPU)")
    workload = THROUGHPUT_WORKLOAD[smoke]
    dataset, reference = workload.create_dataset(), workload.create_model()
    loops = {"trainer": train_with_trainer, "hand": train_by_hand}

    def run(loop: str) -> dict:
        seconds, losses = loops[loop](workload, dataset, copy.deepcopy(reference), precision)
        gc.collect()  # the run's model, optimizer and trainer go before the next run
        return {"timed_s": sum(seconds[1:]), "epoch_s": seconds, "losses": losses}

    if not smoke:  # a warm-up pair: cuBLAS handles, the caching allocator, kernel selection
        run("trainer")
        run("hand")
    pairs = []
    for index in range(1 if smoke else 3):  # the order alternates, so that drift favours neither
        order = ("trainer", "hand") if index % 2 == 0 else ("hand", "trainer")
        pairs.append({loop: run(loop) for loop in order})
    ratios = [pair["trainer"]["timed_s"] / pair["hand"]["timed_s"] for pair in pairs]
    ratio = statistics.median(ratios)
    ms_per_step = {
        loop: 1000 * statistics.median(pair[loop]["timed_s"] for pair in pairs) / workload.timed_steps for loop in loops
    }
    summary = (
        f"trainer {ms_per_step['trainer']:.2f} ms/step, hand-written {ms_per_step['hand']:.2f} ms/step: "
        f"{ratio:.3f}x (pairs {min(ratios):.3f}-{max(ratios):.3f}), {workload.timed_steps} timed steps"
    )
    figures = {"workload": workload.__dict__, "ratio": ratio, "ratios": ratios, "ms_per_step": ms_per_step}
    figures["pairs"] = pairs
    if not all(decreased(pair[loop]["losses"]) for pair in pairs for loop in loops):
        return outcome("FAIL", f"a run did not train (loss did not go down); {summary}", **figures)
    if smoke:
        return outcome("PASS", f"{summary}; timings not judged in smoke mode", **figures)
    return passed_if(ratio <= THROUGHPUT_GOAL, summary, f"slower than {THROUGHPUT_GOAL}x", **figures)


# ------------------------------------------------------------------------------------------------
# 2. No host-device synchronisation in a training step: torch.cuda.set_sync_debug_mode
# ------------------------------------------------------------------------------------------------


class SyncDebugInSteps(TrainerCallback):
    """Sets ``torch.cuda.set_sync_debug_mode(mode)`` at the start of each training step; ``SyncDebugOffAtEpochEnd``
    sets it back at the end of the epoch, before the epoch's one read of the loss. The fetch (and copy to the device)
    of each batch but an epoch's first falls inside, as it comes between two steps."""

    def __init__(self, mode: str):
        self.mode = mode

    def on_train_step_start(self, trainer, **kwargs):
        torch.cuda.set_sync_debug_mode(self.mode)


class SyncDebugOffAtEpochEnd(Trainer):
    def train_epoch_end(self):
        torch.cuda.set_sync_debug_mode("default")
        super().train_epoch_end()


def train_under_sync_debug(precision: str, mode: str, non_blocking_batches: bool = False) -> Trainer:
    """Train the sync workload with the default callbacks, the steps under ``set_sync_debug_mode(mode)``;
    ``non_blocking_batches`` copies the batches to the device without blocking (Accelerate's ``non_blocking``)."""
    from accelerate.utils import DataLoaderConfiguration

    workload = SYNC_WORKLOAD
    model = workload.create_model()
    accelerator_kwargs = {}
    if non_blocking_batches:  # the trainer's own configuration (seedable sampler, its seed) plus non_blocking
        config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=SEED, non_blocking=True)
        accelerator_kwargs["dataloader_config"] = config
    trainer = SyncDebugOffAtEpochEnd(
        model,
        token_cross_entropy,
        create_optimizer(model),
        callbacks=(SyncDebugInSteps(mode), *DEFAULT_CALLBACKS),
        mixed_precision=precision,
        accelerator_kwargs=accelerator_kwargs,
    )
    try:
        trainer.train(
            workload.create_dataset(),
            num_epochs=workload.epochs,
            eval_dataset=workload.create_dataset(num_batches=4, seed=1),
            per_device_batch_size=workload.batch_size,
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return trainer


def describe_site(frames: list) -> str:
    """Where a synchronisation happened: the innermost Python line, and the trainer's line that led to it."""

    def short(frame) -> str:
        path = frame.filename.replace("\\", "/")
        for marker in ("site-packages/", "dist-packages/", f"{REPO_ROOT.as_posix()}/"):
            path = path.split(marker)[-1]
        return f"{path}:{frame.lineno} {frame.name}"

    frames = [frame for frame in frames if not frame.filename.endswith(("warnings.py", "checks.py"))]
    if not frames:
        return "unknown"
    ours = [frame for frame in frames if frame.filename.startswith(PACKAGE_DIR)]
    site = short(frames[-1])
    if ours and ours[-1] is not frames[-1]:
        site += f" (from {short(ours[-1])})"
    return site


def list_syncs(precision: str, non_blocking_batches: bool) -> dict:
    """Every synchronisation in the steps of a run, by site, as ``set_sync_debug_mode("warn")`` reports them."""
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_MESSAGE in str(message):
            sites[describe_site(traceback.extract_stack())] += 1

    with warnings.catch_warnings():  # puts showwarning back too
        warnings.simplefilter("always")
        warnings.showwarning = record
        train_under_sync_debug(precision, "warn", non_blocking_batches)
    return dict(sites.most_common())


def check_sync_free(precision: str, smoke: bool) -> dict:
    if not has_cuda():
        return outcome("SKIPPED", "torch.cuda.set_sync_debug_mode needs CUDA")
    workload = SYNC_WORKLOAD
    steps = workload.steps_per_epoch * workload.epochs
    try:
        trainer = train_under_sync_debug(precision, "error")
    except RuntimeError as error:
        if SYNC_MESSAGE not in str(error):
            raise
        first = describe_site(traceback.extract_tb(error.__traceback__))
        syncs = list_syncs(precision, non_blocking_batches=False)
        syncs_non_blocking = list_syncs(precision, non_blocking_batches=True)
        listed = "; ".join(f"{count}x {site}" for site, count in syncs.items())
        after = "; ".join(f"{count}x {site}" for site, count in syncs_non_blocking.items()) or "none"
        summary = (
            f"a training step synchronised at {first}. All syncs in {steps} steps: {listed}. With "
            f"DataLoaderConfiguration(non_blocking=True): {after}"
        )
        return outcome("FAIL", summary, syncs=syncs, syncs_with_non_blocking_batches=syncs_non_blocking)
    losses = trainer.run_history.get_metric_values("train_loss_epoch")
    scaler_on = trainer.accelerator.scaler is not None
    applied = trainer.run_config.mixed_precision == precision and scaler_on == (precision == "fp16")
    summary = (
        f"{steps} steps under set_sync_debug_mode('error'): no sync; loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"gradient scaler {'on' if scaler_on else 'off'}"
    )
    figures = {"losses": losses, "scaler": scaler_on, "mixed_precision": trainer.run_config.mixed_precision}
    return passed_if(decreased(losses) and applied, summary, "did not train or precision not applied", **figures)


# ------------------------------------------------------------------------------------------------
# 3. Peak CUDA memory of train and evaluate against hand-written loops, on a logits-heavy workload
# ------------------------------------------------------------------------------------------------

MEMORY_VOCAB, MEMORY_WIDTH, MEMORY_BATCH, MEMORY_LENGTH, MEMORY_STEPS = 32000, 64, 8, 256, 4


def peak_memory_above_start(function: Callable) -> int:
    """Bytes of CUDA memory allocated at the peak of ``function()`` beyond those allocated before it."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    function()
    synchronize()
    return torch.cuda.max_memory_allocated() - start


def hand_train_step(model, optimizer, inputs, targets) -> torch.Tensor:
    """One step, in a function of its own, so that nothing of it (logits, loss) outlives it."""
    device = get_device()
    loss = token_cross_entropy(model(inputs.to(device, non_blocking=True)), targets.to(device, non_blocking=True))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def hand_eval_step(model, inputs, targets) -> torch.Tensor:
    device = get_device()
    with torch.no_grad():
        return token_cross_entropy(model(inputs.to(device, non_blocking=True)), targets.to(device, non_blocking=True))


def check_memory(smoke: bool) -> dict:
    if not has_cuda():
        return outcome("SKIPPED", "torch.cuda.max_memory_allocated needs CUDA")
    device = get_device()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(MEMORY_VOCAB, (MEMORY_STEPS * MEMORY_BATCH, MEMORY_LENGTH), generator=generator)
    dataset = TensorDataset(tokens, (tokens * 7 + 3) % MEMORY_VOCAB)
    logits_bytes = MEMORY_BATCH * MEMORY_LENGTH * MEMORY_VOCAB * 4  # float32 ("no" mixed precision)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Embedding(MEMORY_VOCAB, MEMORY_WIDTH), nn.Linear(MEMORY_WIDTH, MEMORY_VOCAB))
    loader = DataLoader(dataset, batch_size=MEMORY_BATCH, shuffle=True, pin_memory=True)
    # one step first, measured by nobody: the cuBLAS workspace it allocates stays, and would count against the loop
    # measured first
    warm_up = copy.deepcopy(reference).to(device)
    hand_train_step(warm_up, create_optimizer(warm_up), *next(iter(loader)))
    del warm_up
    hand_model = copy.deepcopy(reference)
    hand_optimizer = create_optimizer(hand_model)

    def train_by_hand():
        hand_model.to(device)  # inside, as prepare() moves the trainer's model inside train()
        for _ in range(2):
            total = torch.zeros((), device=device)
            for inputs, targets in loader:
                total += hand_train_step(hand_model, hand_optimizer, inputs, targets)
            total.item()

    def evaluate_by_hand():
        hand_model.eval()
        total = torch.zeros((), device=device)
        for inputs, targets in loader:
            total += hand_eval_step(hand_model, inputs, targets)
        total.item()

    trainer_model = copy.deepcopy(reference)
    trainer = Trainer(trainer_model, token_cross_entropy, create_optimizer(trainer_model), mixed_precision="no")
    peaks = {
        "hand_train": peak_memory_above_start(train_by_hand),
        "trainer_train": peak_memory_above_start(
            lambda: trainer.train(dataset, num_epochs=2, per_device_batch_size=MEMORY_BATCH)
        ),
        "hand_evaluate": peak_memory_above_start(evaluate_by_hand),
        "trainer_evaluate": peak_memory_above_start(
            lambda: trainer.evaluate(dataset, per_device_batch_size=MEMORY_BATCH)
        ),
    }
    extra = {
        stage: (peaks[f"trainer_{stage}"] - peaks[f"hand_{stage}"]) / logits_bytes for stage in ("train", "evaluate")
    }
    mib = {name: value / 2**20 for name, value in peaks.items()}
    summary = (
        f"peak above start, trainer vs hand-written: train {mib['trainer_train']:.0f} vs {mib['hand_train']:.0f} MiB "
        f"({extra['train']:+.3f} logits), evaluate {mib['trainer_evaluate']:.0f} vs {mib['hand_evaluate']:.0f} MiB "
        f"({extra['evaluate']:+.3f} logits); one step's logits: {logits_bytes / 2**20:.0f} MiB"
    )
    figures = {"peak_bytes": peaks, "logits_bytes": logits_bytes, "extra_in_logits": extra}
    worst = max(extra.values())
    return passed_if(worst <= MEMORY_GOAL, summary, f"extra peak {worst:.3f} logits > {MEMORY_GOAL}", **figures)


# ------------------------------------------------------------------------------------------------
# 4. The stall of an asynchronous training-state save against a synchronous one
# ------------------------------------------------------------------------------------------------


class SaveStalls:
    """Times each training-state save the loop takes (``safe_points.write_state``, called at the loop's safe points),
    the device synchronised before and the training stream after: the time the loop waits, the copy to host memory
    it makes itself included (an asynchronous save copies the parameters and optimizer state on a stream of its own,
    beside the next forward and backward passes). Also times the part spent waiting for the previous background save
    (``write_state`` waits for it first), and the loop's wait for that side copy at the next update
    (``saver.wait_for_staging``)."""

    def __init__(self):
        self.seconds: list = []
        self.waiting_for_previous: list = []
        self.waiting_for_copy: list = []
        self._original = safe_points.write_state

    def __enter__(self) -> "SaveStalls":
        safe_points.write_state = self._timed
        async_save.saver.wait_for_staging = self._timed_wait_for_staging  # the instance's, which the loop calls
        return self

    def __exit__(self, *exc_info) -> None:
        safe_points.write_state = self._original
        del async_save.saver.wait_for_staging

    def _timed(self, *args, **kwargs):
        synchronize()  # the queued steps are not the save's: a copy would wait for them, as would the next read
        start = time.perf_counter()
        async_save.saver.wait()
        self.waiting_for_previous.append(time.perf_counter() - start)
        folder = self._original(*args, **kwargs)
        if has_cuda():
            torch.cuda.current_stream().synchronize()  # the training stream: the side copy is not the loop's wait
        self.seconds.append(time.perf_counter() - start)
        return folder

    def _timed_wait_for_staging(self) -> None:
        pending = async_save.saver.staging is not None
        start = time.perf_counter()
        async_save.BackgroundSaver.wait_for_staging(async_save.saver)
        if pending:
            self.waiting_for_copy.append(time.perf_counter() - start)


class SaveMidEpoch(TrainerCallback):
    """Asks for a training state after the middle update of each epoch; the loop takes it before the next step, so
    inside the timed epoch."""

    def __init__(self, folder: Path, steps_per_epoch: int, asynchronous: bool):
        self.folder, self.steps_per_epoch, self.asynchronous = folder, steps_per_epoch, asynchronous

    def on_optimizer_step_end(self, trainer, num_update_steps_completed: int = 0, **kwargs):
        if num_update_steps_completed % self.steps_per_epoch == self.steps_per_epoch // 2:
            trainer.save_training_state(self.folder, asynchronous=self.asynchronous)


def check_async_save(smoke: bool) -> dict:
    # Full: 4096-wide layers, 51 M weights; with Adam's moments a 0.6 GiB state. One save per epoch of 150 steps.
    width, depth, features, batch, steps, epochs = (32, 1, 16, 8, 4, 2) if smoke else (4096, 3, 256, 256, 150, 3)
    torch.manual_seed(0)
    layers = [nn.Linear(features, width), nn.GELU()]
    layers += [module for _ in range(depth) for module in (nn.Linear(width, width), nn.GELU())]
    reference = nn.Sequential(*layers, nn.Linear(width, 1))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, features, generator=generator)
    dataset = TensorDataset(x, x[:, :8].sum(dim=1, keepdim=True).tanh())
    root = Path(tempfile.mkdtemp(prefix="async-save-check-"))
    runs = {}
    try:
        for mode in ("none", "sync", "async"):
            model = copy.deepcopy(reference)
            timer = EpochTimer()
            callbacks = [timer, *DEFAULT_CALLBACKS]
            if mode != "none":
                callbacks.append(SaveMidEpoch(root / mode, steps, asynchronous=mode == "async"))
            trainer = Trainer(model, nn.MSELoss(), create_optimizer(model), callbacks=callbacks, mixed_precision="no")
            with SaveStalls() as stalls:
                trainer.train(dataset, num_epochs=epochs, per_device_batch_size=batch)
            runs[mode] = {
                "epoch_s": timer.seconds,
                "timed_s": sum(timer.seconds[1:]),
                "stall_s": stalls.seconds,
                "waiting_for_previous_s": stalls.waiting_for_previous,
                "waiting_for_copy_s": stalls.waiting_for_copy,
                "states": len(list((root / mode).glob("*/manifest.json"))),
                "losses": trainer.run_history.get_metric_values("train_loss_epoch"),
            }
            if mode == "async":
                trainer.load_training_state(root / mode)  # the newest state written in the background loads (checked)
            del trainer, model
            gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return summarize_async_save(runs, epochs, smoke)


def summarize_async_save(runs: dict, epochs: int, smoke: bool) -> dict:
    stall = {mode: statistics.median(runs[mode]["stall_s"]) for mode in ("sync", "async")}
    saves_timed = epochs - 1  # one save in each timed epoch (all but the first)
    lost = {mode: (runs[mode]["timed_s"] - runs["none"]["timed_s"]) / saves_timed for mode in ("sync", "async")}
    ratio = stall["async"] / stall["sync"]
    lost_ratio = lost["async"] / lost["sync"] if lost["sync"] > 0 else float("inf")
    copy_waits = runs["async"]["waiting_for_copy_s"]
    copy_wait = statistics.median(copy_waits) if copy_waits else 0.0
    summary = (
        f"stall per save (median of {len(runs['async']['stall_s'])}): asynchronous {stall['async'] * 1000:.0f} ms "
        f"(+ {copy_wait * 1000:.1f} ms waiting for its side copy at the next update), synchronous "
        f"{stall['sync'] * 1000:.0f} ms: {ratio:.2f}x; training time lost per save: asynchronous "
        f"{lost['async'] * 1000:.0f} ms, synchronous {lost['sync'] * 1000:.0f} ms: {lost_ratio:.2f}x"
    )
    figures = {
        "runs": runs,
        "stall_s": stall,
        "ratio": ratio,
        "lost_per_save_s": lost,
        "lost_ratio": lost_ratio,
        "copy_wait_s": copy_wait,
    }
    complete = all(runs[mode]["states"] == epochs for mode in ("sync", "async"))
    trained = all(decreased(run["losses"]) for run in runs.values())
    if not (complete and trained):
        return outcome("FAIL", f"states missing or a run did not train; {summary}", **figures)
    if smoke:
        return outcome("PASS", f"{summary}; timings not judged in smoke mode", **figures)
    failure = (
        f"asynchronous stall above {ASYNC_STALL_GOAL}x"
        if ratio > ASYNC_STALL_GOAL
        else f"asynchronous save's training time lost above {ASYNC_LOST_GOAL}x"
    )
    return passed_if(ratio <= ASYNC_STALL_GOAL and lost_ratio <= ASYNC_LOST_GOAL, summary, failure, **figures)


# ------------------------------------------------------------------------------------------------
# 5. torch_compile=True trains, and its step time against eager
# ------------------------------------------------------------------------------------------------


def check_compile(smoke: bool) -> dict:
    from torch._dynamo.utils import counters

    workload = COMPILE_WORKLOAD[smoke]
    # Inductor compiles C++ with gcc on the CPU: about 30 s on a cold cache on 2 cores for a tiny model, too slow for
    # the smoke run; aot_eager traces the model as torch.compile does (dynamo, AOT autograd) without generating code.
    option = {"backend": "aot_eager"} if smoke else True
    dataset, reference = workload.create_dataset(), workload.create_model()
    runs = {}
    for name, torch_compile in (("eager", False), ("compiled", option)):
        torch._dynamo.reset()
        counters.clear()
        seconds, losses = train_with_trainer(
            workload, dataset, copy.deepcopy(reference), "bf16", torch_compile=torch_compile
        )
        runs[name] = {
            "epoch_s": seconds,
            "timed_s": sum(seconds[1:]),
            "losses": losses,
            "unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
        }
        gc.collect()
    compiled, eager = runs["compiled"], runs["eager"]
    ms = {name: 1000 * run["timed_s"] / workload.timed_steps for name, run in runs.items()}
    summary = (
        f"torch_compile={option!r}, bf16: loss {compiled['losses'][0]:.3f} -> {compiled['losses'][-1]:.3f}; "
        f"{ms['compiled']:.2f} ms/step compiled vs {ms['eager']:.2f} eager ({ms['compiled'] / ms['eager']:.2f}x); "
        f"first epoch (compilation) {compiled['epoch_s'][0]:.1f} s; {compiled['unique_graphs']} graph(s), "
        f"{compiled['graph_breaks']} graph break(s)"
    )
    if smoke:
        summary += "; smoke mode: aot_eager (inductor takes ~30 s cold on 2 CPU cores), timings not judged"
    figures = {"workload": workload.__dict__, "runs": runs, "ms_per_step": ms}
    ok = decreased(compiled["losses"]) and decreased(eager["losses"]) and compiled["unique_graphs"] >= 1
    return passed_if(ok, summary, "the compiled run did not train, or nothing was compiled", **figures)


# ------------------------------------------------------------------------------------------------
# 6. FSDP2 on one GPU: fsdp_check.py under accelerate launch, against a plain run
# ------------------------------------------------------------------------------------------------

FSDP_LAUNCH_TIMEOUT_S = 150


def check_fsdp2(smoke: bool) -> dict:
    if smoke or not has_cuda():
        reason = "FSDP needs CUDA (Accelerate never selects it on a CPU; tests/test_fsdp.py covers FSDP2 on gloo)"
        return outcome("SKIPPED", reason)
    import fsdp_check  # beside this file

    root = Path(tempfile.mkdtemp(prefix="fsdp2-check-"))
    try:
        runs = {name: launch_fsdp_check(root / name, fsdp=name == "fsdp2") for name in ("reference", "fsdp2")}
        report = io.StringIO()
        with contextlib.redirect_stdout(report):
            failures = fsdp_check.compare([str(root / "reference"), str(root / "fsdp2")])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report.getvalue())
    fsdp, reference = runs["fsdp2"], runs["reference"]
    difference = max(abs(a - b) for a, b in zip(fsdp["parameters"], reference["parameters"]))
    sharded = (fsdp["distributed_type"], fsdp["fsdp_version"], fsdp["parameter_types"]) == ("FSDP", 2, ["DTensor"])
    summary = (
        f"{fsdp['distributed_type']} v{fsdp['fsdp_version']}, parameters {fsdp['parameter_types']}; loss "
        f"{fsdp['train_loss'][0]:.4f} -> {fsdp['train_loss'][-1]:.4f}; largest parameter difference to a plain run "
        f"{difference:.2e}; fsdp_check.py --compare: {failures} failure(s)"
    )
    lists = ("parameters", "parameters_after_load", "resumed_parameters")  # thousands of numbers each: left out
    figures = {name: {key: value for key, value in run.items() if key not in lists} for name, run in runs.items()}
    figures.update(compare=report.getvalue().splitlines(), largest_parameter_difference=difference)
    return passed_if(sharded and failures == 0, summary, "not sharded by FSDP2, or a comparison failed", **figures)


def launch_fsdp_check(folder: Path, fsdp: bool) -> dict:
    """Run fsdp_check.py into ``folder``, plainly or under ``accelerate launch`` with FSDP2 on one process; return its
    result.json. Its output goes to this check's log."""
    script = str(HERE / "fsdp_check.py")
    command = [sys.executable, script, str(folder)]
    if fsdp:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--num_processes", "1"]
        command += ["--mixed_precision", "no", "--dynamo_backend", "no", "--use_fsdp", "--fsdp_version", "2"]
        command += [script, str(folder)]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, timeout=FSDP_LAUNCH_TIMEOUT_S)
    return json.loads((folder / "result.json").read_text())


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------

CHECKS: dict = {
    "throughput_bf16": lambda smoke: check_throughput("bf16", smoke),
    "throughput_fp16": lambda smoke: check_throughput("fp16", smoke),
    "sync_free_no": lambda smoke: check_sync_free("no", smoke),
    "sync_free_bf16": lambda smoke: check_sync_free("bf16", smoke),
    "sync_free_fp16": lambda smoke: check_sync_free("fp16", smoke),
    "memory": check_memory,
    "async_save": check_async_save,
    "compile": check_compile,
    "fsdp2": check_fsdp2,
}


def describe_environment() -> dict:
    import accelerate

    return {
        "device": torch.cuda.get_device_name() if has_cuda() else "cpu",
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "python": sys.version.split()[0],
        "cpu_threads": torch.get_num_threads(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(CHECKS))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU; timings are not judged")
    parser.add_argument("--result", type=Path, help="where to write the outcome as JSON (default: print it)")
    args = parser.parse_args()
    if not args.smoke and not has_cuda():
        result = outcome("SKIPPED", "no CUDA device: run with --smoke on a CPU")
    else:
        try:
            result = CHECKS[args.name](args.smoke)
        except Exception as error:  # the check failed; the traceback goes to the log
            traceback.print_exc()
            result = outcome("FAIL", f"{type(error).__name__}: {str(error)[:1500]}")
    result["environment"] = describe_environment()
    text = json.dumps(result, default=str)
    if args.result is None:
        print(text)
    else:
        args.result.write_text(text)
    print(f"{args.name}: {result['status']}: {result['summary']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
