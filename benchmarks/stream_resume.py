"""The cost of resuming a training stream against the step it stopped at, and the samples each of 2 processes reads.

    python benchmarks/stream_resume.py                   # k = 100, 1,000, 5,000 updates; about 7 minutes on 2 cores
    python benchmarks/stream_resume.py --quick           # a smoke run: k = 20, 0.2 ms a sample, about 50 s
    python benchmarks/stream_resume.py --steps 100,1000 --process-steps 50 --output-dir /tmp/streams

One process: for each ``k`` of ``--steps`` and each kind of data (a stream that keeps its position, the same stream
without ``state_dict``, map-style data, and the stream with a position read by 2 DataLoader workers), a fresh process
trains ``k`` updates of a ``Linear(4, 1)``, batch 4, and saves a training state as the run stops; a second fresh
process (a new job, as a user pays it) builds a new ``Trainer`` and calls ``train(resume_from=...)``, which stops
right after its first update. Every sample costs ``--sleep`` seconds (``time.sleep``, 1 ms by default) to produce,
and a counter shared with the DataLoader workers counts the samples produced. The resume's figures: the time from the
call of ``train()`` to the end of its first update, and the samples produced before it.

Two processes (``--process-steps`` updates, one ``accelerate launch`` of 2 CPU processes with ``--worker
processes``): the samples each process produces in a run stopped after that many updates, and in its resume (a new
``Trainer`` in the same processes) before the first new update, for the default ``stream_split="main_process"``
(Accelerate's dispatching) on a whole stream and on a stream that splits itself by ``torch.distributed.get_rank()``,
and for ``stream_split="dataset"`` on the stream that splits itself.

It prints markdown tables and writes ``results.md`` and ``results.json`` to ``--output-dir`` (default
``benchmarks/results/stream_resume/``); it exits with status 1 if a row failed. See benchmarks/README.md,
"Stream resume".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import accelerate
import torch
import torchdata
from launch import launcher  # benchmarks/launch.py, beside this file
from torch.utils.data import Dataset, IterableDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.errors import StopTrainingError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT_DIR = REPO_ROOT / "benchmarks" / "results" / "stream_resume"
BATCH = 4
#: updates of data left after the stop, so that no epoch ends before the resume's first update
SPARE_UPDATES = 50
NUM_PROCESSES = 2

#: The kinds of data of the one-process rows, in their order: (table title, DataLoader workers).
KINDS = {
    "stateful": ("stream with a position", 0),
    "plain": ("plain stream", 0),
    "map": ("map-style data", 0),
    "stateful_workers": ("stream with a position, 2 workers", 2),
}
#: The configurations of the two-process part: (table title, stream_split, whether the stream splits itself by rank).
PROCESS_CONFIGS = {
    "main_whole": ("`main_process` (default), the whole stream", "main_process", False),
    "main_split": ("`main_process` (default), a stream split by rank", "main_process", True),
    "dataset_split": ('`stream_split="dataset"`, a stream split by rank', "dataset", True),
}
#: The line a resume prints before it replays a stream (loop/stream_position.py, replay_message).
REPLAY_SAID = "produced again and thrown away"

#: Samples produced in this process and its DataLoader workers (forked: the value is shared with them).
PRODUCED = multiprocessing.Value("q", 0)


# ------------------------------------------------------------------------------------------------
# Data: every sample costs `sleep` seconds to produce, and is counted
# ------------------------------------------------------------------------------------------------


def make_sample(index: int, sleep: float) -> tuple:
    """Sample ``index``: a seeded random vector and its target, produced in ``sleep`` seconds, and counted."""
    time.sleep(sleep)  # the stream's cost: reading, decoding, tokenizing
    with PRODUCED.get_lock():
        PRODUCED.value += 1
    features = torch.randn(4, generator=torch.Generator().manual_seed(index))
    return features, features.sum().reshape(1) * 0.5


class SlowStream(IterableDataset):
    """``num_samples`` samples; each DataLoader worker reads every ``num_workers``-th sample, and with ``split`` each
    process every ``world_size``-th (a stream that splits itself by ``torch.distributed.get_rank()``). Its state is
    its place in its part."""

    def __init__(self, num_samples: int, sleep: float, split: bool = False):
        self.num_samples, self.sleep, self.split, self.place = num_samples, sleep, split, 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        split = self.split and torch.distributed.is_initialized()
        world, rank = (torch.distributed.get_world_size(), torch.distributed.get_rank()) if split else (1, 0)
        while True:
            index = (self.place * workers + worker) * world + rank
            if index >= self.num_samples:
                self.place = 0  # the next epoch reads the stream from its start
                return
            self.place += 1  # moved on before the yield: a state taken after it says what comes next
            yield make_sample(index, self.sleep)

    def state_dict(self) -> dict:
        return {"place": self.place}

    def load_state_dict(self, state: dict) -> None:
        self.place = state["place"]


class PlainSlowStream(SlowStream):
    """The same stream, unable to say where it is."""

    state_dict = None  # type: ignore[assignment]
    load_state_dict = None  # type: ignore[assignment]


class SlowMapData(Dataset):
    """Map-style data at the same cost a sample: the trainer skips what was trained by sampler offset."""

    def __init__(self, num_samples: int, sleep: float):
        self.num_samples, self.sleep = num_samples, sleep

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple:
        return make_sample(index, self.sleep)


def make_data(kind: str, num_samples: int, sleep: float, split: bool = False):
    if kind == "map":
        return SlowMapData(num_samples, sleep)
    stream_class = PlainSlowStream if kind == "plain" else SlowStream
    return stream_class(num_samples, sleep, split)


# ------------------------------------------------------------------------------------------------
# Workers: train and stop, or resume until the first new update
# ------------------------------------------------------------------------------------------------


class StopAfter(TrainerCallback):
    """Stops the run after its ``updates``-th optimizer update (a resumed run counts on from its state).

    ``on_optimizer_step_end``, not ``on_train_step_end``: the latter fires after a step's forward pass, before its
    backward pass and update, so a stop asked for there at ``updates`` completed would come one update later."""

    def __init__(self, updates: int):
        self.updates = updates

    def on_optimizer_step_end(self, trainer, num_update_steps_completed=None, **kwargs):
        if num_update_steps_completed >= self.updates:
            raise StopTrainingError("stopped by the benchmark")  # taken before the next update


class FirstUpdate(TrainerCallback):
    """Notes the time, the samples produced and the update's number at the end of the run's first optimizer update,
    and stops the run there."""

    def __init__(self):
        self.at = self.produced = self.update = None

    def on_optimizer_step_end(self, trainer, num_update_steps_completed=None, **kwargs):
        if self.at is None:
            self.at, self.produced, self.update = time.perf_counter(), PRODUCED.value, num_update_steps_completed
        raise StopTrainingError("the first new update is done")


def make_trainer(callbacks: list) -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return Trainer(model, torch.nn.MSELoss(), optimizer, callbacks=callbacks, seed=1)


def train_quietly(trainer: Trainer, data, workers: int, **train_kwargs) -> str:
    """``trainer.train(data, ...)`` for one epoch of batches of 4; returns what it printed (the replay's line)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.train(
            data,
            num_epochs=1,
            per_device_batch_size=BATCH,
            train_dataloader_kwargs={"num_workers": workers},
            **train_kwargs,
        )
    return printed.getvalue()


