"""Run a script as ``__main__`` with ``faulthandler`` on, for ``fsdp_stress.py``: each process writes its dump (every
thread's Python stack at a fatal signal: the SIGABRT of "terminate called without an active exception") to
``faulthandler.rank<RANK>`` in the working folder, with a line as the script returns and one as the last ``atexit``
function runs (it was registered first), so that a dump says in which phase the process aborted. Core dumps are
switched on (``core`` in the working folder, where the kernel's ``core_pattern`` allows) for ``gdb``. With
``EXIT_STRESS_WITHOUT_EXIT_WAIT=1`` the trainer's wait for idle gloo workers at exit
(``parallel.distributed.wait_for_gloo_workers_at_exit``) is turned off: the library as it was before that fix.

    python with_faulthandler.py SCRIPT [ARGUMENT ...]
"""

import atexit
import faulthandler
import os
import resource
import runpy
import sys

dump = open(f"faulthandler.rank{os.environ.get('RANK', '0')}", "w")  # noqa: SIM115 (open until the process ends)


def mark(phase: str) -> None:
    dump.write(f"--- {phase}\n")
    dump.flush()


faulthandler.enable(file=dump, all_threads=True)
soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
atexit.register(mark, "last atexit function: the interpreter finalises next")
if os.environ.get("EXIT_STRESS_WITHOUT_EXIT_WAIT") == "1":
    from pytorch_accel_trainer.parallel import distributed

    distributed.wait_for_gloo_workers_at_exit = lambda: None
script, sys.argv = sys.argv[1], sys.argv[1:]
mark("script started")
runpy.run_path(script, run_name="__main__")
mark("script returned")
