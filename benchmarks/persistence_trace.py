"""What a save and a resume run: the package's functions called by ``save_training_state`` and by a resume, traced.

Two figures, each over a small MLP trained for an epoch on one process:

- **save**: every function of ``--package`` that ``trainer.save_training_state(folder)`` runs, after ``train()``;
- **resume**: every function that ``train(resume_from=folder)`` runs and a fresh ``train()`` of the same run does
  not (both trace the whole call with ``sys.setprofile``; the difference is what a newcomer must read to follow a
  resume).

    .venv/bin/python benchmarks/persistence_trace.py           # both figures: functions, files, by file
    .venv/bin/python benchmarks/persistence_trace.py --list    # the functions too, in the order they first ran

Each figure is given twice: every code object of the package that ran, and the named functions only
(comprehensions, generator expressions and lambdas belong to the function that encloses them). ``--json`` writes the
figures. Python functions of the package only: torch's and Accelerate's calls are left out,
and so is what a background thread runs (a synchronous save runs on the calling thread).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from typing import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

import pytorch_accel_trainer
from pytorch_accel_trainer import Trainer

PACKAGE_ROOT = os.path.dirname(pytorch_accel_trainer.__file__) + os.sep


def traced(action: Callable[[], object]) -> list[tuple[str, str, int]]:
    """The package's functions ``action`` runs on this thread, in the order they first ran: (file, name, line)."""
    seen: dict[tuple[str, str, int], None] = {}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE_ROOT):
            code = frame.f_code
            seen.setdefault((os.path.relpath(code.co_filename, PACKAGE_ROOT), code.co_name, code.co_firstlineno))

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return list(seen)


def is_named(name: str) -> bool:
    """Whether a code object is a function a newcomer follows: comprehensions, generator expressions and lambdas
    (``<listcomp>``, ``<genexpr>``, ``<lambda>``, ...) are part of the function that encloses them."""
    return not name.startswith("<")


def summary(functions: list[tuple[str, str, int]]) -> dict:
    """The figures of one trace: every code object that ran (``functions``, ``files``, ``functions_by_file``) and the
    named functions only (``named``: the same three figures)."""
    files = Counter(filename for filename, _, _ in functions)
    named_files = Counter(filename for filename, name, _ in functions if is_named(name))
    return {
        "functions": len(functions),
        "files": len(files),
        "functions_by_file": dict(files.most_common()),
        "named": {
            "functions": sum(named_files.values()),
            "files": len(named_files),
            "functions_by_file": dict(named_files.most_common()),
        },
        "listing": [f"{filename}:{line} {name}" for filename, name, line in functions],
    }


def _trainer() -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return Trainer(model, loss_func=nn.MSELoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def _dataset() -> TensorDataset:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def measure() -> dict:
    """Both figures: ``{"save": summary, "resume": summary}``."""
    streams = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = open(os.devnull, "w")  # the progress bar and printed metrics, not the figures
    try:
        with tempfile.TemporaryDirectory() as folder:
            trainer = _trainer()
            trainer.train(_dataset(), num_epochs=1, per_device_batch_size=8)
            save = traced(lambda: trainer.save_training_state(folder))
            fresh = set(traced(lambda: _trainer().train(_dataset(), num_epochs=2, per_device_batch_size=8)))
            resumed = traced(
                lambda: _trainer().train(_dataset(), num_epochs=2, per_device_batch_size=8, resume_from=folder)
            )
    finally:
        sys.stdout.close()
        sys.stdout, sys.stderr = streams
    return {"save": summary(save), "resume": summary([function for function in resumed if function not in fresh])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the functions, in the order they first ran")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    results = measure()
    for what, figures in results.items():
        by_file = ", ".join(f"{name} {count}" for name, count in figures["functions_by_file"].items())
        print(f"{what}: {figures['functions']} functions in {figures['files']} files ({by_file})")
        named = figures["named"]
        by_file = ", ".join(f"{name} {count}" for name, count in named["functions_by_file"].items())
        print(f"{what}, named functions only: {named['functions']} in {named['files']} files ({by_file})")
        if args.list:
            print("\n".join(f"    {line}" for line in figures["listing"]))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
