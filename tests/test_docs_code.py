"""Every ```python block of README.md and docs/ runs, so the documentation cannot rot.

A page is a script: its python blocks run in order, as one program (a block may use the names an earlier block of
the same page defined), in a fresh process whose working folder is an empty temporary one, with the repository
root on ``PYTHONPATH`` (so ``examples.train_digits`` imports): a process of the warm launcher (tests/conftest.py
``launcher``), forked from an interpreter that imported torch, Accelerate and the package and did nothing else. Each
block is placed at its own line of the page, so a traceback's line numbers are the page's. Pseudocode, shell commands
and what cannot run here (several GPUs, a package that is not installed) carry another label (```text, ```bash, ...),
and the label tests below keep a python block from hiding under a label these tests do not run (```py, ```python3,
```pycon).

docs/api/ (the API reference, generated from docstrings) holds no code blocks of its own and is left out.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import launcher

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: Labels a fenced block may carry. Only ``python`` runs; the others are shell, data, or text that is not code.
KNOWN_LABELS = {"python", "bash", "text", "yaml", "toml", "json", "ini"}
#: Labels that mean Python but would escape the run: use ```python (runnable) or ```text (not runnable).
PYTHON_ALIASES = {"py", "python3", "py3", "pycon", "ipython", "ipython3", "pytb", "Python"}

#: Pages whose blocks take more than a few seconds (several training runs, or heavy imports).
SLOW_PAGES = {
    "docs/callbacks.md",
    "docs/howto.md",
    "docs/models_and_precision.md",
    "docs/tracking.md",
    "docs/trainer.md",
}
#: Seconds a page may run.
PAGE_TIMEOUT = 240


@dataclass(frozen=True)
class CodeBlock:
    label: str
    first_line: int  # the page's line number of the block's first code line, from 1
    code: str


def documentation_pages() -> list[Path]:
    """README.md and every page under docs/, docs/api/ left out."""
    pages = sorted(path for path in DOCS.rglob("*.md") if path.relative_to(DOCS).parts[0] != "api")
    return [ROOT / "README.md", *pages]


def fenced_blocks(text: str) -> list[CodeBlock]:
    """The fenced code blocks of a markdown page, indented ones (in a list item) included, dedented."""
    blocks, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        opening = re.match(r"^(\s*)```(\S*)", lines[index])
        if not opening:
            index += 1
            continue
        indent, label = opening.group(1), opening.group(2)
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"the code block opened at line {index + 1} is never closed")
        body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[index + 1 : end]]
        blocks.append(CodeBlock(label, index + 2, "\n".join(body) + "\n"))
        index = end + 1
    return blocks


def page_script(blocks: list[CodeBlock]) -> str:
    """The python blocks as one script, each at its line of the page, so tracebacks give the page's line numbers."""
    lines: list[str] = []
    for block in blocks:
        if block.label != "python":
            continue
        lines += [""] * (block.first_line - 1 - len(lines))
        lines += block.code.splitlines()
    return "\n".join(lines) + "\n"


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


PAGES = documentation_pages()
PAGES_WITH_PYTHON = [page for page in PAGES if any(b.label == "python" for b in fenced_blocks(page.read_text()))]


def _page_param(page: Path):
    marks = [pytest.mark.slow] if _name(page) in SLOW_PAGES else []
    return pytest.param(page, id=_name(page), marks=marks)


def _environment() -> dict:
    """The reader's environment: the repository importable, no debugging limit or launcher setting inherited."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("ACCELERATE_", "PT_ACC_")) and key not in {"WORLD_SIZE", "RANK", "LOCAL_RANK"}
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny models; others' tests share the cores
    env["MPLBACKEND"] = "Agg"
    return env


@pytest.mark.parametrize("page", [_page_param(page) for page in PAGES_WITH_PYTHON])
def test_each_page_runs_as_one_script(page, tmp_path):
    """The python blocks of each page run as one script."""
    script = tmp_path / ("page_" + re.sub(r"\W", "_", _name(page)) + ".py")
    script.write_text(page_script(fenced_blocks(page.read_text())))

    result = subprocess.run(
        [*launcher(1), str(script)],
        check=False,
        cwd=tmp_path,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT,
    )

    if result.returncode != 0:
        pytest.fail(
            f"the python blocks of {_name(page)} failed (exit {result.returncode}); line numbers in the traceback "
            f"are the page's:\n{result.stderr[-6000:]}",
            pytrace=False,
        )


def test_every_code_block_carries_a_known_label():
    """A python block labelled ```py or ```python3, or not labelled at all, would never run here."""
    wrong = [
        f"{_name(page)}:{block.first_line - 1}: ```{block.label}"
        for page in PAGES
        for block in fenced_blocks(page.read_text())
        if block.label not in KNOWN_LABELS
    ]
    assert not wrong, (
        f"code blocks with a label these tests do not know: {wrong}. Label Python ```python (it then runs) or, for "
        f"pseudocode and code that cannot run here, ```text; label shell commands ```bash. Known: "
        f"{sorted(KNOWN_LABELS)}; never {sorted(PYTHON_ALIASES)}."
    )


def _placeholder_ellipses(tree: ast.AST) -> list[int]:
    """Lines where ``...`` stands for code left out (``f(...)``, ``x = ...``): the mark of pseudocode.

    ``...`` alone as a statement (an empty body) and inside a subscript (``x[..., 0]``) are real Python.
    """
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            allowed.add(id(node.value))
        if isinstance(node, ast.Subscript):
            allowed |= {id(child) for child in ast.walk(node.slice)}
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value is Ellipsis and id(node) not in allowed
    ]


@pytest.mark.parametrize("page", [pytest.param(page, id=_name(page)) for page in PAGES_WITH_PYTHON])
def test_python_blocks_are_whole_programs(page):
    """Each python block parses on its own and leaves no code out with ``...``; pseudocode is labelled ```text."""
    problems = []
    for block in fenced_blocks(page.read_text()):
        if block.label != "python":
            continue
        try:
            tree = ast.parse(block.code)
        except SyntaxError as error:
            problems.append(f"line {block.first_line + (error.lineno or 1) - 1}: {error.msg}")
            continue
        problems += [
            f"line {block.first_line + line - 1}: `...` for code left out" for line in _placeholder_ellipses(tree)
        ]
    assert not problems, (
        f"{_name(page)} has python blocks that are not programs: {problems}. Write the code out, or label the "
        f"block ```text if it is pseudocode."
    )


def test_block_parser_finds_indented_blocks():
    """The block parser finds indented blocks and line numbers."""
    page = "# Title\n\n```python\nx = 1\n```\n\n- item:\n\n  ```python\n  y = x + 1\n  ```\n\n```bash\nls\n```\n"
    blocks = fenced_blocks(page)
    assert [(block.label, block.first_line, block.code) for block in blocks] == [
        ("python", 4, "x = 1\n"),
        ("python", 10, "y = x + 1\n"),
        ("bash", 14, "ls\n"),
    ]
    assert page_script(blocks).splitlines()[3] == "x = 1"
    assert page_script(blocks).splitlines()[9] == "y = x + 1"


def test_pseudocode_check_spares_ellipsis():
    """Pseudocode detection spares real uses of the ellipsis."""
    real = "def f(x): ...\nclass A:\n    ...\ny = z[..., 0]\n"
    pseudo = "a = f(...)\nb, c = 1, ...\n"
    assert _placeholder_ellipses(ast.parse(real)) == []
    assert sorted(_placeholder_ellipses(ast.parse(pseudo))) == [1, 2]
