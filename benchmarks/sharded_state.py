"""Training-state save and resume of a sharded run on the CPU (gloo), against torch.distributed.checkpoint: FSDP2 on 2
processes, or FSDP2 x tensor parallel (``--layout fsdp_tp``: Accelerate's ``ParallelismConfig(dp_shard_size=2,
tp_size=2)``, each process holding a 2-D ``DTensor`` shard) on 4.

    python benchmarks/sharded_state.py                  # 18 x Linear(2048, 2048) (75.5 M parameters), 3 repeats
    python benchmarks/sharded_state.py --quick          # a smoke run: 4 x Linear(256, 256), one repeat
    python benchmarks/sharded_state.py --layout fsdp_tp # the same model on 4 processes, dp_shard 2 x tp 2
    python benchmarks/sharded_state.py --layers 6 --width 1024 --repeats 5 --output-dir /tmp/sharded

Without ``--worker`` this is the driver: it starts one ``accelerate launch`` of the layout's CPU processes running this
file with
``--worker``, which measures every row ``--repeats`` times in a fixed order, on the same trained model; then it prints
markdown tables (figures, files written, goals) and writes ``results.md`` and ``results.json`` to ``--output-dir``
(default ``benchmarks/results/sharded_state/``). It exits with status 1 if the launch failed or a row raised an error;
a row that the trainer refuses (an asynchronous save with several processes) is reported as ``refused: <message>``.
See benchmarks/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import accelerate
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate import DistributedType, PartialState
from accelerate.utils import FullyShardedDataParallelPlugin
from launch import launcher  # benchmarks/launch.py, beside this file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.loop import safe_points
from pytorch_accel_trainer.parallel.layout import layout_of
from pytorch_accel_trainer.state import async_save

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
#: The layouts measured: their processes, the title of the tables, the ParallelismConfig sizes (``None``: FSDP2
#: alone, switched on by ``CpuFSDP2Trainer``) and the default output folder.
LAYOUTS = {
    "fsdp": {"processes": 2, "title": "FSDP2", "sizes": None, "output": RESULTS_DIR / "sharded_state"},
    "fsdp_tp": {
        "processes": 4,
        "title": "FSDP2 x tensor parallel (dp_shard 2 x tp 2)",
        "sizes": {"dp_shard_size": 2, "tp_size": 2},
        "output": RESULTS_DIR / "sharded_state_fsdp_tp",
    },
}
MIB = 2**20

#: The rows, in the order each repeat measures them, and what the table calls them.
ROWS = {
    "dcp_save": "`dcp.save` (baseline)",
    "state_save": "`save_training_state` after `train()`",
    "dcp_load": "`dcp.load` + `set_*_state_dict` (baseline)",
    "state_load": "`load_training_state`",
    "async_blocked": "background save: the caller blocked (staging)",
    "sync_in_run": "stall of `save_training_state` in `train()`",
    "async_in_run": "stall of `save_training_state(asynchronous=True)` in `train()`",
}
#: The rows that write a state folder, whose files are counted.
SAVE_ROWS = ("dcp_save", "state_save", "async_blocked", "sync_in_run", "async_in_run")
#: Each row's figure is divided by this row's median in the ``x baseline`` column.
BASELINES = {
    "state_save": "dcp_save",
    "async_blocked": "state_save",
    "state_load": "dcp_load",
    "sync_in_run": "state_save",
    "async_in_run": "state_save",
}

#: A file written by one process: DCP's ``__<rank>_<n>.distcp``, the trainer's ``rank_<rank>.pt``.
RANK_FILE_PATTERNS = (re.compile(r"__(\d+)_\d+\.distcp$"), re.compile(r"rank_(\d+)\.pt$"))


# ------------------------------------------------------------------------------------------------
# Host memory
# ------------------------------------------------------------------------------------------------


def read_status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB, e.g. ``VmRSS`` (resident set size) or ``VmHWM`` (its peak)."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1))


def current_rss_kib() -> int:
    return read_status_kib("VmRSS")


class PeakMemory:
    """The peak resident set size of this process since the last :meth:`reset`, in bytes.

    The kernel keeps that peak (``VmHWM``) and resets it to the current RSS when ``5`` is written to
    ``/proc/self/clear_refs``. Where that file is not writable, a thread samples the RSS every 5 ms instead (a
    peak shorter than that can be missed)."""

    def __init__(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.uses_clear_refs = True
            self.method = "VmHWM reset through /proc/self/clear_refs"
        except OSError:
            self.uses_clear_refs = False
            self.method = "RSS sampled every 5 ms"
            self._lock = threading.Lock()
            self._sampled_peak = current_rss_kib()
            threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            rss = current_rss_kib()
            with self._lock:
                self._sampled_peak = max(self._sampled_peak, rss)
            time.sleep(0.005)

    def reset(self) -> None:
        if self.uses_clear_refs:
            Path("/proc/self/clear_refs").write_text("5")
        else:
            with self._lock:
                self._sampled_peak = current_rss_kib()

    def peak(self) -> int:
        if self.uses_clear_refs:
            return read_status_kib("VmHWM") * 1024
        with self._lock:
            return max(self._sampled_peak, current_rss_kib()) * 1024


# ------------------------------------------------------------------------------------------------
# Worker: the trainers and the measured calls (every process runs this)
# ------------------------------------------------------------------------------------------------


class CpuFSDP2Trainer(Trainer):
    """A Trainer whose Accelerator runs FSDP2 on the CPU: Accelerate 1.15 never selects FSDP on a CPU, so the state
    is switched to FSDP after the Accelerator is created (as in tests/scripts/fsdp_train.py)."""

    def _create_accelerator(self):
        accelerator = super()._create_accelerator()
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # AcceleratorState re-reads it
        return accelerator


class TensorParallelTrainer(Trainer):
    """Splits the Linear layers in pairs across the tensor-parallel processes: column-wise, then row-wise."""

    def parallelize_model(self, model, device_mesh):
        plan = {str(index): RowwiseParallel() if index % 2 else ColwiseParallel() for index in range(len(model))}
        return parallelize_module(model, device_mesh["tp"], plan)


class TimedSaveRun(TrainerCallback):
    """In a run it is armed for: times every training step and asks for one training state at a chosen step.

    The step times are the intervals between consecutive ``on_train_step_end`` events (each holds one optimizer
    update, the point between updates where a requested save is taken, and the next forward pass). The peak memory of
    the steps from step 2 to the request is kept, then the peak from the request to the end of the run (which waits
    for a background save)."""

    def __init__(self, memory: PeakMemory):
        self.memory = memory
        self.armed = False

    def arm(self, folder: Path, request_step: int, asynchronous: bool) -> None:
        self.folder, self.request_step, self.asynchronous = folder, request_step, asynchronous
        self.step_ends, self.refused = [], None
        self.steps_peak = self.save_peak = None
        self.armed = True

    def on_train_step_end(self, trainer, step=None, **kwargs):
        if not self.armed:
            return
        self.step_ends.append(time.perf_counter())
        if step == 2:
            self.memory.reset()
        if step == self.request_step:
            self.steps_peak = self.memory.peak()
            self.memory.reset()
            try:  # taken at the next point between updates, before step request_step + 1
                trainer.save_training_state(self.folder, asynchronous=self.asynchronous)
            except ValueError as error:  # the trainer refuses this save (not a crash of the benchmark)
                self.refused = str(error)

    def on_training_run_end(self, trainer, **kwargs):
        if self.armed:
            self.save_peak = self.memory.peak()
            self.armed = False


def make_model(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def make_data(num_samples: int, width: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(num_samples, width, generator=generator)
    return TensorDataset(inputs, torch.randn(num_samples, width, generator=generator))


def make_trainer(args, seed: int, callbacks) -> Trainer:
    torch.manual_seed(seed)
    model = make_model(args.layers, args.width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    sizes = LAYOUTS[args.layout]["sizes"]
    if sizes is None:
        return CpuFSDP2Trainer(model, nn.MSELoss(), optimizer, callbacks=callbacks, seed=seed)
    from accelerate.parallelism_config import ParallelismConfig

    layout = {"parallelism_config": ParallelismConfig(**sizes)}
    return TensorParallelTrainer(
        model, nn.MSELoss(), optimizer, callbacks=callbacks, seed=seed, accelerator_kwargs=layout
    )


def train_updates(trainer: Trainer, args, num_updates: int) -> None:
    """One epoch of exactly ``num_updates`` optimizer updates (one micro-batch each) on every process."""
    num_samples = num_updates * args.batch_size * layout_of(trainer.accelerator).dp_size  # tp ranks share a batch
    trainer.train(make_data(num_samples, args.width), num_epochs=1, per_device_batch_size=args.batch_size)


def torch_optimizer(trainer: Trainer) -> torch.optim.Optimizer:
    """The user's torch optimizer (inside Accelerate's wrapper, if the trainer keeps one)."""
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def live_state_dict(trainer: Trainer) -> dict:
    """The model's and the optimizer's state dicts as torch.distributed.checkpoint takes them (local shards)."""
    model, optimizer = trainer.model, torch_optimizer(trainer)
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def dcp_save(trainer: Trainer, folder: Path) -> None:
    dcp.save(live_state_dict(trainer), checkpoint_id=str(folder))


def dcp_load(trainer: Trainer, folder: Path) -> None:
    state = live_state_dict(trainer)
    dcp.load(state, checkpoint_id=str(folder))  # into the live tensors' shards
    set_model_state_dict(trainer.model, state["model"])
    set_optimizer_state_dict(trainer.model, torch_optimizer(trainer), state["optimizer"])


def save_in_background(trainer: Trainer, folder: Path) -> None:
    """The save a run takes at a point between updates with ``asynchronous=True``, called directly: it returns once
    each process staged its shard in host memory (what training waits for); the files are written in the
    background, waited for after the measurement."""
    safe_points.write_state(trainer, folder, trainer.run_state.position(None), asynchronous=True)


def measure_call(memory: PeakMemory, function, *arguments) -> dict:
    """Wall time of ``function(*arguments)`` between a barrier before and a barrier after, and the peak RSS above the
    RSS before it (both of this process). An error is recorded, not raised."""
    dist.barrier()
    rss_before = current_rss_kib() * 1024
    memory.reset()
    start = time.perf_counter()
    try:
        function(*arguments)
    except Exception as error:  # reported as the row's error; the benchmark goes on
        return {"error": f"{type(error).__name__}: {error}"}
    dist.barrier()
    return {"seconds": time.perf_counter() - start, "peak_bytes": memory.peak() - rss_before}


def measure_in_run(trainer: Trainer, args, timer: TimedSaveRun, folder: Path, asynchronous: bool) -> dict:
    """A training run of ``args.steps`` updates that asks for a state at update ``steps - 3``: the stall is the time
    of the step that holds the save minus the median of steps 2 to the request (before it; step 1 follows the
    prepare and the first step)."""
    request_step = args.steps - 3
    timer.arm(folder, request_step, asynchronous)
    try:
        train_updates(trainer, args, args.steps)
    except Exception as error:  # reported as the row's error
        timer.armed = False
        return {"error": f"{type(error).__name__}: {error}"}
    if timer.refused is not None:
        return {"refused": timer.refused}
    intervals = [after - before for before, after in zip(timer.step_ends, timer.step_ends[1:])]
    # intervals[k - 1] ends at step k's on_train_step_end
    with_save = intervals[request_step]
    others = intervals[1:request_step]
    return {
        "seconds": with_save - statistics.median(others),
        "step_with_save_s": with_save,
        "other_steps_s": others,
        "peak_bytes": timer.save_peak - timer.steps_peak,
    }


def files_written(folder: Path) -> dict:
    """The size of every file under ``folder``, by its path relative to it."""
    return {str(path.relative_to(folder)): path.stat().st_size for path in sorted(folder.rglob("*")) if path.is_file()}


def run_worker(args) -> None:
    """Every process: train, then measure every row ``args.repeats`` times; the main process writes the raw
    figures of all processes to ``args.raw``."""
    torch.set_num_threads(1)
    memory = PeakMemory()
    timer = TimedSaveRun(memory)
    trainer = make_trainer(args, seed=0, callbacks=[timer])
    train_updates(trainer, args, 2)  # Adam holds its two moments
    resumer = make_trainer(args, seed=1, callbacks=[])  # other initial weights, prepared by a run of its own
    train_updates(resumer, args, 1)
    rank = trainer.accelerator.process_index
    work = Path(args.work_dir)
    records = {row: [] for row in ROWS}
    for repeat in range(args.repeats):
        folder = work / f"repeat-{repeat}"
        folders = {row: folder / row for row in SAVE_ROWS}
        measured = {
            "dcp_save": measure_call(memory, dcp_save, trainer, folders["dcp_save"]),
            "state_save": measure_call(memory, trainer.save_training_state, folders["state_save"]),
            "dcp_load": measure_call(memory, dcp_load, resumer, folders["dcp_save"]),
            "state_load": measure_call(memory, resumer.load_training_state, folders["state_save"]),
            "async_blocked": measure_call(memory, save_in_background, trainer, folders["async_blocked"]),
            "sync_in_run": measure_in_run(trainer, args, timer, folders["sync_in_run"], asynchronous=False),
            "async_in_run": measure_in_run(trainer, args, timer, folders["async_in_run"], asynchronous=True),
        }
        async_save.saver.wait()  # the background save of async_blocked, written before anything else runs
        async_save.host_buffers.clear()  # as the end of a run frees them: each row stages from scratch
        dist.barrier()
        if rank == 0:  # one file system: the main process lists every process's files, then removes them
            for row in SAVE_ROWS:
                if folders[row].exists():
                    measured[row]["files"] = files_written(folders[row])
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
        for row, record in measured.items():
            records[row].append(record)
    everyone = [None] * trainer.accelerator.num_processes
    dist.all_gather_object(everyone, {"rank": rank, "records": records, "memory_method": memory.method})
    if rank == 0:
        Path(args.raw).write_text(json.dumps(everyone))


# ------------------------------------------------------------------------------------------------
# Driver: launch, summarise, print, write
# ------------------------------------------------------------------------------------------------


def launch_command(args, work_dir: Path, raw: Path) -> list:
    """``accelerate launch`` of this file's worker on the layout's CPU processes (benchmarks/launch.py)."""
    return [
        *launcher(LAYOUTS[args.layout]["processes"]),
        str(Path(__file__).resolve()),
        "--worker",
        "--raw",
        str(raw),
        "--work-dir",
        str(work_dir),
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
        "--repeats",
        str(args.repeats),
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--layout",
        args.layout,
    ]


def spread(values: list) -> dict:
    """Median, min and max of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def bytes_by_writer(files: dict) -> dict:
    """The bytes of a state folder's files by the process that wrote them, where the name says (DCP's
    ``__<rank>_<n>.distcp``, ``rank_<rank>.pt``); other files under ``"unnamed"``."""
    written = {"unnamed": 0}
    for name, size in files.items():
        ranks = [pattern.search(name) for pattern in RANK_FILE_PATTERNS]
        rank = next((int(match.group(1)) for match in ranks if match), None)
        key = "unnamed" if rank is None else f"rank {rank}"
        written[key] = written.get(key, 0) + size
    return written


