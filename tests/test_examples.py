"""The examples and the notebook run as they are shipped, so they cannot rot."""

import importlib.util
import json
import runpy
from pathlib import Path

import pytest
import torch

from pytorch_accel_trainer.checkpointing import MODEL_KEY, load_checkpoint_file

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NOTEBOOKS = ROOT / "notebooks"


def _import_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _notebook_code_cells(path: Path) -> list[str]:
    notebook = json.loads(path.read_text())
    assert notebook["nbformat"] == 4
    return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]


@pytest.mark.slow
def test_train_digits_reaches_high_accuracy_and_writes_results(tmp_path):
    train_digits = _import_example("train_digits")
    output_dir = tmp_path / "digits"

    accuracy = train_digits.main(["--num-epochs", "4", "--output-dir", str(output_dir)])

    assert accuracy > 0.85
    checkpoint = load_checkpoint_file(output_dir / "model.pt")
    assert checkpoint["accuracy"] == accuracy
    model = train_digits.create_model()
    model.load_state_dict(checkpoint[MODEL_KEY])  # the saved weights fit the example's model
    history = (output_dir / "history.csv").read_text().splitlines()
    assert history[0].split(",") == ["epoch", "accuracy", "eval_loss_epoch", "train_loss_epoch"]
    assert [row.split(",")[0] for row in history[1:]] == ["1", "2", "3", "4"]


def test_train_digits_eval_set_splits_evenly_over_processes():
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


def test_quickstart_notebook_runs_and_shows_the_history():
    namespace: dict = {}
    for source in _notebook_code_cells(NOTEBOOKS / "quickstart.ipynb"):
        exec(compile(source, "quickstart.ipynb", "exec"), namespace)

    history = namespace["history"]
    assert list(history.index) == [1, 2, 3, 4, 5]
    assert set(history.columns) == {"train_loss_epoch", "eval_loss_epoch"}
    assert history["eval_loss_epoch"].iloc[-1] < 1e-3
    assert namespace["weight"] == pytest.approx(2.0, abs=0.02)
    assert namespace["bias"] == pytest.approx(3.0, abs=0.02)


def test_notebook_has_no_outputs():
    notebook = json.loads((NOTEBOOKS / "quickstart.ipynb").read_text())
    code_cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert code_cells
    assert all(cell["outputs"] == [] and cell["execution_count"] is None for cell in code_cells)
