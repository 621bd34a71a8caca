"""The CPU time each test takes, the processes it starts included (the warm launcher's forks too, which ``time`` and
``RUSAGE_CHILDREN`` miss): a pytest plugin that reads a cgroup's CPU time (cgroup v1 ``cpuacct``) around each test.
Run the suite on one worker inside a cgroup of its own (root, Linux):

    mkdir /sys/fs/cgroup/cpuacct/suite
    sh -c 'echo $$ > /sys/fs/cgroup/cpuacct/suite/cgroup.procs; exec env CPU_CGROUP=/sys/fs/cgroup/cpuacct/suite \
        CPU_BY_TEST=cpu.json PYTHONPATH=tests/scripts PYTHONDONTWRITEBYTECODE= .venv/bin/python -m pytest -n 0 \
        -p cpu_by_test'

``CPU_BY_TEST`` receives ``[[test id, CPU seconds, wall seconds], ...]``, rewritten after each test. Other jobs on the
machine do not count: only the cgroup's processes do.
"""

from __future__ import annotations

import json
import os
import time

import pytest


def _cgroup_cpu_s() -> float:
    with open(os.path.join(os.environ["CPU_CGROUP"], "cpuacct.usage")) as usage:
        return int(usage.read()) / 1e9


_rows: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cgroup_cpu_s(), time.monotonic()
    yield
    _rows.append([item.nodeid, round(_cgroup_cpu_s() - cpu, 3), round(time.monotonic() - wall, 3)])
    with open(os.environ["CPU_BY_TEST"], "w") as output:
        json.dump(_rows, output)