def summarise_row(per_process: list) -> dict:
    """One row over the repeats: each repeat's time and peak are the largest of the processes'."""
    repeats = list(zip(*per_process))  # repeats[i]: the records of every process for repeat i
    errors = sorted({record["error"] for records in repeats for record in records if "error" in record})
    refused = sorted({record["refused"] for records in repeats for record in records if "refused" in record})
    summary = {"errors": errors, "refused": refused}
    if errors or refused:
        return summary
    summary["seconds"] = spread([max(record["seconds"] for record in records) for records in repeats])
    summary["peak_bytes"] = spread([max(record["peak_bytes"] for record in records) for records in repeats])
    summary["peak_bytes_per_rank"] = [spread([record["peak_bytes"] for record in records]) for records in per_process]
    files = [records[0].get("files") for records in repeats if records[0].get("files")]
    if files:
        summary["state_bytes"] = statistics.median(sum(repeat_files.values()) for repeat_files in files)
        summary["bytes_by_writer"] = bytes_by_writer(files[-1])
        summary["files"] = files[-1]
    return summary


def summarise(raw: list) -> dict:
    raw = sorted(raw, key=lambda process: process["rank"])
    rows = {row: summarise_row([process["records"][row] for process in raw]) for row in ROWS}
    return {"rows": rows, "memory_method": raw[0]["memory_method"]}


