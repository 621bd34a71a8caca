"""The package installs beside any Accelerate from its lower bound on: public API only, no upper pin.

Accelerate's private state is touched in ``parallel/accelerate_internals.py`` alone, where each use checks that the
attribute exists and falls back to the public API without it; ``setup.cfg`` bounds accelerate and torch from below
only, at the releases that ``docs/versions.md`` names and ``tests/scripts/lowest_accelerate.sh`` tests.
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import pathlib
import re
import warnings

import accelerate
import pytest
import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from conftest import linear_dataset, make_linear, make_trainer
from packaging.requirements import Requirement

from pytorch_accel_trainer.parallel import accelerate_internals

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pytorch_accel_trainer"
INTERNALS = PACKAGE / "parallel" / "accelerate_internals.py"
ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")


# ------------------------------------------------------------------------------------------------
# Accelerate's private attributes: in accelerate_internals.py only
# ------------------------------------------------------------------------------------------------


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


#: torch's own private attributes, which Accelerate also sets on torch's objects (a compiled module's wrapped
#: module, a module's children, a scheduler's step count): using them is no use of Accelerate's state.
TORCH_PRIVATE_NAMES = {"_orig_mod", "_modules", "_step_count"}


def _accelerate_private_names() -> set:
    """The private names Accelerate defines: methods and class attributes of its classes, and every ``x._name = ...``
    in its source (its instances' state, and the marks it sets on the user's objects), torch's own left out."""
    names = set()
    for path in pathlib.Path(accelerate.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                    names.update(target.id for target in targets if isinstance(target, ast.Name))
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {name for name in names if _is_private(name)} - TORCH_PRIVATE_NAMES


ACCELERATE_PRIVATE_NAMES = _accelerate_private_names()


def _looks_like_accelerate(node: ast.expr, accelerate_names: set) -> bool:
    """Whether an expression is (probably) an object of Accelerate's: a name imported from it, or a name that says
    so (``accelerator``, ``self._accelerator``, ``accelerator.gradient_state``, ``state`` of a ``PartialState``)."""
    last = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return last in accelerate_names or re.search(r"accelerat|gradient_state|partial_state", last.lower()) is not None


def _private_imports(tree: ast.AST) -> tuple:
    """The names imported from ``accelerate``, and ``(line, text)`` of each import of a private name or module."""
    names, found = {"accelerate"}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "accelerate":
            names.update(alias.asname or alias.name for alias in node.names)
            paths = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            paths = [alias.name for alias in node.names if alias.name.split(".")[0] == "accelerate"]
        else:
            continue
        if any(_is_private(part) for path in paths for part in path.split(".")):
            found.append((node.lineno, ast.unparse(node)))
    return names, found


def _attribute_uses(tree: ast.AST):
    """``(node, owner, name)`` of each ``owner.name`` and ``getattr(owner, "name", ...)`` (or set/has/delattr)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node, node.value, node.attr
        elif (
            isinstance(node, ast.Call) and getattr(node.func, "id", None) in ATTRIBUTE_FUNCTIONS and len(node.args) > 1
        ):
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                yield node, node.args[0], name.value


def private_accelerate_accesses(source: str) -> list:
    """``(line, text)`` of each use of an Accelerate attribute whose name starts with ``_`` in ``source``: one of
    Accelerate's private names (``x._models``) on anything but ``self``/``cls``, any private attribute of an object
    that looks like Accelerate's, directly or through ``getattr``/``setattr``/``hasattr``/``delattr``, and a private
    name or module imported from ``accelerate``."""
    tree = ast.parse(source)
    accelerate_names, found = _private_imports(tree)
    for node, owner, name in _attribute_uses(tree):
        if not _is_private(name):
            continue
        ours = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
        if (name in ACCELERATE_PRIVATE_NAMES and not ours) or _looks_like_accelerate(owner, accelerate_names):
            found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize(
    "source",
    [
        "accelerator._models.append(model)",
        "self._accelerator._optimizers = []",
        "accelerator.gradient_state._set_sync_gradients(True)",
        "from accelerate import PartialState\nPartialState._shared_state != {}",
        "from accelerate.state import AcceleratorState as S\nS._reset_state()",
        "getattr(accelerator, '_models', [])",
        "setattr(self.accelerator, '_dataloaders', [])",
        "trainer.accelerator.state._mixed_precision",
        "model._is_accelerate_prepared",
        "from accelerate.utils import _private_helper",
    ],
)
def test_check_finds_each_private_access(source):
    """The check finds each form of private access to Accelerate."""
    assert private_accelerate_accesses(source), source


@pytest.mark.parametrize(
    "source",
    [
        "self._models = []",  # the package's own attribute
        "torch._foreach_mul_(grads, 2.0)",  # torch's
        "trainer._accelerator.prepare(model)",  # the trainer's own attribute, then public API
        "accelerator.free_memory()",
        "getattr(model, '__func__', None)",
    ],
)
def test_check_spares_public_attributes(source):
    """The check leaves public attributes, and the package's own, alone."""
    assert private_accelerate_accesses(source) == []


def test_private_access_only_in_internals():
    """No private Accelerate access outside parallel/accelerate_internals.py."""
    found = {
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != INTERNALS
        for line, text in private_accelerate_accesses(path.read_text())
    }
    assert not found, (
        "Accelerate's private state is used outside pytorch_accel_trainer/parallel/accelerate_internals.py; use the "
        f"public API, or add a checked function with a fallback there: {sorted(found)}"
    )


def test_internals_hold_only_what_api_lacks():
    """A test that the allow-listed module is really used for private state (else the allowance is stale)."""
    assert private_accelerate_accesses(INTERNALS.read_text())


# ------------------------------------------------------------------------------------------------
# The internals: present in the installed Accelerate, and each fallback without them
# ------------------------------------------------------------------------------------------------


def test_installed_accelerate_has_internals():
    """The installed Accelerate has every internal the package uses."""
    trainer = make_trainer(make_linear())
    assert accelerate_internals.missing_internals(trainer.accelerator) == [], (
        f"accelerate {accelerate.__version__} renamed private state the trainer uses: it runs on the fallbacks "
        "(pytorch_accel_trainer/parallel/accelerate_internals.py); follow the rename there"
    )


def test_each_run_starts_a_fresh_accelerator(monkeypatch):
    """Each run starts with an accelerator that forgot the last run, without collecting garbage."""
    trainer = make_trainer(make_linear())
    trainer.train(linear_dataset(), num_epochs=1, per_device_batch_size=8)
    monkeypatch.setattr(Accelerator, "free_memory", lambda self, *objects: pytest.fail("free_memory (gc) was called"))
    trainer.evaluate(linear_dataset(), per_device_batch_size=8)
    trainer.train(linear_dataset(), num_epochs=1, per_device_batch_size=8)
    assert trainer.accelerator.step == 0
    assert len(trainer.accelerator._models) == 1 and len(trainer.accelerator._optimizers) == 1  # this run's only


def test_no_prepared_lists_free_memory(monkeypatch):
    """Without the prepared lists, the public free_memory forgets them."""
    accelerator = make_trainer(make_linear()).accelerator
    freed = []
    monkeypatch.setattr(Accelerator, "free_memory", lambda self, *objects: freed.append(self))
    monkeypatch.delattr(accelerator, "_schedulers")  # a release that keeps them elsewhere
    accelerate_internals.forget_prepared(accelerator)
    assert freed == [accelerator]
    assert accelerate_internals.missing_internals(accelerator) == [
        f"accelerate {accelerate.__version__}: Accelerator.{name}"
        for name in ("_models", "_optimizers", "_schedulers", "_dataloaders")
    ]


def test_set_up_without_shared_state(monkeypatch):
    """Without the shared process state, set up means an accelerator was created."""
    make_trainer(make_linear())  # an Accelerator: both states are set up
    assert accelerate_internals.process_state_is_set_up()
    monkeypatch.delattr(PartialState, "_shared_state")
    assert accelerate_internals.process_state_is_set_up()  # accelerate.state.is_initialized()
    assert f"accelerate {accelerate.__version__}: PartialState._shared_state" in (
        accelerate_internals.missing_internals(Accelerator.__new__(Accelerator))
    )


def test_no_state_reset_failed_set_up_warns(monkeypatch):
    """Without the state reset, a failed set-up warns that the precision stays."""
    monkeypatch.delattr(AcceleratorState, "_reset_state")
    with pytest.warns(UserWarning, match=rf"accelerate {re.escape(accelerate.__version__)} has no .*restart"):
        accelerate_internals.undo_failed_set_up()


def test_state_reset_undoes_failed_set_up(monkeypatch):
    """With the state reset, a failed set-up is undone silently."""
    resets = []
    monkeypatch.setattr(AcceleratorState, "_reset_state", staticmethod(lambda: resets.append(True)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerate_internals.undo_failed_set_up()
    assert resets == [True]


# ------------------------------------------------------------------------------------------------
# Requirements: lower bounds only, the one the docs name and the CI script tests
# ------------------------------------------------------------------------------------------------


def _setup_cfg_requirements() -> dict:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in parser["options"]["install_requires"].splitlines()]
    requirements = [Requirement(line) for line in lines if line and not line.startswith("#")]
    return {requirement.name: requirement for requirement in requirements}


def _lower_bound(requirement: Requirement) -> str:
    (bound,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
    return bound


@pytest.mark.parametrize("name", ["accelerate", "torch"])
def test_newer_releases_satisfy_requirements(name):
    """pip installs the package beside any newer accelerate and torch: no upper bound, here or in the installed
    metadata (which pip built from setup.cfg; a stale one needs ``pip install -e .`` again)."""
    declared = _setup_cfg_requirements()[name]
    installed = [
        Requirement(line)
        for line in importlib.metadata.requires("pytorch-accel-trainer") or []
        if Requirement(line).name == name and Requirement(line).marker is None
    ]
    assert [str(requirement.specifier) for requirement in installed] == [str(declared.specifier)], (
        f"the installed metadata of pytorch-accel-trainer requires {[str(r) for r in installed]}, setup.cfg "
        f"{declared}: reinstall it (pip install -c constraints.txt -e .)"
    )
    for version in ("99.0", "3.0.0", "2.99.1"):
        assert declared.specifier.contains(version), f"{declared} refuses {name} {version}"
    assert not declared.specifier.contains("0.1"), f"{declared} has no lower bound"


def test_lower_bounds_match_docs_and_ci():
    """The lower bounds are the ones docs/versions.md names and CI tests."""
    requirements = _setup_cfg_requirements()
    accelerate_floor, torch_floor = _lower_bound(requirements["accelerate"]), _lower_bound(requirements["torch"])
    page = (ROOT / "docs" / "versions.md").read_text()
    assert f"`accelerate>={accelerate_floor}`" in page and f"`torch>={torch_floor}`" in page
    assert f"accelerate>={accelerate_floor}" in (ROOT / "README.md").read_text()
    script = (ROOT / "tests" / "scripts" / "lowest_accelerate.sh").read_text()
    assert "setup.cfg" in script  # the script reads the bound from setup.cfg, so that it tests this one


def test_installed_releases_meet_requirements():
    requirements = _setup_cfg_requirements()
    for name, version in (("accelerate", accelerate.__version__), ("torch", torch.__version__.split("+")[0])):
        assert requirements[name].specifier.contains(version), f"{name} {version} is outside {requirements[name]}"
