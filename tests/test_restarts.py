"""Jobs that torchrun restarts itself: a process lost mid-run, then the restarted attempt resumes, bit for bit.

Each job is ``torchrun --nproc_per_node 2 --max-restarts 2`` with nothing in the environment but the CPU (no
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``, no ``TORCHELASTIC_USE_AGENT_STORE``): one process dies in the first attempt,
torchrun restarts both, and the restarted attempt must connect (pytorch issue #135712: with torch's defaults it often
fails, "Gloo connectFullMesh failed ... Connection refused", or hangs), resume from the last training state and end
with the weights of an uninterrupted run. The agents are torchrun's own; the processes they start, restarted ones
included, are forked warm with the environment each agent gives them (``torchrun_with_warm_processes``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import CPU_PROCESSES_ENV, assert_bitwise_equal, torchrun_with_warm_processes

from pytorch_accel_trainer.parallel import restarts

SCRIPT = Path(__file__).parent / "scripts" / "restart_run.py"

#: what would keep each attempt's store apart without the trainer: the test must pass without them
WORKAROUNDS = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCHELASTIC_USE_AGENT_STORE")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


#: how torchrun meets its processes, which process is lost, where and how, and the state (its epoch and updates) the
#: restarted attempt resumes from (saves every 2 updates, 6 updates an epoch): the three rendezvous a one-machine job
#: can have (torchrun's default, a c10d store on a free port; --standalone; the static one of --master_port), each
#: agent's store shared by every attempt
JOBS = {
    "default-rank1-sigkill": ([], {"rank": 1, "epoch": 2, "step": 3, "how": "sigkill"}, ("step_8", 2, 8)),
    "standalone-rank1-exit": (["--standalone"], {"rank": 1, "epoch": 1, "step": 4, "how": "exit"}, ("step_4", 1, 4)),
    "static-rank0-sigkill": (
        ["--master_port", "FREE"],
        {"rank": 0, "epoch": 3, "step": 1, "how": "sigkill"},
        ("step_12", 3, 12),  # taken at the end of epoch 2: the run continues with epoch 3
    ),
}


def _torchrun(launch: list, config: dict) -> subprocess.CompletedProcess:
    launch = [str(_free_port()) if argument == "FREE" else argument for argument in launch]
    command = [
        *torchrun_with_warm_processes("--nproc_per_node", "2", "--max-restarts", "2", *launch),
        str(SCRIPT),
        json.dumps(config),
    ]
    env = {name: value for name, value in CPU_PROCESSES_ENV.items() if name not in WORKAROUNDS}
    # a session of its own, so that a job that hangs is ended with every process it started
    job = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = job.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        pytest.fail(f"the job hung (pytorch issue #135712 without the trainer's fix):\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("job", list(JOBS))
def test_lost_process_restarts_and_resumes_bitwise(tmp_path, job):
    """A process lost mid-run: torchrun restarts the job, which ends with exit 0 and an uninterrupted run's weights."""
    launch, kill, (state, epoch, updates) = JOBS[job]
    config = {
        "save_dir": str(tmp_path / "states"),
        "out": str(tmp_path / "out.pt"),
        "reference_out": str(tmp_path / "reference.pt"),
        "kill": kill,
    }
    started = time.monotonic()
    finished = _torchrun(launch, config)
    took = time.monotonic() - started
    assert finished.returncode == 0, f"exit {finished.returncode} after {took:.0f} s:\n{finished.stderr[-4000:]}"
    assert finished.stdout.count("finished in attempt 1") == 2, finished.stdout  # both processes, once restarted
    assert_bitwise_equal(
        torch.load(tmp_path / "out.pt", weights_only=True), torch.load(tmp_path / "reference.pt", weights_only=True)
    )
    # the restarted attempt says, once, that it resumes, and from where
    (line,) = [line for line in finished.stdout.splitlines() if line.startswith("Restart ")]
    assert line == (
        f"Restart 1 of at most 2 (torchrun --max-restarts): resuming from {tmp_path / 'states' / state}, "
        f"epoch {epoch}, after {updates} optimizer updates"
    )


