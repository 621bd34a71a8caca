"""Launches of the suite's scripts forked from an interpreter that already imported torch, Accelerate and the package
(and torchmetrics and transformers' models, OPTIONAL_IMPORTS), instead of new interpreters: a new one pays about 4.5 s
of CPU to import the first three (10 to 13 s of wall time on 2 busy cores), and a 2-process ``accelerate launch``
three times that (the launcher and each process), most of what a multi-process test took.

    python tests/scripts/warm_launch.py serve SOCKET [--deepspeed]       # the server (tests/conftest.py starts it)
    python -S tests/scripts/warm_launch.py SOCKET NUM_PROCESSES [--accelerate OPTIONS] [-u] \
        (SCRIPT | -m MODULE | -c CODE) [ARGUMENT ...]

The second command is a launch, and tests/conftest.py's ``launcher(n)`` its start: the suite's
``subprocess.run([*launcher(n), script, ...], env=..., cwd=...)`` calls run unchanged. The client (no imports but the
standard library's) hands its standard streams, environment, working folder and arguments to the server over the
Unix socket ``SOCKET``; the server forks a launch for it, which forks ``NUM_PROCESSES`` processes that each run the
target as ``__main__`` with what a new interpreter would have had (``-u``: unbuffered standard streams, as ``python
-u``); the client then exits as the launch ended.

What each process has, as under the real launch (``real_launcher`` of tests/conftest.py):

- the client's environment, working folder, standard streams and ``sys.argv``; ``sys.path`` starts with the script's
  folder (the working folder for ``-m``), then the client's ``PYTHONPATH``, then the interpreter's own folders;
- on several processes, the variables ``accelerate launch --multi_gpu --mixed_precision no --dynamo_backend no``
  sets (Accelerate's and torchrun's: ``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` of a TCP store the launch hosts, as
  torchrun's agent does, ...);
- the random state of a new interpreter (Python's, numpy's and torch's drawn from the OS), default
  signal handlers, and an interpreter exit as a script's end (threads joined, ``atexit`` functions, streams flushed).

How it ends, as under the real launch: one process's exit status is the launch's (a process killed by a signal: the
client kills itself with it); on several processes, 0 if every process exited 0, otherwise 1, once the first failed
process's siblings were ended (SIGTERM, then SIGKILL 30 s later, as torchrun does). The client killed (a test's
timeout, ``process.kill()``) kills every process of its launch at once; a signal of FORWARDED_SIGNALS sent to the
client goes to every process of its launch, as if sent to it.

DeepSpeed has a server of its own (``serve SOCKET --deepspeed``, tests/conftest.py's ``deepspeed_launcher``), started
in ``deepspeed_environment()`` (DeepSpeed's side folder first on ``PYTHONPATH``, ``TORCH_EXTENSIONS_DIR`` at the CPU op
it built): transformers decides as it is imported whether DeepSpeed is there, so the other server, which never imports
DeepSpeed (the other tests must not), cannot fork a DeepSpeed run. It imports DeepSpeed after torch and Accelerate and
before the rest (a new interpreter pays about 7 s of CPU for DeepSpeed, Accelerate, transformers and the package, and
``accelerate launch`` about 3 s), and loads DeepSpeed's CPU op for gloo's shared-memory collectives
(``deepspeed_shm_comm``), which DeepSpeed keeps per process: a forked process finds it loaded instead of running ninja
to find it built. Every launch of it is one of torchrun's agent, whatever its number of processes (torchrun's
variables, a TCP store, an exit status of 0 or 1), and ``--accelerate OPTIONS`` (``--use_deepspeed --zero_stage 2``)
gives each process what ``accelerate launch OPTIONS`` gives it, computed per launch by the installed Accelerate's own
parser and ``prepare_deepspeed_cmd_env`` from the client's environment and folder (its ``ACCELERATE_*`` variables, the
folder appended to ``PYTHONPATH``, and DEEPSPEED_IMPORT_ENV, which the launcher's ``import deepspeed`` set); empty
OPTIONS give what ``torchrun --nproc_per_node N`` gives. Its launches are also refused where they change one of
DEEPSPEED_READ_AT_IMPORT. What ``import deepspeed`` did before the fork, checked: it starts no thread; it detects the
accelerator once (``DS_ACCELERATOR``, the CPU here) and keeps it, with the server's memory as the CPU accelerator's
first ``max_memory_allocated``; its communication state (``deepspeed.comm``'s backend) is made only as a process sets
up its process group, after the fork; a process of an empty-OPTIONS launch lacks what ``import deepspeed`` sets
(``PYTORCH_NVML_BASED_CUDA_CHECK``), its import having run before; and a library's import that appends to ``sys.path``
(setuptools' vendored packages) leaves the processes' ``sys.path`` as a new interpreter starts with it.

A one-process launch can be the process of a real torchrun agent (``torchrun --no-python python -S warm_launch.py
SOCKET 1 SCRIPT ...``, tests/conftest.py's ``torchrun_with_warm_processes``): the agent's rendezvous, restarts
(``--max_restarts``: each attempt's processes are new clients), signals and exit statuses are torchrun's own, and
each process has the environment the agent gives it and, with ``-u``, the unbuffered output of torchrun's ``python
-u``. Its processes are not the agent's children (``os.getppid()``).

Not the same, so a test of these keeps ``real_launcher``: the launcher's own output and exit statuses (torchrun's
error report), its handling of signals sent to it, restarts, and a variable that torch, Python or a library reads
when it is imported (a launch whose environment changes one of READ_AT_IMPORT is refused with that message). And
what happens in C++ as an interpreter that started with the process finalises: the gloo exit race of
tests/test_exit.py aborted every new interpreter with the fix turned off, but no warm process (4 in 4, behind the
real agents, with the shim preloaded in a server of their own), so that test launches new interpreters.
"""