def run_train_worker(args) -> dict:
    """Train ``args.k`` updates and save a training state as the run stops."""
    workers = KINDS[args.kind][1]
    data = make_data(args.kind, BATCH * (args.k + SPARE_UPDATES), args.sleep)
    saver = SaveTrainingStateCallback(args.state_dir, save_on_signals=())  # saves as the run ends
    trainer = make_trainer([StopAfter(args.k), saver])
    started = time.perf_counter()
    train_quietly(trainer, data, workers)
    return {
        "updates": trainer.run_state.num_update_steps_completed,
        "produced": PRODUCED.value,
        "seconds": time.perf_counter() - started,
    }


def run_resume_worker(args) -> dict:
    """A new trainer resumes the state of ``args.state_dir`` and stops after its first update."""
    workers = KINDS[args.kind][1]
    data = make_data(args.kind, BATCH * (args.k + SPARE_UPDATES), args.sleep)
    first = FirstUpdate()
    trainer = make_trainer([first])
    started = time.perf_counter()
    printed = train_quietly(trainer, data, workers, resume_from=args.state_dir)
    return {
        "seconds_to_first_update": None if first.at is None else first.at - started,
        "produced_before_first_update": first.produced,
        "first_update": first.update,
        "replay_said": REPLAY_SAID in printed,
    }


