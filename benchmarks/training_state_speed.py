"""How fast is a training state saved and loaded, next to torch.save / torch.load of the same tensors, and how
long does an asynchronous save stall training, and how much training time does a save cost? See benchmarks/README.md.

    python benchmarks/training_state_speed.py [--width 2048] [--layers 3] [--repeats 5]
    python benchmarks/training_state_speed.py --time-lost [--saves 20] [--every 12] [--threads 1] [--processes 5]

Prints a markdown table and one JSON line; ``asynchronous`` rows show ``n/a`` on versions without it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.loop import safe_points


def _model(width: int, layers: int) -> nn.Module:
    blocks = [module for _ in range(layers) for module in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def _trainer(width: int, layers: int) -> Trainer:
    torch.manual_seed(0)
    model = _model(width, layers)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.Adam(model.parameters(), lr=1e-4), callbacks=[])
    data = TensorDataset(torch.randn(8, width), torch.randn(8, 1))
    trainer.train(data, num_epochs=1, per_device_batch_size=4)  # two updates: Adam holds its two moments
    return trainer


def _fsynced_torch_save(obj, path: Path, crc32: bool = True) -> None:
    """``torch.save`` flushed to disk, as a training state is; with ``crc32=False``, its zip records without their
    CRC32, as a training state's torch files are written (their XXH3-128 is in the manifest)."""
    computed = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc32)
    try:
        with open(path, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
    finally:
        torch.serialization.set_crc32_options(computed)


def _timed(function, cpu_times: Optional[list] = None) -> float:
    """The wall time of ``function()``; with ``cpu_times``, its CPU time (every thread of the process) is appended
    there: on a machine shared with other jobs, what the call itself cost, without the waits for a core."""
    start, start_cpu = time.perf_counter(), time.process_time()
    function()
    if cpu_times is not None:
        cpu_times.append(time.process_time() - start_cpu)
    return time.perf_counter() - start


def _spread(values: list) -> str:
    """The median of ``values`` with their quartiles (the middle half of the repeats), in one cell."""
    low, median, high = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return f"{median:.3f} ({low:.3f}-{high:.3f})"


def measure(width: int, layers: int, repeats: int, root: Path) -> dict:
    """Time each side of each pair in every repeat, the side that runs first alternating from one repeat to the next
    (the machine's drift falls on both); a pair's ratio is taken within its repeat, then summarised over them."""
    trainer = _trainer(width, layers)
    model, optimizer = trainer.get_model(), trainer.optimizer
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(
        v.numel() * v.element_size()
        for s in optimizer.state_dict()["state"].values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    compared = ("torch_save", "torch_save_no_crc", "torch_load", "state_save", "state_load")
    times: dict = {name: [] for name in (*compared, "sync_stall", "async_stall", "async_total")}
    cpu: dict = {name: [] for name in compared}
    has_async = "asynchronous" in safe_points.write_state.__code__.co_varnames
    for repeat in range(repeats):
        plain, folder = root / f"plain-{repeat}.pt", root / f"states-{repeat}"

        def torch_save(crc32: bool = True):
            _fsynced_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, plain, crc32)

        def torch_load():
            loaded = torch.load(plain, map_location="cpu", weights_only=True)
            model.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])

        pairs = [
            (
                ("torch_save", torch_save),
                ("state_save", lambda: trainer.save_training_state(folder)),
                ("torch_save_no_crc", lambda: torch_save(crc32=False)),
            ),
            (("torch_load", torch_load), ("state_load", lambda: trainer.load_training_state(folder))),
        ]
        for pair in pairs:
            for name, function in pair if repeat % 2 == 0 else reversed(pair):
                times[name].append(_timed(function, cpu[name]))
        position = trainer.run_state.position(None)
        times["sync_stall"].append(_timed(lambda: safe_points.write_state(trainer, root / f"sync-{repeat}", position)))
        if has_async:
            from pytorch_accel_trainer.state import async_save

            start = time.perf_counter()
            safe_points.write_state(trainer, root / f"async-{repeat}", position, asynchronous=True)
            times["async_stall"].append(time.perf_counter() - start)  # what the training loop waits for
            async_save.saver.wait()
            times["async_total"].append(time.perf_counter() - start)
        for path in root.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    ratios = {
        "save": [ours / base for ours, base in zip(times["state_save"], times["torch_save"])],
        "load": [ours / base for ours, base in zip(times["state_load"], times["torch_load"])],
        "save_no_crc": [ours / base for ours, base in zip(times["state_save"], times["torch_save_no_crc"])],
        "save_cpu": [ours / base for ours, base in zip(cpu["state_save"], cpu["torch_save"])],
        "save_no_crc_cpu": [ours / base for ours, base in zip(cpu["state_save"], cpu["torch_save_no_crc"])],
        "load_cpu": [ours / base for ours, base in zip(cpu["state_load"], cpu["torch_load"])],
    }
    if times["async_stall"]:
        ratios["async_stall"] = [ours / base for ours, base in zip(times["async_stall"], times["sync_stall"])]
    return {
        "width": width,
        "layers": layers,
        "repeats": repeats,
        "state_mib": state_bytes / 2**20,
        "median_s": {name: statistics.median(values) for name, values in times.items() if values},
        "median_ratio": {name: statistics.median(values) for name, values in ratios.items()},
        "raw_s": times,
        "raw_cpu_s": cpu,
        "raw_ratio": ratios,
    }


