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
    from pytorch_accel_trainer.tracking import InMemoryRunHistory, RunHistory  # noqa: F401
    from pytorch_accel_trainer.trainer import DEFAULT_CALLBACKS, Trainer, TrainerPlaceholderValues  # noqa: F401


def _runtime_imports_of(path: pathlib.Path) -> set:
    """Modules imported when ``path`` runs, at its top or inside a function (imports under ``if TYPE_CHECKING:`` are
    left out): ``from a.b import c`` imports ``a.b.c`` when that is one of the package's modules, else ``a.b``."""
    names = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    names.add(submodule if _is_package_module(submodule) else node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            visit(ast.iter_child_nodes(node))

    visit(ast.parse(path.read_text()).body)
    return names


#: The package's units, lowest first: a unit imports (at run time) only units of a lower rank, and the modules of
#: one subpackage import each other one way (no cycle). A new top-level module or subpackage must be placed here.
UNIT_RANKS = {
    "errors": 0, "data": 0, "console": 0,  # leaves: nothing of the package
    "parallel": 1, "tracking": 1, "placeholders": 1, "finetuning": 1,  # over the leaves only
    "run_config": 2, "plotting": 2, "schedulers": 2, "state": 2,  # what a run is, and its files on disk
    "utils": 2,  # pytorch-accelerated's helpers, the process decorators among them (from parallel)
    "callbacks": 3,  # get the trainer at call time (its type only under TYPE_CHECKING)
    "predictions": 3,  # written to a folder or a store (state.storage)
    "loop": 4,  # the step's parts the Trainer composes
    "trainer": 5,
    "cli": 6, "__init__": 7, "__main__": 8,  # runs described by data, the package's names, python -m
}  # fmt: skip


def _unit(relative: str) -> str:
    """``loop/run_state.py`` -> ``loop``; ``trainer.py`` -> ``trainer``."""
    return relative.split("/")[0].removesuffix(".py")


def _module_file(module: str) -> str:
    """``pytorch_accel_trainer.loop.run_state`` -> ``loop/run_state.py``; the package itself -> ``__init__.py``."""
    parts = module.split(".")[1:]
    path = PACKAGE.joinpath(*parts)
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(PACKAGE).as_posix()


def _is_package_module(name: str) -> bool:
    return name.split(".")[0] == "pytorch_accel_trainer" and (PACKAGE / _module_file(name)).is_file()


PACKAGE_FILES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", PACKAGE_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way_between_units(path):
    relative = path.relative_to(PACKAGE).as_posix()
    unit = _unit(relative)
    assert unit in UNIT_RANKS, f"{relative} belongs to no unit of UNIT_RANKS: place it"
    for module in sorted(name for name in _runtime_imports_of(path) if _is_package_module(name)):
        imported = _unit(_module_file(module))
        if imported == unit:
            continue  # one subpackage: its modules may use each other, one way (see the test of cycles below)
        assert UNIT_RANKS[imported] < UNIT_RANKS[unit], f"{relative} ({unit}) imports {module} ({imported})"


#: The loop modules that still import a concrete callback until the branch where callbacks declare what they write
#: (helper "persist") is merged: the lead removes this list at the merge.
@pytest.mark.parametrize("path", [pytest.param(path, id=path.name) for path in sorted((PACKAGE / "loop").glob("*.py"))])
def test_the_loop_imports_no_callback(path):
    """The engine defines protocols and plug-ins declare what they need: no module of ``loop/`` imports from
    ``callbacks/`` (under ``TYPE_CHECKING`` included), so the loop asks every callback alike, a user's included."""
    relative = path.relative_to(PACKAGE).as_posix()
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert not [name for name in imported if name and name.startswith("pytorch_accel_trainer.callbacks")], (
        f"{relative} imports from pytorch_accel_trainer.callbacks: have the callbacks declare what the loop needs "
        "through a TrainerCallback method with a default, and ask every callback through it"
    )


def test_at_most_about_twenty_top_level_modules():
    top_level = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top_level) <= 20, top_level
    units = {_unit(path.relative_to(PACKAGE).as_posix()) for path in PACKAGE_FILES}
    assert units == set(UNIT_RANKS), "UNIT_RANKS names exactly the package's units"


def test_no_import_cycle_between_modules():
    """Between units the ranks hold the direction; inside a subpackage, imports between its modules run one way too.
    An import inside a function counts: the two modules still need each other."""
    imports = {path.relative_to(PACKAGE).as_posix(): _runtime_imports_of(path) for path in PACKAGE_FILES}
    graph = {
        module: {_module_file(name) for name in names if _is_package_module(name)} for module, names in imports.items()
    }
    cycles, visiting, done = [], [], set()

    def visit(module):
        visiting.append(module)
        for imported in sorted(graph[module]):
            if imported in visiting:
                cycles.append(" -> ".join([*visiting[visiting.index(imported) :], imported]))
            elif imported not in done:
                visit(imported)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    assert not cycles, f"import cycles: {cycles}. Move what both modules need into the lower one, or its own module."