from __future__ import annotations

import gc
import io
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid

#: Variables (names, or the start of names) that Python, torch or the libraries it loads read as they start or are
#: imported: a launch that changes one cannot be forked from the server's imports. Not every variable torch reads:
#: torch itself sets some in the test process as it runs (KMP_DUPLICATE_LIB_OK, TORCH_WARM_POOL, ... as it compiles).
READ_AT_IMPORT = (
    "PYTHON",
    "PYTORCH_",
    "TORCH_LOGS",
    "TORCH_SHOW_CPP_STACKTRACES",
    "TORCH_COMPILE",
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "HF_",
    "TRANSFORMERS_",
)
#: What DeepSpeed (and mlflow, which its autotuner imports) read as they are imported, and where the DeepSpeed server
#: loaded DeepSpeed's CPU op from (``TORCH_EXTENSIONS_DIR``): refused in a launch of the DeepSpeed server that changes
#: one. ``DS_ACCELERATOR`` picks the accelerator, which ``import deepspeed`` detects once and keeps.
DEEPSPEED_READ_AT_IMPORT = (
    "DS_ACCELERATOR",
    "DEEPSPEED_TIMEOUT",
    "DISABLE_LOGS_WHILE_COMPILING",
    "LOGGER_METHODS_TO_EXCLUDE_FROM_DISABLE",
    "MLFLOW_",
    "TORCH_EXTENSIONS_DIR",
)
#: Those of them read when used: ``sys.path`` is made from ``PYTHONPATH`` for each process, and torch sets its
#: compiler's cache folder in the environment of the test process as it first compiles.
READ_WHEN_USED = {"PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR"}

#: What ``accelerate launch --multi_gpu --num_machines 1 --mixed_precision no --dynamo_backend no`` adds to the
#: environment of each process, besides torchrun's per-process variables (``_process_environment``): its
#: ``ACCELERATE_*`` variables, as the installed Accelerate's launch computes them (``_accelerate_launch_env``; they
#: differ between versions: 1.16 no longer sets ``ACCELERATE_DYNAMO_USE_DYNAMIC`` when it is not given).
ACCELERATE_ENV: dict = {}

#: What ``import deepspeed`` adds to the environment (``PYTORCH_NVML_BASED_CUDA_CHECK``, mlflow's telemetry session):
#: ``accelerate launch --use_deepspeed`` imports DeepSpeed before it copies its environment to its processes, so each
#: process of a DeepSpeed launch has them unless its client set them. Filled by the DeepSpeed server.
DEEPSPEED_IMPORT_ENV: dict = {}

