"""Tiny real fixtures: y = 2x + 3 data, small models, and a callback that records every event."""

from __future__ import annotations

import atexit
import gc
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile

# The suite runs on the CPU on every machine, one with a GPU included: its tests compare with tensors made on the CPU
# and test what the CPU does (fp16 refused, bitwise resume), so that it passes, with the same results, everywhere. What
# only a GPU shows is benchmarks/gpu_checks/. Set before torch initialises CUDA; the scripts the tests launch inherit
# it. PYTORCH_ACCEL_TRAINER_TESTS_ON_GPU=1 leaves the GPU visible, to see what the suite finds there (CONTRIBUTING.md).
if os.environ.get("PYTORCH_ACCEL_TRAINER_TESTS_ON_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch
from filelock import FileLock
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import EVENTS, TrainerCallback


def pytest_report_header(config):
    """CI's log says which torch and accelerate the suite ran against (setup.cfg declares the tested range)."""
    import accelerate

    return f"pytorch_accel_trainer tested with torch {torch.__version__}, accelerate {accelerate.__version__}"


#: The test files that take longest on 2 CPU cores, longest first: pytest-xdist (--dist loadfile) hands out whole files
#: in this order, then the other files with slow or distributed tests, then the rest, so that no long file starts last
#: and keeps one core busy after the other ran out of work. First the file whose tests start the shared 2-process
#: launch of the scenarios (``two_process_scenarios``), which the tests that read it wait for. Measured as the sum of
#: a file's --durations with -n 2 on a busy machine (test_tune.py 129 s, test_streams.py 90 s, ... test_distributed.py
#: 26 s); mypy and inductor's first compile as on a fresh clone, with no cache (about 40 s each). Refresh it when a
#: file's time changes by much.
LONGEST_FILES = (
    "test_callbacks_distributed.py",
    "test_tune.py",
    "test_streams.py",
    "test_restarts.py",
    "test_resume_processes.py",
    "test_notebooks.py",
    "test_benchmarks.py",
    "test_fsdp.py",  # 37 s on one worker (43 s of CPU), its DeepSpeed launches forked (deepspeed_launcher)
    "test_exit.py",
    "test_docs_code.py",
    "test_multi_node.py",
    "test_async_save.py",
    "test_sharded_state.py",
    "test_training_state.py",
    "test_lint.py",
    "test_resume_resize.py",
    "test_compile.py",
    "test_resume_checks.py",
    "test_cli.py",
    "test_warm_launch.py",
    "test_distributed.py",
)


def _start_rank(item) -> int:
    """The files of LONGEST_FILES first, in its order, then those of the other slow or distributed tests, the rest."""
    name = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    if name in LONGEST_FILES:
        return LONGEST_FILES.index(name)
    return len(LONGEST_FILES) + (0 if item.get_closest_marker("slow") or item.get_closest_marker("distributed") else 1)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n auto --dist loadfile``, set in pyproject.toml) the longest files start first (see
    LONGEST_FILES): xdist hands the files out in the order of their first test. The sort is stable: a file's tests keep
    their order. A run without workers keeps the order of the files."""
    if hasattr(config, "workerinput"):  # a worker's collection: the controller schedules in its order
        items.sort(key=_start_rank)


# One intra-op thread per test process, and in the processes the tests start (unless OMP_NUM_THREADS is set): the
# suite runs one test process per core, so a second thread only waits for a core, spinning. The GAN example's
# test took 4 times longer with two threads on 2 cores, and up to 50 s while the other core ran a test.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

#: The environment of a multi-process test: gloo on the CPU, one thread per process (the machine has 2 cores).
CPU_PROCESSES_ENV = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}


def _benchmark_launch():
    return load_module_from(pathlib.Path(__file__).parents[1] / "benchmarks" / "launch.py", "benchmark_launch")


def real_launcher(num_processes: int) -> list:
    """The start of a command that runs a script (appended, with its arguments) on ``num_processes`` new interpreters:
    ``accelerate launch`` for several, plain ``python`` for one. For the tests of the launch itself (the launcher's
    output and exit status, restarts, a rank's death that the launcher must handle, the environment a launch gives):
    the others use ``launcher``."""
    return _benchmark_launch().new_interpreters(num_processes)


def accelerate_launch(num_processes: int, *mode: str) -> list:
    """The real ``accelerate launch`` of ``num_processes`` CPU processes in ``mode`` (e.g. ``--use_deepspeed
    --zero_stage 2``), as ``real_launcher`` spells it."""
    return _benchmark_launch().accelerate_launch(num_processes, *mode)


#: Forks the suite's launches from an interpreter that already imported torch, Accelerate and the package.
WARM_LAUNCH_SCRIPT = pathlib.Path(__file__).parent / "scripts" / "warm_launch.py"

#: This test process's warm launchers (their servers and sockets), by kind ("plain", "deepspeed"), each started by
#: its first launch.
_warm_servers: dict = {}


def launcher(num_processes: int) -> list:
    """The start of a command that runs a script (appended, with its arguments; ``-m MODULE`` for a module) on
    ``num_processes`` processes as ``real_launcher``'s command does (the same environment, arguments, streams, exit
    status), but forked from an interpreter that already imported torch, Accelerate and the package (the warm
    launcher, tests/scripts/warm_launch.py, which says what differs): a new interpreter pays about 4.5 s of CPU for
    those imports (10 to 13 s of wall time on 2 busy cores). Its first call starts this test process's warm
    launcher."""
    return [sys.executable, "-S", str(WARM_LAUNCH_SCRIPT), _warm_socket("plain", CPU_PROCESSES_ENV), str(num_processes)]


def deepspeed_launcher(num_processes: int, *options: str) -> list:
    """The start of a command that runs a script (appended, with its arguments) on ``num_processes`` processes as
    ``accelerate_launch(num_processes, *options)`` does (``options``: ``--use_deepspeed`` and DeepSpeed's, e.g.
    ``--zero_stage 2``; run with ``deepspeed_environment()``): the environment the installed Accelerate's launch gives
    its processes, computed by its own parser, on any number of processes; without ``options``, as ``python -m
    torch.distributed.run --nproc_per_node N`` does (torchrun's variables alone). Forked from a second warm launcher,
    started in ``deepspeed_environment()`` by the first call, that imported DeepSpeed (before transformers, which
    decides at import whether DeepSpeed is there) and its CPU op besides what ``launcher``'s imports. A new
    interpreter pays about 7 s of CPU to import DeepSpeed, Accelerate, transformers and the package, and the launcher
    about 3 s. Skips the test where DeepSpeed is not installed (``deepspeed_environment``)."""
    socket_path = _warm_socket("deepspeed", deepspeed_environment(), "--deepspeed")
    return [
        sys.executable,
        "-S",
        str(WARM_LAUNCH_SCRIPT),
        socket_path,
        str(num_processes),
        "--accelerate",
        " ".join(options),
    ]


def _warm_socket(kind: str, env: dict, *serve_options: str) -> str:
    """The socket of this test process's warm launcher of ``kind``, started in ``env`` (with ``serve_options``) if it
    is not yet."""
    if kind not in _warm_servers:
        folder = tempfile.mkdtemp(prefix=f"warm-launch-{kind}-")
        socket_path = os.path.join(folder, "socket")
        with open(f"{socket_path}.log", "wb") as log:
            server = subprocess.Popen(
                [sys.executable, str(WARM_LAUNCH_SCRIPT), "serve", socket_path, *serve_options],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        _warm_servers[kind] = socket_path
        atexit.register(_stop_warm_server, server, folder)
    return _warm_servers[kind]


def torchrun_with_warm_processes(*options: str) -> list:
    """The start of a command that runs a script (appended, with its arguments) under a real torchrun agent,
    ``python -m torch.distributed.run`` with ``options``, whose processes are warm launches (``launcher(1)``): the
    agent is the real one (its rendezvous, restarts, signals and exit status, what the tests of restarts and of
    several agents test), and each process it starts, first or restarted, is a client of the warm launcher that
    hands on the environment the agent gives it (``RANK``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ...),
    forwards the signals the agent sends it (SIGTERM as it stops a failed attempt) and ends as its forked process
    ended, signal included. A worker's environment that changes a variable read at import (``OMP_NUM_THREADS`` other
    than this suite's 1, ...) is refused, naming it. Its output is unbuffered, as under torchrun's ``python -u``."""
    return [sys.executable, "-m", "torch.distributed.run", *options, "--no-python", *launcher(1), "-u"]


#: where tests/scripts/install_deepspeed_aside.sh installs DeepSpeed (the README's test command runs it first),
#: resolved: torch's build of DeepSpeed's CPU op records its sources' paths, and builds it again where they change (a
#: checkout whose .venv links to another's)
DEEPSPEED_ASIDE = (pathlib.Path(__file__).resolve().parents[1] / ".venv" / "deepspeed").resolve()


def deepspeed_environment() -> dict:
    """The environment of a DeepSpeed launch: DeepSpeed's side folder first on the path, and the CPU op the install
    script built there (skips the test, naming the script that installs it, where neither it nor an importable
    DeepSpeed is there)."""
    if (DEEPSPEED_ASIDE / "deepspeed").is_dir():
        path = os.pathsep.join(filter(None, [str(DEEPSPEED_ASIDE), os.environ.get("PYTHONPATH")]))
        extensions = str(DEEPSPEED_ASIDE / "torch_extensions")
        return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": extensions}
    pytest.importorskip(
        "deepspeed", reason="DeepSpeed is optional: sh tests/scripts/install_deepspeed_aside.sh installs it aside"
    )
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def benchmark_environment() -> dict:
    """The environment of a benchmark script's smoke run (tests/test_benchmarks.py, tests/test_gpu_checks.py): the
    processes it starts are forked from the warm launcher (``BENCHMARK_LAUNCHER``, benchmarks/launch.py), as a smoke
    run checks what they do, not their start-up. The scripts hide the GPU from what they measure, and so did the warm
    launcher's imports, unless the suite runs with the GPU visible (``PYTORCH_ACCEL_TRAINER_TESTS_ON_GPU=1``), where
    they start new interpreters."""
    env = dict(os.environ)
    if env.get("CUDA_VISIBLE_DEVICES") == "":
        env["BENCHMARK_LAUNCHER"] = shlex.join(launcher(1)[:-1])  # its command, less the number of processes
    return env


def _stop_warm_server(server: subprocess.Popen, folder: str) -> None:
    """End the warm launcher as its test process ends (it also ends when its standard input closes)."""
    server.stdin.close()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    shutil.rmtree(folder, ignore_errors=True)


#: Runs the scenarios of the multi-process tests one after the other, in one launch per number of processes.
SCENARIOS_SCRIPT = pathlib.Path(__file__).parent / "scripts" / "scenarios.py"


class ScenarioLaunch:
    """What one launch of ``tests/scripts/scenarios.py`` left: a folder per scenario (see that script), and how the
    launch ended. Each accessor fails the test that asks, with the launch's or the scenario's error, if either failed.
    """

    def __init__(self, root: pathlib.Path, num_processes: int):
        self.root, self.num_processes = root, num_processes
        self.launch = json.loads((root / "launch.json").read_text())

    def folder(self, scenario: str) -> pathlib.Path:
        """The folder of ``scenario``, which ran to its end on every process."""
        errors = self.errors(scenario)
        if errors:
            pytest.fail(
                f"scenario {scenario!r} raised on {len(errors)} of {self.num_processes} processes:\n"
                + "\n".join(errors)
            )
        return self.root / scenario

    def errors(self, scenario: str) -> list:
        """The tracebacks of ``scenario``, one per process it raised on (the launch itself exited 0)."""
        if self.launch["returncode"] != 0:
            pytest.fail(self._launch_failure(), pytrace=False)
        ended = self._ended(scenario)
        if len(ended) != self.num_processes:
            pytest.fail(
                f"scenario {scenario!r} did not run on {self.num_processes} processes (it ended on {ended}): name it "
                "in the test's @pytest.mark.scenarios(...), and give it arguments for that number of processes in "
                "SCENARIOS (tests/scripts/scenarios.py)",
                pytrace=False,
            )
        return [(self.root / scenario / name).read_text() for name in ended if name.startswith("error")]

    def _ended(self, scenario: str) -> list:
        """The ``done.rank<i>`` and ``error.rank<i>`` files of the processes that ended ``scenario``."""
        return sorted(
            path.name for path in (self.root / scenario).glob("*.rank*") if path.name.startswith(("done", "error"))
        )

    def _launch_failure(self) -> str:
        """The launch's exit status and stderr, and what each scenario it left unfinished printed to stderr (where a
        hung scenario's watchdog writes every thread's traceback)."""
        message = (
            f"the {self.num_processes}-process launch of the scenarios exited {self.launch['returncode']}: "
            f"{self.launch['command']}\n{self.launch['stderr']}"
        )
        for folder in sorted(path for path in self.root.iterdir() if path.is_dir()):
            if len(self._ended(folder.name)) != self.num_processes:
                printed = "".join(path.read_text()[-3000:] for path in sorted(folder.glob("stderr.rank*")))
                message += (
                    f"\n--- scenario {folder.name!r} did not end on every process; it printed to stderr:\n{printed}"
                )
        return message

    def read_json(self, scenario: str, name: str = "result.json"):
        """The JSON file ``name`` that ``scenario`` wrote."""
        return json.loads((self.folder(scenario) / name).read_text())

    def printed(self, scenario: str, stream: str = "stdout") -> str:
        """What every process printed to ``stream`` (``"stdout"`` or ``"stderr"``) during ``scenario``, by rank."""
        folder = self.folder(scenario)
        return "".join((folder / f"{stream}.rank{rank}").read_text() for rank in range(self.num_processes))


def _launch_scenarios(request, tmp_path_factory, num_processes: int) -> ScenarioLaunch:
    """Launch the scenarios the session's tests name (``@pytest.mark.scenarios``) on ``num_processes`` processes,
    once for all the test processes of the session: the first to get here launches while the others wait on a file
    lock, then reuse what it left (pytest-xdist's recipe for a session fixture shared by its workers)."""
    names = {name for item in request.session.items for mark in item.iter_markers("scenarios") for name in mark.args}
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder, which holds each worker's
    root = shared / f"scenarios-{num_processes}-processes"
    with FileLock(f"{root}.lock"):
        if not (root / "launch.json").exists():
            root.mkdir(exist_ok=True)
            command = [*launcher(num_processes), str(SCENARIOS_SCRIPT), str(root), *sorted(names)]
            # under pytest-timeout's 300 s: the launch's end is recorded, for every test to fail with, not retried
            try:
                completed = subprocess.run(command, env=CPU_PROCESSES_ENV, capture_output=True, text=True, timeout=270)
                returncode, stderr = completed.returncode, completed.stderr[-5000:]
            except subprocess.TimeoutExpired as error:
                returncode, stderr = "killed after 270 s", (error.stderr or b"")[-5000:].decode(errors="replace")
            launch = {"command": " ".join(command), "returncode": returncode, "stderr": stderr}
            (root / "launch.json").write_text(json.dumps(launch))
    return ScenarioLaunch(root, num_processes)


@pytest.fixture(scope="session")
def one_process_scenarios(request, tmp_path_factory) -> ScenarioLaunch:
    """The session's scenarios of tests/scripts/scenarios.py on one process (the references of the 2-process ones)."""
    return _launch_scenarios(request, tmp_path_factory, 1)


@pytest.fixture(scope="session")
def two_process_scenarios(request, tmp_path_factory) -> ScenarioLaunch:
    """The session's scenarios of tests/scripts/scenarios.py on 2 processes, in one ``accelerate launch``."""
    return _launch_scenarios(request, tmp_path_factory, 2)


def load_module_from(path, name: str):
    """The module of the Python file at ``path``, imported under ``name`` (a file outside any package: an example,
    a helper beside the data it serves)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def linear_dataset(num_samples: int = 64, seed: int = 0) -> TensorDataset:
    """Samples of y = 2x + 3 (exactly learnable by nn.Linear(1, 1))."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 1, generator=generator)
    return TensorDataset(x, 2 * x + 3)


def regression_dataset(num_samples: int = 20, num_features: int = 4, seed: int = 0) -> TensorDataset:
    """A small nonlinear regression problem for equivalence tests."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, num_features, generator=generator)
    y = (x**2).sum(dim=1, keepdim=True) + torch.randn(num_samples, 1, generator=generator) * 0.1
    return TensorDataset(x, y)


def classification_dataset(num_samples: int = 30, seed: int = 0) -> TensorDataset:
    """Two classes: is the point above the line y = x? (30 samples: batches of 8 leave a last batch of 6.)"""
    generator = torch.Generator().manual_seed(seed)
    points = torch.randn(num_samples, 2, generator=generator)
    return TensorDataset(points, (points[:, 1] > points[:, 0]).long())


def make_mlp(num_features: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(num_features, 8), nn.Tanh(), nn.Linear(8, 1))


def make_linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(1, 1)


class StreamDataset(IterableDataset):
    """The samples of a TensorDataset, streamed in order, with no __len__."""

    def __init__(self, dataset: TensorDataset):
        self.dataset = dataset

    def __iter__(self):
        for index in range(len(self.dataset)):
            yield self.dataset[index]


class RecordingCallback(TrainerCallback):
    """Records the name of every event it receives, in order."""

    def __init__(self):
        self.events: list[str] = []


def _recorder(event):
    def record(self, trainer, **kwargs):
        self.events.append(event)

    return record


for _event in EVENTS:
    setattr(RecordingCallback, _event, _recorder(_event))


def assert_bitwise_equal(a, b) -> None:
    """Tensors (and nested dicts/lists of them) equal bit for bit, dtypes included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_bitwise_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_bitwise_equal(x, y)
    else:
        assert a == b


def make_trainer(
    model: nn.Module, lr: float = 0.1, callbacks=(), trainer_class=Trainer, loss_func=None, **kwargs
) -> Trainer:
    """A ``trainer_class`` of ``model`` with SGD at ``lr`` and ``loss_func`` (MSELoss by default)."""
    return trainer_class(
        model=model,
        loss_func=nn.MSELoss() if loss_func is None else loss_func,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        callbacks=callbacks,
        **kwargs,
    )


@pytest.fixture
def recorder() -> RecordingCallback:
    return RecordingCallback()


@pytest.fixture
def sharded_layout(monkeypatch):
    """States written in this test on one process are sharded ones (DCP's shards and ``.metadata``), as several
    processes write them: the properties of that layout checked without launching processes."""
    from pytorch_accel_trainer.state import parts
    from pytorch_accel_trainer.state.files import SHARDED

    monkeypatch.setattr(parts, "layout_of", lambda processes, content=None: SHARDED)


#: What botocore needs to talk to a local S3 endpoint (moto accepts any credentials).
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="module")
def s3_endpoint():
    """A real S3 endpoint on localhost, moto's server in a thread (as s3fs's own tests start one), with the bucket
    ``states-bucket``; skipped without s3fs and moto's server (moto[s3], flask and flask-cors: the test extra installs
    them). fsspec finds it from its config in this process, from ``FSSPEC_S3_ENDPOINT_URL`` (with ``S3_ENV``) in a
    launched one."""
    import logging
    import socket

    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")
    server_module = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved_env, saved_conf = dict(os.environ), fsspec.config.conf.get("s3")
    os.environ.update(S3_ENV)
    fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    fsspec.filesystem("s3", skip_instance_cache=True).makedirs("states-bucket", exist_ok=True)  # moto keeps buckets
    try:
        yield endpoint
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        if saved_conf is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved_conf
        server.stop()


@pytest.fixture
def no_gc():
    """The garbage collector off for the test (collected once first): what a step keeps alive is not freed behind
    the test's back."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