def test_the_package_has_no_alias_module():
    """No module stands for another by setting ``sys.modules[...]``: each module has one import path. The package
    was never released, so none is kept for a path it used before."""
    aliases = [
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE_FILES
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        and any(
            isinstance(target, ast.Subscript) and ast.unparse(target.value) == "sys.modules"
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    ]
    assert not aliases, f"{aliases} set sys.modules[...]: import the module from its one path instead"


@pytest.mark.parametrize("package", sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py")))
def test_each_subpackage_says_what_it_owns(package):
    docstring = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
    assert docstring and len(docstring) > 80, f"{package}/__init__.py must say what the subpackage owns"


#: Every import path users have: pytorch-accelerated 0.1.61's public modules (``trainer``, ``callbacks``, ``tracking``,
#: ``run_config``, ``schedulers``, ``finetuning``, ``utils``; tests/test_peer_api.py checks all their names) and every
#: module our docs name, with a name each must hold.
PUBLIC_PATHS = {
    "pytorch_accel_trainer": "Trainer",
    "pytorch_accel_trainer.trainer": "Trainer",
    "pytorch_accel_trainer.callbacks": "TrainerCallback",
    "pytorch_accel_trainer.callbacks.base": "CallbackHandler",
    "pytorch_accel_trainer.tracking": "RunHistory",
    "pytorch_accel_trainer.run_config": "TrainerRunConfig",
    "pytorch_accel_trainer.schedulers": "CosineLrScheduler",
    "pytorch_accel_trainer.schedulers.scheduler_base": "StatefulSchedulerBase",
    "pytorch_accel_trainer.finetuning": "ModelFreezer",
    "pytorch_accel_trainer.utils": "worker_init_fn",
    "pytorch_accel_trainer.placeholders": "TrainerPlaceholderValues",
    "pytorch_accel_trainer.plotting": "plot_run_history",
    "pytorch_accel_trainer.predictions": "load_predictions",
    "pytorch_accel_trainer.errors": "CheckpointError",
    "pytorch_accel_trainer.cli": "main",
    "pytorch_accel_trainer.state.checkpointing": "build_checkpoint",
    "pytorch_accel_trainer.state.training_state": "find_resumable_state",
    "pytorch_accel_trainer.loop.run_state": "TrainResult",
    "pytorch_accel_trainer.loop.lr_find": "suggest_lr",
    "pytorch_accel_trainer.parallel.distributed": "create_accelerator",
    "pytorch_accel_trainer.parallel.sharded": "get_full_model_state_dict",
    "pytorch_accel_trainer.cli.config": "TrainingConfig",
    "pytorch_accel_trainer.cli.commands": "console_main",
    "pytorch_accel_trainer.cli.parsing": "parse_command",
    "pytorch_accel_trainer.cli.run_folder": "RunFolderCallback",
    "pytorch_accel_trainer.cli.tune": "tune",
}


@pytest.mark.parametrize("path", sorted(PUBLIC_PATHS))
def test_every_public_import_path_keeps_working(path):
    module = importlib.import_module(path)
    assert hasattr(module, PUBLIC_PATHS[path]), f"{path} lost {PUBLIC_PATHS[path]}"


def test_docs_name_only_import_paths_that_exist():
    texts = [path.read_text() for path in (ROOT / "docs").rglob("*.md")] + [(ROOT / "README.md").read_text()]
    named = {match for text in texts for match in re.findall(r"(?<![\w/])(pytorch_accel_trainer(?:\.[a-z_]+)+)", text)}
    for name in sorted(named):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest prefix that is a module, then attributes
            try:
                module = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            target = module
            for attribute in parts[cut:]:
                target = getattr(target, attribute, None)
                assert target is not None, f"the docs name {name}, which does not exist"
            break
        else:
            pytest.fail(f"the docs name {name}, which is no module")


def test_importing_does_nothing_to_random_state_and_leaves_heavy_imports_to_their_use():
    """Importing the package changes no random state, and imports neither pandas (the run history's tables) nor
    torch.distributed.checkpoint (a sharded state's; about a second of start-up a one-process run never needs)."""
    code = (
        "import random, numpy, torch\n"
        "states = (random.getstate(), numpy.random.get_state()[1].tolist(), torch.random.get_rng_state())\n"
        "import pytorch_accel_trainer\n"
        "after = (random.getstate(), numpy.random.get_state()[1].tolist(), torch.random.get_rng_state())\n"
        "assert states[0] == after[0] and states[1] == after[1] and torch.equal(states[2], after[2])\n"
        "assert 'pandas' not in __import__('sys').modules\n"
        "assert 'torch.distributed.checkpoint' not in __import__('sys').modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _readme_commands() -> list:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```")
    assert text.startswith("# pytorch_accel_trainer\n\n```bash\n"), "the README must open with its two commands"
    lines = blocks[1].strip().splitlines()[1:]  # the first line is the language tag
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_readme_commands_and_ci_agree():
    """The README opens with two commands, and CI runs its test command."""
    commands = _readme_commands()
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_quickstart_is_the_tested_example():
    example = (ROOT / "examples" / "quickstart.py").read_text().split('"""', 2)[2].strip()
    readme_code = (ROOT / "README.md").read_text().split("```python")[1].split("```")[0].strip()
    assert readme_code == example  # tests/test_examples.py runs the example


def test_pseudocode_names_existing_functions():
    """docs/inside_the_trainer.md names the method or function behind each block: each must exist in the code."""
    page = (ROOT / "docs" / "inside_the_trainer.md").read_text()
    source = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py"))
    defined = set(re.findall(r"def (\w+)\(", source)) | set(re.findall(r"class (\w+)\b", source))
    named = set(re.findall(r"`(_?[a-z][a-z0-9_]*)\(", page)) | set(re.findall(r"# (_[a-z_]+)\(", page))
    named |= set(re.findall(r"^\s*# (\w+)\(", page, flags=re.MULTILINE))
    missing = sorted(name for name in named if name not in defined and name not in dir(__builtins__))
    assert not missing, f"docs/inside_the_trainer.md names what the code does not define: {missing}"


#: The only places that assign ``trainer.model`` / ``self.model``, by file and function, each with its reason.
MODEL_ASSIGNMENTS = {
    ("trainer.py", "Trainer.__init__"): "the model the trainer is given",
    ("trainer.py", "Trainer._prepare"): (
        "preparation: unwrapped from an earlier run, split by parallelize_model, prepared by Accelerate, compiled"
    ),
    ("trainer.py", "Trainer._unwrap_models"): "unwrapping at the end of a training, evaluation or prediction run",
    ("trainer.py", "Trainer.run_extra_eval_epoch"): "its swap: the model evaluated, then the trainer's put back",
    ("callbacks/ema.py", "ModelEmaCallback._ema_weights_in"): "its swap: the EMA weights saved and evaluated, put back",
    ("callbacks/device.py", "ConvertSyncBatchNormCallback.on_training_run_start"): "SyncBatchNorm conversion",
    ("finetuning.py", "ModelFreezer.__init__"): "the freezer's own model attribute, not a trainer's",
}


def _assignment_targets(node: ast.AST):
    """Every attribute or name a statement assigns to, unpacking tuples and lists."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    stack = list(targets)
    while stack:
        target = stack.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            stack.extend(target.elts)
        elif isinstance(target, ast.Starred):
            stack.append(target.value)
        else:
            yield target


def _assignments_in(node: ast.AST, relative: str, scope: tuple = ()):
    """``(relative, enclosing class.function, target)`` of every assignment statement under ``node``."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        scope = (*scope, node.name)
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        yield from ((relative, ".".join(scope), target) for target in _assignment_targets(node))
    for child in ast.iter_child_nodes(node):
        yield from _assignments_in(child, relative, scope)


def _assignments_in_package():
    """``(relative path, enclosing class.function, target)`` of every assignment statement of the package."""
    for path in PACKAGE_FILES:
        yield from _assignments_in(ast.parse(path.read_text()), path.relative_to(PACKAGE).as_posix())


def test_run_state_has_one_writer():
    """A RunState field is assigned only in trainer.py's loop and RunState's own transitions (``state.x = ...``,
    ``run_state.x = ...``, ``self.run_state.x = ...``); everything else calls a RunState method. ``trainer.model`` is
    assigned only where MODEL_ASSIGNMENTS says why."""
    import dataclasses

    from pytorch_accel_trainer.loop.run_state import RunState

    fields = {field.name for field in dataclasses.fields(RunState)}
    state_writers, model_writers = set(), set()
    for relative, scope, target in _assignments_in_package():
        if not isinstance(target, ast.Attribute):
            continue
        owner = target.value
        names_a_run_state = (isinstance(owner, ast.Name) and owner.id in ("state", "run_state")) or (
            isinstance(owner, ast.Attribute) and owner.attr == "run_state"
        )
        if target.attr in fields and names_a_run_state:
            state_writers.add((relative, scope, ast.unparse(target)))
        if target.attr == "model" and isinstance(owner, ast.Name) and owner.id in ("self", "trainer"):
            model_writers.add((relative, scope))
    outside = sorted(writer for writer in state_writers if writer[0] not in ("trainer.py", "loop/run_state.py"))
    assert not outside, f"RunState fields assigned outside trainer.py and loop/run_state.py: {outside}"
    assert state_writers, "the check found no assignment at all: it no longer sees the loop's"
    undocumented = sorted(model_writers - set(MODEL_ASSIGNMENTS))
    assert not undocumented, f"trainer.model assigned where MODEL_ASSIGNMENTS does not say why: {undocumented}"
    assert model_writers == set(MODEL_ASSIGNMENTS), (
        f"gone, drop from MODEL_ASSIGNMENTS: {set(MODEL_ASSIGNMENTS) - model_writers}"
    )