#: How long a failed process's siblings have to end after SIGTERM before SIGKILL (torchrun's default).
TERMINATE_GRACE_S = 30

#: The signals a client hands on to the processes of its launch, as if sent to them: those torchrun's agent sends its
#: processes (SIGTERM as it stops them for a restart) or handles, and the trainer's preemption signals.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

#: How often a launch looks at its processes (accelerate launch's --monitor_interval, passed to torchrun's agent).
MONITOR_INTERVAL_S = 0.1


# ---------------------------------------------------------------------------------------------------------- client


def client(socket_path: str, num_processes: int, target: list) -> None:
    """Hand this process's streams, environment, folder and ``target`` to the server; exit as the launch ended."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + 600  # the server is importing torch on a busy machine
    while True:
        try:
            connection.connect(socket_path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                sys.exit(f"warm_launch: no server at {socket_path} after 600 s; its log: {socket_path}.log")
            time.sleep(0.05)
    options = target[1] if target[0] == "--accelerate" else None  # a DeepSpeed launch's accelerate launch options
    target = target[2:] if options is not None else target
    request = {"num_processes": num_processes, "target": target, "env": dict(os.environ), "cwd": os.getcwd()}
    request["accelerate_options"] = options
    # a process started with SIGINT ignored (a shell's background job, nohup) hands that on to a script run by plain
    # python; accelerate launch's workers get Python's handler whatever their launcher had
    request["sigint_ignored"] = (
        num_processes == 1 and options is None and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    )
    processes: list = []  # the pids of the launch's processes, once the server sent them
    received: list = []  # the signals received before that

    def forward(signum, frame):
        for pid in processes:
            _kill(pid, signum)
        if not processes:
            received.append(signum)

    for signum in FORWARDED_SIGNALS:
        if signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, forward)
    socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    replies = b""
    while True:
        while b"\n" not in replies:
            replies += _receive(connection, socket_path)
        line, replies = replies.split(b"\n", 1)
        ended = json.loads(line)
        if "pids" not in ended:
            break  # the last reply: how the launch ended
        processes.extend(ended["pids"])
        for signum in received:
            forward(signum, None)
    if ended.get("refused"):
        sys.exit(f"warm_launch: {ended['refused']}")
    if ended.get("signal"):
        if ended["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(ended["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), ended["signal"])
    sys.exit(ended["returncode"])


def _receive(connection: socket.socket, socket_path: str) -> bytes:
    chunk = connection.recv(4096)
    if not chunk:
        log = _tail(f"{socket_path}.log")
        sys.exit(f"warm_launch: the server ended during the launch; the end of its log:\n{log}")
    return chunk


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # it ended: its launch reports how


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as log:
            return log.read()[-3000:]
    except OSError as error:
        return str(error)


# ---------------------------------------------------------------------------------------------------------- server


def serve(socket_path: str, deepspeed: bool = False) -> int:
    """Import what every launch imports (with ``deepspeed``: DeepSpeed first, and its CPU op), then fork a launch per
    connection until standard input closes. Returns, in a launched process only, that process's exit status (``main``
    exits with it)."""
    started_path = list(sys.path)  # a new interpreter's (DeepSpeed's import appends setuptools' vendored packages)
    import accelerate  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401

    if deepspeed:  # before transformers, which decides as it is imported whether DeepSpeed is there
        _import_deepspeed()

    # Every run's first optimizer imports it (about 800 modules, sympy's included: 1 s of CPU per process). It sets
    # TORCHINDUCTOR_CACHE_DIR here to its default, read when used; each launch has its client's environment.
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401

    import pytorch_accel_trainer  # noqa: F401

    _import_optional_libraries()

    ACCELERATE_ENV.update(_accelerate_launch_env())
    gc.freeze()  # the launches share these objects unchanged: their collector leaves them be (fewer copied pages)
    imported_env = dict(os.environ)
    imported_pythonpath = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    own_path = [path for path in started_path[1:] if path not in imported_pythonpath]  # but this folder
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the launches reap themselves
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
            return 0  # the test session ended
        if listener in readable:
            connection, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                return _launch(connection, imported_env, own_path, deepspeed)
            connection.close()


#: What the suite's launched scripts import besides torch, Accelerate and the package, where installed (the test extra
#: has them): torchmetrics (the metric callbacks' scripts and examples: about 3 s of CPU per process on its own), and
#: transformers' Llama, GPT-2 and tensor-parallel plan (examples/parallel_layouts.py's 4-process launches,
#: benchmarks/memory_growth.py's rows: about 1.8 s per process). transformers reads HF_* and TRANSFORMERS_* as it is
#: imported (READ_AT_IMPORT).
OPTIONAL_IMPORTS = (
    "torchmetrics",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.distributed.tensor_parallel",
)


def _accelerate_launch_env() -> dict:
    """The ``ACCELERATE_*`` variables that the installed Accelerate's ``accelerate launch --multi_gpu --num_processes 2
    --num_machines 1 --mixed_precision no --dynamo_backend no`` gives each process (its own parser and
    ``prepare_multi_gpu_env``)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    arguments = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    args = launch_command_parser().parse_args([*arguments, "--dynamo_backend", "no", "script.py"])
    _validate_launch_command(args)
    return {name: value for name, value in prepare_multi_gpu_env(args).items() if name.startswith("ACCELERATE_")}