# ------------------------------------------------------------------------------------------------
# Training time lost per save: the steps after each save against the quiet steps of the same run
# ------------------------------------------------------------------------------------------------

#: The run: 12 x Linear(1024, 1024) with AdamW (140 MiB of weights and moments), batches of 8.
LOST_WIDTH, LOST_LAYERS, LOST_BATCH = 1024, 12, 8
LOST_MODES = ("sync", "async")
LOST_WARM_UP = 2  # saves of each mode not counted: the first allocate what later ones reuse


class AlternatingSaves(TrainerCallback):
    """Times every update of the run, and asks for a training state after every ``every`` updates, synchronous and
    asynchronous in turn, ``saves`` of each."""

    def __init__(self, folder: Path, every: int, saves: int) -> None:
        self.folder, self.every = folder, every
        self.updates = every * (2 * saves + 1)  # a quiet interval after the last save
        self.marks: list = []  # perf_counter as the epoch starts and as each update ends
        self.writing: list = []  # per update: a background save was still being written as it ended

    def on_train_epoch_start(self, trainer, **kwargs):
        self.marks.append(time.perf_counter())

    def on_optimizer_step_end(self, trainer, num_update_steps_completed: int = 0, **kwargs):
        from pytorch_accel_trainer.state import async_save

        self.marks.append(time.perf_counter())
        self.writing.append(async_save.saver.writing)
        update = num_update_steps_completed
        if update % self.every == 0 and update < self.updates - self.every + 1:
            mode = LOST_MODES[(update // self.every - 1) % len(LOST_MODES)]
            trainer.save_training_state(self.folder, asynchronous=mode == "async", max_checkpoints=2)


def measure_time_lost(saves: int, threads: int, every: int, root: Path) -> dict:
    """One run in this process (torch on ``threads`` threads) with ``saves`` saves of each mode (after
    :data:`LOST_WARM_UP` more), ``every`` updates apart. A save asked for after update ``n`` is taken as update
    ``n + 1`` starts; what it cost training is the time of updates ``n + 1`` to ``n + every // 2`` over the run's
    quiet updates (the rest of each interval), each taken as the median over that mode's saves, so that bursts of
    other jobs on the host fall out."""
    torch.set_num_threads(threads)
    callback = AlternatingSaves(root / "states", every, saves + LOST_WARM_UP)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(LOST_WIDTH, LOST_WIDTH) for _ in range(LOST_LAYERS)))
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=1e-4), callbacks=[callback])
    updates = callback.updates
    data = TensorDataset(torch.randn(updates * LOST_BATCH, LOST_WIDTH), torch.randn(updates * LOST_BATCH, LOST_WIDTH))
    trainer.train(data, num_epochs=1, per_device_batch_size=LOST_BATCH)
    seconds = [end - start for start, end in zip(callback.marks, callback.marks[1:])]  # seconds[u - 1]: update u
    affected = every // 2
    after: dict = {mode: [[] for _ in range(affected)] for mode in LOST_MODES}  # per offset, per save
    quiet: list = []
    unfinished = 0
    for index, saved_after in enumerate(range(every, updates - every + 1, every)):
        mode = LOST_MODES[index % len(LOST_MODES)]
        quiet += seconds[saved_after + affected : saved_after + every]
        if index // len(LOST_MODES) < LOST_WARM_UP:
            continue
        for offset in range(affected):
            after[mode][offset].append(seconds[saved_after + offset])
        unfinished += callback.writing[saved_after + affected - 1]
    step = statistics.median(quiet)
    lost = {mode: [statistics.median(values) - step for values in after[mode]] for mode in LOST_MODES}
    return {
        "saves": saves,
        "threads": threads,
        "every": every,
        "updates": updates,
        "state_dir": str(root),
        "quiet_update_s": step,
        "lost_per_offset_s": lost,
        "lost_per_save_s": {mode: sum(values) for mode, values in lost.items()},
        "async_writes_unfinished": unfinished,
        "update_s": seconds,
    }


def print_time_lost(result: dict) -> None:
    lost, offsets = result["lost_per_save_s"], result["lost_per_offset_s"]
    every = result["every"]
    print(
        f"training time lost per save: one run, {result['threads']} torch thread(s), {result['saves']} saves of each "
        f"mode, {every} updates apart, states in {result['state_dir']}\n"
    )
    print(
        f"| save | lost per save, ms | ratio (goal: async <= 0.1x) | updates 1-{every // 2} after it, ms over quiet |"
    )
    print("|---|---|---|---|")
    for mode in LOST_MODES:
        per_offset = ", ".join(f"{value * 1000:+.0f}" for value in offsets[mode])
        print(f"| {mode} | {lost[mode] * 1000:.1f} | {lost[mode] / lost['sync']:.3f}x | {per_offset} |")
    print(
        f"\nquiet update (median): {result['quiet_update_s'] * 1000:.1f} ms; asynchronous writes still under way "
        f"{every // 2} updates after their save: {result['async_writes_unfinished']}"
    )
    print(json.dumps(result))


