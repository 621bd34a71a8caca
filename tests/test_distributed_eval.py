"""Distributed evaluation sees every sample exactly once: sizes 1-17 x batch 1-4 x map/iterable, 1 and 2 processes."""

from __future__ import annotations

import pytest
import torch
from conftest import make_trainer
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("evaluate_every_case")
@pytest.mark.parametrize("num_processes", [1, 2])
def test_every_sample_evaluated_once_in_order(request, num_processes):
    """Every sample is evaluated exactly once, in dataset order (tests/scripts/distributed_eval.py, on each process)."""
    launch = request.getfixturevalue({1: "one_process_scenarios", 2: "two_process_scenarios"}[num_processes])
    results = [launch.read_json("evaluate_every_case", f"result.rank{rank}.json") for rank in range(num_processes)]
    for result in results:
        assert result["num_processes"] == num_processes
        assert len(result["cases"]) == 17 * 4 * 2
        for name, case in result["cases"].items():
            size = int(name.split("size=")[1].split()[0])
            assert case["gathered"] == [float(i) for i in range(size)], name  # trainer.gather: ids, in order
            assert sorted(case["gathered_padded"]) == [float(i) for i in range(size)], name  # padded: each id once
            assert case["gathered_for_metrics"] == case["expected_rows"], name
            assert case["evaluation_loss"] == pytest.approx(case["expected_loss"], rel=1e-5), name
            assert case["mae"] == pytest.approx(case["expected_mae"], rel=1e-5), name  # torchmetrics, exact too


class _NoRows(IterableDataset):
    def __iter__(self):
        return iter(())


def test_an_empty_evaluation_set_is_a_clear_error():
    trainer = make_trainer(nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"dataset is empty \(len\(dataset\) == 0\)"):
        trainer.evaluate(TensorDataset(torch.zeros(0, 2), torch.zeros(0, 1)))
    with pytest.raises(ValueError, match="The evaluation dataloader yielded no batch: the evaluation dataset is empty"):
        trainer.evaluate(_NoRows())