def _import_deepspeed() -> None:
    """Import DeepSpeed as ``accelerate launch --use_deepspeed`` and its processes do (DEEPSPEED_IMPORT_ENV: what that
    adds to the environment), and load its CPU op for gloo's shared-memory collectives as its torch backend does
    (``deepspeed.comm.torch.build_shm_op``): DeepSpeed keeps a loaded op for its process, so a forked process does not
    run ninja again to find the op built."""
    before = dict(os.environ)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    DEEPSPEED_IMPORT_ENV.update({name: value for name, value in os.environ.items() if before.get(name) != value})
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load()


def _accelerate_deepspeed_env(request: dict) -> dict:
    """The environment ``accelerate launch OPTIONS`` (``request["accelerate_options"]``: ``--use_deepspeed`` and its
    options) gives each of ``request["num_processes"]`` processes of one machine, from the client's environment and
    folder, as the installed Accelerate's launch computes it (its parser, ``launch_command``'s DeepSpeed fields,
    ``prepare_deepspeed_cmd_env``, ``deepspeed_launcher``'s NCCL variables): ``ACCELERATE_*`` variables, and the
    launch's folder appended to ``PYTHONPATH``. Run in a launch's own process: it sets that process's environment and
    folder to the client's, as the real launcher has them."""
    import shlex

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import check_cuda_p2p_ib_support
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    os.environ.clear()
    os.environ.update({**DEEPSPEED_IMPORT_ENV, **request["env"]})  # the launcher imported DeepSpeed
    os.chdir(request["cwd"])
    options = [*shlex.split(request["accelerate_options"]), "--num_processes", str(request["num_processes"])]
    args, defaults, mixed_precision_from_config = _validate_launch_command(
        launch_command_parser().parse_args([*options, "script.py"])
    )
    fields = list(defaults.deepspeed_config.keys()) if defaults else []
    fields += ["mixed_precision"] if mixed_precision_from_config else []
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    if not check_cuda_p2p_ib_support():
        env.setdefault("NCCL_P2P_DISABLE", "1")
        env.setdefault("NCCL_IB_DISABLE", "1")
    return env


def _import_optional_libraries() -> None:
    import importlib

    for name in OPTIONAL_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # not installed (or transformers 4, without transformers.distributed): imported when used
            pass


