"""Pipeline stages of a Hugging Face transformers model, cut from the model's own pipeline plan (no tracing).

transformers describes how its models are to be split: ``model.pp_plan`` (the class's ``_pp_plan`` plus the
config's ``base_model_pp_plan``) names the modules a pipeline runs in order, e.g. ``model.embed_tokens`` (input_ids
-> inputs_embeds), ``model.layers`` (the decoder layers), ``model.norm`` and ``lm_head`` (hidden states -> logits).
The layers are cut like any block list; the entries before them go to the first stage, those after them to the last.
Modules that hold only buffers (the rotary embedding's ``inv_freq``) are needed by every stage and kept on all of
them; any other module with weights that the plan does not name is refused (no stage would know when to run it).

A stage runs the model's *own* forward code on a view of the model holding only its layers (the others are
identities, so per-layer attention types still line up), as transformers' own pipeline support does: the first
stage from ``input_ids``, later stages from the previous stage's hidden states passed as ``inputs_embeds``, the
last stage through the causal-LM head (so logit scaling or soft-capping in the head's forward stays). The plan's
contract is what makes that exact: ``embed_tokens(input_ids)`` *is* ``inputs_embeds``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_par.parallel.hf import outermost_hf_models
from lightning_par.parallel.sequence_scope import active_scope, context_positions


@dataclass(frozen=True)
class HFPipelineModel:
    """Where the transformers model sits in the user's module, and its plan resolved to FQNs of that module."""

    fqn: str  # of the transformers model inside the LightningModule ("" if it is the module itself)
    model: nn.Module
    base_fqn: str  # of its base model (the one with ``layers``)
    first: list[str]  # plan entries before the layers, FQNs in the LightningModule
    layers: str
    last: list[str]

    def join(self, name: str) -> str:
        return f"{self.fqn}.{name}" if self.fqn else name


def _plan_of(model: nn.Module) -> dict[str, object]:
    plan = getattr(model, "pp_plan", None)
    if isinstance(plan, dict) and plan:
        return plan
    plan = dict(getattr(type(model), "_pp_plan", None) or {})  # transformers < 5: assemble it the same way
    base = model.base_model_prefix if isinstance(getattr(model, model.base_model_prefix, None), nn.Module) else ""
    for key, value in (getattr(model.config, "base_model_pp_plan", None) or {}).items():
        plan[f"{base}.{key}" if base else key] = value
    return plan


def find_hf_pipeline_model(module: nn.Module) -> HFPipelineModel | None:
    """The transformers model to pipeline, if ``module`` holds one with a pipeline plan; else None (the traced
    path). More than one such model is refused: the stages would not know whose layers to cut."""
    candidates = [(fqn, m) for fqn, m in outermost_hf_models(module) if _plan_of(m)]
    if not candidates:
        return None
    if len(candidates) > 1:
        raise ValueError(f"pipeline parallelism found several Hugging Face models with a pipeline plan "
                         f"({[fqn for fqn, _ in candidates]}); it pipelines one model. Keep one in the module.")
    fqn, model = candidates[0]
    plan = _plan_of(model)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    entries = sorted(plan, key=lambda name: order.get(name, -1))
    missing = [name for name in entries if name not in order]
    layers = [name for name in entries if isinstance(model.get_submodule(name), nn.ModuleList)] if not missing else []
    if missing or len(layers) != 1:
        raise ValueError(f"{type(model).__name__}'s pipeline plan {sorted(plan)} does not name its modules and one "
                         f"list of layers; it cannot be pipelined from its plan.")
    split = entries.index(layers[0])
    prefix = (fqn + ".") if fqn else ""
    base_fqn = layers[0].rpartition(".")[0]
    return HFPipelineModel(fqn, model, prefix + base_fqn if base_fqn else fqn, [prefix + e for e in entries[:split]],
                           prefix + layers[0], [prefix + e for e in entries[split + 1:]])


