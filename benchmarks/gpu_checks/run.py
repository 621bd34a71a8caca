"""The GPU checks in one command: each check in a fresh process, one markdown table at the end.

    python benchmarks/gpu_checks/run.py                    # on a CUDA GPU: at most 8 minutes on one H100
    python benchmarks/gpu_checks/run.py --smoke            # on the CPU, tiny sizes, what needs CUDA skipped
    python benchmarks/gpu_checks/run.py --only memory,compile --output-dir /tmp/gpu

Writes ``results.md`` (the table), ``results.json`` (every raw figure) and ``runs/<check>.log`` (each check's
output) to ``--output-dir`` (default ``benchmarks/results/gpu/``). Exits with status 1 if a check failed, 2 if the
command cannot run (an unknown check; no CUDA device without ``--smoke``). What each check measures and its goal:
benchmarks/README.md ("GPU checks"). This file imports no torch: a check that crashes or hangs takes only its own
process down, and is reported as failed. The checks' processes start as benchmarks/launch.py says (``python``, or
``BENCHMARK_LAUNCHER``'s command, which the test suite's smoke run sets to its warm launcher).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from launch import LAUNCHER_VARIABLE, launcher  # noqa: E402  (benchmarks/launch.py)

CHECKS_SCRIPT = HERE / "checks.py"
DEFAULT_OUTPUT_DIR = REPO_ROOT / "benchmarks" / "results" / "gpu"
#: The whole run on a GPU stays under 8 minutes: a check is given at most what is left of this, and is skipped
#: when less than MIN_START_S is left.
DEFAULT_BUDGET_S = 450
MIN_START_S = 20
SMOKE_TIMEOUT_S = 120


@dataclass(frozen=True)
class Check:
    """One check: its name (``checks.py NAME``), what it measures, its goal, its time limit on a GPU, and why the
    smoke run skips it (``None``: it runs there, at tiny sizes)."""

    name: str
    measures: str
    goal: str
    timeout_s: int
    smoke_skip: Optional[str] = None


CUDA_ONLY = "needs CUDA"
#: In the order they run; the GPU time budget goes to the first ones first.
CHECKS = (
    Check(
        "throughput_bf16", "Trainer.train vs a hand-written AMP loop, bf16, time of the timed epochs", "<= 1.03x", 150
    ),
    Check(
        "throughput_fp16",
        "Trainer.train vs a hand-written AMP loop with GradScaler, fp16",
        "<= 1.03x",
        150,
        f"fp16 {CUDA_ONLY}: the trainer refuses it on the CPU",
    ),
    Check(
        "sync_free_no",
        "set_sync_debug_mode('error') from each step's start to the epoch's end, fp32",
        "no sync",
        120,
        f"set_sync_debug_mode {CUDA_ONLY}",
    ),
    Check("sync_free_bf16", "the same, bf16", "no sync", 120, f"set_sync_debug_mode {CUDA_ONLY}"),
    Check("sync_free_fp16", "the same, fp16 (gradient scaler on)", "no sync", 120, f"set_sync_debug_mode {CUDA_ONLY}"),
    Check(
        "memory",
        "peak CUDA memory of train() and evaluate() vs hand-written loops, Embedding(32000, 64) -> Linear(64, 32000)",
        "extra <= 0.1 x one step's logits",
        120,
        f"max_memory_allocated {CUDA_ONLY}",
    ),
    Check(
        "async_save", "time the loop waits for an asynchronous training-state save vs a synchronous one", "<= 0.5x", 180
    ),
    Check(
        "fsdp2",
        "fsdp_check.py under FSDP2 on one GPU vs a plain run",
        "DTensor parameters, same result",
        240,
        f"FSDP {CUDA_ONLY}: Accelerate never selects it on a CPU (tests/test_fsdp.py covers FSDP2 on gloo)",
    ),
    Check("compile", "torch_compile=True trains; step time vs eager", "loss goes down", 300),
)
CHECK_NAMES = [check.name for check in CHECKS]


def _parse_arguments(argv: Optional[list]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--only", default=None, help=f"comma-separated checks to run, of: {','.join(CHECK_NAMES)}")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU; what needs CUDA is skipped")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"the whole run's time limit in seconds (default {DEFAULT_BUDGET_S})",
    )
    parser.add_argument("--jobs", type=int, default=None, help="checks at a time (default 1; 2 with --smoke)")
    return parser.parse_args(argv)


def _select_checks(only: Optional[str]) -> list:
    if only is None:
        return list(CHECKS)
    names = [name.strip() for name in only.split(",") if name.strip()]
    unknown = [name for name in names if name not in CHECK_NAMES]
    if unknown or not names:
        raise ValueError(f"--only {only!r}: unknown check(s) {unknown}; choose among {', '.join(CHECK_NAMES)}")
    return [check for check in CHECKS if check.name in names]


def _child_environment(smoke: bool) -> dict:
    """The checks import the package from this checkout (installed or not); on the CPU each takes one thread, as
    the smoke run runs two at a time on the reference machine's two cores."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
    if not environment.get(LAUNCHER_VARIABLE):  # a forked process keeps its launcher's streams (benchmarks/launch.py)
        environment["PYTHONUNBUFFERED"] = "1"
    if smoke:
        environment.setdefault("OMP_NUM_THREADS", "1")
    return environment


