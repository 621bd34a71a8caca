"""Layouts of Accelerate's ParallelismConfig (docs/scaling.md, "Layouts"): FSDP2 x tensor parallel and HSDP train like
one process, each tensor-parallel group reads one batch, each sample is trained, evaluated and predicted once.

The layout runs share one 4-process CPU launch and one of 2 processes for tensor parallelism alone
(``tests/scripts/layouts_run.py``: about 20 s and 10 s on 2 cores); the layout object and the errors are checked in
this process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
from types import SimpleNamespace

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from conftest import launcher
from torch import nn

from pytorch_accel_trainer.parallel.layout import (
    Layout,
    keep_model_group_leaders,
    layout_of,
    parallelism_config_from,
    validate_layout_on_cpu,
)
from pytorch_accel_trainer.parallel.sharded import apply_transformers_tensor_parallel_plan

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "layouts_run.py"
TIMEOUT_S = 300


def _launch(output: pathlib.Path, processes: int, runs: tuple, **variables: str) -> dict:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", **variables}
    completed = subprocess.run(
        [*launcher(processes), str(SCRIPT), str(output)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return {
        run: [json.loads((output / f"{run}.rank{rank}.json").read_text()) for rank in range(processes)] for run in runs
    }


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory) -> dict:
    """``{run: [result of each process]}``: fsdp_tp and hsdp of one 4-process launch (the ParallelismConfig given in
    accelerator_kwargs), tp of a 2-process one (given as ``accelerate launch --parallelism_config_tp_size 2`` does)."""
    output = tmp_path_factory.mktemp("layouts")
    from_launcher = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2"}
    runs = ("tp", "llama_tp") if importlib.util.find_spec("transformers.distributed") else ("tp",)
    return {**_launch(output, 4, ("fsdp_tp", "hsdp")), **_launch(output, 2, runs, **from_launcher)}


def _trained_ids_by_data_parallel_rank(results: list) -> dict:
    by_rank: dict = {}
    for result in results:
        by_rank.setdefault(result["dp"][0], []).append(result["train_ids"])
    return by_rank


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("run", "distributed_type"), [("fsdp_tp", "FSDP"), ("hsdp", "FSDP"), ("tp", "MULTI_CPU")])
def test_layout_trains_like_one_process(layout_runs, run, distributed_type):
    results = layout_runs[run]
    assert {result["distributed_type"] for result in results} == {f"DistributedType.{distributed_type}"}
    assert {tuple(result["param_types"]) for result in results} == {("DTensor",)}
    for result in results:  # 3 AdamW updates with clipping, the weights gathered in full on every process
        assert result["max_weight_diff"] < 1e-6, result
        assert result["train_loss_diff"] < 1e-6, result
        assert result["total_batch"] == 8  # per data-parallel rank x data-parallel ranks, not x processes
        sharding = "tensor parallel" if run == "tp" else "FSDP"
        assert f"this trainer runs under {sharding}" in result["add_model_refused"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("run", ["fsdp_tp", "hsdp", "tp"])
def test_exports_gather_the_full_weights_in_every_layout(layout_runs, run):
    """save_weights and save_checkpoint hold the full weights and optimizer state (tensor parallel alone too, where
    no FSDP gathers them); load_checkpoint puts them back into the shards."""
    for result in layout_runs[run]:
        exports = {key: result[key] for key in ("weights_file_equal", "checkpoint_equal", "reloaded_equal")}
        assert exports == {"weights_file_equal": True, "checkpoint_equal": True, "reloaded_equal": True}
        assert result["optimizer_full_shapes"]


@pytest.mark.distributed
@pytest.mark.slow
def test_transformers_model_is_split_by_its_own_plan(layout_runs):
    pytest.importorskip("transformers.distributed", reason="transformers 5 applies a plan to an existing model")
    for result in layout_runs["llama_tp"]:
        assert result["param_types"] == ["DTensor", "Parameter"]  # the norm weights, left out by the plan
        assert result["max_weight_diff"] < 1e-5, result


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("run", "dp_size"), [("fsdp_tp", 2), ("hsdp", 4), ("tp", 1)])
def test_each_data_parallel_rank_reads_its_own_batches(layout_runs, run, dp_size):
    by_rank = _trained_ids_by_data_parallel_rank(layout_runs[run])
    assert sorted(by_rank) == list(range(dp_size))
    for seen in by_rank.values():  # every process of a tensor-parallel group saw the same batches
        assert all(ids == seen[0] for ids in seen)
    trained = sorted(i for seen in by_rank.values() for batch in seen[0] for i in batch)
    assert trained == list(range(24))  # every sample of the epoch once


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "batches"), [("fsdp_tp", [list(range(8)), [8, 9]]), ("tp", [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]])]
)
def test_evaluation_and_predict_count_each_sample_once_under_tensor_parallel(layout_runs, run, batches):
    for result in layout_runs[run]:
        assert result["eval_ids"] == batches  # gather_for_metrics: no copy from the tp ranks
        assert result["eval_ids_padded"] == batches  # gather(padding_value=...)
        assert result["eval_loss_diff"] < 1e-6
        assert result["predict_rows"] == 10
        assert result["predict_max_diff"] < 1e-6


def _accelerator(process_index: int, num_processes: int, config=None) -> SimpleNamespace:
    return SimpleNamespace(process_index=process_index, num_processes=num_processes, parallelism_config=config)


def test_layout_without_parallelism_config_is_one_rank_per_process():
    assert layout_of(_accelerator(2, 3)) == Layout(dp_replicate=3, dp_size=3, dp_rank=2)
    assert layout_of(_accelerator(0, 1)).dp_size == 1


@pytest.mark.parametrize(
    ("process_index", "dp_rank", "tp_rank", "leads"), [(0, 0, 0, True), (1, 0, 1, False), (2, 1, 0, True)]
)
def test_layout_of_fsdp_by_tp(process_index, dp_rank, tp_rank, leads):
    layout = layout_of(_accelerator(process_index, 4, ParallelismConfig(dp_shard_size=2, tp_size=2)))
    assert (layout.dp_size, layout.dp_rank, layout.tp_rank, layout.leads_model_group) == (2, dp_rank, tp_rank, leads)
    assert layout.as_fact() == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 1}


def test_gathered_rows_keep_one_copy_per_tensor_parallel_group():
    accelerator = _accelerator(0, 4, ParallelismConfig(dp_shard_size=2, tp_size=2))
    gathered = torch.tensor([0, 1, 0, 1, 2, 3, 2, 3])  # 2 rows per process, processes 0-1 and 2-3 the same
    assert keep_model_group_leaders(accelerator, gathered).tolist() == [0, 1, 2, 3]
    assert keep_model_group_leaders(_accelerator(0, 2), gathered).tolist() == gathered.tolist()


def test_parallelism_config_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    config = parallelism_config_from({})
    assert (config.dp_shard_size, config.tp_size) == (2, 2)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "false")
    assert parallelism_config_from({}) is None


def test_parallelism_config_of_another_type_is_refused():
    with pytest.raises(TypeError, match="accelerator_kwargs\\['parallelism_config'\\] is dict, not valid"):
        parallelism_config_from({"parallelism_config": {"tp_size": 2}})


def test_context_parallel_is_refused_on_the_cpu():
    with pytest.raises(ValueError, match="cp_size=2.*does not run on the CPU.*launch on GPUs"):
        validate_layout_on_cpu(ParallelismConfig(dp_shard_size=2, cp_size=2), 4)


def test_sizes_that_do_not_fit_the_processes_are_refused():
    with pytest.raises(ValueError, match="needs 4 processes, but 2 were launched"):
        validate_layout_on_cpu(ParallelismConfig(dp_shard_size=2, tp_size=2), 2)


def test_default_parallelize_model_asks_for_an_override_for_a_plain_model():
    mesh = {"tp": SimpleNamespace(size=lambda: 2)}
    with pytest.raises(ValueError, match="tp_size=2.*no tensor-parallel plan.*override Trainer.parallelize_model"):
        apply_transformers_tensor_parallel_plan(nn.Linear(2, 2), mesh)
