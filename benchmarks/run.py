"""Benchmark pytorch_accel_trainer against hand-written loops: ``python benchmarks/run.py``.

Each measurement runs in a fresh process (``run.py --worker ROW WORKLOAD``, which prints one JSON line; ``--quick``
gives each row one process for every workload);
this parent process never imports torch. Rows and repeats are interleaved, so that a slow spell of the
machine spreads over every row instead of landing on one. See benchmarks/README.md.
"""

import time

T0 = time.perf_counter()  # the worker's start: its start-up cost is measured from here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(1, str(REPO_ROOT))  # benchmark this checkout, installed or not

from launch import launcher  # noqa: E402
from workloads import BASELINE_ROW, WORKLOADS, available_rows, workload_spec  # noqa: E402

#: Modules whose import time is compared in fresh processes: the ratio is the second over the first.
IMPORT_MODULES = ("accelerate", "pytorch_accel_trainer")
WORKER_TIMEOUT_S = 300


# ----------------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------------


def worker_main(row: str, workloads: str, quick: bool) -> None:
    """Measure ``row`` on each of the comma-separated ``workloads`` in turn: one JSON line each. The full run gives
    one workload per process; ``--quick`` gives a row all of them (see ``_worker_batches``)."""
    from worker import measure

    t0 = T0
    for workload in workloads.split(","):
        print(json.dumps(measure(row, workload, quick, t0)), flush=True)
        t0 = time.perf_counter()  # the next workload's start-up is its setup: the libraries are imported by now


def paired_worker_main(row: str, workloads: str, quick: bool, pairs: int) -> None:
    from worker import measure_paired

    for workload in workloads.split(","):
        print(json.dumps(measure_paired(row, workload, quick, pairs)), flush=True)


def import_worker_main(module: str) -> None:
    import importlib
    import resource

    start = time.perf_counter()
    importlib.import_module(module)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_mb = peak / 2**20 if sys.platform == "darwin" else peak / 2**10
    print(json.dumps({"module": module, "import_ms": seconds * 1e3, "peak_rss_mb": peak_mb}), flush=True)


# ----------------------------------------------------------------------------------------------------
# Parent side
# ----------------------------------------------------------------------------------------------------


def _run_import_child(args: list, timeout: float, env: Optional[dict] = None) -> dict:
    """Run ``run.py ARGS`` in a new interpreter, where an import is timed whatever ``BENCHMARK_LAUNCHER`` says
    (benchmarks/launch.py), and return its JSON line (or an ``error``)."""
    return _run_child_lines(args, 1, timeout, env, start=[sys.executable])[0]


def _run_child_lines(
    args: list, count: int, timeout: float, env: Optional[dict] = None, start: Optional[list] = None
) -> list:
    """Run ``run.py ARGS`` in a fresh process (started by ``start``, by default benchmarks/launch.py's ``launcher``)
    and return its last ``count`` JSON lines, one per measurement (or as many ``error`` results)."""
    command = [*(launcher(1) if start is None else start), str(Path(__file__).resolve()), *args]
    # every row on the CPU, also on a machine with a GPU: the hand-written loops never move anything to a device, so
    # a row that took the GPU would be measured against a CPU baseline (the GPU figures: benchmarks/gpu_checks/)
    env = {**(os.environ if env is None else env), "CUDA_VISIBLE_DEVICES": ""}
    start = time.perf_counter()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=env)
    except subprocess.TimeoutExpired:
        return [{"error": f"timed out after {timeout} s"}] * count
    wall_ms = (time.perf_counter() - start) * 1e3
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]  # the JSON lines
    if completed.returncode != 0 or len(lines) < count:
        return [{"error": f"exit code {completed.returncode}: {completed.stderr.strip()[-2000:]}"}] * count
    try:
        results = [json.loads(line) for line in lines[-count:]]
    except json.JSONDecodeError:
        return [{"error": f"no JSON result line: {completed.stdout[-500:]}"}] * count
    for result in results:
        result["process_wall_ms"] = wall_ms
    return results


def _worker_batches(workloads: list, rows: list, quick: bool) -> list:
    """The ``(workloads, row)`` of each worker process, in the order they run: one workload per process in a full
    run; in a ``--quick`` smoke run, one process per row measures every workload in turn, as a process spends longer
    importing torch than a quick measurement takes. Its start-up, import and memory figures are then fresh-process
    figures for the first workload only."""
    if quick:
        return [(list(workloads), row) for row in rows]
    return [([workload], row) for workload in workloads for row in rows]


