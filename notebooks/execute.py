"""Execute the numbered notebooks of this folder and save each one with its outputs, in place.

    python notebooks/execute.py                       # 01_quickstart.ipynb, 02_finetuning.ipynb, ...
    python notebooks/execute.py 03_resume.ipynb       # only these

Each notebook runs top to bottom in a fresh "python3" kernel (the Python running this script), with this folder
as its working directory, so that a reader on GitHub sees what a run gives. A notebook whose cell raises is not
saved. After saving, every problem a reader should not see (an error, a warning, a traceback, a machine-specific
path, stray stderr output) is listed and the exit status is 1. tests/test_notebooks.py runs the same checks.

The widget state of the progress bars is saved in the notebook's metadata, so that Jupyter and nbviewer show each
bar as it ended. Cell timings are not recorded: they would change every line of the file at each run.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS_DIR = Path(__file__).resolve().parent
ROOT = NOTEBOOKS_DIR.parent
KERNEL_NAME = "python3"
#: seconds a cell may run; each notebook takes well under a minute in all
CELL_TIMEOUT = 120

# tqdm's text bars (used where ipywidgets is missing) are the only stderr output allowed: "epoch 1:  40%|####  | 4/10"
_PROGRESS_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+")


def notebook_paths() -> list[Path]:
    """The notebooks this script executes: ``NN_name.ipynb`` in this folder, in order."""
    return sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))


def execute_notebook(path: Path, timeout: int = CELL_TIMEOUT) -> nbformat.NotebookNode:
    """Run the notebook at ``path`` in a fresh kernel, in its own folder, and return it with its outputs (unsaved).

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised; the error names the cell and shows its traceback.
        nbclient.exceptions.CellTimeoutError: a cell ran longer than ``timeout`` seconds.
    """
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name=KERNEL_NAME,
        resources={"metadata": {"path": str(path.parent)}},
        record_timing=False,
    )
    client.execute()
    return notebook


def output_problems(notebook: nbformat.NotebookNode) -> list[str]:
    """What a reader should not see in the notebook's outputs, one line per problem; empty when it is clean.

    A problem is an error output, a stream or text output that mentions a warning (in any case) or a traceback,
    stderr output other than tqdm's progress bars, or a path of this machine (the repository or the temporary
    folder) that would change from one machine or run to the next.
    """
    machine_paths = (str(ROOT), tempfile.gettempdir())
    problems = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        where = f"cell {index} ({cell.get('id', '?')})"
        for output in cell.outputs:
            if output.output_type == "error":
                problems.append(f"{where} raised {output.ename}: {output.evalue}")
                continue
            text = _output_text(output)
            if re.search("warning", text, re.IGNORECASE):
                problems.append(f"{where} shows a warning: {_excerpt(text, 'warning')}")
            if "Traceback" in text:
                problems.append(f"{where} shows a traceback: {_excerpt(text, 'Traceback')}")
            if output.output_type == "stream" and output.name == "stderr" and not _is_progress_bars(text):
                problems.append(f"{where} writes to stderr: {text.strip()[:200]!r}")
            shown = next(
                (path for path in machine_paths if path in text), None
            )  # one problem, even for a repository in /tmp
            if shown is not None:
                problems.append(f"{where} shows the path {shown!r}, which changes between machines or runs")
    return problems


def _output_text(output: nbformat.NotebookNode) -> str:
    if output.output_type == "stream":
        return output.text
    return output.get("data", {}).get("text/plain", "")


def _is_progress_bars(text: str) -> bool:
    """Whether ``text`` holds only tqdm progress bars (each redrawn after a carriage return)."""
    lines = [line.strip() for line in re.split(r"[\r\n]", text)]
    return all(_PROGRESS_BAR.search(line) for line in lines if line)


def _excerpt(text: str, word: str) -> str:
    start = max(0, text.lower().find(word.lower()) - 80)
    return repr(text[start : start + 200])


def main(argv: Sequence[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv)
    paths = [NOTEBOOKS_DIR / Path(name).name for name in names] if names else notebook_paths()
    missing = [path.name for path in paths if not path.is_file()]
    if missing:
        known = ", ".join(path.name for path in notebook_paths())
        print(f"No notebook named {', '.join(missing)} in {NOTEBOOKS_DIR}; the notebooks are: {known}", file=sys.stderr)
        return 2
    all_problems = []
    for path in paths:
        start = time.perf_counter()
        notebook = execute_notebook(path)  # a cell that raises stops here, before the notebook is saved
        nbformat.write(notebook, path)
        problems = output_problems(notebook)
        print(f"{path.name}: executed in {time.perf_counter() - start:.1f} s and saved")
        all_problems += [f"{path.name}: {problem}" for problem in problems]
    for problem in all_problems:
        print(problem, file=sys.stderr)
    return 1 if all_problems else 0


if __name__ == "__main__":
    sys.exit(main())
