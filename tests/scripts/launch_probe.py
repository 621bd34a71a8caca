"""What a launched process sees, for tests/test_warm_launch.py: writes ``OUT/rank<RANK>.json`` (its environment,
``sys.argv``, ``sys.path``, working folder, first random draws, ``__main__``, signal handlers), then ends as asked.

Usage: ``launch_probe.py OUT [ACTION ...]``, the ACTION of each process by rank (the last one for the ranks after it;
none: exit 0): ``exit<CODE>``, ``kill`` (SIGKILL itself), ``raise`` (a ValueError) or ``sleep`` (until ended).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

rank = int(os.environ.get("RANK", "0"))
seen = {
    "env": dict(os.environ),
    "argv": sys.argv,
    "path": sys.path,
    "cwd": os.getcwd(),
    "draws": [random.random(), float(np.random.rand()), torch.rand(1).item()],
    "main": [__name__, sys.modules["__main__"].__file__ == __file__],
    "pid": os.getpid(),
    "signals": [str(signal.getsignal(signum)) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)],
}
(Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(seen))
actions = sys.argv[2:] or ["exit0"]
action = actions[min(rank, len(actions) - 1)]
if action.startswith("exit"):
    sys.exit(int(action[4:]))
if action == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if action == "raise":
    raise ValueError(f"raised on process {rank}")
if action == "sleep":
    time.sleep(600)