def median_of(rows: dict, row: str, figure: str):
    """The median of a row's figure, or ``None`` if the row has none (refused or failed)."""
    summary = rows[row].get(figure)
    return None if summary is None else summary["median"] if isinstance(summary, dict) else summary


def goals(rows: dict) -> list:
    """The issue's goals: (goal, figure text, PASS/FAIL)."""
    state_bytes = median_of(rows, "state_save", "state_bytes")
    results = []

    def ratio_goal(text, numerator, denominator, limit, unit_text):
        if numerator is None or not denominator:
            results.append((text, "no figure", "FAIL"))
            return
        ratio = numerator / denominator
        verdict = "PASS" if ratio <= limit else "FAIL"
        results.append((text, f"{unit_text(numerator, denominator)} = {ratio:.2f}x", verdict))

    def mib_pair(numerator, denominator):
        return f"{numerator / MIB:.1f} MiB / {denominator / MIB:.1f} MiB"

    def second_pair(numerator, denominator):
        return f"{numerator:.3f} s / {denominator:.3f} s"

    for row, what in (("state_save", "save"), ("state_load", "resume")):
        ratio_goal(
            f"{what}: peak per process <= 0.75x the state",
            median_of(rows, row, "peak_bytes"),
            state_bytes,
            0.75,
            mib_pair,
        )
    ratio_goal(
        "save <= 1.2x dcp.save",
        median_of(rows, "state_save", "seconds"),
        median_of(rows, "dcp_save", "seconds"),
        1.2,
        second_pair,
    )
    ratio_goal(
        "resume <= 1.2x dcp.load",
        median_of(rows, "state_load", "seconds"),
        median_of(rows, "dcp_load", "seconds"),
        1.2,
        second_pair,
    )
    if rows["async_blocked"]["errors"]:
        results.append(("background stall <= 0.25x the synchronous save", "refused or failed", "FAIL"))
    else:
        ratio_goal(
            "background stall (the caller blocked) <= 0.25x the synchronous save",
            median_of(rows, "async_blocked", "seconds"),
            median_of(rows, "state_save", "seconds"),
            0.25,
            second_pair,
        )
    return results