def run_processes_worker(args) -> dict:
    """On each of the launched processes: for each configuration, a run stopped after ``args.k`` updates (a state
    saved as it stops), then a new trainer resuming it until its first update."""
    results = {}
    for name, (_, stream_split, split) in PROCESS_CONFIGS.items():
        # every part long enough for k + SPARE_UPDATES updates of both processes, also when the main process reads
        # only its own half of a stream split by rank
        num_samples = 2 * NUM_PROCESSES * BATCH * (args.k + SPARE_UPDATES)
        state_dir = Path(args.state_dir) / name
        PRODUCED.value = 0
        trainer = make_trainer([StopAfter(args.k), SaveTrainingStateCallback(state_dir, save_on_signals=())])
        train_quietly(trainer, make_data("stateful", num_samples, args.sleep, split), 0, stream_split=stream_split)
        trained = {"updates": trainer.run_state.num_update_steps_completed, "produced": PRODUCED.value}
        PRODUCED.value = 0
        first = FirstUpdate()
        resumer = make_trainer([first])
        started = time.perf_counter()
        printed = train_quietly(
            resumer,
            make_data("stateful", num_samples, args.sleep, split),
            0,
            stream_split=stream_split,
            resume_from=state_dir,
        )
        results[name] = {
            "trained": trained,
            "seconds_to_first_update": None if first.at is None else first.at - started,
            "produced_before_first_update": first.produced,
            "first_update": first.update,
            "replay_said": REPLAY_SAID in printed,
        }
    return {"rank": int(os.environ.get("RANK", "0")), "configs": results}


def run_worker(args) -> None:
    """Run the worker ``args.worker`` and write its figures to ``args.result`` (with ``.rank<i>`` on each of several
    processes: their printed lines could interleave)."""
    torch.set_num_threads(1)
    worker = {"train": run_train_worker, "resume": run_resume_worker, "processes": run_processes_worker}[args.worker]
    figures = worker(args)
    suffix = f".rank{os.environ['RANK']}" if args.worker == "processes" else ""
    Path(args.result + suffix).write_text(json.dumps(figures))


# ------------------------------------------------------------------------------------------------
# Driver: one fresh process per measurement, then tables
# ------------------------------------------------------------------------------------------------


def worker_environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "1"}


def run_command(command: list, results: list, timeout: int) -> dict:
    """Run ``command``; the figures its processes wrote to the files ``results``, its wall time, or an error with the
    end of its output."""
    started = time.perf_counter()
    try:
        completed = subprocess.run(
            command, env=worker_environment(), capture_output=True, text=True, cwd=REPO_ROOT, timeout=timeout
        )
    except subprocess.TimeoutExpired as error:
        return {"error": f"killed after {timeout} s: {str(error.stderr or '')[-2000:]}"}
    wall = time.perf_counter() - started
    missing = [path.name for path in results if not path.exists()]
    if completed.returncode != 0 or missing:
        log = (completed.stdout + completed.stderr)[-3000:]
        return {"error": f"exit status {completed.returncode}, no figures from {missing}: {log}"}
    return {"results": [json.loads(path.read_text()) for path in results], "wall_seconds": wall}


def worker_command(args, worker: str, kind: str, k: int, state_dir: Path, result: Path) -> list:
    return [
        *launcher(1),
        str(Path(__file__).resolve()),
        "--worker",
        worker,
        "--kind",
        kind,
        "--k",
        str(k),
        "--sleep",
        str(args.sleep),
        "--state-dir",
        str(state_dir),
        "--result",
        str(result),
    ]


def launch_command(args, state_dir: Path, result: Path) -> list:
    """``accelerate launch`` of the two-process worker on 2 CPU processes (benchmarks/launch.py)."""
    launch = [*launcher(NUM_PROCESSES), str(Path(__file__).resolve()), "--worker", "processes"]
    launch += ["--k", str(args.process_steps), "--sleep", str(args.sleep), "--state-dir", str(state_dir)]
    return launch + ["--result", str(result)]


def measure_row(args, kind: str, k: int, work_dir: Path) -> dict:
    """One row: a process trains ``k`` updates and saves, a second one resumes."""
    state_dir = work_dir / f"{kind}-{k}"
    row = {"kind": kind, "k": k}
    result = work_dir / f"{kind}-{k}-train.json"
    trained = run_command(worker_command(args, "train", kind, k, state_dir, result), [result], args.timeout)
    if "error" in trained:
        return {**row, "error": f"training: {trained['error']}"}
    row["train"] = {**trained["results"][0], "process_wall_seconds": trained["wall_seconds"]}
    result = work_dir / f"{kind}-{k}-resume.json"
    resumed = run_command(worker_command(args, "resume", kind, k, state_dir, result), [result], args.timeout)
    shutil.rmtree(state_dir, ignore_errors=True)
    if "error" in resumed:
        return {**row, "error": f"resume: {resumed['error']}"}
    row["resume"] = {**resumed["results"][0], "process_wall_seconds": resumed["wall_seconds"]}
    row["error"] = check_row(row)
    return row


