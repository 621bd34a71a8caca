"""What one training step runs: the package's functions called over one accumulation window, traced.

A window is everything between the end of one optimizer update and the end of the next: the zero_grad and the
events after the second update, then two micro-batches (gradient accumulation 2), the clipping and the update. The
trace runs ``sys.setprofile`` from inside the optimizer's ``step`` (the second window of a small run), so it sees
exactly what a newcomer must read to follow a step: every function of ``--package`` that runs, by file.

    .venv/bin/python benchmarks/step_trace.py                    # no callbacks, then the default callbacks
    .venv/bin/python benchmarks/step_trace.py --list             # the functions too, in the order they first ran
    .venv/bin/python benchmarks/step_trace.py --package pytorch_accelerated   # the same window in another trainer

It prints one line per configuration: distinct functions, files, calls and the lines of those functions (their
source spans), and ``--json`` writes the figures. The trace counts Python functions only; torch and Accelerate's
own calls are left out (``--all`` counts every Python call in the window, whoever defined it).
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
    """Records the calls made between the end of the second optimizer update and the end of the third (a window in
    the steady state: what runs once per run, such as the first lookup of an event's listeners, is left out)."""

    def __init__(self, package_root: str, count_all: bool):
        self.package_root, self.count_all = package_root, count_all
        self.calls: Counter = Counter()
        self.all_calls = 0
        self.updates = 0

    def profile(self, frame, event, arg):
        if event != "call":
            return
        self.all_calls += 1
        code = frame.f_code
        if code.co_filename.startswith(self.package_root):
            self.calls[(code.co_filename, code.co_name, code.co_firstlineno)] += 1

    def optimizer_stepped(self) -> None:
        """Called at the end of each ``optimizer.step()``: the second starts the trace, the third ends it."""
        self.updates += 1
        if self.updates == 2:
            sys.setprofile(self.profile)
        elif self.updates == 3:
            sys.setprofile(None)

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


def traced_optimizer(trace: WindowTrace, parameters):
    class TracedSGD(torch.optim.SGD):
        def step(self, closure=None):
            result = super().step(closure)
            trace.optimizer_stepped()
            return result

    return TracedSGD(parameters, lr=0.01)


def run(package: str, callbacks: str, count_all: bool) -> tuple[dict, list]:
    module = importlib.import_module(package)
    root = os.path.dirname(module.__file__) + os.sep
    trainer_module = importlib.import_module(f"{package}.trainer")
    trace = WindowTrace(root, count_all)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    kwargs = {} if callbacks == "default" else {"callbacks": []}
    optimizer = traced_optimizer(trace, model.parameters())
    trainer = trainer_module.Trainer(model, loss_func=nn.MSELoss(), optimizer=optimizer, **kwargs)
    x = torch.randn(64, 8)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
    streams = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = open(os.devnull, "w")  # the progress bar and printed metrics, not the figures
    try:
        trainer.train(dataset, num_epochs=1, per_device_batch_size=4, gradient_accumulation_steps=2)
    finally:
        sys.stdout.close()
        sys.stdout, sys.stderr = streams
    assert trace.updates >= 3, "the run made fewer than three updates: no whole window was traced"
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
