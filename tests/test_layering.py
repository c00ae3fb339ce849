"""The package's imports point down: read from the source, so a change that ties two floors together fails here.

Floors, lowest first: the top-level helpers (``dims``, ``checks``, ``collectives``, ...) and ``parallel/`` (plain
torch.distributed that several techniques share); the techniques' torch-level code (``techniques/<technique>/``,
all but its technique object: usable without Lightning and without the cost model); ``costs/`` (the cost model,
which traces the model through that code); the technique objects (each technique's options, checks and cost
account, in its folder), ``techniques/technique.py`` under them and ``techniques/recipe.py`` over them; ``planner/``
(the search that runs the techniques); ``strategies/`` (Lightning). ``callbacks/`` observe training and import no
engine part but the torch-level code they read. A technique folder imports no other technique folder: what two
share lives on a floor below both.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_par"
TECHNIQUES = PACKAGE / "techniques"
#: the technique folders, and in each the files that are its technique object (options, checks, cost account) or
#: what it installs into the LightningModule; every other file of a folder is torch-level
TECHNIQUE_OBJECTS = {
    "tensor": {"tensor_parallel"},
    "context": {"context_parallel"},
    "pipeline": {"pipeline_parallel", "pipeline_adapter"},
    "experts": {"expert_parallel"},
    "sharding": {"fully_sharded"},
    "recompute": {"activation_checkpointing"},
    "float8": {"float8_training"},
    "quantize": {"quantize_base"},
}
#: what each folder must never import (higher floors, and for callbacks every engine floor)
FORBIDDEN = {
    "parallel": {"costs", "techniques", "planner", "strategies", "callbacks"},
    "costs": {"planner", "strategies", "callbacks"},
    "techniques": {"planner", "strategies", "callbacks"},
    "planner": {"strategies", "callbacks"},
    "callbacks": {"costs", "planner", "strategies"},
}


def _imports(path: Path) -> set[str]:
    """Every ``lightning_par`` module a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_par"):
            found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("lightning_par")}
    return found


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and (PACKAGE / parts[1]).is_dir() else None


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_a_folder_imports_nothing_from_the_floors_above_it(folder):
    upward = sorted(
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path in (PACKAGE / folder).rglob("*.py")
        for module in _imports(path)
        if _folder(module) in FORBIDDEN[folder]
    )
    assert not upward, "\n".join(upward)