def check_row(row: dict) -> str | None:
    """Why a measured row is wrong (the first run did not stop after ``k`` updates, or its resume did not go on from
    the update after the stop), or ``None``."""
    if row["train"]["updates"] != row["k"]:
        return f"the first run stopped after {row['train']['updates']} updates, not {row['k']}"
    expected = row["train"]["updates"] + 1
    if row["resume"]["first_update"] != expected:
        return f"the resume's first update was number {row['resume']['first_update']}, not {expected}"
    return None


def measure_processes(args, work_dir: Path) -> dict:
    state_dir = work_dir / "processes"
    result = work_dir / "processes.json"
    results = [work_dir / f"processes.json.rank{rank}" for rank in range(NUM_PROCESSES)]
    launched = run_command(launch_command(args, state_dir, result), results, args.timeout)
    if "error" in launched:
        return {"error": launched["error"]}
    ranks = sorted(launched["results"], key=lambda result: result["rank"])
    configs = {}
    for name in PROCESS_CONFIGS:
        per_rank = [rank["configs"][name] for rank in ranks]
        error = None
        if any(result["first_update"] != result["trained"]["updates"] + 1 for result in per_rank):
            error = "a process's resume did not go on from the update after the stop"
        configs[name] = {"per_rank": per_rank, "error": error}
    return {"k": args.process_steps, "configs": configs, "wall_seconds": launched["wall_seconds"]}


def machine() -> dict:
    return {
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "torchdata": torchdata.__version__,
        "platform": platform.platform(),
    }


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


# ------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------


def seconds(value) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def pivot_table(rows: list, kinds: list) -> list:
    """The issue's table: per step, each kind's time to the first new update and the samples produced before it."""
    header = "| updates before the stop | " + " | ".join(f"{KINDS[kind][0]}: time | samples" for kind in kinds) + " |"
    lines = [header, "|---:|" + "---:|---:|" * len(kinds)]
    for k in sorted({row["k"] for row in rows}):
        cells = []
        for kind in kinds:
            row = next(row for row in rows if row["k"] == k and row["kind"] == kind)
            if "resume" not in row or row["error"]:
                cells += ["FAIL", ""]
                continue
            resume = row["resume"]
            cells += [seconds(resume["seconds_to_first_update"]), f"{resume['produced_before_first_update']:,}"]
        lines.append(f"| {k:,} | " + " | ".join(cells) + " |")
    return lines


