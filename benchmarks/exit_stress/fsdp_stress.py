"""Launch the 2-process FSDP2 run over gloo (``tests/scripts/fsdp_train.py ... fsdp2``) many times; count the launches
that do not exit 0 and the aborts ("terminate called without an active exception"), and say where each abort came.

Each process runs under ``with_faulthandler.py``: at a fatal signal it writes every thread's Python stack to
``faulthandler.rank<i>``, after the marks of the phases it reached (the script started, returned, the last ``atexit``
function ran), and it may leave a ``core`` for ``gdb``. A launch that failed keeps its folder under ``--keep``; the
others are removed. The launches are forked from an interpreter that already imported torch, Accelerate and the
package (``tests/scripts/warm_launch.py``, as the test suite launches): about 9 s of CPU less per process.
``--slow-gloo`` preloads ``slow_wakeup.c`` into every process, as ``stress.py --slow-gloo`` does;
``--without-exit-wait`` turns off the trainer's wait for idle gloo workers at exit (the library before that fix).

    .venv/bin/python benchmarks/exit_stress/fsdp_stress.py --launches 100
    .venv/bin/python benchmarks/exit_stress/fsdp_stress.py --launches 20 --slow-gloo --keep /tmp/fsdp-aborts
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from stress import ABORT, _shim

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
WARM_LAUNCH = REPO / "tests" / "scripts" / "warm_launch.py"
FSDP_SCRIPT = REPO / "tests" / "scripts" / "fsdp_train.py"
WRAPPER = HERE / "with_faulthandler.py"


def launch_env(slow_gloo: bool, without_exit_wait: bool) -> dict:
    """The environment of the server and of each launch (they must agree): the CPU, one OpenMP thread, the shim, and
    whether ``with_faulthandler.py`` turns the library's wait at exit off."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env["EXIT_STRESS_WITHOUT_EXIT_WAIT"] = "1" if without_exit_wait else "0"
    if slow_gloo:
        env["LD_PRELOAD"] = _shim()
    return env


def start_server(folder: pathlib.Path, env: dict) -> tuple[subprocess.Popen, str]:
    """The warm launcher's server, started in ``env``."""
    socket_path = str(folder / "socket")
    log = open(f"{socket_path}.log", "wb")  # noqa: SIM115 (the server's, until it ends)
    server = subprocess.Popen(
        [sys.executable, str(WARM_LAUNCH), "serve", socket_path], stdin=subprocess.PIPE, stdout=log, stderr=log, env=env
    )
    return server, socket_path


def where_it_aborted(folder: pathlib.Path) -> list[str]:
    """For each process that dumped a fatal error: its rank, the last phase it reached and the innermost Python frame
    of each thread (faulthandler's dump, the current thread first)."""
    places = []
    for dump in sorted(folder.glob("faulthandler.rank*")):
        text = dump.read_text(errors="replace")
        if "Fatal Python error" not in text:
            continue
        phases = [line[4:] for line in text.splitlines() if line.startswith("--- ")]
        frames, thread = [], None
        for line in text.splitlines():
            if line.startswith(("Thread 0x", "Current thread 0x")):
                thread = line.split(" (most recent call first)")[0]
            elif thread and line.startswith("  File "):
                frames.append(f"{thread}: {line.strip()}")
                thread = None  # its innermost frame only
        places.append(
            f"{dump.name[len('faulthandler.') :]} after '{phases[-1] if phases else 'nothing'}'; "
            + " | ".join(frames or ["no Python frame"])
        )
    return places


def launch(socket_path: str, folder: pathlib.Path, env: dict, timeout: float) -> tuple[int, bool, str]:
    """One launch in ``folder``; its exit status, whether a process aborted in C++, and the end of its stderr."""
    folder.mkdir(parents=True)
    command = [sys.executable, "-S", str(WARM_LAUNCH), socket_path, "2", str(WRAPPER), str(FSDP_SCRIPT), ".", "fsdp2"]
    completed = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=timeout)
    return completed.returncode, ABORT in completed.stderr, completed.stderr[-3000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=100, help="launches (default 100)")
    parser.add_argument("--slow-gloo", action="store_true", help="preload the 2 ms wake-up delay shim")
    parser.add_argument(
        "--without-exit-wait", action="store_true", help="turn the trainer's wait for idle gloo workers at exit off"
    )
    parser.add_argument("--keep", type=pathlib.Path, help="keep the folders of the failed launches here")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one launch may take (default 300)")
    args = parser.parse_args()
    root = pathlib.Path(tempfile.mkdtemp(prefix="fsdp-stress-"))
    env = launch_env(args.slow_gloo, args.without_exit_wait)
    server, socket_path = start_server(root, env)
    failed, aborted, places = 0, 0, collections.Counter()
    started = time.monotonic()
    try:
        for index in range(args.launches):
            folder = root / f"launch_{index:03d}"
            status, abort, stderr = launch(socket_path, folder, env, args.timeout)
            where = where_it_aborted(folder)
            if status != 0 or abort or where:
                failed += status != 0
                aborted += abort
                places.update(where)
                print(f"--- launch {index} exited {status}{' (C++ abort)' if abort else ''}; {where}\n{stderr}")
                if args.keep is not None:
                    shutil.copytree(folder, args.keep / folder.name, dirs_exist_ok=True)
            shutil.rmtree(folder, ignore_errors=True)  # its cores are large
            print(
                f"launch {index + 1}/{args.launches}: {failed} failed, {aborted} aborted "
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    finally:
        server.stdin.close()
        server.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"FSDP2 over gloo{' (slow gloo)' if args.slow_gloo else ''}"
        f"{' without the exit wait' if args.without_exit_wait else ''}: {args.launches - failed}/{args.launches} "
        f"exited 0; {failed} failed, {aborted} with a C++ abort"
    )
    for place, count in places.most_common():
        print(f"  {count} x {place}")
    return 1 if failed or aborted else 0


if __name__ == "__main__":
    sys.exit(main())
