"""The examples run as they are shipped, so they cannot rot (the notebooks: tests/test_notebooks.py)."""

import runpy
from pathlib import Path

import pytest
import torch
from conftest import load_module_from

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _import_example(name: str):
    return load_module_from(EXAMPLES / f"{name}.py", f"example_{name}")


def test_digits_eval_set_splits_evenly():
    """train_digits' eval set splits evenly over processes."""
    train_digits = _import_example("train_digits")
    train_dataset, eval_dataset = train_digits.create_datasets()

    assert len(train_dataset) + len(eval_dataset) == 1797
    assert len(eval_dataset) % (32 * 4) == 0  # no sample repeated to even out 1, 2 or 4 processes
    features = train_dataset.tensors[0]
    torch.testing.assert_close(features.mean(dim=0), torch.zeros(64), atol=1e-5, rtol=0)


def test_quickstart_fits_the_line(capsys):
    namespace = runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")

    model = namespace["model"]
    assert model.weight.item() == pytest.approx(2.0, abs=0.01)
    assert model.bias.item() == pytest.approx(3.0, abs=0.01)
    assert namespace["trainer"].run_history.get_metric_values("weight")[-1] == model.weight.item()
    assert "epoch 10: y = 2.000x + 3.000" in capsys.readouterr().out


def test_quickstart_stays_short():
    lines = (EXAMPLES / "quickstart.py").read_text().splitlines()
    code_lines = [line for line in lines if line.strip() and not line.lstrip().startswith(("#", '"""'))]
    assert len(code_lines) <= 25


def test_docs_index_shows_the_quickstart_as_it_is():
    quickstart = (EXAMPLES / "quickstart.py").read_text().rstrip()
    index = (ROOT / "docs" / "index.md").read_text()
    assert f"```python\n{quickstart}\n```" in index
