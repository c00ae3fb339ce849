"""Plan a run without launching it: ``python -m lightning_par.plan``.

For a Hugging Face model config (a ``config.json``, or a model type and sizes) or a LightningCLI project (module and
data classes plus its YAML), on a world of any size, on a known device or on this machine:

    python -m lightning_par.plan --hf-config llama --hf-override hidden_size=4096 num_hidden_layers=32 \\
        --world 8 --device H100 --seq-len 8192 --batch 16 --precision bf16-mixed
    python -m lightning_par.plan --module example_projects.gpt.lit.GPTModule \\
        --datamodule example_projects.gpt.data.CharDataModule --config example_projects/gpt/configs/fsdp2.yaml \\
        --world 4 --yaml plan.yaml --json plan.json --plot plan.png

The model is built on the meta device (nothing allocated), traced once, and every valid layout is predicted and
ranked; the table (within 120 columns, with a legend) goes to stdout with the first layout's strategy arguments,
``accumulate_grad_batches`` and per-rank batch; ``--yaml`` writes them as a LightningCLI config to pass after the
project's own (``train.py fit --config configs/fsdp2.yaml --config plan.yaml``), ``--json`` every prediction.
Async tensor parallelism, never run yet (it needs 2+ CUDA GPUs), is ranked only with ``--async-tp``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_CHOICES = {"both": (True, False), "on": (True,), "off": (False,)}


def _parser() -> argparse.ArgumentParser:
    from lightning_par.planner.search import PIPELINE_SCHEDULES
    from lightning_par.techniques.pipeline.pipeline import SCHEDULES

    p = argparse.ArgumentParser(prog="python -m lightning_par.plan", description=__doc__.split("\n\n")[0])
    model = p.add_argument_group("the model")
    model.add_argument("--hf-config", help="a Hugging Face config.json (or its directory), or a model type (llama)")
    model.add_argument("--hf-override", nargs="*", default=[], metavar="KEY=VALUE",
                       help="config fields, e.g. hidden_size=4096 num_hidden_layers=32")
    model.add_argument("--module", help="a LightningModule class path (LightningCLI project)")
    model.add_argument("--datamodule", help="its LightningDataModule class path")
    model.add_argument("--config", nargs="+", metavar="YAML", help="the LightningCLI YAML (several: merged in "
                       "order, as LightningCLI merges repeated --config)")
    model.add_argument("--batch-arg", metavar="NAME", help="the data module's per-rank batch-size argument, which "
                       "--yaml sets (default: batch_size where the data module takes one)")
    tune = p.add_argument_group("fine-tuning (frozen weights have no gradients nor optimizer state)")
    tune.add_argument("--lora-rank", type=int, metavar="R", help="Hugging Face models: LoRA adapters of rank R "
                      "(PEFT) on --lora-targets; every other parameter frozen")
    tune.add_argument("--lora-targets", nargs="+", default=["all-linear"], metavar="NAME",
                      help="the modules LoRA adapts (PEFT's target_modules; default all-linear: every linear layer "
                      "but the head)")
    tune.add_argument("--lora-target-parameters", nargs="+", default=[], metavar="NAME",
                      help="parameters LoRA adapts directly (PEFT's target_parameters), e.g. a mixture of experts' "
                      "stacked 'mlp.experts.gate_up_proj' 'mlp.experts.down_proj'")
    tune.add_argument("--freeze", nargs="+", default=[], metavar="GLOB", help="parameters to freeze, by name "
                      "globs as the Hugging Face model names them, e.g. 'model.embed_tokens.*' 'model.layers.[0-7].*'")
    tune.add_argument("--quantize-base", choices=("nf4",), help="QLoRA: the blocks' frozen linear weights in 4 "
                      "bits (NF4: 0.516 bytes per weight), as NDParallelStrategy(quantize_base='nf4') stores them; "
                      "with --lora-rank or --freeze; tensor parallelism only where it cuts the weights into whole "
                      "blocks")
    data = p.add_argument_group("the batch")
    data.add_argument("--seq-len", type=int, help="tokens per sequence (Hugging Face models; default 4096)")
    data.add_argument("--batch", type=int, help="sequences per step, the global batch (default: 1 per device)")
    where = p.add_argument_group("where it runs")
    where.add_argument("--world", type=int, required=True, help="devices in all")
    where.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (default 8): mesh "
                       "dimensions within a node use --intra-link, those across nodes --inter-link")
    where.add_argument("--device", help="a known device (H100, H200, A100-80GB, B200, ...); default: this machine")
    where.add_argument("--intra-link", help="the link within a node (default: the device's own; pcie4 on this "
                       "machine)")
    where.add_argument("--inter-link", default="ib-ndr400", help="the link between nodes")
    where.add_argument("--compile", action="store_true", help="the run compiles (the strategy's compile=True): "
                       "the non-matmul ops priced as torch.compile fuses them (devices.FUSED_TRAFFIC of eager's "
                       "bytes; a GPU's only)")
    where.add_argument("--float8", choices=("tensorwise",), help="float8 training (the strategies' float8="
                       "'tensorwise'): the blocks' aligned linear layers' matmuls at the device's float8 rate, their "
                       "casts priced as memory traffic (a GPU with float8 matmuls only: devices.with_float8)")
    where.add_argument("--precision", default="bf16-mixed", help="the Trainer's precision, which sets the bytes "
                       "and the matmul rate priced: 32-true, bf16-mixed (default), 16-mixed or bf16-true")
    where.add_argument("--memory-budget", type=float, help="bytes per device (default: the device's memory less "
                       "the reserve)")
    where.add_argument("--memory-reserve", type=float, default=0.1, help="share of device memory kept free for "
                       "allocator fragmentation and workspaces (default 0.1)")
    _weighed_flags(where)
    where.add_argument("--restrict", nargs="*", default=[], metavar="DIM=SIZES",
                       help="allowed sizes, e.g. pp=1 tp=1,2,4")
    where.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), default=list(PIPELINE_SCHEDULES),
                       metavar="NAME", help=f"the pipeline schedules to weigh, of {', '.join(sorted(SCHEDULES))} "
                       f"(default: {' '.join(PIPELINE_SCHEDULES)}); interleaved ones with every stage count per rank "
                       f"that cuts the blocks evenly (and see --uneven-stages)")
    where.add_argument("--uneven-stages", choices=("on", "off"), default="on",
                       help="interleaved schedules: also weigh 4, 8 and 16 stages per rank where the blocks cannot be "
                       "cut into equal stages (default on; Megatron-LM needs equal stages: off)")
    where.add_argument("--gradient-accumulation", choices=("on", "off"), default="on",
                       help="for layouts without a pipeline whose batch does not fit: weigh splitting it into "
                       "micro-batches (the Trainer's accumulate_grad_batches; default on)")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=15, help="layouts to show in the table (default 15)")
    out.add_argument("--yaml", metavar="OUT.yaml", help="write the first layout as a LightningCLI config: "
                     "trainer.strategy (class path and arguments), trainer.accumulate_grad_batches and the per-rank "
                     "batch size, to pass as a second --config next to the project's own")
    out.add_argument("--json", help="write every prediction here")
    out.add_argument("--plot", help="write the plan's picture here (PNG)")
    return p


def _weighed_flags(group: argparse._ArgumentGroup) -> None:
    """A flag per option the planner weighs (``--name-with-dashes``), its help from the option's field
    (``techniques.technique.planned``): its named values, several at once (``flag_values``), or on / off / both;
    an option the engine has never run (``Options.UNTRIED``) is left out of the ranking unless the flag is given
    (alone: both)."""
    from lightning_par.planner.search import UNTRIED
    from lightning_par.techniques.recipe import weighed_options

    for name, f in weighed_options().items():
        flag, values = "--" + name.replace("_", "-"), f.metadata["flag_values"]
        if values:
            weighed = [v for v, value in values.items() if value in f.metadata["weigh"]]
            group.add_argument(flag, nargs="+", choices=sorted(values), default=weighed, help=f.metadata["flag"])
        elif name in UNTRIED:
            group.add_argument(flag, choices=("both", "on", "off"), nargs="?", const="both", default=None,
                               help=f.metadata["flag"])
        else:
            default = "both" if len(f.metadata["weigh"]) == 2 else "on" if f.metadata["weigh"][0] else "off"
            group.add_argument(flag, choices=("both", "on", "off"), default=default, help=f.metadata["flag"])


def _weighed(args: argparse.Namespace) -> dict[str, tuple]:
    """``plan_layouts``' keyword arguments from the flags of ``_weighed_flags``; an untried option whose flag is
    not given is weighed (to say what it would change) and left out of the ranking after."""
    from lightning_par.techniques.recipe import weighed_options

    out = {}
    for name, f in weighed_options().items():
        given, values = getattr(args, name), f.metadata["flag_values"]
        out[name] = tuple(values[v] for v in given) if values else _CHOICES["both" if given is None else given]
    return out


def _left_out(args: argparse.Namespace) -> list[str]:
    """The untried options whose flag was not given: weighed only to say what they would change."""
    from lightning_par.planner.search import UNTRIED

    return [name for name in UNTRIED if getattr(args, name, None) is None]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from dataclasses import replace

    from lightning_par.costs.profile import profile_model
    from lightning_par.planner.predict import shares_cores, trace_dtype
    from lightning_par.planner.search import plan_layouts, untried
    from lightning_par.techniques.recipe import options_of

    start = time.perf_counter()
    if bool(args.hf_config) == bool(args.module):
        raise SystemExit("pass either --hf-config (a Hugging Face model) or --module (a LightningCLI project)")
    if args.hf_config:
        module, batch = _hf_model(args)
        batch_arg = None
    else:
        module, batch = _lightning_project(args)
        batch_arg = args.batch_arg or _batch_argument(args.datamodule)
    global_batch = int(batch[0].shape[0])
    fixed = _fixed_options(args)  # what the user sets and the planner keeps (QLoRA's 4-bit weights)
    options = options_of(fixed)
    profile = profile_model(module, batch, dtype=trace_dtype(args.precision),
                            prepare=lambda copy, blocks: [o.before_trace(copy, blocks) for o in options])
    name = getattr(module, "planner_name", profile.name)
    hardware = _hardware(args, profile)
    restrict = {k: [int(x) for x in v.split(",")] for k, v in (item.split("=", 1) for item in args.restrict)}
    for o in options:  # what does not compose with tensor parallelism yet
        restrict.update(o.restrict())
    # async TP has never run: by default it is weighed only to say what it would change, and left out of the ranking
    left_out = _left_out(args)
    plan = plan_layouts(profile, batch, args.world, hardware, precision=args.precision, batch_is_global=True,
                        memory_budget=args.memory_budget, memory_reserve=args.memory_reserve, restrict=restrict,
                        schedules=args.schedules, gradient_accumulation=args.gradient_accumulation == "on",
                        uneven_stages=args.uneven_stages == "on", **_weighed(args))
    untried_winner = None
    if left_out:
        piped = [p for p in plan.predictions if untried(p.layout)]
        plan = replace(plan, predictions=[p for p in plan.predictions if not untried(p.layout)])
        if piped and piped[0].fits and plan.predictions and piped[0].tokens_per_s > plan.best.tokens_per_s:
            untried_winner = piped[0]
    seconds = time.perf_counter() - start
    out = [f"{name}: {_parameters(profile)}, global batch {global_batch} x "
           f"{profile.seq_len} tokens, {args.world} devices ({hardware.gpus_per_node} per node), {args.precision}",
           f"Hardware: {hardware.source}",
           f"{len(plan.predictions)} layouts in {seconds:.1f} s"]
    out = [line for text in out for line in _wrapped(text)] + ["", plan.table(args.top, width=WIDTH), ""]
    notes = []
    best = plan.best
    rank_batch, micro = _batches(best.layout, global_batch)
    kwargs = {**best.layout.strategy_kwargs(), **fixed}
    notes += [f"#1 {best.layout}: {best.reason}",
            f"To train it: strategy lightning_par.NDParallelStrategy("
            f"{', '.join(f'{k}={v!r}' for k, v in kwargs.items())}), accumulate_grad_batches="
            f"{best.layout.accumulate_grad_batches}, the data loader's batch size {micro} per rank ({rank_batch} per "
            f"rank and optimizer step){'' if args.yaml else '; --yaml OUT.yaml writes it as a config'}"]
    if left_out and not shares_cores(hardware):  # (CPU ranks never weigh it)
        if untried_winner is not None:
            gain = untried_winner.tokens_per_s / best.tokens_per_s - 1
            notes.append(f"If async TP worked (never run: it needs 2+ CUDA GPUs; --async-tp weighs it), "
                       f"{untried_winner.layout} would come first: {untried_winner.tokens_per_s:,.0f} tok/s/dev, "
                       f"{gain:+.1%}.")
        else:
            notes.append("Async TP (never run: it needs 2+ CUDA GPUs; --async-tp weighs it) would not change the "
                         "first layout.")
    print("\n".join(out + [line for text in notes for line in _wrapped(text)]))
    if args.yaml:
        Path(args.yaml).write_text(plan_yaml(plan, name, global_batch, argv if argv is not None else sys.argv[1:],
                                             batch_arg, fixed=fixed))
        print(f"Wrote {args.yaml}: pass it as a second --config after the project's own.")
    if args.json:
        Path(args.json).write_text(json.dumps({**plan.as_dict(), "seconds": seconds}, indent=1, default=str))
    if args.plot:
        from lightning_par.planner.picture import draw_plan

        draw_plan(plan).savefig(args.plot, dpi=100)
    return 0


#: the columns the output fits
WIDTH = 120


def _wrapped(text: str, width: int = WIDTH) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False) or [""]


def _parameters(profile: Any) -> str:
    count = sum(p.numel for p in profile.params)
    return f"{count / 1e9:.3f} B parameters" if count >= 1e8 else f"{count / 1e6:.3f} M parameters"


def _init_args(layout: Any) -> dict[str, Any]:
    """``Layout.strategy_kwargs()``, and ``NDParallelStrategy``'s own default for every other option a layout
    decides: LightningCLI keeps a first config's strategy arguments that the second does not name, even under
    another class path (a pipeline config's micro-batches would otherwise outlive a plan without a pipeline)."""
    import inspect

    from lightning_par import NDParallelStrategy
    from lightning_par.planner.predict import Layout

    kwargs = layout.strategy_kwargs()
    defaults = inspect.signature(NDParallelStrategy.__init__).parameters
    # (the planned options include the pipeline's cut, which the planner makes even: the project's own split
    # points fit only the project's pipeline)
    decided = Layout.names()
    return {**kwargs, **{name: defaults[name].default for name in decided if name in defaults and name not in kwargs}}


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= 0.1 * scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def _batches(layout: Any, global_batch: int) -> tuple[int, int]:
    """A rank's samples per optimizer step (the global batch over the data-parallel ranks) and per loader batch
    (that over ``accumulate_grad_batches``; a pipeline splits its loader batch into micro-batches itself)."""
    rank_batch = global_batch // layout.dp
    return rank_batch, rank_batch // layout.accumulate_grad_batches


def _batch_argument(datamodule: str | None) -> str | None:
    """The data module's batch-size argument where it takes one named ``batch_size``."""
    import inspect

    if not datamodule:
        return None
    module, _, name = datamodule.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return "batch_size" if "batch_size" in inspect.signature(cls.__init__).parameters else None


def plan_yaml(plan: Any, name: str, global_batch: int, argv: list[str], batch_arg: str | None,
              now: str | None = None, fixed: dict[str, Any] | None = None) -> str:
    """The plan's first layout as a LightningCLI config: ``trainer.strategy`` (``Layout.strategy_kwargs()``),
    ``trainer.accumulate_grad_batches`` (``Layout.trainer_kwargs()``) and, where the data module's batch-size
    argument is known (``batch_arg``), ``data.<batch_arg>``: the batch of one rank's loader step. A header comment
    names the model, the cluster, the prediction and the date. ``fixed``: strategy options the user set
    (``--quantize-base``), written beside the layout's."""
    import datetime
    import shlex

    import yaml

    best = plan.best
    layout = best.layout
    rank_batch, micro = _batches(layout, global_batch)
    now = now or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    hw = plan.hardware
    header = [
        f"lightning_par plan of {now}: python -m lightning_par.plan {shlex.join(argv)}",
        f"model: {name}, {_parameters(plan.profile)}; global batch "
        f"{global_batch} x {plan.seq_len} tokens, {plan.precision}",
        f"cluster: {plan.world_size} devices, {hw.gpus_per_node} per node ({hw.source}); the Trainer's devices x "
        f"num_nodes must be {plan.world_size}",
        f"layout: {layout}; " + "; ".join(f"{options.COLUMN[2]} {options.column()}"
                                          for options in layout.technique_options() if options.COLUMN),
        f"predicted: {best.tokens_per_s:,.0f} tokens/s per device, step {best.step_s * 1e3:.1f} ms, "
        f"{_size(best.memory)} per rank ({_size(best.model_state)} model state, {_size(best.activations)} "
        f"activations)" + ("" if best.fits else "; DOES NOT FIT the memory budget"),
        "use as a second config: train.py fit --config PROJECT.yaml --config THIS.yaml (every option the layout "
        "decides is written, defaults included, so that the project's own values for them do not carry over; its "
        "other strategy options, such as compile or tp_plan, do)",
    ]
    trainer = {"strategy": {"class_path": "lightning_par.NDParallelStrategy",
                            "init_args": {**_init_args(layout), **(fixed or {})}},
               "accumulate_grad_batches": layout.trainer_kwargs().get("accumulate_grad_batches", 1)}
    body = {"trainer": trainer}
    split = (f"the global batch {global_batch} / dp {layout.dp}"
             + (f" / accumulate {layout.accumulate_grad_batches}" if layout.accumulate_grad_batches > 1 else ""))
    if batch_arg:
        body["data"] = {batch_arg: micro}
        footer = [f"data.{batch_arg}: the batch of one rank's loader step, {split}"]
    else:
        footer = [f"set the data loader's batch size to {micro} per rank ({split}); {rank_batch} per rank and "
                  f"optimizer step"]
    lines = [line for text in header for line in _wrapped(text, WIDTH - 2)]  # (after "# ")
    comments = "\n".join(f"# {line}" for line in lines)
    notes = "\n".join(f"# {line}" for text in footer for line in _wrapped(text, WIDTH - 2))
    return f"{comments}\n{yaml.safe_dump(body, sort_keys=False)}{notes}\n"


def _hardware(args: argparse.Namespace, profile: Any) -> Any:
    """A known device from the table; else this machine's matmul throughput, measured here, with the links from the
    table (one process cannot measure a link; the planner under ``auto_parallel`` measures them). With
    ``--compile`` its non-matmul ops are priced as torch.compile fuses them; with ``--float8`` the matmuls float8
    converts at the device's float8 rate."""
    from lightning_par.devices import fused, with_float8

    hardware = _device_hardware(args, profile)
    hardware = fused(hardware) if args.compile else hardware
    if args.float8:
        try:
            hardware = with_float8(hardware)
        except ValueError as e:
            raise SystemExit(f"--float8: {e}") from None
    return hardware


def _device_hardware(args: argparse.Namespace, profile: Any) -> Any:
    from dataclasses import replace

    from lightning_par.devices import known_hardware, lookup_link, precision_kind

    if args.device:
        return known_hardware(args.device, precision=precision_kind(args.precision) or "bf16",
                              gpus_per_node=args.gpus_per_node, inter_link=args.inter_link,
                              intra_link=args.intra_link)
    from lightning_par.planner.probe import probe_dtype, probe_hardware, probe_shapes, tp_degrees

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    shapes = probe_shapes(profile)
    measured = probe_hardware(device, probe_dtype(args.precision), shapes,
                              tp_sizes=tp_degrees(shapes, args.gpus_per_node))
    intra, inter = lookup_link(args.intra_link or "pcie4"), lookup_link(args.inter_link)
    return replace(measured, gpus_per_node=args.gpus_per_node, intra_bandwidth=intra.bandwidth,
                   intra_latency=intra.latency, inter_bandwidth=inter.bandwidth, inter_latency=inter.latency,
                   group_links=(), source=f"{measured.source}; links from the table: {intra.name}, {inter.name}")


class _CausalLM(nn.Module):
    """The planner's view of a Hugging Face causal LM: ``forward(x)`` gives logits, ``loss`` is cross-entropy."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def _fixed_options(args: argparse.Namespace) -> dict[str, Any]:
    """The strategy options the fine-tuning flags set (the planner prices them, never changes them)."""
    if args.quantize_base and not (args.lora_rank or args.freeze):
        raise SystemExit("--quantize-base stores frozen weights in 4 bits: pass --lora-rank (QLoRA) or --freeze too")
    if args.lora_target_parameters and not args.lora_rank:
        raise SystemExit("--lora-target-parameters names what LoRA adapts: pass --lora-rank too")
    if args.module and (args.lora_rank or args.freeze):
        raise SystemExit("--lora-rank and --freeze are for --hf-config; a LightningCLI project's module sets its own "
                         "adapters and frozen weights (configure_model)")
    if args.quantize_base and args.float8:
        raise SystemExit("--quantize-base and --float8 do not combine (the strategies refuse them together)")
    fixed = {"quantize_base": args.quantize_base} if args.quantize_base else {}
    return {**fixed, "float8": args.float8} if args.float8 else fixed


def _fine_tuned(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    """The Hugging Face model as ``--lora-rank`` / ``--freeze`` fine-tune it: PEFT's LoRA (on the meta device
    too) and frozen parameters by name."""
    from fnmatch import fnmatch

    frozen = [name for name, p in model.named_parameters() if any(fnmatch(name, g) for g in args.freeze)]
    if args.freeze and not frozen:
        raise SystemExit(f"--freeze {' '.join(args.freeze)} matches no parameter; names look like "
                         f"{next(n for n, _ in model.named_parameters())!r}")
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        targets = args.lora_targets if args.lora_targets != ["all-linear"] else "all-linear"
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                 target_modules=targets,
                                                 target_parameters=args.lora_target_parameters or None))
    return model


def _hf_model(args: argparse.Namespace) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = {k: _value(v) for k, v in (item.split("=", 1) for item in args.hf_override)}
    path = Path(args.hf_config)
    if path.is_dir():
        config = AutoConfig.from_pretrained(path, **overrides)
    elif path.is_file():
        fields = json.loads(path.read_text())
        config = AutoConfig.for_model(fields.pop("model_type"), **{**fields, **overrides})
    else:
        config = AutoConfig.for_model(args.hf_config, **overrides)
    with torch.device("meta"):
        # fp32 weights whatever the config's dtype, as a Lightning module trains them under 32-true and the mixed
        # precisions; "bf16-true" is traced on a bf16 copy (trace_dtype)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    seq = args.seq_len or 4096
    batch = args.batch or args.world
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    name = f"{type(model).__name__} ({config.model_type})"
    causal = _CausalLM(_fine_tuned(model, args))
    # the table and the config's header name the model as its config does (LlamaForCausalLM), not this wrapper
    causal.planner_name = name + (f", LoRA r={args.lora_rank}" if args.lora_rank else "") + (
        f", {args.quantize_base} base weights" if args.quantize_base else "")
    return causal, (ids, ids)


def _lightning_project(args: argparse.Namespace) -> tuple[nn.Module, Any]:
    from lightning.pytorch.cli import LightningCLI

    def load(path: str) -> type:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    argv = [f"--config={path}" for path in args.config or []]
    own, sys.argv = sys.argv, sys.argv[:1]  # (LightningCLI reads the given args, not the planner's command line)
    try:
        cli = LightningCLI(load(args.module), load(args.datamodule) if args.datamodule else None, run=False,
                           args=argv + ["--trainer.devices=1", "--trainer.accelerator=cpu", "--trainer.logger=false",
                                        "--trainer.strategy=auto", "--trainer.callbacks=[]"],
                           save_config_callback=None)
    finally:
        sys.argv = own
    module = cli.model
    if hasattr(module, "configure_model"):
        with torch.device("meta"):
            module.configure_model()
    datamodule = cli.datamodule
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    if args.batch:  # the global batch: the dataloader's per-device batch, repeated
        batch = tuple(t[:1].expand(args.batch, *t.shape[1:]) if isinstance(t, torch.Tensor) else t for t in batch)
    return module, batch


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


if __name__ == "__main__":
    sys.exit(main())
