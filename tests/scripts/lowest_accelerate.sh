#!/bin/sh
# The accelerate-dependent tests against the oldest Accelerate the package allows: the lower bound of setup.cfg's
# install_requires, read from there, installed alone (no dependencies) in a side folder, .venv/lowest-accelerate,
# that goes first on the path of the test run and of every process it starts, over .venv's newer Accelerate (torch,
# the package, the test tools and what Accelerate itself requires are .venv's): no second environment, no second
# torch to install. The main suite runs against the newest Accelerate pip finds; CI runs this after it (the README's
# test command). See docs/versions.md.
#
# Usage: sh tests/scripts/lowest_accelerate.sh [pytest arguments]
set -eu
cd "$(dirname "$0")/../.."

. tests/scripts/setup_cfg_version.sh
lowest=$(setup_cfg_version accelerate ">=" install_requires)
# pip found no release newer than the lower bound: the main suite just ran against it, which is the whole range
if .venv/bin/python -c "import sys, accelerate; from packaging.version import Version as V
sys.exit(V(accelerate.__version__) != V('$lowest'))" 2>/dev/null; then
    echo "lowest_accelerate.sh: the main suite ran against accelerate $lowest, the lower bound: nothing more to test"
    exit 0
fi
# inside .venv's folder, which git, ruff and tests/test_lint.py's walk of the checkout skip
side=.venv/lowest-accelerate
.venv/bin/pip install -q --no-compile --no-deps --upgrade --target "$PWD/$side" "accelerate==$lowest"
export PYTHONPATH="$PWD/$side${PYTHONPATH:+:$PYTHONPATH}"
# the side folder's Accelerate, its version and the folder it is imported from, or stop
.venv/bin/python -c "import sys, accelerate; from packaging.version import Version as V
if V(accelerate.__version__) != V('$lowest') or not accelerate.__file__.startswith('$PWD/$side/'):
    sys.exit(f'lowest_accelerate.sh: imported accelerate {accelerate.__version__} from {accelerate.__file__}')"

# what depends on Accelerate: no private state outside accelerate_internals.py, 2 processes equal 1, accumulation,
# exact resume (the shuffled order of a resumed epoch), FSDP2 on the CPU, and the process and precision set-up
PYTHONDONTWRITEBYTECODE= exec .venv/bin/python -m pytest "$@" \
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