def _launch(connection: socket.socket, imported_env: dict, own_path: list, deepspeed: bool) -> int:
    """Run one launch: fork its processes, wait for them, tell the client how it ended. In a forked process, returns
    that process's exit status; in the launch itself, exits."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    while not message.endswith(b"\n"):
        message += connection.recv(1 << 20)
    request = json.loads(message)
    refused = _refusal(request, imported_env, deepspeed)
    if refused is None and request["accelerate_options"]:
        try:
            request["launch_env"] = _accelerate_deepspeed_env(request)
        except (Exception, SystemExit) as error:  # noqa: BLE001 - the launch's options, refused as accelerate would
            refused = f"accelerate launch {request['accelerate_options']} fails: {type(error).__name__}: {error}"
    if refused is not None:
        connection.sendall(json.dumps({"refused": refused}).encode() + b"\n")
        os._exit(0)
    num_processes = request["num_processes"]
    request["error_folder"] = tempfile.mkdtemp(prefix="torchelastic_")  # where torchrun's processes report errors
    # plain torchrun of one machine without --master_port: a c10d rendezvous on localhost, a run id of its own
    request["run_id"] = str(uuid.uuid4()) if request["accelerate_options"] == "" else "none"
    # torchrun's agent starts the processes of the DeepSpeed server's launches (accelerate launch's), one included
    port_pipes = [os.pipe() for _ in range(num_processes)] if num_processes > 1 or deepspeed else []
    children = {}
    for rank in range(num_processes):
        pid = os.fork()
        if pid == 0:
            connection.close()
            port = None
            if port_pipes:
                for index, (read_end, write_end) in enumerate(port_pipes):
                    os.close(write_end)
                    if index != rank:
                        os.close(read_end)
                with os.fdopen(port_pipes[rank][0]) as port_pipe:
                    port = port_pipe.read()
            return _run_process(request, fds, rank, port, own_path)
        children[pid] = rank
    for fd in fds:
        os.close(fd)
    try:
        connection.sendall(json.dumps({"pids": list(children)}).encode() + b"\n")  # for the client to signal them
    except OSError:
        pass  # the client was killed: _wait kills them
    store = None
    if port_pipes:
        from torch.distributed import TCPStore

        # the store of torchrun's agent, which every process joins as a client (TORCHELASTIC_USE_AGENT_STORE)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        for read_end, write_end in port_pipes:
            os.close(read_end)
            os.write(write_end, str(store.port).encode())
            os.close(write_end)
    ended = _wait(children, connection, under_agent=bool(port_pipes))
    try:
        connection.sendall(json.dumps(ended).encode() + b"\n")
    except OSError:
        pass  # the client was killed
    shutil.rmtree(request["error_folder"], ignore_errors=True)
    os._exit(0)


def _refusal(request: dict, imported_env: dict, deepspeed: bool):
    """Why the server cannot fork ``request``'s launch (a message naming what to use instead), or None."""
    if deepspeed != (request["accelerate_options"] is not None):
        return (
            "the DeepSpeed server forks DeepSpeed launches only (deepspeed_launcher of tests/conftest.py), the other "
            "server none (launcher)"
            if deepspeed
            else "a launch with accelerate launch options needs the DeepSpeed server: deepspeed_launcher "
            "(tests/conftest.py)"
        )
    if request["accelerate_options"] and "--use_deepspeed" not in request["accelerate_options"].split():
        return (
            f"the DeepSpeed server's accelerate launch options {request['accelerate_options']!r} lack "
            "--use_deepspeed: give them, or none for torchrun's processes"
        )
    read_at_import = READ_AT_IMPORT + DEEPSPEED_READ_AT_IMPORT if deepspeed else READ_AT_IMPORT
    env = {**DEEPSPEED_IMPORT_ENV, **request["env"]} if deepspeed else request["env"]
    changed = sorted(
        name
        for name in set(env) | set(imported_env)
        if name.startswith(read_at_import) and name not in READ_WHEN_USED and env.get(name) != imported_env.get(name)
    )
    if changed:
        return (
            f"the launch's environment changes {changed}, read as torch, Python or DeepSpeed start, which the warm "
            "launcher imported before: launch with real_launcher or accelerate_launch (tests/conftest.py)"
        )
    return None


def _wait(children: dict, connection: socket.socket, under_agent: bool) -> dict:
    """Wait for the processes ``children`` (pid: rank), looking at them every MONITOR_INTERVAL_S as torchrun's agent
    does; end the others once one failed, and every one at once if the client died. Returns how the launch ended:
    ``{"returncode": ...}`` or ``{"signal": ...}``, as the client must end: ``under_agent`` (processes that torchrun's
    agent would have started), 0 or 1 as accelerate launch exits."""
    statuses: dict = {}
    terminated_at = None
    while len(statuses) < len(children):
        if select.select([connection], [], [], MONITOR_INTERVAL_S)[0] and not connection.recv(1, socket.MSG_PEEK):
            _signal_all(children, statuses, signal.SIGKILL)  # the client was killed: so is its launch
        while len(statuses) < len(children):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            statuses[pid] = status
        failed = any(os.WIFSIGNALED(status) or os.WEXITSTATUS(status) != 0 for status in statuses.values())
        if failed and terminated_at is None:
            terminated_at = time.monotonic()
            _signal_all(children, statuses, signal.SIGTERM)
        elif terminated_at is not None and time.monotonic() - terminated_at > TERMINATE_GRACE_S:
            _signal_all(children, statuses, signal.SIGKILL)
    if under_agent:
        return {"returncode": int(any(status != 0 for status in statuses.values()))}
    (status,) = statuses.values()
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    return {"returncode": os.WEXITSTATUS(status)}


