"""What one training step runs: the package's functions called over one accumulation window, traced.

A window is two micro-batches (gradient accumulation 2), the clipping, the update and the events around them. A
callback marks it: the trace runs ``sys.setprofile`` from its ``on_train_step_start`` at the first micro-batch of the
third window to the same event at the fourth window's (the steady state: what runs once per run, such as the first
lookup of an event's listeners, is left out). The callback is one a user could write, so the dispatch of an event
that has a listener is counted too, as in every real run. The trace sees exactly what a newcomer must read to follow
a step: every function of ``--package`` that runs, by file.

    .venv/bin/python benchmarks/step_trace.py                    # no callbacks, then the default callbacks
    .venv/bin/python benchmarks/step_trace.py --list             # the functions too, in the order they first ran
    .venv/bin/python benchmarks/step_trace.py --package pytorch_accelerated   # the same window in another trainer

It prints one line per configuration (``none``: the marking callback alone; ``default``: the default callbacks and
it): distinct functions, files, calls and the lines of those functions (their source spans), and ``--json`` writes
the figures. The trace counts Python functions only; torch and Accelerate's own calls are left out (``--all`` counts
every Python call in the window, whoever defined it).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
from collections import Counter

import torch
from torch import nn
from torch.utils.data import TensorDataset


class WindowTrace:
    """Records the calls made from the start of the first micro-batch of one accumulation window to the start of the
    next window's (``TRACED_WINDOW``, in the steady state), as a callback marks them."""

    #: The window traced, from 0: the third, whose first micro-batch is ``TRACED_WINDOW * ACCUMULATION``.
    TRACED_WINDOW = 2

    def __init__(self, package_root: str, count_all: bool):
        self.package_root, self.count_all = package_root, count_all
        self.calls: Counter = Counter()
        self.all_calls = 0
        self.micro_batches = 0

    def profile(self, frame, event, arg):
        if event != "call":
            return
        self.all_calls += 1
        code = frame.f_code
        if code.co_filename.startswith(self.package_root):
            self.calls[(code.co_filename, code.co_name, code.co_firstlineno)] += 1

    def micro_batch_starts(self) -> None:
        """Called by the marking callback as each micro-batch starts: the traced window's first starts the trace, the
        next window's first ends it."""
        first = self.TRACED_WINDOW * ACCUMULATION
        if self.micro_batches == first:
            sys.setprofile(self.profile)
        elif self.micro_batches == first + ACCUMULATION:
            sys.setprofile(None)
        self.micro_batches += 1

    def summary(self) -> dict:
        files = Counter()
        lines = 0
        for filename, _, first_line in self.calls:
            files[os.path.relpath(filename, self.package_root)] += 1
            lines += _function_lines(filename, first_line)
        return {
            "functions": len(self.calls),
            "files": len(files),
            "calls": sum(self.calls.values()),
            "lines": lines,
            "functions_by_file": dict(files.most_common()),
            "all_python_calls": self.all_calls,
        }


def _function_lines(filename: str, first_line: int) -> int:
    """The source lines of the function starting at ``first_line`` of ``filename`` (decorators and docstring
    included)."""
    with open(filename) as file:
        source = file.readlines()
    block = inspect.getblock(source[first_line - 1 :])
    return len(block)


#: The micro-batches of a window.
ACCUMULATION = 2


def window_marker(package: str, trace: WindowTrace):
    """A callback of ``package``, as a user writes one, that tells ``trace`` where each micro-batch starts."""
    base = importlib.import_module(f"{package}.callbacks").TrainerCallback

    class MarkWindow(base):
        def on_train_step_start(self, trainer, **kwargs):
            trace.micro_batch_starts()

    return MarkWindow()


def run(package: str, callbacks: str, count_all: bool) -> tuple[dict, list]:
    module = importlib.import_module(package)
    root = os.path.dirname(module.__file__) + os.sep
    trainer_module = importlib.import_module(f"{package}.trainer")
    trace = WindowTrace(root, count_all)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    others = list(trainer_module.DEFAULT_CALLBACKS) if callbacks == "default" else []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = trainer_module.Trainer(
        model, loss_func=nn.MSELoss(), optimizer=optimizer, callbacks=[*others, window_marker(package, trace)]
    )
    x = torch.randn(64, 8)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
    streams = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = open(os.devnull, "w")  # the progress bar and printed metrics, not the figures
    try:
        trainer.train(dataset, num_epochs=1, per_device_batch_size=4, gradient_accumulation_steps=ACCUMULATION)
    finally:
        sys.setprofile(None)
        sys.stdout.close()
        sys.stdout, sys.stderr = streams
    assert trace.micro_batches > (trace.TRACED_WINDOW + 1) * ACCUMULATION, "the run ended before the traced window"
    listing = [
        f"{os.path.relpath(filename, root)}:{first_line} {name} x{count}"
        for (filename, name, first_line), count in trace.calls.items()
    ]
    return trace.summary(), listing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", default="pytorch_accel_trainer")
    parser.add_argument("--callbacks", choices=["none", "default", "both"], default="both")
    parser.add_argument("--list", action="store_true", help="list the functions, in the order they first ran")
    parser.add_argument("--all", action="store_true", help="also count every Python call in the window")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    results = {}
    for callbacks in ("none", "default") if args.callbacks == "both" else (args.callbacks,):
        summary, listing = run(args.package, callbacks, args.all)
        results[callbacks] = summary
        by_file = ", ".join(f"{name} {count}" for name, count in summary["functions_by_file"].items())
        print(
            f"{args.package}, callbacks={callbacks}: {summary['functions']} functions in {summary['files']} files, "
            f"{summary['calls']} calls, {summary['lines']} lines ({by_file}); "
            f"every Python call: {summary['all_python_calls']}"
        )
        if args.list:
            print("\n".join(f"    {line}" for line in listing))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
