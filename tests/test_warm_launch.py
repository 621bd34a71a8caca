"""The warm launcher (tests/scripts/warm_launch.py, ``launcher`` of tests/conftest.py) gives a script what the real
launch (``real_launcher``: ``python``, ``accelerate launch``) gives it, and ends as the real launch ends: the suite's
multi-process tests rely on it (tests/scripts/launch_probe.py records what a process sees)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    CPU_PROCESSES_ENV,
    accelerate_launch,
    deepspeed_environment,
    deepspeed_launcher,
    launcher,
    real_launcher,
)

PROBE = Path(__file__).parent / "scripts" / "launch_probe.py"
#: Variables whose value each launch draws anew (plain torchrun's run id; mlflow's session: each ``accelerate launch
#: --use_deepspeed`` imports DeepSpeed, and so mlflow, and hands it on; the DeepSpeed server's imports drew it once).
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID", "_MLFLOW_TELEMETRY_SESSION_ID"}
#: The launch options of the suite's DeepSpeed launches.
DEEPSPEED = ("--use_deepspeed", "--zero_stage", "2")


def _probe(launch, num_processes: int, folder: Path, *actions: str, env=None, **options):
    """Launch the probe with ``launch`` (``launcher`` or ``real_launcher``); what it ended with and what each process
    saw, by rank."""
    folder.mkdir()
    command = [*launch(num_processes), str(PROBE), str(folder), *actions]
    completed = subprocess.run(
        command, env=env or CPU_PROCESSES_ENV, capture_output=True, text=True, timeout=240, **options
    )
    return completed, [json.loads(path.read_text()) for path in sorted(folder.glob("rank*.json"))]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("num_processes", "actions"), [(1, ["exit3"]), (2, ["sleep", "exit3"])])
def test_a_warm_launch_gives_and_ends_as_the_real_launch(tmp_path, num_processes, actions):
    """The same environment (Accelerate's and torchrun's variables on 2 processes), arguments, ``sys.path``, folder,
    ``__main__``, signal handlers, and random states of their own; and the same exit status when a process fails (on
    2 processes, the launcher ends the other one, asleep)."""
    real, real_seen = _probe(real_launcher, num_processes, tmp_path / "real", *actions, cwd=tmp_path)
    warm, warm_seen = _probe(launcher, num_processes, tmp_path / "warm", *actions, cwd=tmp_path)
    assert warm.returncode == real.returncode == (3 if num_processes == 1 else 1), (real.stderr[-2000:], warm.stderr)
    _assert_same_processes(real_seen, warm_seen, num_processes)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("num_processes", "options", "actions"),
    [(1, DEEPSPEED, ["exit3"]), (2, DEEPSPEED, ["sleep", "exit3"]), (1, (), ["exit3"])],
    ids=["accelerate-1", "accelerate-2", "torchrun-1"],
)
def test_a_warm_deepspeed_launch_gives_and_ends_as_the_real_launch(tmp_path, num_processes, options, actions):
    """``deepspeed_launcher`` gives each process what ``accelerate launch --use_deepspeed --zero_stage 2`` gives it
    (its ``ACCELERATE_*`` variables, torchrun's on one process too, the launch's folder on ``PYTHONPATH``, what
    ``import deepspeed`` set in the launcher), or without options what ``torchrun --nproc_per_node 1`` gives it
    (examples/parallel_layouts.py's DeepSpeed runs); and ends as they end (1 when a process failed)."""
    env = deepspeed_environment()

    def real_launch(count: int) -> list:
        if options:
            return accelerate_launch(count, *options)
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(count)]

    real, real_seen = _probe(real_launch, num_processes, tmp_path / "real", *actions, env=env, cwd=tmp_path)
    warm, warm_seen = _probe(
        lambda count: deepspeed_launcher(count, *options),
        num_processes,
        tmp_path / "warm",
        *actions,
        env=env,
        cwd=tmp_path,
    )
    assert warm.returncode == real.returncode == 1, (real.stderr[-2000:], warm.stderr)
    used = {process["env"].get("ACCELERATE_USE_DEEPSPEED") for process in warm_seen}
    assert used == ({"true"} if options else {None})
    _assert_same_processes(real_seen, warm_seen, num_processes)


