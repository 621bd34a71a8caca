"""How fast is a training state saved and loaded, next to torch.save / torch.load of the same tensors, and how
long does an asynchronous save stall training? See benchmarks/README.md.

    python benchmarks/training_state_speed.py [--width 2048] [--layers 3] [--repeats 5]

Prints a markdown table and one JSON line; ``asynchronous`` rows show ``n/a`` on versions without it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir", default=None, help="where the files are written (default: a temporary folder)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="state-speed-", dir=args.dir))
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