def _workload_repeats(name: str, args: argparse.Namespace) -> int:
    """The repeats of workload ``name``: ``--repeats``, at most the workload's own cap (memory needs fewer)."""
    return min(args.repeats, workload_spec(name, args.quick).get("repeats", args.repeats))


def _rotated(items: list, shift: int) -> list:
    shift %= len(items)
    return items[shift:] + items[:shift]


def _spread(values: list) -> dict:
    values = sorted(values)
    summary = {"median": statistics.median(values), "min": values[0], "max": values[-1], "n": len(values)}
    if len(values) >= 4:
        quartiles = statistics.quantiles(values, n=4, method="inclusive")
        summary["q1"], summary["q3"] = quartiles[0], quartiles[2]
    return summary


def summarize_workload(runs_by_row: dict) -> dict:
    """Median and spread of each metric of each row, and the paired ratio to the baseline row."""
    summaries = {}
    baseline = runs_by_row.get(BASELINE_ROW, [])
    for row, runs in runs_by_row.items():
        ok = [run for run in runs if "error" not in run]
        errors = [run["error"] for run in runs if "error" in run]
        summary: dict = {"runs": len(runs), "errors": errors}
        if ok:
            for key in (
                "us_per_step",
                "cpu_us_per_step",
                "first_epoch_us_per_step",
                "startup_ms",
                "import_ms",
                "setup_ms",
                "peak_rss_mb",
                "rss_increase_mb",
                "rss_after_imports_mb",
                "whole_run_us_per_step",
                "whole_run_cpu_us_per_step",
                "run_peak_increase_mb",
            ):
                summary[key] = _spread([run[key] for run in ok])
            summary["trained_runs"] = sum(run["trained"] for run in ok)
            summary["first_loss"] = statistics.median(run["train_losses"][0] for run in ok)
            summary["last_loss"] = statistics.median(run["train_losses"][-1] for run in ok)
        summary["trained"] = bool(ok) and not errors and summary["trained_runs"] == len(runs)
        # the ratio of each repeat to the baseline of the same repeat, then the median of those ratios
        pairs = [(run, base) for run, base in zip(runs, baseline) if "error" not in run and "error" not in base]
        ratios = [run["us_per_step"] / base["us_per_step"] for run, base in pairs]
        summary["ratio_to_baseline"] = _spread(ratios) if ratios else None
        cpu_ratios = [run["cpu_us_per_step"] / base["cpu_us_per_step"] for run, base in pairs]
        summary["cpu_ratio_to_baseline"] = _spread(cpu_ratios) if cpu_ratios else None
        whole = [run["whole_run_us_per_step"] / base["whole_run_us_per_step"] for run, base in pairs]
        summary["whole_run_ratio_to_baseline"] = _spread(whole) if whole else None
        # memory: the run's peak above the memory at its start, less the baseline's of the same repeat
        extra = [run["run_peak_increase_mb"] - base["run_peak_increase_mb"] for run, base in pairs]
        summary["extra_peak_over_baseline_mb"] = _spread(extra) if extra else None
        summaries[row] = summary
    return summaries


