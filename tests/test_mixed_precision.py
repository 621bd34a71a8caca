"""Mixed precision: bf16 on the CPU, the precision from the environment, and the errors.

Accelerate sets the mixed precision once per process (a singleton that refuses another one later), so each
precision trains in a fresh process: ``tests/scripts/mixed_precision_run.py``, which writes what it saw as JSON,
forked from the warm launcher's interpreter (tests/conftest.py ``launcher``), which imported torch and Accelerate
but set nothing up.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Optional

import pytest
from conftest import launcher, linear_dataset, make_linear, make_trainer

SCRIPT = Path(__file__).resolve().parent / "scripts" / "mixed_precision_run.py"


def run_in_fresh_process(tmp_path: Path, precision: str, environment_precision: Optional[str] = None) -> dict:
    """Run the script with ``mixed_precision=precision`` ("none": None), and ``ACCELERATE_MIXED_PRECISION`` if given."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ACCELERATE_")}
    if environment_precision is not None:
        env["ACCELERATE_MIXED_PRECISION"] = environment_precision
    output = tmp_path / "result.json"
    completed = subprocess.run(
        [*launcher(1), str(SCRIPT), str(output), precision], env=env, capture_output=True, text=True, timeout=240
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(output.read_text())


def assert_trains_in_float32_losses(result: dict) -> None:
    """The loss went down, and what the trainer logged are Python floats of float32 losses."""
    train_losses = result["logged"]["train_loss_epoch"]
    assert train_losses[-1] < 0.5 * train_losses[0]
    assert len(result["logged"]["eval_loss_epoch"]) == 4 and len(result["logged"]["evaluation_loss"]) == 1
    assert result["logged_types"] == ["float"]
    assert result["loss_dtypes"] == ["torch.float32"]  # Accelerate returns the model outputs in float32
    assert result["output_dtypes"] == ["torch.float32"]
    assert result["parameter_dtypes"] == ["torch.float32"]  # the weights stay float32; only compute is bf16


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> dict:
    """What a fresh process saw with Trainer(mixed_precision="bf16"), shared by the tests that read it."""
    return run_in_fresh_process(tmp_path_factory.mktemp("bf16"), "bf16")


@pytest.mark.slow
def test_bf16_on_cpu_autocasts(bf16_run):
    """bf16 on the CPU autocasts, and logs float32 losses."""
    result = bf16_run

    assert "error" not in result
    assert result["mixed_precision"] == "bf16"
    assert result["hidden_dtypes"] == ["torch.bfloat16"]  # the forward pass really ran under bf16 autocast
    assert_trains_in_float32_losses(result)


@pytest.mark.slow
def test_none_takes_environment_precision(tmp_path):
    """mixed_precision=None takes the precision from the environment."""
    result = run_in_fresh_process(tmp_path, "none", environment_precision="bf16")

    assert result["mixed_precision"] == "bf16"
    assert result["hidden_dtypes"] == ["torch.bfloat16"]
    assert_trains_in_float32_losses(result)


@pytest.mark.slow
def test_explicit_precision_wins(tmp_path):
    """An explicit mixed_precision wins over the environment."""
    result = run_in_fresh_process(tmp_path, "no", environment_precision="bf16")

    assert result["mixed_precision"] == "no"
    assert result["hidden_dtypes"] == ["torch.float32"]
    assert_trains_in_float32_losses(result)


@pytest.mark.slow
def test_second_trainer_keeps_precision(bf16_run):
    """A second trainer keeps the precision of the process."""
    result = bf16_run

    assert result["second_trainer_mixed_precision"] == "bf16"  # mixed_precision=None: what the process has
    assert re.search(
        r"Trainer\(mixed_precision='no'\) differs from the mixed precision Accelerate was already set up with in this "
        r"process \('bf16'\); Accelerate cannot change it once set",
        result["change_error"],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision, environment_precision, message",
    [
        (
            "fp16",
            None,
            r"^mixed_precision='fp16' needs a GPU \(or another accelerator\), but this process runs on the CPU",
        ),
        (
            "none",
            "fp16",
            r"^mixed_precision='fp16' \(from ACCELERATE_MIXED_PRECISION: accelerate launch or the environment\) "
            r"needs a GPU",
        ),
    ],
    ids=["argument", "environment"],
)
def test_fp16_on_cpu_is_a_clear_error(tmp_path, precision, environment_precision, message):
    # Accelerate alone accepts fp16 on the CPU, then neither autocasts nor scales: a float32 run labelled fp16
    """fp16 on the CPU is a clear error that leaves the process usable."""
    result = run_in_fresh_process(tmp_path, precision, environment_precision)

    assert re.search(message, result["error"])
    assert "Use mixed_precision='bf16' on the CPU, or 'no'." in result["error"]
    assert result["mixed_precision"] == "bf16"  # the script's next Trainer could still choose its precision
    assert result["hidden_dtypes"] == ["torch.bfloat16"]


@pytest.mark.slow
@pytest.mark.skipif(
    any(importlib.util.find_spec(backend) is not None for backend in ("transformer_engine", "msamp", "torchao")),
    reason="an fp8 backend is installed",
)
def test_fp8_without_backend_is_an_error(tmp_path):
    """fp8 without a backend is an error that leaves the process usable (Accelerate's error: its second backend is
    MS-AMP up to 1.15, torchao from 1.16)."""
    result = run_in_fresh_process(tmp_path, "fp8")

    assert re.search(
        r"Using `fp8` precision requires `transformer_engine` or `(MS-AMP|torchao)` to be installed", result["error"]
    )
    assert result["mixed_precision"] == "bf16"


def test_unknown_precision_names_choices():
    """An unknown mixed_precision names the choices."""
    with pytest.raises(
        ValueError,
        match=r"^mixed_precision='fp64' is not valid: choose one of \('no', 'bf16', 'fp16', 'fp8'\) "
        r"\(or a name of another trainer for them: \[.*\]\), or None to take",
    ):
        make_trainer(make_linear(), mixed_precision="fp64")


def test_other_precision_refused_in_process():
    """Another precision than the process has is refused, in process."""
    first = make_trainer(make_linear())  # sets Accelerate up in this process, if no test has yet
    first.train(linear_dataset(16), num_epochs=1)
    current = first.run_config.mixed_precision
    other = "bf16" if current != "bf16" else "no"

    with pytest.raises(
        ValueError,
        match=(
            rf"^Trainer\(mixed_precision='{other}'\) differs from the mixed precision Accelerate was already set up "
            rf"with in this process \('{current}'\); Accelerate cannot change it once set\. Use one mixed precision "
            r"per process, or set it for the whole run with `accelerate launch --mixed_precision \.\.\.`"
        ),
    ):
        make_trainer(make_linear(), mixed_precision=other)

    same = make_trainer(make_linear(), mixed_precision=current)  # the process's own precision is accepted
    same.train(linear_dataset(16), num_epochs=1)
    assert same.run_config.mixed_precision == current