def detail_table(rows: list) -> list:
    lines = [
        "| data | updates before the stop | samples trained | time to first new update | samples produced before it "
        "| replay line | resume process wall | first run: train() | first run: samples produced |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        title = KINDS[row["kind"]][0]
        if "resume" not in row or row["error"]:
            lines.append(f"| {title} | {row['k']:,} | FAIL: {' '.join(str(row['error']).split())[:200]} | | | | | | |")
            continue
        train, resume = row["train"], row["resume"]
        lines.append(
            f"| {title} | {train['updates']:,} | {train['updates'] * BATCH:,} | "
            f"{seconds(resume['seconds_to_first_update'])} | {resume['produced_before_first_update']:,} | "
            f"{'yes' if resume['replay_said'] else 'no'} | {seconds(resume['process_wall_seconds'])} | "
            f"{seconds(train['seconds'])} | {train['produced']:,} |"
        )
    return lines


def processes_table(processes: dict) -> list:
    if "error" in processes:
        return [f"Two processes: FAIL: {' '.join(processes['error'].split())[:400]}"]
    lines = [
        "| stream_split, stream | updates trained | samples produced in the run, rank 0 / rank 1 | resume: samples "
        "produced before the first new update, rank 0 / rank 1 | replay line | resume: time to first new update |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for name, (title, _, _) in PROCESS_CONFIGS.items():
        config = processes["configs"][name]
        per_rank = config["per_rank"]
        if config["error"]:
            lines.append(f"| {title} | FAIL: {config['error']} | | | | |")
            continue
        trained = " / ".join(f"{result['trained']['produced']:,}" for result in per_rank)
        again = " / ".join(f"{result['produced_before_first_update']:,}" for result in per_rank)
        said = "yes" if any(result["replay_said"] for result in per_rank) else "no"
        slowest = max(result["seconds_to_first_update"] for result in per_rank)
        lines.append(
            f"| {title} | {per_rank[0]['trained']['updates']:,} | {trained} | {again} | {said} | {seconds(slowest)} |"
        )
    return lines


def markdown(result: dict) -> str:
    setup, rows = result["setup"], result["rows"]
    kinds = [kind for kind in KINDS if any(row["kind"] == kind for row in rows)]
    host = setup["machine"]
    lines = [
        "# Stream resume: the cost against the step",
        "",
        f"{setup['date']}; {host['cpu_cores']} CPU cores, torch {host['torch']}, accelerate {host['accelerate']}, "
        f"torchdata {host['torchdata']}, Python {host['python']}; load average at the start {setup['load_average']}, "
        f"at the end {setup['load_average_end']}; {setup['sleep'] * 1000:g} ms a sample (time.sleep), batch {BATCH}, "
        f"Linear(4, 1), one process, {setup['seconds']:.0f} s in all.",
        "",
        "Time: from the call of train(resume_from=...) in a fresh process to the end of its first update. Samples: "
        "those the data produced before it (the stream's or the dataset's counter).",
        "",
        *pivot_table(rows, kinds),
        "",
        *detail_table(rows),
    ]
    if result["processes"] is not None:
        lines += ["", f"## Two processes, {setup['process_steps']} updates, then a resume", ""]
        lines += processes_table(result["processes"])
    return "\n".join(lines) + "\n"


def failed(result: dict) -> bool:
    if any("resume" not in row or row["error"] for row in result["rows"]):
        return True
    processes = result["processes"]
    if processes is None:  # --process-steps 0
        return False
    return "error" in processes or any(config["error"] for config in processes["configs"].values())


def run_driver(args) -> int:
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="stream-resume-"))
    setup = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "load_average": load_average(),
        "steps": args.steps,
        "kinds": args.kinds,
        "process_steps": args.process_steps,
        "sleep": args.sleep,
        "batch_size": BATCH,
    }
    print(f"load average {setup['load_average']}; {len(args.steps) * len(args.kinds)} rows", flush=True)
    started = time.perf_counter()
    rows = []
    try:
        for k in args.steps:
            for kind in args.kinds:
                rows.append(measure_row(args, kind, k, work_dir))
                print(f"{KINDS[kind][0]}, k = {k}: {json.dumps(rows[-1])[:300]}", flush=True)
        processes = measure_processes(args, work_dir) if args.process_steps else None
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    setup["seconds"] = time.perf_counter() - started
    setup["load_average_end"] = load_average()
    result = {"setup": setup, "rows": rows, "processes": processes}
    text = markdown(result)
    print(text)
    (output_dir / "results.md").write_text(text)
    (output_dir / "results.json").write_text(json.dumps(result, indent=1))
    print(f"written to {output_dir}/results.md and results.json")
    return 1 if failed(result) else 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="100,1000,5000", help="updates before the stop (default 100,1000,5000)")
    parser.add_argument("--kinds", help=f"data kinds, of {', '.join(KINDS)} (default: all; --quick: the first 3)")
    parser.add_argument("--process-steps", type=int, default=100, help="updates of the 2-process runs (0: none)")
    parser.add_argument("--sleep", type=float, default=0.001, help="seconds to produce a sample (default 0.001)")
    parser.add_argument("--quick", action="store_true", help="k = 20, 0.2 ms a sample, no workers: a smoke run")
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR))
    parser.add_argument("--timeout", type=int, default=600, help="seconds each process may take (default 600)")
    parser.add_argument("--worker", choices=("train", "resume", "processes"), help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:  # the row with workers left out: each worker process is one more start-up
        args.steps, args.process_steps, args.sleep = "20", 20, 0.0002
        args.kinds = args.kinds or "stateful,plain,map"
    args.steps = [int(step) for step in str(args.steps).split(",")]
    args.kinds = (args.kinds or ",".join(KINDS)).split(",")
    unknown = [kind for kind in args.kinds if kind not in KINDS]
    if unknown:
        parser.error(f"--kinds {','.join(unknown)} is not valid: choose from {', '.join(KINDS)}")
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return 0
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
