"""The multi-process tests' scenarios, run one after the other in one launch, so that the suite starts its processes
once per number of processes instead of once per test: a 2-process ``accelerate launch`` costs about 10 s of CPU
before any training (the launcher and each process import torch, Accelerate and the package), most of what such a
test took. tests/conftest.py launches it once per test session (``one_process_scenarios``, ``two_process_scenarios``)
with the scenarios the collected tests name (``@pytest.mark.scenarios``); each test then reads its scenario's folder.

    python tests/scripts/scenarios.py OUTPUT_DIR [NAME ...]                              # the 1-process scenarios
    ACCELERATE_USE_CPU=1 accelerate launch --num_processes 2 tests/scripts/scenarios.py OUTPUT_DIR [NAME ...]

Runs the scenarios of SCENARIOS named (all of them when none is) that have arguments for its number of processes, in
the order of SCENARIOS, each into ``OUTPUT_DIR/<name>/``. There each process leaves ``stdout.rank<i>`` and
``stderr.rank<i>``, all it printed during the scenario (file descriptors 1 and 2), then ``done.rank<i>``, or
``error.rank<i>`` (the traceback) if the scenario raised on it: the next scenarios still run. Each scenario starts
from the random state of a fresh process. One that hangs (a process waiting for another that raised) ends the launch
after SCENARIO_TIMEOUT_S, with every thread's traceback in its ``stderr.rank<i>``.

A scenario that needs another Accelerate set-up per process (mixed precision, FSDP, another ``ACCELERATE_*``
variable) or that tests the launch itself or a process's death keeps a launch of its own: it cannot share these.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/, after this folder: conftest, test_schedulers

import console_run  # noqa: E402
import distributed_callbacks  # noqa: E402
import distributed_dataloader  # noqa: E402
import distributed_eval  # noqa: E402
import distributed_step_metrics  # noqa: E402
import distributed_trackers  # noqa: E402
import distributed_train  # noqa: E402
import distributed_utils  # noqa: E402
import extra_models_run  # noqa: E402
import predict_run  # noqa: E402
import test_schedulers  # noqa: E402

SCENARIO_TIMEOUT_S = 120  # each takes under 15 s on 2 busy cores; conftest gives the whole launch 270 s

# name: (function, {number of processes: its keyword arguments}), in the order they run. Each function's first argument
# is its folder. The scenarios of one test compare 1 and 2 processes with the same global batch.
SCENARIOS = {
    # first: its decorators are called before anything else sets Accelerate up, as in a script that prepares its data
    "process_decorators": (distributed_utils.process_decorators, {2: {}}),
    "callbacks_stop_together": (
        distributed_callbacks.stop_together,
        {1: {"per_device_batch_size": 8}, 2: {"per_device_batch_size": 4}},
    ),
    "train_samples": (distributed_train.train_into, {1: {"per_device_batch_size": 8}, 2: {"per_device_batch_size": 4}}),
    "train_samples_accumulated": (distributed_train.train_into, {1: {"per_device_batch_size": 4, "accumulation": 2}}),
    "train_tokens": (
        distributed_train.train_into,
        {
            1: {"per_device_batch_size": 8, "loss_kind": "tokens"},
            2: {"per_device_batch_size": 4, "loss_kind": "tokens"},
        },
    ),
    "train_tokens_accumulated": (
        distributed_train.train_into,
        {1: {"per_device_batch_size": 4, "accumulation": 2, "loss_kind": "tokens"}},
    ),
    "train_tokens_unweighted": (
        distributed_train.train_into,
        {1: {"per_device_batch_size": 4, "accumulation": 2, "loss_kind": "tokens_unweighted"}},
    ),
    # one process: tests/test_train_api.py runs it in its own process
    "stop_in_last_epoch": (distributed_callbacks.stop_in_last_epoch, {2: {"per_device_batch_size": 2}}),
    "evaluate_every_case": (distributed_eval.evaluate_every_case, {1: {}, 2: {}}),
    "predict_every_case": (predict_run.predict_every_case, {2: {}}),
    "console_output": (console_run.train, {1: {}, 2: {}}),
    "dataloader_shards": (distributed_dataloader.train, {1: {"batch_size": 8}, 2: {"batch_size": 4}}),
    "extra_model": (extra_models_run.train, {1: {"batch_size": 8}, 2: {"batch_size": 4}}),
    "extra_model_reference": (extra_models_run.train, {2: {"batch_size": 4, "save_dir": "states"}}),
    "extra_model_crashed": (extra_models_run.train, {2: {"batch_size": 4, "save_dir": "states", "crash_after": 5}}),
    # after extra_model_crashed: resumes from the training states it saved (and saves its own there)
    "extra_model_resumed": (
        extra_models_run.train,
        {2: {"batch_size": 4, "save_dir": "../extra_model_crashed/states"}},
    ),
    "wsd_schedule": (
        test_schedulers.train_wsd_on_processes,
        {1: {"per_device_batch_size": 4, "accumulation": 1}, 2: {"per_device_batch_size": 1, "accumulation": 2}},
    ),
    "tracker_records": (distributed_trackers.average_records, {2: {}}),
    "tracker_run_name": (distributed_trackers.share_run_name, {2: {}}),
    "step_metrics": (distributed_step_metrics.mean_over_samples, {2: {}}),
}

FRESH_TORCH_SEED = torch.initial_seed()  # what torch draws from in a fresh process


def _start_from_fresh_random_state() -> None:
    """The random state of a fresh process: Python's and numpy's drawn from the OS, torch's default seed."""
    random.seed()
    np.random.seed()
    torch.manual_seed(FRESH_TORCH_SEED)


@contextlib.contextmanager
def _printed_into(folder: Path, rank: int):
    """Send what this process prints (file descriptors 1 and 2: Python, tqdm, C++ and the watchdog) into ``folder``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(folder / f"stdout.rank{rank}", "wb") as out, open(folder / f"stderr.rank{rank}", "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)


def run_scenario(name: str, folder: Path, rank: int, num_processes: int) -> None:
    """Run scenario ``name`` in ``folder`` on this process; record its traceback there if it raises."""
    function, arguments = SCENARIOS[name]
    folder.mkdir(parents=True, exist_ok=True)
    environ, cwd = dict(os.environ), os.getcwd()
    _start_from_fresh_random_state()
    try:
        with _printed_into(folder, rank):
            faulthandler.dump_traceback_later(SCENARIO_TIMEOUT_S, exit=True)
            try:
                function(folder, **arguments[num_processes])
            finally:
                faulthandler.cancel_dump_traceback_later()
    except Exception:
        (folder / f"error.rank{rank}").write_text(traceback.format_exc())
        print(f"scenario {name} raised on process {rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    else:
        (folder / f"done.rank{rank}").touch()
    finally:
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)


def main(output_dir: str, names: list) -> None:
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"no scenario named {unknown} in tests/scripts/scenarios.py; the scenarios: {list(SCENARIOS)}")
    # read from the launcher's variables: the first scenario must be the first to set Accelerate up
    rank, num_processes = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    for name, (_, arguments) in SCENARIOS.items():
        if num_processes in arguments and (not names or name in names):
            run_scenario(name, Path(output_dir) / name, rank, num_processes)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
