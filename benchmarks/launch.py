"""How the benchmarks start the processes they measure: ``python`` for one, ``accelerate launch`` on the CPU for
several (as tests/conftest.py's ``real_launcher`` and exit_stress/stress.py use).

The environment variable ``BENCHMARK_LAUNCHER`` replaces both: a command that takes the number of processes, then the
script and its arguments. The test suite's smoke runs (tests/test_benchmarks.py) set it to its warm launcher
(tests/scripts/warm_launch.py), which forks the processes from an interpreter that already imported torch, Accelerate
and the package: a smoke run checks that every row runs and trains, never its start-up figures, and a new interpreter
pays about 4.5 s of CPU for those imports (10 to 13 s of wall time on 2 busy cores). Import times are measured in a
new interpreter whatever it says (run.py's ``--import-worker``).
"""

from __future__ import annotations

import os
import shlex
import sys

LAUNCHER_VARIABLE = "BENCHMARK_LAUNCHER"


def launcher(num_processes: int) -> list:
    """The start of a command that runs a script (appended, with its arguments) on ``num_processes`` processes:
    ``BENCHMARK_LAUNCHER``'s, else :func:`new_interpreters`."""
    launcher = os.environ.get(LAUNCHER_VARIABLE)
    if launcher:
        return [*shlex.split(launcher), str(num_processes)]
    return new_interpreters(num_processes)


def new_interpreters(num_processes: int) -> list:
    """The start of a command that runs a script on ``num_processes`` new interpreters: plain ``python`` for one,
    ``accelerate launch`` of one CPU job for several (tests/conftest.py's ``real_launcher``)."""
    if num_processes == 1:
        return [sys.executable]
    return accelerate_launch(num_processes, "--multi_gpu")


def accelerate_launch(num_processes: int, *mode: str) -> list:
    """``accelerate launch`` of ``num_processes`` processes of one machine, without mixed precision or dynamo, on a
    free port; ``mode``: how Accelerate distributes them (``--multi_gpu``, or ``--use_deepspeed --zero_stage 2``)."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *mode,
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
    ]