def shared_buffer_modules(module: nn.Module, hf: HFPipelineModel) -> list[str]:
    """Modules outside the plan's entries that hold buffers but no parameters (rotary embeddings): every stage
    needs them. Any other weight-holding module outside the plan is refused here, naming it."""
    named = (hf.layers, *hf.first, *hf.last)
    shared = []
    for name, sub in module.named_modules():
        if any(name == n or name.startswith(n + ".") for n in named):
            continue
        if list(sub.parameters(recurse=False)):
            raise ValueError(f"{name!r} ({type(sub).__name__}) holds weights that the pipeline plan of "
                             f"{type(hf.model).__name__} does not name, so no stage would run it. Under pipeline "
                             f"parallelism keep only the Hugging Face model's modules in the LightningModule.")
        if list(sub.buffers(recurse=False)):
            shared.append(name)
    return shared


class _Skipped(nn.Module):
    """Stands for a layer another stage runs: hands the hidden states through."""

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return hidden_states


@contextmanager
def _swapped(owner: nn.Module, name: str, replacement: nn.Module | None) -> Iterator[None]:
    if replacement is None:
        yield
        return
    original = owner._modules[name]
    owner._modules[name] = replacement
    try:
        yield
    finally:
        owner._modules[name] = original


class HFStage(nn.Module):
    """One pipeline stage of a transformers causal LM: the user's own modules, run by the model's own forward.

    Children are the stage's real modules (so ``parameters()`` are exactly this stage's, as the zero-bubble
    schedules need); the transformers model itself is held without registering it.
    """

    def __init__(self, module: nn.Module, hf: HFPipelineModel, layer_ids: Sequence[int], first: bool,
                 last: bool, shared: Sequence[str], seq_len: int | None = None, tables: Any = None) -> None:
        super().__init__()
        self._tables = (tables,)  # the pipeline's RowTables (not a module)
        self.first, self.last = first, last
        self.seq_len = seq_len  # of the stage inputs' sequences (the first stage's token ids)
        self._hf_model = (hf.model,)  # a tuple: not registered as a child
        self._base = (module.get_submodule(hf.base_fqn),)
        layers = module.get_submodule(hf.layers)
        self.layer_ids = list(layer_ids)
        self.layers = nn.ModuleDict({str(i): layers[i] for i in self.layer_ids})
        self.edges = nn.ModuleDict({name.replace(".", "__"): module.get_submodule(name)
                                    for name in (*(hf.first if first else ()), *(hf.last if last else ()))})
        self.shared = nn.ModuleDict({name.replace(".", "__"): module.get_submodule(name) for name in shared})
        self._layers_name = hf.layers.rpartition(".")[2]
        self._view = nn.ModuleList([layers[i] if i in set(self.layer_ids) else _Skipped() for i in range(len(layers))])
        # entries after the layers that live in the base model (the final norm) are skipped before the last stage
        base_prefix = hf.base_fqn + "." if hf.base_fqn else ""
        self._base_tail = [n[len(base_prefix):] for n in hf.last if n.startswith(base_prefix) and "." not in
                           n[len(base_prefix):]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, model = self._base[0], self._hf_model[0]
        chunk = None
        if not self.first and self.seq_len is not None and x.shape[1] != self.seq_len:
            # sequence parallelism hands this rank's sequence chunk on between stages (1/tp of the bytes); the
            # model derives its masks and positions from its input's length, so it gets a placeholder of the whole
            # sequence (a broadcast zero, no memory) and the first layer gets the chunk back
            chunk, x = x, x.new_zeros(()).expand(x.shape[0], self.seq_len, *x.shape[2:])
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        rows = self._tables[0].of(self) if self._tables[0] is not None else {}
        # the rows' own positions (packed documents), else the global ones (this rank's tokens under context
        # parallelism; arange otherwise)
        positions = rows.get("position_ids")
        if positions is None:
            positions = context_positions(x.shape[1], x.device).unsqueeze(0)
        scope = active_scope()
        if scope is not None:  # the model's own pre-hook is not on this path (non-last stages call the base model)
            scope.set_tokens(rows.get("position_ids"), rows.get("attention_mask"), confirm=True)
        elif "attention_mask" in rows:
            inputs["attention_mask"] = rows["attention_mask"]
        with _swapped(base, self._layers_name, self._view), _skip_tail(base, self._base_tail, skip=not self.last), \
                _first_input(self.layers[str(self.layer_ids[0])] if self.layer_ids else None, chunk):
            if self.last:
                return model(**inputs, position_ids=positions, use_cache=False).logits
            return base(**inputs, position_ids=positions, use_cache=False).last_hidden_state


@contextmanager
def _first_input(layer: nn.Module | None, value: torch.Tensor | None) -> Iterator[None]:
    """While in the block: ``layer`` gets ``value`` as its hidden states (its first positional argument, or
    ``hidden_states=``), whatever the model passes it."""
    if layer is None or value is None:
        yield
        return

    def swap(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (value, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": value}

    handle = layer.register_forward_pre_hook(swap, with_kwargs=True, prepend=True)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _skip_tail(base: nn.Module, names: Sequence[str], skip: bool) -> Iterator[None]:
    if not skip or not names:
        yield
        return
    with _swapped(base, names[0], _Skipped()), _skip_tail(base, names[1:], skip):
        yield


def check_forward_contract(template: nn.Module, hf: HFPipelineModel, args: tuple[object, ...],
                           tables: dict[str, torch.Tensor] | None = None) -> None:
    """The stages feed the module's input to the transformers model as ``input_ids`` and hand its logits on, in
    place of the user's ``forward``: check, on the meta-device ``template``, that the user's forward does exactly
    that (one call of the model with the input as ``input_ids``, and the rows' ``position_ids`` / ``attention_mask``
    it was given as those, nothing else that changes its result, the logits returned), so a forward that does more
    fails here instead of training something else."""
    tables = tables or {}
    from transformers.modeling_outputs import CausalLMOutputWithPast

    model = template.get_submodule(hf.fqn) if hf.fqn else template
    name = type(model).__name__
    meta_args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    calls: list[tuple[tuple, dict]] = []
    logits = torch.empty(0, device="meta")

    def record(*call_args: object, **call_kwargs: object) -> CausalLMOutputWithPast:
        nonlocal logits
        calls.append((call_args, call_kwargs))
        ids = call_kwargs.get("input_ids", call_args[0] if call_args else None)
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else (0, 0)
        logits = torch.empty(*shape, model.config.vocab_size, device="meta")
        return CausalLMOutputWithPast(logits=logits)

    contract = (f"under pipeline parallelism a LightningModule holding {name} must have forward(x) return "
                f"`self.<model>(input_ids=x).logits`, or forward(x, position_ids=p) (packed rows) return "
                f"`self.<model>(input_ids=x, position_ids=p).logits` (the stages run {name}'s own modules from its "
                f"pipeline plan)")
    meta_tables = {k: t.to("meta") for k, t in tables.items()}
    model.forward = record  # the template is this pipeline's own meta copy: patching it touches nothing else
    try:
        with torch.no_grad():
            out = template(*meta_args, **meta_tables)
    finally:
        del model.forward
    if len(calls) != 1:
        raise ValueError(f"{contract}; forward called {name} {len(calls)} times.")
    (call_args, call_kwargs), = calls
    ids = call_kwargs.get("input_ids", call_args[0] if call_args else None)
    extra = [k for k, v in call_kwargs.items() if k != "input_ids" and v is not None
             and k not in ("use_cache", "return_dict", "output_attentions", "output_hidden_states")
             and not (k in meta_tables and v is meta_tables[k])]
    if len(meta_args) != 1 or ids is not meta_args[0] or extra or len(call_args) > 1:
        raise ValueError(f"{contract}; it was called with {sorted(call_kwargs) or 'positional arguments'}"
                         f"{' (' + ', '.join(extra) + ' are not passed on between stages)' if extra else ''}.")
    if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
        raise ValueError(f"{contract}; forward returned {type(out).__name__} "
                         f"{tuple(getattr(out, 'shape', ()))} instead of the logits {tuple(logits.shape)}.")