def _technique_folder(module: str) -> str | None:
    """``tensor`` for ``lightning_par.techniques.tensor.tensor_plan`` (and the folder's package itself)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "techniques" and parts[2] in TECHNIQUE_OBJECTS else None


def _is_technique_object(module: str) -> bool:
    """A technique object's module, or the floor and the recipe they stand on and in (``techniques.technique``,
    ``techniques.recipe``, the ``techniques`` package that exports them)."""
    parts = module.split(".")
    if parts[:2] != ["lightning_par", "techniques"]:
        return False
    if len(parts) == 2 or parts[2] in ("technique", "recipe"):
        return True
    folder = _technique_folder(module)
    return folder is not None and len(parts) > 3 and parts[3] in TECHNIQUE_OBJECTS[folder]


def _torch_level_files() -> list[Path]:
    return [path for folder, objects in TECHNIQUE_OBJECTS.items() for path in (TECHNIQUES / folder).glob("*.py")
            if path.stem not in objects | {"__init__"}]


def _lightning_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found |= {n for n in names if n.split(".")[0] in ("lightning", "lightning_utilities", "pytorch_lightning")}
    return found


def test_the_technique_folders_are_the_ones_on_disk():
    folders = {p.name for p in TECHNIQUES.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(TECHNIQUE_OBJECTS)
    for folder, objects in TECHNIQUE_OBJECTS.items():
        assert {f"{o}.py" for o in objects} <= {p.name for p in (TECHNIQUES / folder).glob("*.py")}, folder


def test_every_technique_object_is_in_a_file_named_as_one():
    """A class deriving from ``Technique`` lives in a technique object's file (so the torch-level rules below do not
    miss a file that should obey them, nor hold one that cannot)."""
    misplaced = sorted(
        f"{path.relative_to(PACKAGE)}: {node.name}"
        for path in _torch_level_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "Technique" for b in node.bases))
    assert not misplaced, misplaced


def test_torch_level_files_import_neither_lightning_nor_the_cost_model():
    """A technique's torch-level code runs on plain torch.distributed: no Lightning, no cost model, no technique
    object."""
    wrong = sorted(
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path in _torch_level_files()
        for module in _imports(path) | _lightning_imports(path)
        if module.split(".")[0] != "lightning_par" or _folder(module) == "costs" or _is_technique_object(module))
    assert not wrong, "\n".join(wrong)


def test_the_cost_model_reads_no_technique_object():
    """``costs/`` traces the model through the techniques' torch-level code; the technique objects write into its
    sheet, so it never imports them."""
    wrong = sorted(f"{path.relative_to(PACKAGE)} imports {module}" for path in (PACKAGE / "costs").glob("*.py")
                   for module in _imports(path) if _is_technique_object(module))
    assert not wrong, "\n".join(wrong)


def test_callbacks_read_no_technique_object():
    wrong = sorted(f"{path.relative_to(PACKAGE)} imports {module}" for path in (PACKAGE / "callbacks").glob("*.py")
                   for module in _imports(path) if _is_technique_object(module))
    assert not wrong, "\n".join(wrong)


def test_a_technique_folder_imports_no_other_technique_folder():
    """What two techniques share lives on a floor below both (``parallel/``, the top-level helpers,
    ``techniques/technique.py``), so a change to one technique stays in its folder."""
    crossing = sorted(
        f"{path.relative_to(PACKAGE)} imports {module}"
        for folder in TECHNIQUE_OBJECTS
        for path in (TECHNIQUES / folder).glob("*.py")
        for module in _imports(path)
        if _technique_folder(module) not in (None, folder)
        or module in ("lightning_par.techniques", "lightning_par.techniques.recipe"))
    assert not crossing, "\n".join(crossing)


def test_no_two_top_level_modules_import_each_other():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    edges = {stem: {m.split(".")[1] for m in _imports(PACKAGE / f"{stem}.py") if "." in m} & top - {stem}
             for stem in top}
    both_ways = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if a < b and a in edges.get(b, ()))
    assert not both_ways, both_ways


def test_module_names_do_not_collide_across_folders():
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert [name for name, count in names.items() if count > 1] == []


def test_every_folder_is_a_package_that_an_install_ships():
    """setuptools' ``packages.find`` (pyproject.toml) ships only folders with an ``__init__.py``; an editable install
    imports the others anyway, so only a wheel would miss them."""
    folders = [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))]
    assert [str(p.relative_to(PACKAGE)) for p in folders if not (p / "__init__.py").is_file()] == []


def test_the_old_paths_of_moved_modules_import_the_moved_modules():
    """``lightning_par.parallel.pipeline_live`` and the other paths users import from still work: each is the moved
    module itself (``moved_modules.py``), and no file stands at an old path."""
    import importlib

    from lightning_par.moved_modules import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
        assert importlib.import_module(new).__spec__.name == new, old
        assert not (PACKAGE.parent / (old.replace(".", "/") + ".py")).exists(), old
    from lightning_par.parallel.pipeline_live import LivePipeline

    from lightning_par.techniques.pipeline.pipeline_live import LivePipeline as moved

    assert LivePipeline is moved


def test_the_planner_and_the_cost_model_name_no_technique_option():
    """An option lives in its technique's options dataclass (with ``NDParallelStrategy``'s flat keyword argument and
    the code that reads it): the planner's layouts, search, command line and the cost sheet reach the options the
    planner decides through the dataclasses' hooks (``techniques.technique.Options``), never by name."""
    import re

    from lightning_par.techniques.recipe import planned_options

    named = sorted(f"{path.relative_to(PACKAGE)}: {name}" for folder in ("planner", "costs")
                   for path in (PACKAGE / folder).rglob("*.py") for name in planned_options()
                   if re.search(rf"\b{name}\b", path.read_text()))
    assert named == []
