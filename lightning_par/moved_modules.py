"""The old import paths of the modules that moved into their technique's folder (``techniques/<technique>/``), and
of ``lm.hub`` (now ``hub``, where the strategies read it).

``import lightning_par.parallel.pipeline_live`` (or ``from lightning_par.parallel.context import ...``) still works:
it returns the moved module itself (the same object, so patching it patches the engine's). No file stands at the
old path: a file there would hide the move from git, and a merge of someone's edit to the old file would no longer
follow it to its new place. Importing this module (``lightning_par/__init__.py`` does) installs the finder.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

#: old module path -> new one
MOVED = {f"lightning_par.{old}": f"lightning_par.techniques.{new}" for old, new in {
    "parallel.tensor": "tensor.tensor",
    "parallel.tensor_plan": "tensor.tensor_plan",
    "parallel.tensor_check": "tensor.tensor_check",
    "parallel.sequence_regather": "tensor.sequence_regather",
    "techniques.tensor_parallel": "tensor.tensor_parallel",
    "parallel.context": "context.context",
    "parallel.context_sharding": "context.context_sharding",
    "parallel.context_routing": "context.context_routing",
    "parallel.context_hf": "context.context_hf",
    "techniques.context_parallel": "context.context_parallel",
    "parallel.pipeline": "pipeline.pipeline",
    "parallel.pipeline_live": "pipeline.pipeline_live",
    "parallel.pipeline_hf": "pipeline.pipeline_hf",
    "parallel.schedule_recorder": "pipeline.schedule_recorder",
    "techniques.pipeline_parallel": "pipeline.pipeline_parallel",
    "techniques.pipeline_adapter": "pipeline.pipeline_adapter",
    "parallel.experts": "experts.experts",
    "techniques.expert_parallel": "experts.expert_parallel",
    "parallel.fsdp": "sharding.fsdp",
    "parallel.grad_norm": "sharding.grad_norm",
    "techniques.fully_sharded": "sharding.fully_sharded",
    "parallel.recompute": "recompute.recompute",
    "techniques.activation_checkpointing": "recompute.activation_checkpointing",
}.items()}
MOVED["lightning_par.lm.hub"] = "lightning_par.hub"  # (below the strategies: their pretrained= takes Hub IDs too)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`MOVED` and loads it as the module at the new one."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system sets ``__spec__`` to ours: put its own back
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once), after the usual finders."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())


install()
