"""The notebooks run, show no warning or error, and are committed with the outputs of a clean run.

The slow tests execute each notebook in a fresh Jupyter kernel (nbclient, kernel "python3"), as
``notebooks/execute.py`` does before the notebooks are committed, without saving it. The fast ones read the committed
files: what a reader on GitHub sees.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest
from conftest import load_module_from
from nbformat.v4 import new_code_cell, new_notebook, new_output

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = [
    "01_quickstart.ipynb",
    "02_finetuning.ipynb",
    "03_resume.ipynb",
    "04_notebook_launcher.ipynb",
    "05_lr_find_and_search.ipynb",
]
#: the most seconds a cell may take here; each notebook takes well under a minute in all
CELL_TIMEOUT = 120


execute_script = load_module_from(NOTEBOOKS_DIR / "execute.py", "notebooks_execute")


def _code_cells(notebook) -> list:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def _output_kinds(cell) -> set:
    """What a cell shows, by kind: ``("stream", "stdout")``, ``("execute_result", "image/png")``, ..."""
    kinds = set()
    for output in cell.outputs:
        if output.output_type == "stream":
            kinds.add(("stream", output.name))
        else:
            kinds.update((output.output_type, mimetype) for mimetype in output.get("data", {}))
    return kinds


def _shows_something(source: str) -> bool:
    """Whether a cell's code calls ``print`` (outside functions), or ends with a value the notebook displays (a
    name or an attribute: a call's value may be ``None``)."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    statements = ast.parse(code).body
    last = statements[-1] if statements else None
    ends_with_value = isinstance(last, ast.Expr) and not isinstance(last.value, ast.Call) and not code.endswith(";")
    run_now = [statement for statement in statements if not isinstance(statement, (ast.FunctionDef, ast.ClassDef))]
    prints = any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
        for statement in run_now
        for node in ast.walk(statement)
    )
    return ends_with_value or prints


def test_execute_script_runs_these_notebooks():
    assert [path.name for path in execute_script.notebook_paths()] == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_outputs_are_a_clean_run(name):
    """A committed notebook holds the outputs of a clean run."""
    notebook = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata.kernelspec.name == "python3"

    code_cells = _code_cells(notebook)
    # run top to bottom, once, in one kernel: not cells rerun by hand in another order
    assert [cell.execution_count for cell in code_cells] == list(range(1, len(code_cells) + 1))
    silent = [cell.id for cell in code_cells if _shows_something(cell.source) and not cell.outputs]
    assert silent == [], f"{name}: cells that print or show a value were committed without their outputs"
    assert execute_script.output_problems(notebook) == []


def test_finetuning_notebook_shows_its_plot():
    notebook = nbformat.read(NOTEBOOKS_DIR / "02_finetuning.ipynb", as_version=4)

    plot_cells = [cell for cell in _code_cells(notebook) if "plot_run_history(trainer" in cell.source]
    assert len(plot_cells) == 1
    assert ("execute_result", "image/png") in _output_kinds(plot_cells[0])


def test_lr_find_notebook_shows_plot_and_search():
    notebook = nbformat.read(NOTEBOOKS_DIR / "05_lr_find_and_search.ipynb", as_version=4)
    cells = _code_cells(notebook)
    (plot,) = [cell for cell in cells if cell.source.strip().endswith("result.plot()")]
    assert ("execute_result", "image/png") in _output_kinds(plot)
    (search,) = [cell for cell in cells if "tune(config, space" in cell.source]
    printed = "".join(output.get("text", "") for output in search.outputs)
    assert "trial-0000 · eval_loss_epoch" in printed and "best: trial" in printed


def test_output_problems_finds_bad_outputs():
    """output_problems finds what a reader should not see, and passes a clean notebook."""

    def cell_with(*outputs):
        return new_code_cell("x", outputs=list(outputs))

    progress = "epoch 1:   0%|          | 0/8 [00:00<?, ?batch/s]\repoch 1: 100%|##########| 8/8 [00:00<00:00]\n"
    clean = new_notebook(
        cells=[
            cell_with(new_output("stream", name="stdout", text="y = 2.000x + 3.000\n")),
            cell_with(new_output("stream", name="stderr", text=progress)),
        ]
    )
    assert execute_script.output_problems(clean) == []

    bad = new_notebook(
        cells=[
            cell_with(new_output("stream", name="stderr", text="TqdmWarning: IProgress not found.\n")),
            cell_with(new_output("execute_result", data={"text/plain": "Traceback (most recent call last)"})),
            cell_with(new_output("error", ename="ValueError", evalue="bad", traceback=[])),
            cell_with(new_output("stream", name="stderr", text="some log line\n")),
            cell_with(new_output("stream", name="stdout", text=f"saved to {execute_script.ROOT}/x.pt\n")),
        ]
    )
    problems = execute_script.output_problems(bad)
    expected = [
        "shows a warning",
        "writes to stderr",
        "shows a traceback",
        "raised ValueError: bad",
        "writes to stderr",
        "shows the path",
    ]
    assert len(problems) == len(expected)
    for problem, what in zip(problems, expected):
        assert what in problem


@pytest.mark.slow
@pytest.mark.tooling
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_without_errors_or_warnings(name):
    files_before = sorted(path.name for path in NOTEBOOKS_DIR.iterdir() if path.name != "__pycache__")

    # raises CellExecutionError, with the cell and its traceback, if a cell fails; CellTimeoutError after the timeout
    executed = execute_script.execute_notebook(NOTEBOOKS_DIR / name, timeout=CELL_TIMEOUT)

    assert execute_script.output_problems(executed) == []
    committed = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    for new, old in zip(_code_cells(executed), _code_cells(committed)):
        # a cell that shows something now was committed with the same kinds of output: rerun notebooks/execute.py
        assert _output_kinds(new) == _output_kinds(old), f"{name}, cell {new.id}: outputs out of date"
    files_after = sorted(path.name for path in NOTEBOOKS_DIR.iterdir() if path.name != "__pycache__")
    assert files_after == files_before  # the notebooks write in temporary folders and remove them
