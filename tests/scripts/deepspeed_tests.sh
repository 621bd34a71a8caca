#!/bin/sh
# The DeepSpeed tests (tests/test_fsdp.py -k deepspeed: training, and training states under ZeRO 1, 2 and 3 on 1 and 2
# CPU processes; tests/test_layout_states.py -k deepspeed: examples/parallel_layouts.py under ZeRO 2 and 3) with DeepSpeed installed in a side folder, at the version of setup.cfg's `deepspeed` extra. Not in
# .venv itself: with DeepSpeed importable, Accelerate imports it in every run (accelerator.unwrap_model ->
# extract_model_from_parallel imports DeepSpeedEngine whenever DeepSpeed is installed), which costs each training
# process of the main suite 3.5 to 8 s more on 2 busy cores and prints DeepSpeed's "Setting accelerator to CPU"
# warning to stdout. CI runs this after the main suite (the README's test command). About 2 min on 2 cores (3 s of
# install with pip's cache, 16 s building DeepSpeed's wheel without it).
#
# Usage: sh tests/scripts/deepspeed_tests.sh [pytest arguments]
set -eu
cd "$(dirname "$0")/../.."

version=$(sed -n 's/^ *deepspeed==\([0-9][0-9.]*\).*/\1/p' setup.cfg)
if [ -z "$version" ]; then
    echo "setup.cfg has no 'deepspeed==X' line (its deepspeed extra) to take DeepSpeed's version from" >&2
    exit 1
fi
# inside .venv's folder, which git, ruff and tests/test_lint.py's walk of the checkout skip; DeepSpeed's own
# dependencies that .venv lacks (torch, numpy, pydantic, psutil, packaging, tqdm are there)
target="$PWD/.venv/deepspeed"
.venv/bin/pip install -q --no-compile --no-deps --upgrade --target "$target" -c constraints.txt \
    "deepspeed==$version" hjson ninja py-cpuinfo msgpack einops
PYTHONPATH="$target" PYTHONDONTWRITEBYTECODE= .venv/bin/python -m pytest -n 0 tests/test_fsdp.py \
    tests/test_layout_states.py -k deepspeed "$@"
