"""LoRA adapters (through PEFT) and frozen parameters for a Hugging Face model: options checked before any process
starts (on a meta-device model), applied to the model in ``configure_model``.

The strategies handle what PEFT builds under every layout (``docs/finetuning.md``): the adapters follow their base
layer's tensor-parallel style, travel with their pipeline stage, and are initialized by PEFT's rule once they have
memory after a meta-device build.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch

from torch import nn

#: PEFT's own choice of every linear layer but the output head
ALL_LINEAR = "all-linear"


@dataclass
class LoRA:
    """PEFT ``LoraConfig`` options: the adapters' rank ``r``, scale (the update is ``alpha / r * B @ A``), dropout on
    their input, the modules that get them (``"all-linear"``, or names: ``["q_proj", "v_proj"]``, matched as PEFT
    does, by the module's name or its last dotted segments) and, for a mixture of experts whose experts are stacked
    parameters rather than modules, the parameters that get them (``target_parameters``, e.g.
    ``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | str = ALL_LINEAR
    target_parameters: list[str] | None = None

    def check(self, prefix: str = "lora.") -> None:
        """Raise a clear error for values PEFT would accept but that make no sense (or fail much later); ``prefix``
        names the options in the messages."""
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"{prefix}r={self.r!r} must be a positive int (the adapters' rank, e.g. 8).")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ValueError(f"{prefix}alpha={self.alpha!r} must be a positive number (the update is scaled by "
                             f"alpha / r; e.g. 2 * r).")
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float))
                or not 0.0 <= self.dropout < 1.0):
            raise ValueError(f"{prefix}dropout={self.dropout!r} must be a probability in [0, 1), e.g. 0.05.")
        if self.target_modules != ALL_LINEAR and not _names(self.target_modules):
            raise ValueError(f"{prefix}target_modules={self.target_modules!r} must be {ALL_LINEAR!r} or a non-empty "
                             f"list of module names, e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj'].")
        if self.target_parameters is not None and not _names(self.target_parameters):
            raise ValueError(f"{prefix}target_parameters={self.target_parameters!r} must be a non-empty list of "
                             f"parameter names, e.g. ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'].")

    def check_targets(self, model: nn.Module, prefix: str = "lora.") -> None:
        """Every named target must match some module (parameter) of ``model``; raises naming those that match
        nothing and what there is to pick from. Works on the meta device."""
        if self.target_modules != ALL_LINEAR:
            names = [name for name, _ in model.named_modules() if name]
            unmatched = [t for t in self.target_modules if not any(_ends_with(n, t) for n in names)]
            if unmatched:
                linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
                raise ValueError(f"{prefix}target_modules: {unmatched} match no module of {type(model).__name__}. Its "
                                 f"Linear layers are named {linear}; pick from those, or use {ALL_LINEAR!r}.")
        if self.target_parameters is not None:
            names = [name for name, _ in model.named_parameters()]
            unmatched = [t for t in self.target_parameters if not any(_ends_with(n, t) for n in names)]
            if unmatched:
                stacked = sorted({n.split("layers.", 1)[-1].split(".", 1)[-1] for n, p in model.named_parameters()
                                  if p.ndim == 3})
                raise ValueError(f"{prefix}target_parameters: {unmatched} match no parameter of "
                                 f"{type(model).__name__}. Its stacked (3-D) parameters are {stacked or 'none'}.")

    def apply(self, model: nn.Module) -> nn.Module:
        """``model`` wrapped by PEFT ``get_peft_model``: adapters on the targets, every other parameter frozen."""
        from peft import LoraConfig, get_peft_model

        self.check()
        self.check_targets(model)
        targets = self.target_modules if self.target_modules == ALL_LINEAR else list(self.target_modules)
        extra = {"target_parameters": list(self.target_parameters)} if self.target_parameters else {}
        config = LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                            **extra)
        return get_peft_model(model, config)


def _names(value: object) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(t, str) and t for t in value)


def _ends_with(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _matches(name: str, pattern: str) -> bool:
    """A parameter's name against a glob: the parameter itself or any module above it."""
    return fnmatch(name, pattern) or fnmatch(name, pattern + ".*")


def freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """Set ``requires_grad=False`` on every parameter of ``model`` whose name matches one of the glob ``patterns``
    (``model.embed_tokens``, ``model.layers.[0-3].*``, ``*.mlp.*``); returns the frozen names. A pattern that matches
    nothing is refused, with examples of the names there are."""
    if not _names(patterns):
        raise ValueError(f"freeze={patterns!r} must be a non-empty list of parameter-name globs, e.g. "
                         f"['model.embed_tokens', 'model.layers.[0-3].*'].")
    names = [name for name, _ in model.named_parameters()]
    unmatched = [p for p in patterns if not any(_matches(n, p) for n in names)]
    if unmatched:
        raise ValueError(f"freeze: {unmatched} match no parameter of {type(model).__name__}. Its parameters are named "
                         f"like {names[:3] + names[-2:]}.")
    frozen = []
    for name, param in model.named_parameters():
        if any(_matches(name, p) for p in patterns):
            param.requires_grad_(False)
            frozen.append(name)
    return frozen
