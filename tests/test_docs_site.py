"""The documentation site: it builds with no warning, and its API reference has every public name of the package.

``mkdocs build --strict`` (mkdocs.yml) fails on any warning: a broken link or anchor, a page missing from the nav, a
docstring that documents an argument its function does not have. It needs the docs tools (mkdocs, mkdocs-material,
mkdocstrings[python]) and takes seconds, so it is ``slow``. The reference check reads docs/api/ and imports the
package only, so a new public name without a ``:::`` entry fails at once.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pytorch_accel_trainer

ROOT = Path(__file__).resolve().parents[1]
API_DOCS = ROOT / "docs" / "api"
PACKAGE = "pytorch_accel_trainer"

#: Modules whose every public name must be in the reference: the names of their ``__all__``, else every name a
#: top-level ``def``, ``class`` or assignment of the module defines without a leading underscore.
PUBLIC_MODULES = (
    "",
    "trainer",
    "callbacks",
    "tracking",
    "plotting",
    "predictions",
    "run_config",
    "loop.run_state",
    "placeholders",
    "schedulers",
    "finetuning",
    "utils",
    "state.training_state",
    "state.checkpointing",
    "cli.config",
    "cli",
    "cli.commands",
    "cli.parsing",
    "cli.run_folder",
    "cli.tune",
    "errors",
)
#: Implementation modules that also hold a few public names (imported from there by users and the guide pages).
PUBLIC_NAMES_OF_OTHER_MODULES = {
    "parallel.distributed": ("create_accelerator", "ProcessAgreement"),
    "loop.lr_find": ("LrFinderResult", "suggest_lr"),
}
#: Implementation modules: the subpackages' helpers (the Trainer's mixins' methods are the Trainer's, in its
#: reference) and the modules re-exported by the callbacks, schedulers and cli.tune packages. A new module goes in one
#: of these places: whether it is public is decided.
INTERNAL_MODULES = (
    "__main__",
    "console",
    "data",
    "loop",
    "loop.*",
    "state",
    "state.*",
    "parallel",
    "parallel.*",
    "cli.tune.*",
    "callbacks.*",
    "schedulers.*",
)

_DIRECTIVE = re.compile(r"^::: *(?P<path>[\w.]+) *$")


def _module_name(short: str) -> str:
    return f"{PACKAGE}.{short}" if short else PACKAGE


@functools.cache
def _public_names(module) -> list:
    if hasattr(module, "__all__"):
        return [name for name in module.__all__ if not name.startswith("_") or name.endswith("__")]
    names = []
    for node in ast.parse(Path(module.__file__).read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]
    return [name for name in names if not name.startswith("_")]


@functools.cache
def _import_path(path: str):
    """The object a ``:::`` path names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def _directives() -> list:
    """``(page, path, options)`` for each ``::: path`` of docs/api/, options being the indented lines after it."""
    directives = []
    for page in sorted(API_DOCS.glob("*.md")):
        lines = page.read_text().splitlines()
        for index, line in enumerate(lines):
            match = _DIRECTIVE.match(line)
            if match:
                options = []
                for option in lines[index + 1 :]:
                    if not option.startswith("    "):
                        break
                    options.append(option.strip())
                directives.append((page.name, match["path"], options))
    return directives


def _is_covered(value, name: str, module, directives: list, reference_text: str) -> bool:
    for _, path, options in directives:
        rendered = _import_path(path)
        if inspect.ismodule(rendered) and "members: false" not in options:
            if name in _public_names(rendered) and getattr(rendered, name) is value:
                return True  # rendered with the whole module, this one or the one it is defined in
        elif rendered is value and (path.endswith(f".{name}") or inspect.isclass(value) or inspect.isroutine(value)):
            return True  # this object, under this name or, when re-exported, under the one it is defined with
    defined_in = getattr(value, "__module__", None) or ""
    if (inspect.isclass(value) or inspect.isroutine(value)) and not defined_in.startswith(PACKAGE):
        return f"{module.__name__}.{name}" in reference_text  # re-exported from another library: named, with a link
    return False


def test_every_module_is_public_or_internal():
    modules = {info.name for info in pkgutil.walk_packages(pytorch_accel_trainer.__path__, f"{PACKAGE}.")}
    families = tuple(_module_name(pattern[:-1]) for pattern in INTERNAL_MODULES if pattern.endswith(".*"))  # "x."
    listed = {_module_name(name) for name in (*PUBLIC_MODULES, *PUBLIC_NAMES_OF_OTHER_MODULES, *INTERNAL_MODULES)}
    unplaced = sorted(name for name in modules if name not in listed and not name.startswith(families))
    assert not unplaced, f"place each new module in PUBLIC_MODULES or INTERNAL_MODULES of this test: {unplaced}"
    stale = sorted(name for name in listed if "*" not in name and name != PACKAGE and name not in modules)
    assert not stale, f"these modules no longer exist: {stale}"


def test_directives_name_objects_and_members():
    """Every directive names an object, and renders its members."""
    directives = _directives()
    assert directives, "docs/api/ has no ::: directives"
    for page, path, options in directives:
        _import_path(path)  # raises for a name that does not exist
        restricting = [option for option in options if re.match(r"(members|filters):", option)]
        if path != PACKAGE:  # the package page shows only its docstring; its names have their own entries
            assert not restricting, f"docs/api/{page}: ::: {path} hides members ({restricting}); list them instead"
    trainer = [options for _, path, options in directives if path == f"{PACKAGE}.trainer.Trainer"]
    assert len(trainer) == 1 and "inherited_members: true" in trainer[0], "the Trainer's mixins hold hooks: render them"


def test_public_names_in_api_reference():
    """Every public name is in the API reference."""
    directives = _directives()
    reference_text = "\n".join(page.read_text() for page in API_DOCS.glob("*.md"))
    wanted = [(_module_name(short), None) for short in PUBLIC_MODULES]
    wanted += [(_module_name(short), names) for short, names in PUBLIC_NAMES_OF_OTHER_MODULES.items()]
    missing = []
    for module_name, names in wanted:
        module = importlib.import_module(module_name)
        for name in names or _public_names(module):
            if not _is_covered(getattr(module, name), name, module, directives, reference_text):
                missing.append(f"{module_name}.{name}")
    assert not missing, (
        f"not in the API reference: {missing}. Add a `::: <module>.<name>` line to a page of docs/api/ "
        "(or render the whole module there)."
    )


@pytest.mark.slow
@pytest.mark.tooling
def test_the_site_builds_with_no_warning(tmp_path):
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about MkDocs 2.0: not a warning
    result = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}", pytrace=False)
    assert (tmp_path / "site" / "api" / "trainer" / "index.html").is_file()
