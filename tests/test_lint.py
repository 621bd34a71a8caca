"""The habits of a well-kept library, checked by the test command (so CI runs them): lint, format and types.

The tools are pinned in setup.cfg's test extra; their settings are in pyproject.toml (CONTRIBUTING.md says why).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.tooling


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(pathlib.Path(sys.executable).parent))
    if path is None:
        pytest.fail(f"{name} is not installed beside {sys.executable}: pip install -c constraints.txt -e '.[test]'")
    return path


def test_ruff_check_passes():
    completed = _run(_tool("ruff"), "check", ".", "--output-format", "concise")
    assert completed.returncode == 0, completed.stdout[-5000:] + completed.stderr[-2000:]


def test_ruff_format_leaves_every_file_unchanged():
    completed = _run(_tool("ruff"), "format", "--check", ".")
    assert completed.returncode == 0, completed.stdout[-5000:] + completed.stderr[-2000:]


def _python_files() -> list:
    """The repository's ``.py`` files; the virtual environment and the built site (folders named ``.venv`` or
    ``site``) are not walked (CI's ``.venv`` holds tens of thousands of files: 7 s to walk on a fresh clone)."""
    files = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if name not in (".venv", "site")]
        files += [pathlib.Path(folder, name) for name in names if name.endswith(".py")]
    return files


def test_fmt_skip_only_on_tables_of_data():
    sources = _python_files()
    skipped = [
        f"{path.relative_to(ROOT)}" for path in sources for line in path.read_text().splitlines() if "fmt: skip" in line
    ]
    assert len(skipped) <= 5, f"`# fmt: skip` is for tables of data, at most a handful: {skipped}"


@pytest.mark.slow
def test_mypy_reports_no_error_on_the_package():
    completed = _run(sys.executable, "-m", "mypy")
    assert completed.returncode == 0, completed.stdout[-8000:] + completed.stderr[-2000:]
    assert re.search(r"Success: no issues found in \d+ source files", completed.stdout), completed.stdout[-2000:]