def _assert_same_processes(real_seen: list, warm_seen: list, num_processes: int) -> None:
    """What each process of a real and of a warm launch saw is the same, but what each launch draws anew."""
    assert len(real_seen) == len(warm_seen) == num_processes
    draws = [process["draws"] for process in real_seen + warm_seen]
    for real_process, warm_process in zip(real_seen, warm_seen):
        real_env, warm_env = real_process.pop("env"), warm_process.pop("env")
        assert real_env.keys() == warm_env.keys()
        assert {name: value for name, value in warm_env.items() if name not in PER_LAUNCH} == {
            name: value for name, value in real_env.items() if name not in PER_LAUNCH
        }
        for process in (real_process, warm_process):
            del process["pid"], process["draws"]
            process["argv"][1] = "OUT"  # each launch's own folder
        assert warm_process == real_process
    # Python's, numpy's and torch's random states are drawn from the OS: each process draws its own
    for generator_draws in zip(*draws):
        assert len(set(generator_draws)) == 2 * num_processes


@pytest.mark.parametrize(("action", "returncode"), [("kill", -signal.SIGKILL), ("raise", 1), ("exit0", 0)])
def test_a_warm_process_ends_as_python_ends(tmp_path, action, returncode):
    """A process killed by a signal, or that raised, ends its launch as it ends ``python``."""
    completed, _ = _probe(launcher, 1, tmp_path / "probe", action)
    assert completed.returncode == returncode, completed.stderr
    assert ("ValueError: raised on process 0" in completed.stderr) == (action == "raise")


def test_a_killed_warm_launch_ends_its_processes(tmp_path):
    """The client killed (a test's timeout), its processes are killed too."""
    folder = tmp_path / "probe"
    folder.mkdir()
    client = subprocess.Popen([*launcher(2), str(PROBE), str(folder), "sleep"], env=CPU_PROCESSES_ENV)
    deadline = time.monotonic() + 120
    while len(list(folder.glob("rank*.json"))) < 2:
        assert time.monotonic() < deadline and client.poll() is None, "the launch never started its processes"
        time.sleep(0.05)
    time.sleep(0.5)  # the files are written whole
    pids = [json.loads(path.read_text())["pid"] for path in folder.glob("rank*.json")]
    client.kill()
    client.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"processes {pids} outlived their launch"
        time.sleep(0.05)


def test_a_signal_to_the_client_goes_to_its_process(tmp_path):
    """SIGTERM to the client (torchrun's agent stopping an attempt, torchrun_with_warm_processes) reaches its process,
    whose handler runs (the trainer's saves on SIGTERM), and the client ends with that process's exit status."""
    ready = tmp_path / "ready"
    code = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(600)\n"
    )
    client = subprocess.Popen([*launcher(1), "-c", code], env=CPU_PROCESSES_ENV)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline and client.poll() is None, "the launch never started its process"
        time.sleep(0.05)
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=30) == 128 + signal.SIGTERM


def test_unbuffered_streams_as_python_u():
    """``-u`` (torchrun runs ``python -u``: torchrun_with_warm_processes) gives the unbuffered standard streams of
    ``python -u``, whose output is out before a SIGKILL; without it, the streams are ``python``'s."""
    code = "import sys; print([(type(s.buffer).__name__, s.write_through) for s in (sys.stdout, sys.stderr)])"
    for option in (["-u"], []):
        warm, real = (
            subprocess.run([*launch(1), *option, "-c", code], env=CPU_PROCESSES_ENV, capture_output=True, text=True)
            for launch in (launcher, real_launcher)
        )
        assert warm.returncode == 0 and warm.stdout == real.stdout, (option, warm.stdout, warm.stderr, real.stdout)
    assert real.stdout  # the streams were printed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_variable_read_at_import_is_refused(tmp_path):
    """torch reads TORCH_* variables as it is imported, which the warm launcher did before: such a launch is refused
    with what to use instead."""
    env = {**CPU_PROCESSES_ENV, "TORCH_SHOW_CPP_STACKTRACES": "1"}
    completed, seen = _probe(launcher, 1, tmp_path / "probe", env=env)
    assert completed.returncode != 0 and not seen
    assert "['TORCH_SHOW_CPP_STACKTRACES']" in completed.stderr and "real_launcher" in completed.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_a_variable_deepspeed_reads_at_import_is_refused(tmp_path):
    """DeepSpeed picks its accelerator as it is imported (``DS_ACCELERATOR``), which the DeepSpeed server did before:
    such a launch is refused with what to use instead."""
    env = {**deepspeed_environment(), "DS_ACCELERATOR": "cpu"}
    completed, seen = _probe(lambda count: deepspeed_launcher(count, *DEEPSPEED), 1, tmp_path / "probe", env=env)
    assert completed.returncode != 0 and not seen
    assert "['DS_ACCELERATOR']" in completed.stderr and "accelerate_launch" in completed.stderr