def _fmt(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def _step_digits(median: float) -> int:
    return 1 if median < 100 else 0


def _ratio_text(ratio: Optional[dict]) -> str:
    return "n/a" if ratio is None else f"{ratio['median']:.2f} ({ratio['min']:.2f}–{ratio['max']:.2f})"


def workload_table(name: str, summaries: dict) -> str:
    header = (
        "| row | µs/step (median) | spread (min–max) | × torch_loop (min–max) | whole run µs/step "
        "| whole run × torch_loop (min–max) | start-up ms (import + setup) "
        "| peak RSS MB | RSS increase MB | loss first→last | trained |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|\n"
    )
    lines = []
    for row, summary in summaries.items():
        if "us_per_step" not in summary:
            lines.append(f"| {row} | ERROR | | | | | | | | | FAIL |")
            continue
        step, whole = summary["us_per_step"], summary["whole_run_us_per_step"]
        digits = _step_digits(step["median"])
        ratio_text = _ratio_text(summary["ratio_to_baseline"])
        whole_text = f"{_fmt(whole['median'], _step_digits(whole['median']))}"
        whole_ratio_text = _ratio_text(summary["whole_run_ratio_to_baseline"])
        startup = summary["startup_ms"]["median"]
        imports, setup = summary["import_ms"]["median"], summary["setup_ms"]["median"]
        trained = "yes" if summary["trained"] else f"FAIL ({summary.get('trained_runs', 0)}/{summary['runs']})"
        lines.append(
            f"| {row} | {_fmt(step['median'], digits)} | {_fmt(step['min'], digits)}–{_fmt(step['max'], digits)} "
            f"| {ratio_text} | {whole_text} | {whole_ratio_text} | {_fmt(startup)} ({_fmt(imports)} + {_fmt(setup)}) "
            f"| {_fmt(summary['peak_rss_mb']['median'])} | {_fmt(summary['rss_increase_mb']['median'], 1)} "
            f"| {summary['first_loss']:.3f}→{summary['last_loss']:.3f} | {trained} |"
        )
    notes = [
        f"- {row}: {len(summary['errors'])} failed run(s); first error: {summary['errors'][0][-300:]!r}"
        for row, summary in summaries.items()
        if summary["errors"]
    ]
    return header + "\n".join(lines) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def memory_table(spec: dict, summaries: dict, quick: bool) -> str:
    """The peak memory of each row's run above the memory at its start, and the extra over the torch loop in units of
    one step's logits (the goal: at most 0.1). Not judged in a ``--quick`` run: its logits are tiny, and a process
    measures every workload in turn, so a later workload's peak may be an earlier one's."""
    logits = spec["logits_mib"]
    lines = [
        "| row | peak above run start MiB (min–max) | extra over torch_loop MiB "
        f"| × one step's logits ({logits:,.0f} MiB) | goal ≤ 0.1 |",
        "|---|---:|---:|---:|:---:|",
    ]
    for row, summary in summaries.items():
        if "run_peak_increase_mb" not in summary:
            lines.append(f"| {row} | ERROR | | | |")
            continue
        peak, extra = summary["run_peak_increase_mb"], summary["extra_peak_over_baseline_mb"]
        peak_text = f"{_fmt(peak['median'])} ({_fmt(peak['min'])}–{_fmt(peak['max'])})"
        if row == BASELINE_ROW or extra is None:
            lines.append(f"| {row} | {peak_text} | | | |")
            continue
        units = extra["median"] / logits
        verdict = "not judged (--quick)" if quick else ("yes" if units <= 0.1 else "**no**")
        lines.append(
            f"| {row} | {peak_text} | {extra['median']:+,.0f} ({extra['min']:+,.0f}–{extra['max']:+,.0f}) "
            f"| {units:+.2f} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def import_table(imports: dict) -> str:
    lines = [
        "| import (fresh process) | median ms | spread (min–max) | peak RSS MB |",
        "|---|---:|---:|---:|",
    ]
    for module, summary in imports["modules"].items():
        if summary is None:
            lines.append(f"| `import {module}` | ERROR | | |")
            continue
        ms = summary["import_ms"]
        lines.append(
            f"| `import {module}` | {_fmt(ms['median'])} | {_fmt(ms['min'])}–{_fmt(ms['max'])} "
            f"| {_fmt(summary['peak_rss_mb']['median'])} |"
        )
    ratio = imports.get("ratio")
    text = "\n".join(lines) + "\n"
    if ratio:
        text += (
            f"\n`import pytorch_accel_trainer` / `import accelerate` (median of paired ratios): "
            f"**{ratio['median']:.2f}×** (min–max {ratio['min']:.2f}–{ratio['max']:.2f}); median difference "
            f"{imports['added_ms']['median']:+,.0f} ms. The package imports accelerate (and torch) itself, so what it "
            f"adds is the difference; a difference inside the spread is noise.\n"
        )
    torch_only = imports.get("torch_from_workers")
    if torch_only:
        text += (
            f"\nFor scale, `import torch` alone (the import time of the torch_loop workers, measured from their "
            f"first line) takes a median {torch_only['median']:,.0f} ms (min–max {torch_only['min']:,.0f}–"
            f"{torch_only['max']:,.0f}).\n"
        )
    return text


def summarize_paired(paired_runs: dict) -> dict:
    """The median and spread of the same-process ratios of each row."""
    summaries = {}
    for row, result in paired_runs.items():
        if "error" in result:
            summaries[row] = {"error": result["error"], "trained": False}
            continue
        summaries[row] = {
            "ratio": _spread(result["ratios"]),
            "cpu_ratio": _spread(result["cpu_ratios"]) if "cpu_ratios" in result else None,
            "row_us_per_step": _spread(result["row_us_per_step"]),
            "baseline_us_per_step": _spread(result["baseline_us_per_step"]),
            "pairs": result["pairs"],
            "trained": result["trained"],
        }
    return summaries


def paired_table(summaries: dict) -> str:
    lines = [
        "| row (same process as torch_loop) | × torch_loop, median of pairs | quartiles | min–max "
        "| CPU time × torch_loop (quartiles) | row µs/step | torch_loop µs/step | trained |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for row, summary in summaries.items():
        if "error" in summary:
            lines.append(f"| {row} | ERROR | | | | | | no |")
            continue
        ratio, ours, base = summary["ratio"], summary["row_us_per_step"], summary["baseline_us_per_step"]
        cpu_ratio = summary.get("cpu_ratio")
        cpu_text = "n/a" if cpu_ratio is None else f"{cpu_ratio['median']:.3f} ({_quartiles(cpu_ratio)})"
        digits = _step_digits(base["median"])
        lines.append(
            f"| {row} | **{ratio['median']:.3f}** | {_quartiles(ratio)} | {ratio['min']:.2f}–{ratio['max']:.2f} "
            f"| {cpu_text} | {_fmt(ours['median'], digits)} | {_fmt(base['median'], digits)} "
            f"| {'yes' if summary['trained'] else 'FAIL'} |"
        )
    return "\n".join(lines) + "\n"


def _quartiles(spread: dict) -> str:
    """The first and third quartiles of a spread of ratios; ``–`` with fewer than 4 values."""
    return f"{spread['q1']:.2f}–{spread['q3']:.2f}" if "q1" in spread else "–"


def _processes_text(quick: bool) -> str:
    if quick:  # see _worker_batches
        return "one process per row for every workload (--quick: start-up and memory are fresh for the first only)"
    return "each measurement in a fresh process"


def render_markdown(results: dict) -> str:
    meta = results["meta"]
    parts = [
        "# Benchmark results\n",
        f"`{meta['command']}` — {meta['date']}, {meta['machine']}, Python {meta['python']}, torch {meta['torch']}, "
        f"accelerate {meta['accelerate']}; {meta['repeats']} repeat(s), {_processes_text(meta['quick'])}, "
        f"`torch.set_num_threads(1)`; total {meta['total_runtime_s']:.0f} s; load average "
        f"{meta['loadavg_start']} at start, {meta['loadavg_end']} at end.\n",
        "µs/step: wall time of the timed epochs (all but the first, warm-up one) divided by their training steps "
        "(micro-batches). × torch_loop: the median over repeats of each repeat's ratio to the torch_loop run of the "
        "same repeat, with its min–max. Whole run: the time of the whole run as its user pays it (building the "
        "model, the trainer or Accelerator and dataloaders, every epoch with the warm-up one, and the end of the "
        "run) divided by all its steps, fresh process per row, interleaved rounds; its ratio is again the median of "
        "the per-round ratios. Start-up: from the worker's first line to the first training "
        "step, with the medians of its two parts (the imports the row needs + the setup after them). Peak RSS: "
        "`ru_maxrss` of the worker; RSS increase: peak minus the RSS right after the imports. "
        "Trained: the last epoch's train loss is below the first epoch's, in every repeat.\n",
    ]
    for name, workload in results["workloads"].items():
        spec = workload["spec"]
        eval_text = f", {spec['eval_samples']} eval samples" if spec["eval_samples"] else ""
        if spec["phase"] == "evaluate":
            size_text = f"Batch {spec['batch_size']}, {spec['eval_samples']} eval samples: one evaluation of "
            size_text += f"{spec['steps_per_epoch']} batches, timed whole."
        else:
            size_text = f"Batch {spec['batch_size']}, {spec['train_samples']} train samples{eval_text}; "
            size_text += f"{spec['epochs']} epochs × {spec['steps_per_epoch']} steps "
            size_text += f"({spec['timed_steps']} timed steps)."
        if meta["quick"]:
            size_text += " (--quick sizes.)"
        parts.append(f"## {name}\n\n{workload['about']} {size_text}\n")
        parts.append(workload_table(name, workload["rows"]))
        if spec["model"] == "lm":
            parts.append(
                "Memory: the peak RSS of the worker above its RSS just before the run (data and imports made, the "
                "first optimizer's one-off import of torch._dynamo paid), per repeat against the torch_loop run of "
                "the same repeat.\n"
            )
            parts.append(memory_table(spec, workload["rows"], meta["quick"]))
        if workload.get("paired"):
            pairs = next(iter(workload["paired"].values())).get("pairs", "?")
            parts.append(
                f"Same process, alternating: {pairs} pairs of runs (row, then torch_loop, order swapped each pair), "
                "each run timed as above; the ratio of each pair, then the median. Host drift cancels out here, so "
                "these are the ratios to read for per-step overhead. CPU time: the same ratios of the time the "
                "process ran on a core (`time.process_time`), which leaves out the time it waited for one: on a busy "
                "machine (load average above the cores) the steadier of the two.\n"
            )
            parts.append(paired_table(workload["paired"]))
    parts.append("## Import time\n")
    parts.append(import_table(results["imports"]))
    parts.append(
        "The import workers run with bytecode written and reused (PYTHONDONTWRITEBYTECODE removed from their "
        "environment, one untimed import first), as after any install: pip writes the .pyc files of torch and "
        "accelerate when it installs them. Compiling this checkout's modules from source at every import (what "
        "PYTHONDONTWRITEBYTECODE=1 does) would add about 120 ms on the reference machine.\n"
    )
    return "\n".join(parts)


def _versions() -> dict:
    """Library versions, read from package metadata (nothing is imported)."""
    from importlib import metadata

    versions = {}
    for package in ("torch", "accelerate"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def _loadavg() -> str:
    try:
        return "/".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "n/a"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--repeats", type=int, default=None, help="measurements per row and workload (default 5; 1 with --quick)"
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads (default: all)")
    parser.add_argument("--rows", default=None, help="comma-separated rows (default: every available row)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: smaller workloads, one repeat, one process per row"
    )
    parser.add_argument("--output-dir", default=str(BENCH_DIR / "results"), help="where results.md/json go")
    parser.add_argument("--worker", nargs=2, metavar=("ROW", "WORKLOAD"), help=argparse.SUPPRESS)
    parser.add_argument("--import-worker", metavar="MODULE", help=argparse.SUPPRESS)
    parser.add_argument("--paired-worker", nargs=2, metavar=("ROW", "WORKLOAD"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="same-process alternating runs of each row against the torch loop (default 10; 2 with --quick; 0: none)",
    )
    args = parser.parse_args(argv)
    if args.pairs is None:
        args.pairs = 2 if args.quick else 10
    if args.worker or args.import_worker or args.paired_worker:
        return args  # a worker: nothing else to check, and its start-up is being timed
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    args.workloads = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in args.workloads if name not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; the workloads are {list(WORKLOADS)}")
    rows = available_rows()
    if args.rows is None:
        args.rows = rows
    else:
        args.rows = [name.strip() for name in args.rows.split(",") if name.strip()]
        unknown = [name for name in args.rows if name not in rows]
        if unknown:
            parser.error(f"unknown or unavailable row(s) {unknown}; the available rows are {rows}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker or args.import_worker or args.paired_worker:
        if args.worker:
            worker_main(*args.worker, quick=args.quick)
        elif args.paired_worker:
            paired_worker_main(*args.paired_worker, quick=args.quick, pairs=args.pairs)
        else:
            import_worker_main(args.import_worker)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the result is out: skip the interpreter's teardown of torch (about 0.5 s a process)

    started, loadavg_start = time.perf_counter(), _loadavg()
    quick_flag = ["--quick"] if args.quick else []
    runs = {workload: {row: [] for row in args.rows} for workload in args.workloads}
    import_runs = {module: [] for module in IMPORT_MODULES}
    paired_rows = [row for row in args.rows if row != BASELINE_ROW] if args.pairs else []
    total = sum(_workload_repeats(name, args) for name in args.workloads) * len(args.rows)
    total += args.repeats * len(IMPORT_MODULES)
    total += sum(workload_spec(name, args.quick)["paired"] for name in args.workloads) * len(paired_rows)
    done = 0

    def progress(label: str, result: dict, value: str) -> None:
        nonlocal done
        done += 1
        status = f"ERROR {result['error'][:300]}" if "error" in result else value
        print(f"[{done}/{total}] {label}: {status}", file=sys.stderr, flush=True)

    # Import times are compared with bytecode written and reused, as after any install (pip compiles the .pyc
    # files of torch and accelerate when it installs them): one untimed import first writes this checkout's.
    import_env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    if not args.quick:  # a smoke run's timings are rough anyway: no process spent on writing bytecode
        for module in IMPORT_MODULES:
            _run_import_child(["--import-worker", module], timeout=120, env=import_env)
    for repeat in range(args.repeats):
        # interleaved: each repeat visits every workload and row, in an order rotated by the repeat
        for module in _rotated(list(IMPORT_MODULES), repeat):
            result = _run_import_child(["--import-worker", module], timeout=120, env=import_env)
            import_runs[module].append(result)
            progress(f"repeat {repeat + 1} import {module}", result, f"{result.get('import_ms', 0):.0f} ms")
        due = [name for name in args.workloads if repeat < _workload_repeats(name, args)]
        for workloads, row in _worker_batches(due, _rotated(list(args.rows), repeat), args.quick):
            worker_flags = ["--worker", row, ",".join(workloads), *quick_flag]
            results = _run_child_lines(worker_flags, len(workloads), timeout=WORKER_TIMEOUT_S * len(workloads))
            for workload, result in zip(workloads, results):
                runs[workload][row].append(result)
                value = f"{result.get('us_per_step', 0):.1f} µs/step, trained={result.get('trained')}"
                progress(f"repeat {repeat + 1} {workload} {row}", result, value)

    paired_runs: dict = {workload: {} for workload in args.workloads}
    paired_workloads = [name for name in args.workloads if workload_spec(name, args.quick)["paired"]]
    for workloads, row in _worker_batches(paired_workloads, paired_rows, args.quick):
        pairs_flags = ["--paired-worker", row, ",".join(workloads), "--pairs", str(args.pairs), *quick_flag]
        results = _run_child_lines(pairs_flags, len(workloads), timeout=WORKER_TIMEOUT_S * 2 * len(workloads))
        for workload, result in zip(workloads, results):
            paired_runs[workload][row] = result
            value = "" if "error" in result else f"median ratio {statistics.median(result['ratios']):.3f}"
            progress(f"paired {workload} {row}", result, value)

    imports: dict = {"modules": {}}
    for module, module_runs in import_runs.items():
        ok = [run for run in module_runs if "error" not in run]
        if not ok:
            imports["modules"][module] = None
            continue
        summary = {key: _spread([run[key] for run in ok]) for key in ("import_ms", "peak_rss_mb", "process_wall_ms")}
        summary["errors"] = [run["error"] for run in module_runs if "error" in run]
        imports["modules"][module] = summary
    pairs = [
        (ours, base)
        for ours, base in zip(import_runs["pytorch_accel_trainer"], import_runs["accelerate"])
        if "error" not in ours and "error" not in base
    ]
    if pairs:
        imports["ratio"] = _spread([ours["import_ms"] / base["import_ms"] for ours, base in pairs])
        imports["added_ms"] = _spread([ours["import_ms"] - base["import_ms"] for ours, base in pairs])
    torch_only = [
        run["import_ms"]
        for workload in args.workloads
        if not WORKLOADS[workload]["progress"]  # whose torch_loop imports torch only
        for run in runs[workload].get(BASELINE_ROW, [])
        if "error" not in run
    ]
    imports["torch_from_workers"] = _spread(torch_only) if torch_only else None
    imports["runs"] = import_runs

    versions = _versions()
    results = {
        "meta": {
            "command": " ".join(["python benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": _machine(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            **versions,
            "repeats": args.repeats,
            "quick": args.quick,
            "rows": args.rows,
            "workloads": args.workloads,
            "total_runtime_s": time.perf_counter() - started,
            "loadavg_start": loadavg_start,
            "loadavg_end": _loadavg(),
            "dont_write_bytecode": bool(os.environ.get("PYTHONDONTWRITEBYTECODE")),
        },
        "rows": args.rows,
        "workloads": {
            workload: {
                "spec": workload_spec(workload, args.quick),
                "about": WORKLOADS[workload]["about"],
                "rows": summarize_workload(runs[workload]),
                "paired": summarize_paired(paired_runs[workload]),
                "runs": runs[workload],
            }
            for workload in args.workloads
        },
        "imports": imports,
    }
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(results)
    (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (output_dir / "results.md").write_text(markdown)
    print(markdown)
    print(f"Wrote {output_dir / 'results.md'} and {output_dir / 'results.json'}", file=sys.stderr)

    failed = [
        f"{workload}/{row}"
        for workload, data in results["workloads"].items()
        for row, summary in data["rows"].items()
        if not summary["trained"]
    ]
    failed += [
        f"{workload}/{row} (paired)"
        for workload, data in results["workloads"].items()
        for row, summary in data["paired"].items()
        if not summary["trained"]
    ]
    if failed:
        print(f"FAILED (error or did not train): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
