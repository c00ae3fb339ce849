"""The documentation: README.md and the MkDocs site in docs/ (single process, no job launched).

The site builds with ``mkdocs build --strict``; every Python block parses, every YAML block loads, the repository
paths that bash blocks name exist, the blocks marked ``<!-- runnable -->`` run, and relative links resolve.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]
RUNNABLE = "<!-- runnable -->"

# a fence opens with ``` (possibly indented, inside a list item) and closes at the same indentation
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
# repository paths a bash block may name: folders of this repo, then a file with an extension
_REPO_PATH = re.compile(
    r"(?<![\w./-])((?:example_projects|benchmarks|tests|lightning_par|docs)/[\w./-]*\.(?:py|yaml|yml|md))")
# [text](target): inline links; images too
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


class Block:
    def __init__(self, page: Path, line: int, lang: str, code: str, runnable: bool) -> None:
        self.page, self.line, self.lang, self.code, self.runnable = page, line, lang, code, runnable

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, dedented; ``runnable`` when the line before the fence (blank lines
    aside) is the ``<!-- runnable -->`` marker."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group("indent"), m.group("lang"), i
        j = i + 1
        while j < len(lines) and not (lines[j].startswith(indent + "```") and lines[j].strip() == "```"):
            j += 1
        assert j < len(lines), f"{page.name}:{start + 1}: code fence never closed"
        before = [ln.strip() for ln in lines[:start] if ln.strip()]
        runnable = bool(before) and before[-1] == RUNNABLE
        code = textwrap.dedent("\n".join(lines[start + 1:j]))
        blocks.append(Block(page, start + 1, lang, code, runnable))
        i = j + 1
    return blocks


def prose(page: Path) -> str:
    """The page without its code blocks and inline code spans (links are looked for there only)."""
    text = re.sub(r"^([ \t]*)```.*?^\1```[ \t]*$", "", page.read_text(), flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


BLOCKS = [b for page in PAGES for b in code_blocks(page)]


def _blocks(lang: str, runnable: bool | None = None) -> list:
    chosen = [b for b in BLOCKS if b.lang == lang and (runnable is None or b.runnable == runnable)]
    return [pytest.param(b, id=b.id) for b in chosen]


def test_pages_exist():
    names = {p.name for p in DOCS.glob("*.md")}
    for page in ("index.md", "strategies.md", "checkpoints.md", "migrating.md", "huggingface.md", "finetuning.md",
                 "monitoring.md", "examples.md", "planner.md", "benchmarks.md", "troubleshooting.md", "tests.md",
                 "status.md", "api.md"):
        assert page in names
    assert sum(b.runnable for b in BLOCKS) >= 3, "a few blocks should be marked runnable"


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') is not installed")
    pytest.importorskip("mkdocstrings")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # mkdocs-material's notice about its successor
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("lightning_par.FSDP2Strategy", "lightning_par.NDParallelStrategy", "lightning_par.ParallelDims",
                 "lightning_par.plan_layouts", "lightning_par.callbacks.DeviceUtilizationMonitor"):
        assert f'id="{name}"' in api, f"{name} missing from the API reference"


@pytest.mark.parametrize("block", _blocks("python"))
def test_python_blocks_parse(block):
    ast.parse(block.code, filename=block.id)


@pytest.mark.parametrize("block", _blocks("yaml"))
def test_yaml_blocks_load(block):
    assert yaml.safe_load(block.code) is not None


@pytest.mark.parametrize("block", _blocks("bash"))
def test_bash_blocks_name_existing_paths(block):
    missing = [p for p in _REPO_PATH.findall(block.code) if not (ROOT / p).exists()]
    assert not missing, f"{block.id}: {missing} do not exist"


@pytest.mark.parametrize("block", _blocks("python", runnable=True))
def test_runnable_blocks_run(block, tmp_path, monkeypatch):
    """Blocks that construct strategies, Trainers, layouts or plans (nothing is launched), each in a fresh
    namespace, in an empty working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    exec(compile(block.code, block.id, "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("page", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in _LINK.findall(prose(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s):, mailto: and in-page anchors (mkdocs --strict checks those of docs/)
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).resolve().exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files {broken}"


def test_readme_keeps_the_quickstart_commands():
    """CI runs the README's test command (.ci/run); both Quickstart commands stay verbatim."""
    readme = (ROOT / "README.md").read_text()
    for command in (
        'python3.11 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[dev]" '
        "&& pytest -q tests",
        'python3.11 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[dev]" '
        "&& python example_projects/gpt/train.py fit --config example_projects/gpt/configs/fsdp2.yaml",
    ):
        assert command in readme


def test_the_readme_names_every_registered_strategy_and_the_monitors_page_every_monitor():
    """Counted from the code: every name lightning_par registers with Lightning is in the README's import comment,
    and every monitor ``lightning_par.callbacks`` exports has its section on the monitoring page."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_par.callbacks as callbacks

    ours = sorted(name for name, entry in StrategyRegistry.items()
                  if entry["strategy"].__module__.startswith("lightning_par"))
    assert len(ours) == 7, ours
    readme = (ROOT / "README.md").read_text()
    comment = readme[readme.index("import lightning_par  # registers"):]
    comment = comment[:comment.index("\n\n")]
    assert [name for name in ours if f'"{name}"' not in comment] == []
    monitors = sorted(name for name in callbacks.__all__ if name.endswith("Monitor"))
    page = (ROOT / "docs" / "monitoring.md").read_text()
    assert [name for name in monitors if f"`{name}`" not in page] == []


def test_the_option_table_names_every_technique_option_and_the_strategy_takes_each_with_its_default():
    """Each technique's options are one dataclass (``techniques/recipe.OPTIONS``): the Options table of
    ``docs/strategies.md`` names every field, and ``NDParallelStrategy`` takes each as a flat keyword argument
    (LightningCLI reads its signature) with the dataclass's default."""
    import inspect
    from dataclasses import fields

    from lightning_par import NDParallelStrategy
    from lightning_par.techniques.recipe import OPTIONS

    text = (DOCS / "strategies.md").read_text()
    table = text[text.index("## Options"):]
    table = table[:table.index("\n\n", table.index("| option |"))]
    named = set(re.findall(r"`(\w+)`", "\n".join(row.split("|")[1] for row in table.splitlines() if "|" in row)))
    signature = inspect.signature(NDParallelStrategy.__init__).parameters
    for options in OPTIONS:
        for field in fields(options):
            assert field.name in named, f"{options.__name__}.{field.name} is missing from the option table"
            assert field.name in signature, field.name
            assert signature[field.name].default == field.default, field.name


def test_the_planner_table_names_every_weighed_option_with_its_default():
    """``plan_layouts``' table in ``docs/planner.md`` names each option the techniques let the planner weigh
    (``planned(..., weigh=...)`` in their options dataclasses) with the values weighed by default."""
    from lightning_par.planner.search import WEIGH

    text = (DOCS / "planner.md").read_text()
    table = text[text.index("`plan_layouts` options (keyword-only):"):]
    rows = {row.split("|")[1].strip().strip("`"): row.split("|")[2].strip().strip("`")
            for row in table[:table.index("\n\n", table.index("| option |"))].splitlines()[2:]}
    for name, default in WEIGH.items():
        assert name in rows, f"{name} is missing from plan_layouts' table"
        assert rows[name] == repr(default).replace("'", '"'), (name, rows[name])
