"""Package shape: public names, import direction, import side effects, and README/CI agreement."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
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
            if isinstance(node, ast.ImportFrom) and node.module == "pytorch_accel_trainer":
                names.update(f"pytorch_accel_trainer.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            visit(ast.iter_child_nodes(node))

    visit(ast.parse(path.read_text()).body)
    return names


#: Every module of the package and its layer: a module imports (at run time) only modules of lower layers; the
#: callbacks also import each other. A new module must be placed here, which is the point: the direction is chosen.
LAYERS = {
    # 0: leaves, importing nothing of the package
    "errors.py": 0, "utils.py": 0, "preemption.py": 0, "sharded.py": 0, "checkpointing.py": 0, "freezing.py": 0,
    "state_files.py": 0, "rng_state.py": 0,
    # 1: helpers over the leaves
    "finetuning.py": 1,
    "validation.py": 1, "tracking.py": 1, "placeholders.py": 1, "batches.py": 1, "non_finite.py": 1,
    "distributed.py": 1, "training_state.py": 1,
    # 2: what a run is (its config and state), and the callbacks, which get the trainer at call time
    "run_config.py": 2, "run_state.py": 2, "plotting.py": 2, "callbacks/*": 2, "schedulers/*": 2,
    # 3: the loop's mechanics over the run state
    "accumulation.py": 3, "persistence.py": 3, "async_save.py": 2,
    "run_folder.py": 3,
    # 4: the Trainer's mixins, 5: the Trainer, 6: the package's names and runs described by data, 7: the command line
    "config.py": 6, "cli.py": 7, "__main__.py": 8,
    "setup.py": 4, "accessors.py": 4, "loop_support.py": 4, "extra_models.py": 4, "timm_scheduler.py": 4, "trainer.py": 5, "__init__.py": 6,
}  # fmt: skip


TRAINER_MIXINS = ("setup.py", "persistence.py", "accessors.py", "loop_support.py", "extra_models.py")


PACKAGES = ("callbacks/", "schedulers/")  # each a family of modules in one layer, free to import each other


def _layer(relative: str) -> int:
    family = next((package for package in PACKAGES if relative.startswith(package)), None)
    return LAYERS[family + "*" if family else relative]


def _module_file(module: str) -> str:
    parts = module.split(".")[1:]
    path = PACKAGE.joinpath(*parts)
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(PACKAGE).as_posix()


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_layer_map(path):
    relative = path.relative_to(PACKAGE).as_posix()
    assert relative.startswith(PACKAGES) or relative in LAYERS, f"{relative} has no layer in LAYERS: place it"
    for module in sorted(name for name in _runtime_imports_of(path) if name.startswith("pytorch_accel_trainer.")):
        imported = _module_file(module)
        if any(relative.startswith(package) and imported.startswith(package) for package in PACKAGES):
            continue  # one family: its modules may use each other
        assert _layer(imported) < _layer(relative), f"{relative} (layer {_layer(relative)}) imports {imported} (layer {_layer(imported)})"


def test_the_layer_map_names_only_modules_that_exist():
    for relative in LAYERS:
        assert relative.endswith("/*") or (PACKAGE / relative).is_file(), relative


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_passes_600_lines_and_none_writes_the_trainers_private_attributes(path):
    text = path.read_text()
    assert len(text.splitlines()) < 600
    writer = r"\b(trainer|self)" if path.name in TRAINER_MIXINS else r"\btrainer"  # in a mixin, self is the trainer
    if path.name != "trainer.py":  # but the dataloader factories set pytorch-accelerated's _train/_eval_dl_kwargs
        private = r"\._(?!train_dl_kwargs|eval_dl_kwargs)[a-z]\w*\s*(=|\+=|-=)(?!=)"
        assert not re.search(writer + private, text), "write trainer._* only in trainer.py"


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


def test_the_pseudocode_page_names_only_functions_that_exist():
    """docs/inside_the_trainer.md names the method or function behind each block: each must exist in the code."""
    page = (ROOT / "docs" / "inside_the_trainer.md").read_text()
    source = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py"))
    defined = set(re.findall(r"def (\w+)\(", source)) | set(re.findall(r"class (\w+)\b", source))
    named = set(re.findall(r"`(_?[a-z][a-z0-9_]*)\(", page)) | set(re.findall(r"# (_[a-z_]+)\(", page))
    named |= set(re.findall(r"^\s*# (\w+)\(", page, flags=re.MULTILINE))
    missing = sorted(name for name in named if name not in defined and name not in dir(__builtins__))
    assert not missing, f"docs/inside_the_trainer.md names what the code does not define: {missing}"