def _signal_all(children: dict, statuses: dict, signum: int) -> None:
    for pid in children:
        if pid not in statuses:
            _kill(pid, signum)


def _process_environment(request: dict, rank: int, port) -> dict:
    """The environment of process ``rank``: the client's, and on several processes what the real launch adds; of the
    DeepSpeed server's launches, on any number of processes, torchrun's variables, and what ``accelerate launch
    --use_deepspeed ...`` adds where the launch has accelerate launch options (``launch_env``)."""
    env = dict(request.get("launch_env") or request["env"])
    num_processes = request["num_processes"]
    if num_processes > 1 or request["accelerate_options"] is not None:
        if request["accelerate_options"] is None:
            env.update(ACCELERATE_ENV)
        if num_processes > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            ROLE_RANK=str(rank),
            ROLE_NAME="default",
            WORLD_SIZE=str(num_processes),
            LOCAL_WORLD_SIZE=str(num_processes),
            GROUP_WORLD_SIZE="1",
            ROLE_WORLD_SIZE=str(num_processes),
            MASTER_ADDR="127.0.0.1" if request["accelerate_options"] != "" else "localhost",
            MASTER_PORT=port,
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_RUN_ID=request["run_id"],
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
            TORCHELASTIC_ERROR_FILE=os.path.join(request["error_folder"], "attempt_0", str(rank), "error.json"),
        )
    return env


def _run_process(request: dict, fds: list, rank: int, port, own_path: list) -> int:
    """Become process ``rank`` of the launch and run its target as ``__main__``, as ``python SCRIPT``, ``python -m
    MODULE`` or ``python -c CODE`` do (it stays ``sys.modules["__main__"]`` until the interpreter exits); return its
    exit status."""
    import builtins
    import random
    import runpy
    import traceback
    import types

    import numpy as np
    import torch

    for target_fd, fd in enumerate(fds):
        os.dup2(fd, target_fd)
        os.close(fd)
    os.environ.clear()
    os.environ.update(_process_environment(request, rank, port))
    os.chdir(request["cwd"])
    target = request["target"]
    if target[0] == "-u":  # as python -u: what a process writes goes out at once, also just before a SIGKILL
        target = target[1:]
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), sys.stdout.encoding, write_through=True)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), sys.stderr.encoding, "backslashreplace", write_through=True
        )
    option = target[0] if target[0] in ("-m", "-c") else None
    first = os.path.dirname(os.path.abspath(target[0])) if option is None else os.getcwd() if option == "-m" else ""
    sys.path[:] = [first, *(path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path), *own_path]
    sys.argv = list(target) if option is None else ["-c", *target[2:]] if option == "-c" else target[1:]
    random.seed()
    np.random.seed()
    torch.seed()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN if request.get("sigint_ignored") else signal.default_int_handler)
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    try:
        if option == "-m":
            runpy._run_module_as_main(target[1])  # what python -m runs, in sys.modules["__main__"]
        else:
            if option == "-c":
                code = compile(target[1], "<string>", "exec")
            else:
                with open(target[0], "rb") as source:
                    code = compile(source.read(), target[0], "exec")
                main_module.__dict__.update(__file__=target[0], __cached__=None)
            main_module.__dict__["__builtins__"] = builtins
            exec(code, main_module.__dict__)
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            return exit.code or 0
        print(exit.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - what an interpreter prints for an uncaught exception
        traceback.print_exc()
        return 1
    return 0


def main(argv: list) -> int:
    if argv[0] == "serve":
        return serve(argv[1], deepspeed=argv[2:] == ["--deepspeed"])
    client(argv[0], int(argv[1]), argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
