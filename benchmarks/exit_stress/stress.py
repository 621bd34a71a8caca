"""Launch a user-style 2-process script many times and count the launches that do not exit 0.

A finished multi-process job must exit 0 every time. A user's script has no teardown at its end (the README
quickstart, ``examples/quickstart.py``, is the default script), so this launches exactly that, with
``accelerate launch`` and with ``torchrun``, on the CPU (gloo), and counts the failures and the aborts
("terminate called without an active exception").

``--slow-gloo`` preloads ``slow_wakeup.c`` (compiled with gcc on first use), which makes every thread sleep
2 ms after each condition-variable wake-up: it widens the window in which a gloo worker thread releases a
finished collective while the main thread is leaving the interpreter, the race behind the aborts.

    .venv/bin/python benchmarks/exit_stress/stress.py --launches 30            # 30 each way
    .venv/bin/python benchmarks/exit_stress/stress.py --launches 10 --slow-gloo
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from launch import new_interpreters  # noqa: E402  (benchmarks/launch.py)

ABORT = "terminate called without an active exception"


def _shim() -> str:
    library = pathlib.Path(tempfile.gettempdir()) / "pytorch_accel_trainer_slow_wakeup.so"
    if not library.exists():
        subprocess.run(
            ["gcc", "-shared", "-fPIC", "-O2", "-o", str(library), str(HERE / "slow_wakeup.c"), "-ldl"], check=True
        )
    return str(library)


def launchers() -> dict:
    accelerate = new_interpreters(2)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return {"accelerate launch": accelerate, "torchrun": torchrun}


def launch(command: list, script: str, slow_gloo: bool, timeout: float = 240) -> tuple[int, bool, str]:
    """Run one launch; return its exit status, whether a process aborted in C++, and the end of its stderr."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    if slow_gloo:
        env["LD_PRELOAD"] = _shim()
    completed = subprocess.run([*command, script], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return completed.returncode, ABORT in completed.stderr, completed.stderr[-3000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=30, help="launches per launcher (default 30)")
    parser.add_argument("--slow-gloo", action="store_true", help="preload the 2 ms wake-up delay shim")
    parser.add_argument("--script", default=str(REPO / "examples" / "quickstart.py"), help="the user script to launch")
    parser.add_argument("--launcher", choices=[*launchers(), "both"], default="both")
    args = parser.parse_args()
    failures = 0
    for name, command in launchers().items():
        if args.launcher not in (name, "both"):
            continue
        results = [launch(command, args.script, args.slow_gloo) for _ in range(args.launches)]
        failed = sum(status != 0 for status, _, _ in results)
        aborted = sum(abort for _, abort, _ in results)
        for status, _, stderr in results:
            if status != 0:
                print(f"--- a {name} launch exited {status}; the end of its stderr:\n{stderr}")
        failures += failed
        print(
            f"{name}{' (slow gloo)' if args.slow_gloo else ''}: {args.launches - failed}/{args.launches} exited 0; "
            f"{failed} failed, {aborted} with a C++ abort"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
