"""Every causal-LM architecture of the installed transformers that has a pipeline plan, trained by the strategies.

Not a timing benchmark: a compatibility sweep of models nobody here wrote. For each architecture (text-only
``...ForCausalLM`` whose config has ``base_model_pp_plan``), a tiny config is made from its defaults (hidden 32, 4
heads, 4 layers, vocabulary 32, experts 4, dropout 0; multi-head latent attention with rope/nope dims 4), the
model trains 4 AdamW steps in one process, then under cp=2, pp=2 (1F1B, 2 micro-batches), tp=2, tp=2 with sequence
and loss parallelism, FSDP2 dp_shard=2, and expert parallelism ep=2 over dp_shard=2 on 2 gloo processes (one
launch per architecture). Each cell is the
largest difference (losses and final weights) from the one-process run, or the error the layout raised.

    python benchmarks/hf_architectures.py                      # all (~30 min on 2 cores)
    python benchmarks/hf_architectures.py llama qwen3 gpt_oss  # some
    python benchmarks/hf_architectures.py --layouts ep2 --moe  # one column, the mixtures of experts only

Reading it: ``parity`` is <= 1e-5. A larger number with an architecture whose one-process run moves by as much when
only the batch is split in two (see ``--order-check``) is the model's own sensitivity to summation order, not a
fault of the layout. Errors that start with what lightning_par refuses (the layout and the reason) are refusals;
anything else is a failure to look at. Results: printed table and ``benchmarks/results/hf_architectures.json``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import format_table, launch, quiet_worker, run_metadata, write_json  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))  # benchmarks.common put it there too; said here for the import below
from hf_models import HFCausalLM  # noqa: E402

TOL = 1e-5
STEPS = 4
#: sizes set wherever a config has the attribute (multi-head latent attention: rope and nope parts of 4)
SIZES: dict[str, Any] = dict(
    vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, head_dim=8, num_local_experts=4,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    layer_types=None, sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, qk_rope_head_dim=4,
    qk_nope_head_dim=4, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16, qk_head_dim=8, n_routed_experts=4,
    n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, num_shared_experts=1,
)
LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {  # strategy arguments, data-parallel size
    "cp2": (dict(dp_shard=1, cp=2), 1),
    "pp2": (dict(dp_shard=1, pp=2, pp_microbatches=2), 1),
    "tp2": (dict(dp_shard=1, tp=2), 1),
    "tp2_sp_lp": (dict(dp_shard=1, tp=2, sequence_parallel=True, loss_parallel=True), 1),
    "fsdp2": (dict(dp_shard=2), 2),
    "ep2": (dict(dp_shard=2, ep=2), 2),  # mixtures of experts (from base_model_ep_plan); refused without experts
}


def architectures() -> list[str]:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t in CONFIG_MAPPING
            and getattr(CONFIG_MAPPING[t], "base_model_pp_plan", None)
            and not getattr(CONFIG_MAPPING[t], "sub_configs", None)]


def _has(config: Any, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 - per-layer attributes raise on global access
        return False


def tiny_config(model_type: str) -> Any:
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    kwargs = {k: v for k, v in SIZES.items() if _has(default, k)}
    kwargs.update({k: 0.0 for k, v in default.to_dict().items()
                   if ("dropout" in k or "pdrop" in k) and isinstance(v, float)})
    if "qk_rope_head_dim" in kwargs and "head_dim" in kwargs:  # multi-head latent attention: rotary on the rope part
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    return cls(**kwargs)


def build(model_type: str) -> torch.nn.Module:
    import transformers

    config = tiny_config(model_type)
    try:
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except (ValueError, ImportError):  # no SDPA path (e.g. attention sinks): the eager one
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


class SweepLM(HFCausalLM):
    """The tests' user LightningModule (forward returns the logits) around any architecture's tiny model."""

    def __init__(self, arch: str = "llama", lr: float = 3e-3) -> None:
        super(HFCausalLM, self).__init__()  # HFCausalLM's own __init__ builds only the tests' listed configs
        self.lr, self.optimizer = lr, "adamw"
        self.model = build(arch)


def moe_architectures() -> list[str]:
    """The architectures whose config names experts modules for expert parallelism (``base_model_ep_plan``)."""
    from transformers import CONFIG_MAPPING

    return [t for t in architectures()
            if "ep_dispatch_experts" in (getattr(CONFIG_MAPPING[t], "base_model_ep_plan", None) or {}).values()]


def _layouts_worker(arch: str, layouts: list[str]) -> dict[str, Any]:
    quiet_worker()
    from workers import fit

    from lightning_par import NDParallelStrategy

    out: dict[str, Any] = {}
    for name in layouts:
        kwargs, dp = LAYOUTS[name]
        try:
            out[name] = fit(NDParallelStrategy(**kwargs), devices=2, dp_size=dp, max_steps=STEPS, module_cls=SweepLM,
                            arch=arch)
        except Exception as e:  # noqa: BLE001 - a layout's error is the cell's result
            out[name] = f"{type(e).__name__}: {e}"
    return out


def order_sensitivity(arch: str) -> float:
    """One process, AdamW, the batch of 8 in one piece vs as two halves whose gradients are averaged: the largest
    weight difference after STEPS steps (what data parallelism changes: only the order of the sums)."""
    from workers import token_dataset

    torch.manual_seed(0)
    whole = SweepLM(arch)
    halves = copy.deepcopy(whole)
    optimizers = whole.configure_optimizers(), halves.configure_optimizers()
    data = token_dataset(96)
    for step in range(STEPS):
        x, y = data[8 * step: 8 * step + 8]
        for model, opt, parts in ((whole, optimizers[0], 1), (halves, optimizers[1], 2)):
            opt.zero_grad()
            for i in range(parts):
                rows = slice(8 // parts * i, 8 // parts * (i + 1))
                (model.loss(model(x[rows]), y[rows]) / parts).backward()
            opt.step()
    return max((a - b).abs().max().item() for a, b in zip(whole.parameters(), halves.parameters()))


def cell(result: Any, reference: dict[str, Any]) -> Any:
    from workers import max_loss_diff, max_weight_diff

    if isinstance(result, str):
        return result
    return max(max_loss_diff(result["losses"], reference["losses"]),
               max_weight_diff(result["weights"], reference["weights"]))


def show(value: Any) -> str:
    if isinstance(value, float):
        return "parity" if value <= TOL else f"{value:.1e}"
    text = str(value).split(":", 1)
    kind = text[0]
    return f"{kind}: {text[1].strip()[:60]}" if len(text) > 1 else kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archs", nargs="*", help="model types (default: every one with a pipeline plan)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {list(LAYOUTS)}")
    parser.add_argument("--moe", action="store_true", help="only the architectures with a base_model_ep_plan")
    parser.add_argument("--order-check", action="store_true",
                        help="also measure each model's own sensitivity to splitting the batch (one process)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hf_architectures.json"))
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",")]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; choose from {list(LAYOUTS)}")
    quiet_worker()
    from workers import fit_reference

    rows, results = [], {}
    for arch in args.archs or (moe_architectures() if args.moe else architectures()):
        start = time.perf_counter()
        try:
            reference = fit_reference(module_cls=SweepLM, max_steps=STEPS, arch=arch)
        except Exception as e:  # noqa: BLE001 - a tiny config this script cannot make: reported, not fatal
            results[arch] = {"build": f"{type(e).__name__}: {e}"}
            rows.append([arch, f"not built: {type(e).__name__}", *[""] * len(layouts)])
            continue
        runs = launch(2, _layouts_worker, arch, layouts, timeout=900)[0]
        results[arch] = {name: cell(runs[name], reference) for name in layouts}
        if args.order_check:
            results[arch]["order_sensitivity"] = order_sensitivity(arch)
        rows.append([arch, f"{time.perf_counter() - start:.0f} s", *(show(results[arch][n]) for n in layouts)])
        print(" | ".join(rows[-1]), flush=True)
    print()
    print(format_table(["architecture", "time", *layouts], rows))
    counts = {name: sum(isinstance(r.get(name), float) and r[name] <= TOL for r in results.values())
              for name in layouts}
    print(f"\nin parity (<= {TOL:g}) of {len(results)}: " + ", ".join(f"{n} {c}" for n, c in counts.items()))
    out = write_json(args.out, {"metadata": run_metadata(), "tolerance": TOL, "steps": STEPS, "results": results,
                                "parity_counts": counts})
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