def number(value: float, digits: int) -> str:
    """``value`` with ``digits`` decimals, a tiny negative value shown as 0 rather than -0."""
    return f"{round(value, digits) + 0.0:.{digits}f}"


def format_spread(summary: dict, scale: float = 1.0, digits: int = 3) -> str:
    """``median (min–max)`` of a :func:`spread`, each divided by ``scale``."""
    median, low, high = (number(summary[key] / scale, digits) for key in ("median", "min", "max"))
    return f"{median} ({low}–{high})"


def short(message: str, length: int = 160) -> str:
    message = " ".join(message.split())
    return message if len(message) <= length else message[: length - 1] + "…"


def markdown(result: dict) -> str:
    rows, setup = result["summary"]["rows"], result["setup"]
    processes, title = setup["num_processes"], LAYOUTS[setup["layout"]]["title"]
    state_bytes = median_of(rows, "state_save", "state_bytes")
    lines = [
        f"# Training-state save and resume, {title} on {processes} CPU processes (gloo)",
        "",
        f"Model: {setup['layers']} x Linear({setup['width']}, {setup['width']}), {setup['parameters'] / 1e6:.1f} M "
        f"parameters ({setup['parameters'] * 4 / MIB:.0f} MiB of weights), Adam; {setup['repeats']} repeat(s), "
        f"{setup['steps']} updates per in-run row; torch {setup['torch']}, accelerate {setup['accelerate']}; "
        f"load average before: {setup['load_average']}; peak memory: {result['summary']['memory_method']}.",
        "",
        "| row | seconds: median (min–max) | × baseline | peak MiB, largest process: median (min–max) "
        "| peak MiB by rank (medians) | peak / state |",
        "|---|---|---|---|---|---|",
    ]
    for row, title in ROWS.items():
        summary = rows[row]
        if summary["errors"] or summary["refused"]:
            kind, messages = ("error", summary["errors"]) if summary["errors"] else ("refused", summary["refused"])
            lines.append(f"| {title} | {kind}: {short('; '.join(messages))} | | | | |")
            continue
        baseline = BASELINES.get(row)
        if baseline is None:
            ratio = "1"
        elif median_of(rows, baseline, "seconds"):
            ratio = f"{summary['seconds']['median'] / median_of(rows, baseline, 'seconds'):.2f}x `{baseline}`"
        else:
            ratio = "n/a"
        peak = summary["peak_bytes"]["median"]
        peak_ratio = f"{peak / state_bytes:.2f}" if state_bytes else "n/a"
        by_rank = " / ".join(number(rank["median"] / MIB, 1) for rank in summary["peak_bytes_per_rank"])
        lines.append(
            f"| {title} | {format_spread(summary['seconds'])} | {ratio} | "
            f"{format_spread(summary['peak_bytes'], MIB, 1)} | {by_rank} | {peak_ratio} |"
        )
    lines += [
        "",
        "Seconds: wall time from a barrier before the call to a barrier after it, the largest of the processes; for "
        "the in-run rows, the stall: the step that holds the save minus the median of the steps before it. Peak: "
        "the peak RSS above the RSS before the call; for the in-run rows, the peak from the request to the end of "
        "the run above the peak of the steps before the request. Peak / state: the largest process's peak over "
        "the size of the training state's files.",
    ]
    lines += [
        "",
        "| state written by | MiB in all | "
        + " | ".join(f"rank {rank} MiB" for rank in range(processes))
        + " | not named by rank MiB |",
        "|---|---|" + "---|" * processes + "---|",
    ]
    for row in SAVE_ROWS:
        summary = rows[row]
        if "state_bytes" not in summary:
            lines.append(f"| {ROWS[row]} | no state | " + " | " * processes + "|")
            continue
        by_writer = summary["bytes_by_writer"]
        per_rank = " | ".join(f"{by_writer.get(f'rank {rank}', 0) / MIB:.1f}" for rank in range(processes))
        lines.append(
            f"| {ROWS[row]} | {summary['state_bytes'] / MIB:.1f} | {per_rank} | {by_writer['unnamed'] / MIB:.1f} |"
        )
    lines += ["", "| goal | figures (medians) | result |", "|---|---|---|"]
    lines += [f"| {goal} | {figures} | {verdict} |" for goal, figures, verdict in result["goals"]]
    return "\n".join(lines) + "\n"


