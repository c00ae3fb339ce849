"""The package's imports point down: read from the source, so a change that ties two floors together fails here.

Floors, lowest first: the top-level helpers (``dims``, ``checks``, ``collectives``, ...), ``parallel/`` (plain
torch.distributed), ``costs/`` (the cost model techniques write into), ``techniques/``, ``planner/`` (the search
that runs the techniques), ``strategies/`` (Lightning). ``callbacks/`` observe training and import no engine part.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_par"
FLOORS = ["parallel", "costs", "techniques", "planner", "strategies"]
# what each folder must never import (higher floors, and for callbacks every engine floor)
FORBIDDEN = {
    "parallel": {"costs", "techniques", "planner", "strategies", "callbacks"},
    "costs": {"techniques", "planner", "strategies", "callbacks"},
    "techniques": {"planner", "strategies", "callbacks"},
    "planner": {"strategies", "callbacks"},
    "callbacks": {"costs", "techniques", "planner", "strategies"},
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
        for path in (PACKAGE / folder).glob("*.py")
        for module in _imports(path)
        if _folder(module) in FORBIDDEN[folder]
    )
    assert not upward, "\n".join(upward)


def test_no_two_top_level_modules_import_each_other():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    edges = {stem: {m.split(".")[1] for m in _imports(PACKAGE / f"{stem}.py") if "." in m} & top - {stem}
             for stem in top}
    both_ways = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if a < b and a in edges.get(b, ()))
    assert not both_ways, both_ways


def test_module_names_do_not_collide_across_folders():
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert [name for name, count in names.items() if count > 1] == []


def test_every_folder_is_a_package_that_an_install_ships():
    """setuptools' ``packages.find`` (pyproject.toml) ships only folders with an ``__init__.py``; an editable install
    imports the others anyway, so only a wheel would miss them."""
    folders = [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))]
    assert [str(p.relative_to(PACKAGE)) for p in folders if not (p / "__init__.py").is_file()] == []