def _cuda_available() -> bool:
    """Asked of a child process, so that this one never imports torch."""
    probe = "import torch; print(torch.cuda.is_available())"
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if completed.returncode != 0:
        print(f"{sys.executable} could not import torch:\n{completed.stderr[-2000:]}", file=sys.stderr)
    return completed.stdout.strip() == "True"


def _log_tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_check(check: Check, smoke: bool, output_dir: Path, deadline: float) -> dict:
    """Run one check in a fresh process, within its time limit and what is left of the run's; return its outcome
    (FAIL with the log's last lines if the process crashed, hung or wrote no result)."""
    base = {"goal": check.goal, "measures": check.measures}
    if smoke and check.smoke_skip:
        return {**base, "status": "SKIPPED", "summary": f"smoke mode: {check.smoke_skip}", "figures": {}}
    left = deadline - time.monotonic()
    if left < MIN_START_S:
        summary = f"the run's time budget was spent ({left:.0f} s left; --budget-s to change it)"
        return {**base, "status": "SKIPPED", "summary": summary, "figures": {}}
    timeout = min(SMOKE_TIMEOUT_S if smoke else check.timeout_s, left)
    log, result_file = output_dir / "runs" / f"{check.name}.log", output_dir / "runs" / f"{check.name}.json"
    result_file.unlink(missing_ok=True)
    command = [*launcher(1), str(CHECKS_SCRIPT), check.name, "--result", str(result_file)] + ["--smoke"] * smoke
    start = time.monotonic()
    with open(log, "w") as handle:
        # a session of its own, so that a hung check is killed with the processes it started (launchers, compilers)
        process = subprocess.Popen(
            command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=_child_environment(smoke),
            start_new_session=True,
        )
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    seconds = time.monotonic() - start
    if result_file.is_file():
        result = {**base, **json.loads(result_file.read_text())}
        result_file.unlink()  # its content goes into results.json
    elif returncode is None:
        result = {**base, "status": "FAIL", "summary": f"timed out after {timeout:.0f} s", "figures": {}}
    else:
        result = {**base, "status": "FAIL", "summary": f"exited with code {returncode}, no result", "figures": {}}
    if result["status"] == "FAIL":
        result["log_tail"] = _log_tail(log)
    result["wall_s"] = round(seconds, 2)
    return result


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def format_table(results: dict, header: str) -> str:
    lines = [header, "", "| check | status | result | goal | s |", "|---|---|---|---|---|"]
    for name, result in results.items():
        lines.append(
            f"| {name} | {result['status']} | {_cell(result['summary'])} | {_cell(result['goal'])} | "
            f"{result.get('wall_s', 0):.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list] = None) -> int:
    args = _parse_arguments(argv)
    try:
        checks = _select_checks(args.only)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    if not args.smoke and not _cuda_available():
        print("No CUDA device: the GPU checks need one. On a CPU: python benchmarks/gpu_checks/run.py --smoke")
        return 2
    started, start = datetime.datetime.now().isoformat(timespec="seconds"), time.monotonic()
    deadline = start + args.budget_s
    output_dir = args.output_dir.resolve()
    (output_dir / "runs").mkdir(parents=True, exist_ok=True)
    jobs = args.jobs or (2 if args.smoke else 1)  # on a GPU, one at a time: the timings must not share it

    def run_and_report(check: Check) -> dict:
        result = run_check(check, args.smoke, output_dir, deadline)
        print(f"{check.name}: {result['status']} ({result.get('wall_s', 0):.0f} s): {result['summary']}", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        outcomes = list(pool.map(run_and_report, checks))
    results = {check.name: outcome for check, outcome in zip(checks, outcomes)}
    wall = time.monotonic() - start
    environment = next((result["environment"] for result in results.values() if "environment" in result), {})
    mode = "smoke (CPU, tiny sizes, timings not judged)" if args.smoke else "GPU"
    header = (
        f"GPU checks, {mode}: {started}, {wall:.0f} s; {environment.get('device', '?')}, torch "
        f"{environment.get('torch', '?')}, accelerate {environment.get('accelerate', '?')}"
    )
    table = format_table(results, header)
    print("\n" + table)
    failed = [name for name, result in results.items() if result["status"] == "FAIL"]
    record = {"mode": "smoke" if args.smoke else "gpu", "started": started, "wall_s": round(wall, 2)}
    record.update({"command": [sys.executable, *sys.argv], "environment": environment, "failed": failed})
    record["checks"] = results
    (output_dir / "results.md").write_text(table)
    (output_dir / "results.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"Wrote {output_dir / 'results.md'} and results.json; each check's output in {output_dir / 'runs'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