def time_lost_in_fresh_processes(count: int, arguments: list) -> list:
    """The ``--time-lost`` results of ``count`` fresh processes of this script, one after the other (``arguments``:
    the options they share)."""
    results = []
    for _ in range(count):
        command = [sys.executable, str(Path(__file__).resolve()), "--time-lost", "--json-only", *arguments]
        completed = subprocess.run(command, capture_output=True, text=True, check=True)
        results.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    return results


def print_time_lost_in_processes(results: list) -> None:
    """One line per fresh process, then the median over them of each mode's loss per save, and its ratio."""
    first = results[0]
    print(
        f"training time lost per save: {len(results)} fresh processes, each one run, {first['threads']} torch "
        f"thread(s), {first['saves']} saves of each mode, {first['every']} updates apart\n"
    )
    print("| process | synchronous save lost, ms | asynchronous save lost, ms | ratio | quiet update, ms |")
    print("|---|---|---|---|---|")
    for index, result in enumerate(results, 1):
        lost = result["lost_per_save_s"]
        print(
            f"| {index} | {lost['sync'] * 1000:.1f} | {lost['async'] * 1000:.1f} | {lost['async'] / lost['sync']:.3f}x "
            f"| {result['quiet_update_s'] * 1000:.1f} |"
        )
    median = {mode: statistics.median(r["lost_per_save_s"][mode] for r in results) for mode in LOST_MODES}
    print(
        f"| median | {median['sync'] * 1000:.1f} | {median['async'] * 1000:.1f} | "
        f"{median['async'] / median['sync']:.3f}x (goal: <= 0.1x) | |"
    )
    print(json.dumps({"processes": results, "median_lost_per_save_s": median}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir", default=None, help="where the files are written (default: a temporary folder)")
    parser.add_argument("--time-lost", action="store_true", help="training time lost per save, sync and async")
    parser.add_argument("--saves", type=int, default=20, help="saves of each mode of --time-lost")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of --time-lost")
    parser.add_argument("--every", type=int, default=12, help="updates between saves of --time-lost")
    parser.add_argument("--processes", type=int, default=1, help="--time-lost in this many fresh processes")
    parser.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.time_lost and args.processes > 1:
        shared = ["--saves", str(args.saves), "--threads", str(args.threads), "--every", str(args.every)]
        print_time_lost_in_processes(
            time_lost_in_fresh_processes(args.processes, shared + (["--dir", args.dir] if args.dir else []))
        )
        return
    root = Path(tempfile.mkdtemp(prefix="state-speed-", dir=args.dir))
    if args.time_lost:
        try:
            result = measure_time_lost(args.saves, args.threads, args.every, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(result)) if args.json_only else print_time_lost(result)
        return
    try:
        result = measure(args.width, args.layers, args.repeats, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    raw, ratios = result["raw_s"], result["raw_ratio"]
    print(f"state: {result['state_mib']:.0f} MiB (params + Adam moments), {args.repeats} repeats in {root.parent}")
    print("seconds and ratios: median (lower-upper quartile); a ratio is taken within each repeat\n")
    cpu = result["raw_cpu_s"]
    print("| measure | seconds | ratio (goal) | CPU seconds | CPU-time ratio |\n|---|---|---|---|---|")
    for label, name, ratio, goal in (
        ("torch.save + fsync", "torch_save", "", ""),
        ("save_training_state", "state_save", "save", " (<= 1.05)"),
        ("torch.save + fsync without the zip's CRC32", "torch_save_no_crc", "", ""),
        ("save_training_state over the row above", "state_save", "save_no_crc", ""),
        ("torch.load + load_state_dict", "torch_load", "", ""),
        ("load_training_state (verify + load)", "state_load", "load", " (<= 1.1)"),
    ):
        wall_ratio, cpu_ratio = (_spread(ratios[ratio]), _spread(ratios[f"{ratio}_cpu"])) if ratio else ("1", "1")
        print(f"| {label} | {_spread(raw[name])} | {wall_ratio}{goal} | {_spread(cpu[name])} | {cpu_ratio} |")
    print(f"| stall of a synchronous save | {_spread(raw['sync_stall'])} | 1 | | |")
    if "async_stall" in ratios:
        total = [ours / base for ours, base in zip(raw["async_total"], raw["sync_stall"])]
        stall = _spread(ratios["async_stall"])
        print(f"| stall of an asynchronous save | {_spread(raw['async_stall'])} | {stall} | | |")
        print(f"| asynchronous save, until written | {_spread(raw['async_total'])} | {_spread(total)} | | |")
    else:
        print("| stall of an asynchronous save | n/a | n/a | | |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
