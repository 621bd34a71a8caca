#!/bin/sh
# DeepSpeed, at the version of setup.cfg's `deepspeed` extra, installed in a side folder (.venv/deepspeed) that
# tests/test_fsdp.py puts on the path of its DeepSpeed launches only (they skip, naming this script, without it).
# Not in .venv itself: with DeepSpeed importable, Accelerate imports it in every run (accelerator.unwrap_model ->
# extract_model_from_parallel imports DeepSpeedEngine whenever DeepSpeed is installed), which costs each training
# process of the suite 3.5 to 8 s more on 2 busy cores and prints DeepSpeed's "Setting accelerator to CPU" warning
# to stdout.
#
# It needs only torch in .venv: the README's test command runs it beside the install of the test extra (`&`, then
# `wait`), so that its build (below, about 45 s of one core) takes the core pip leaves idle.
#
# Usage: sh tests/scripts/install_deepspeed_aside.sh
set -eu
cd "$(dirname "$0")/../.."

. tests/scripts/setup_cfg_version.sh
version=$(setup_cfg_version deepspeed "==" "deepspeed extra")
# inside .venv's folder, which git, ruff and tests/test_lint.py's walk of the checkout skip; DeepSpeed's own
# dependencies that the test extra does not bring (it brings torch, numpy, pydantic, psutil, packaging, tqdm)
.venv/bin/pip install -q --no-compile --no-deps --upgrade --target "$PWD/.venv/deepspeed" -c constraints.txt \
    "deepspeed==$version" hjson ninja py-cpuinfo msgpack einops

# DeepSpeed on the CPU builds its shared-memory collectives (the C++ op deepspeed_shm_comm, against this torch, with
# the machine's C++ compiler and ninja) the first time a process sets up its communication: about 60 s of CPU, which
# every other DeepSpeed process of the suite waited on under torch's build lock (one test took 100 s of a 10-minute
# run). Built here, once per install, into the side folder, where conftest's deepspeed_environment points DeepSpeed's
# launches (TORCH_EXTENSIONS_DIR). Where this fails, so would DeepSpeed's launches.
# Importing DeepSpeed to build it needs dependencies that the test extra brings to .venv; that install may be writing
# them at this moment, so the build imports its own copies, from a folder removed after (about 5 s).
build_deps="$PWD/.venv/deepspeed-build-deps"
rm -rf "$build_deps"
.venv/bin/pip install -q --no-compile --no-deps --target "$build_deps" -c constraints.txt \
    numpy pydantic pydantic-core annotated-types typing-inspection typing-extensions psutil packaging tqdm
TORCH_EXTENSIONS_DIR="$PWD/.venv/deepspeed/torch_extensions" PYTHONPATH="$PWD/.venv/deepspeed:$build_deps" \
    .venv/bin/python -c '
from deepspeed.comm.torch import build_shm_op
if build_shm_op() is None:
    print("DeepSpeed has no shared-memory op to build on this machine")
'
rm -rf "$build_deps"
