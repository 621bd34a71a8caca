"""Package shape: public names, import direction, import side effects, and README/CI agreement."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pytorch_accel_trainer"


def test_public_names_match_pytorch_accelerated():
    import pytorch_accel_trainer

    for name in ("Trainer", "TrainerPlaceholderValues", "notebook_launcher", "__version__"):
        assert hasattr(pytorch_accel_trainer, name)
    for module in ("trainer", "callbacks", "tracking", "run_config"):
        importlib.import_module(f"pytorch_accel_trainer.{module}")
    from pytorch_accel_trainer.trainer import DEFAULT_CALLBACKS, Trainer, TrainerPlaceholderValues  # noqa: F401
    from pytorch_accel_trainer.tracking import InMemoryRunHistory, RunHistory  # noqa: F401


def _runtime_imports_of(path: pathlib.Path) -> set:
    """Modules imported when ``path`` runs (imports under ``if TYPE_CHECKING:`` are left out)."""
    names = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            visit(ast.iter_child_nodes(node))

    visit(ast.parse(path.read_text()).body)
    return names


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_one_way(path):
    imports = {name for name in _runtime_imports_of(path) if name.startswith("pytorch_accel_trainer")}
    relative = path.relative_to(PACKAGE).as_posix()
    if relative not in ("__init__.py", "trainer.py"):
        assert "pytorch_accel_trainer.trainer" not in imports  # trainer is the top; callbacks get it at call time
    if relative.startswith("callbacks/"):
        assert all(name.startswith(("pytorch_accel_trainer.callbacks", "pytorch_accel_trainer.utils", "pytorch_accel_trainer.tracking", "pytorch_accel_trainer.preemption")) for name in imports)
    if relative == "utils.py":
        assert imports == set()


def test_importing_does_nothing_to_random_state():
    code = (
        "import random, numpy, torch\n"
        "states = (random.getstate(), numpy.random.get_state()[1].tolist(), torch.random.get_rng_state())\n"
        "import pytorch_accel_trainer\n"
        "after = (random.getstate(), numpy.random.get_state()[1].tolist(), torch.random.get_rng_state())\n"
        "assert states[0] == after[0] and states[1] == after[1] and torch.equal(states[2], after[2])\n"
        "assert 'pandas' not in __import__('sys').modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _readme_commands() -> list:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```")
    assert text.startswith("# pytorch_accel_trainer\n\n```bash\n"), "the README must open with its two commands"
    lines = blocks[1].strip().splitlines()[1:]  # the first line is the language tag
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_readme_opens_with_two_commands_and_ci_runs_the_test_command():
    commands = _readme_commands()
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_quickstart_is_the_tested_example():
    example = (ROOT / "examples" / "quickstart.py").read_text().split('"""', 2)[2].strip()
    readme_code = (ROOT / "README.md").read_text().split("```python")[1].split("```")[0].strip()
    assert readme_code == example  # tests/test_examples.py runs the example
