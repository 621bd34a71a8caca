#!/bin/sh
# The accelerate-dependent tests against the oldest Accelerate the package allows: the lower bound of setup.cfg's
# install_requires, read from there, in a second environment. The main suite runs against the newest Accelerate pip
# finds; CI runs this after it (the README's test command). About 55 s from nothing on 2 cores (20 s of install,
# 34 s of tests). See docs/versions.md.
#
# Usage: sh tests/scripts/lowest_accelerate.sh [pytest arguments]
set -eu
cd "$(dirname "$0")/../.."

lowest=$(sed -n 's/^ *accelerate>=\([0-9][0-9.]*\).*/\1/p' setup.cfg)
if [ -z "$lowest" ]; then
    echo "setup.cfg's install_requires has no 'accelerate>=X' line to take the lowest Accelerate from" >&2
    exit 1
fi
# pip found no release newer than the lower bound: the main suite just ran against it, which is the whole range
if .venv/bin/python -c "import sys, accelerate; from packaging.version import Version as V
sys.exit(V(accelerate.__version__) != V('$lowest'))" 2>/dev/null; then
    echo "lowest_accelerate.sh: the main suite ran against accelerate $lowest, the lower bound: nothing more to test"
    exit 0
fi
# inside .venv's folder, which git, ruff and tests/test_lint.py's walk of the checkout skip (they would read all of
# torch anywhere else), and which `python3 -m venv .venv` leaves alone
venv=.venv/lowest-accelerate
python3 -m venv "$venv"
"$venv/bin/pip" install -q -U pip  # the pip of `python3 -m venv` (23.2) takes three times as long to resolve
# --no-compile, then PYTHONDONTWRITEBYTECODE= below: Python compiles what the tests import, not all of torch (README)
"$venv/bin/pip" install -q --no-compile -c constraints.txt torch
"$venv/bin/pip" install -q --no-compile -c constraints.txt -e . "accelerate==$lowest" pytest pytest-xdist pytest-timeout

# what depends on Accelerate: no private state outside accelerate_internals.py, 2 processes equal 1, accumulation,
# exact resume (the shuffled order of a resumed epoch), FSDP2 on the CPU, and the process and precision set-up
PYTHONDONTWRITEBYTECODE= exec "$venv/bin/python" -m pytest "$@" \
    tests/test_accelerate_versions.py \
    tests/test_distributed.py::test_two_processes_equal_one \
    tests/test_distributed.py::test_one_process_set_up_under_launch \
    tests/test_accumulation.py \
    tests/test_training_state.py::test_crash_then_resume_is_bitwise_equal \
    tests/test_fsdp.py::test_fsdp2_trains_like_ddp \
    tests/test_fsdp.py::test_fsdp2_checkpoint_is_plain \
    tests/test_fsdp.py::test_fsdp2_resume_equals_uninterrupted \
    tests/test_mixed_precision.py::test_fp16_on_cpu_is_a_clear_error \
    tests/test_mixed_precision.py::test_second_trainer_keeps_precision