def test_restarted_attempt_line(monkeypatch):
    """The line names the restart, torchrun's limit, the state, its epoch and updates; nothing on a first attempt."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restarts.describe_restarted_attempt("states/step_8", epoch=2, num_update_steps=8) is None  # no torchrun
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert restarts.describe_restarted_attempt("states/step_8", epoch=2, num_update_steps=8) is None  # first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restarts.describe_restarted_attempt("states/step_8", epoch=2, num_update_steps=8) == (
        "Restart 1 of at most 2 (torchrun --max-restarts): resuming from states/step_8, epoch 2, after 8 optimizer "
        "updates"
    )
    assert restarts.describe_restarted_attempt(None) == (
        "Restart 1 of at most 2 (torchrun --max-restarts): no training state was saved before, so the run starts "
        "again from the beginning"
    )


def _restarted_attempt_env(monkeypatch, **variables) -> None:
    """The environment torchrun's agent gives process 0 of restart 1 of a 2-process job on one machine."""
    defaults = {
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "GROUP_WORLD_SIZE": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
    }
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    for name, value in {**defaults, **variables}.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    ("variables", "obstacle"),
    [
        ({"GROUP_WORLD_SIZE": "2"}, "the job has 2 torchrun agents (nodes), each counting its restarts on its own"),
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed creates the process group itself and takes no store"),
    ],
    ids=["several-agents", "deepspeed"],
)
def test_says_what_to_set_where_it_cannot_separate_attempts(monkeypatch, variables, obstacle):
    """Where the trainer cannot give the attempt keys of its own, a restarted attempt warns, naming why and the fix,
    and leaves the process group to Accelerate."""
    _restarted_attempt_env(monkeypatch, **variables)
    monkeypatch.setattr(restarts, "_is_connected", lambda: False)  # this test process may have set Accelerate up
    with pytest.warns(RuntimeWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") as warned:
        restarts.prepare_restarted_attempt(cpu=False)
    message = str(warned[0].message)
    assert message.startswith("Restart 1 of at most 2 (torchrun --max-restarts): ")
    assert obstacle in message and "--rdzv-backend c10d" in message and "#135712" in message
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "variables",
    [
        {"TORCHELASTIC_RESTART_COUNT": "0"},  # the first attempt
        {"TORCHELASTIC_USE_AGENT_STORE": "False"},  # each attempt's first process makes a store of its own
        {"WORLD_SIZE": "1"},  # one process: no group to connect
    ],
    ids=["first-attempt", "own-store", "one-process"],
)
def test_nothing_to_do(monkeypatch, recwarn, variables):
    """Nothing is set up or said where no earlier attempt's keys can be read."""
    _restarted_attempt_env(monkeypatch, GROUP_WORLD_SIZE="2", **variables)  # would warn, if it got that far
    monkeypatch.setattr(restarts, "_is_connected", lambda: False)
    restarts.prepare_restarted_attempt(cpu=True)
    assert not recwarn.list and not torch.distributed.is_initialized()


def _elastic_agent(node: str, port: int, config: dict, is_host: bool) -> subprocess.Popen:
    """One torchrun agent (a "machine") of an elastic job of 1 to 2 nodes with one process each, on localhost."""
    rendezvous = f"is_host={str(is_host).lower()},last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"
    command = [
        *torchrun_with_warm_processes(
            *("--nnodes", "1:2", "--nproc_per_node", "1", "--max-restarts", "2", "--rdzv-backend", "c10d"),
            *("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--rdzv-conf", rendezvous),
        ),
        *(str(SCRIPT), json.dumps(config)),
    ]
    env = {name: value for name, value in CPU_PROCESSES_ENV.items() if name not in WORKAROUNDS}
    env["RESTART_RUN_NODE"] = node
    agent = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    if config["kill"].get("node") == node:
        Path(config["kill"]["agent_pid_file"]).write_text(str(agent.pid))  # the node's process kills its agent
    return agent


@pytest.mark.slow
@pytest.mark.distributed
def test_elastic_job_goes_on_with_the_node_left(tmp_path):
    """``--nnodes 1:2``: a node lost mid-run (its agent and process), the other restarts and finishes alone, resuming
    the 2-process state on 1 process (``allow_resume_changes=True``), each remaining sample trained once."""
    config = {
        "save_dir": str(tmp_path / "states"),
        "out": str(tmp_path / "out.pt"),
        "allow_resume_changes": True,
        "kill": {"node": "b", "epoch": 2, "step": 3, "how": "node", "agent_pid_file": str(tmp_path / "agent_b.pid")},
    }
    port = _free_port()
    # node a hosts the rendezvous (a store that must outlive node b), on the endpoint's port
    nodes = [_elastic_agent("a", port, config, is_host=True), _elastic_agent("b", port, config, is_host=False)]
    try:
        (stdout, stderr), _ = [node.communicate(timeout=150) for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
        pytest.fail(f"the elastic job hung:\n{nodes[0].communicate()[1][-4000:]}")
    assert nodes[1].returncode == -signal.SIGKILL  # node b's agent, lost with its process
    assert nodes[0].returncode == 0, stderr[-4000:]
    assert stdout.count("finished in attempt 1") == 1
    assert "The state was saved by 2 process(es) and resumes on 1" in stdout
    assert (
        f"Restart 1 of at most 2 (torchrun --max-restarts): resuming from {tmp_path / 'states' / 'step_8'}, epoch 2, "
        "after 8 optimizer updates"
    ) in stdout
    # 8 updates on 2 processes (6 in epoch 1, 2 of epoch 2: 8 of its 24 samples), then on 1 process with batches of
    # 2: the epoch's 16 samples left (8 updates) and epoch 3 (12)
    assert torch.load(tmp_path / "out.pt", weights_only=True)["updates"] == 8 + 8 + 12