def run_driver(args) -> int:
    """Launch the worker, summarise its figures, print and write them; 1 if the launch or a row failed."""
    output_dir = Path(args.output_dir or LAYOUTS[args.layout]["output"])
    output_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="sharded-state-", dir=args.work_dir))
    raw_path = work_dir / "raw.json"
    command = launch_command(args, work_dir, raw_path)
    environment = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    load_average = " ".join(f"{value:.2f}" for value in os.getloadavg())
    processes = LAYOUTS[args.layout]["processes"]
    print(f"launching {processes} processes: {' '.join(command)}", flush=True)
    started = time.perf_counter()
    try:
        completed = subprocess.run(
            command, env=environment, capture_output=True, text=True, cwd=REPO_ROOT, timeout=args.timeout
        )
        returncode, log = completed.returncode, completed.stdout + completed.stderr
    except subprocess.TimeoutExpired as error:
        returncode, log = f"killed after {args.timeout} s", str(error.stderr or "")
    raw = json.loads(raw_path.read_text()) if raw_path.exists() else None
    shutil.rmtree(work_dir, ignore_errors=True)
    if returncode != 0 or raw is None:
        print(f"the launch failed (exit status {returncode}):\n{log[-6000:]}", file=sys.stderr)
        return 1
    parameters = args.layers * (args.width * args.width + args.width)
    result = {
        "setup": {
            "layers": args.layers,
            "width": args.width,
            "parameters": parameters,
            "repeats": args.repeats,
            "steps": args.steps,
            "per_device_batch_size": args.batch_size,
            "num_processes": processes,
            "layout": args.layout,
            "torch": torch.__version__,
            "accelerate": accelerate.__version__,
            "python": platform.python_version(),
            "load_average": load_average,
            "seconds": round(time.perf_counter() - started, 1),
            "command": " ".join(command),
        },
        "summary": summarise(raw),
        "raw": raw,
    }
    result["goals"] = goals(result["summary"]["rows"])
    text = markdown(result)
    print(text)
    (output_dir / "results.md").write_text(text)
    (output_dir / "results.json").write_text(json.dumps(result, indent=1))
    print(f"written to {output_dir}/results.md and results.json ({result['setup']['seconds']} s)")
    crashed = [row for row, summary in result["summary"]["rows"].items() if summary["errors"]]
    return 1 if crashed else 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18, help="Linear layers of the model (default 18)")
    parser.add_argument("--width", type=int, default=2048, help="their width (default 2048)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each row (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="updates of each in-run row's training run (>= 6)")
    parser.add_argument("--batch-size", type=int, default=2, help="per-device batch size (default 2)")
    parser.add_argument("--quick", action="store_true", help="4 x Linear(256, 256), one repeat, 6 steps: a smoke run")
    parser.add_argument(
        "--layout",
        choices=sorted(LAYOUTS),
        default="fsdp",
        help="fsdp: 2 processes (default); fsdp_tp: 4, dp_shard 2 x tp 2",
    )
    parser.add_argument("--output-dir", default=None, help="default benchmarks/results/sharded_state[_fsdp_tp]")
    parser.add_argument("--work-dir", default=None, help="where the states are written (default: a temporary folder)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds the launch may take (default 1800)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--raw", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.repeats, args.steps = 4, 256, 1, 6
    if args.steps < 6:
        parser.error("--steps must be at least 6 (the save is asked for at step steps - 3, after steps 2 and up)")
    if args.layout == "fsdp_tp" and args.layers % 2:
        parser.error(f"--layers {args.layers}: --layout fsdp_tp splits the layers in pairs; pass an even number")
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return 0
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
