"""Expert parallelism (mixture of experts): expert state per rank, all-to-all bytes, step time against two
references, and grouped-mm experts against the per-expert loop.

One launch per world size (tests/launch.py: fresh processes, one gloo process group, one thread per rank). The
model is the example GPT with a mixture of experts in every block (example_projects/gpt/moe.py: softmax top-k
router, SwiGLU experts as stacked weights run by a grouped matmul), and for the transformers comparison a tiny
Qwen3-MoE built from a config with the same sizes (hidden, expert width, experts, top-k, layers). In it, every rank:

1. Expert state. One process's worth first: the unsharded model, one AdamW step, its expert parameters, gradients
   and AdamW moments counted (the reference). Then ``NDParallelStrategy(ep=E)`` through a Lightning Trainer for
   every ep the world allows (ep=1 is plain FSDP2 over the world; ep=2; ep=4 at world 4), two training steps, and
   the experts' bytes counted from the local shards this rank really holds after the last step
   (``DTensor.to_local()`` of every expert parameter, its gradient and its optimizer-state tensors; AdamW's 0-d
   ``step`` counters, replicated, are reported apart). Expected ratio to the unsharded bytes: 1 / (ep x efsdp) =
   1 / (dp_shard x cp) = 1 / world whatever ep is: ep changes who holds which experts, not how many bytes.

2. All-to-all bytes of the dispatch, measured on the last step of each run with a ``TorchDispatchMode`` that sees
   every collective op the step dispatches, forward and backward (torch's ``CommDebugMode`` is such a mode too,
   but it only counts calls): ``_c10d_functional.all_to_all_single`` (the routed rows, autograd's reverse
   all-to-all in backward) and ``c10d.alltoall_base_`` (``dist.all_to_all_single``: the token counts). From each
   call's input and split sizes: bytes sent, and bytes that left the rank (all but the split addressed to itself).
   Compared with two formulas, per MoE layer, T tokens per rank, top-k, hidden H, 4-byte rows:

   - even routing (what ``ExpertParallel.account`` prices): 4 transfers (rows out and back in forward, their
     gradients in backward) x T x k x H x 4 bytes, of which ``(ep - 1) / ep`` leave the rank;
   - the actual routing of that step, read from the counts all-to-all (sent and received counts per expert):
     2 x (rows this rank routed to other ranks' experts + rows other ranks routed to this rank's experts) x H x 4
     bytes leave the rank. Measured must equal it exactly; the difference to the even formula is the load.
     transformers' experts (``ours Qwen3-MoE``) are dispatched once per token and rank: their counts are per rank
     (tokens, and the choices they carry: the first column is read),
     their rows one per (token, rank), and their choices (2 x k float32 per row, out in forward and back as their
     gradient) are counted apart and added: below the even formula by the tokens whose choices share a rank.

3. Step time, side by side in one run, at ep=``--ep``: four variants trained step by step in lockstep
   (``benchmarks.common.Lockstep``, the rotation reversed in odd rounds), the same batches and initial weights:

   - ``ours GPT``: ``Trainer(strategy=NDParallelStrategy(ep=E))`` on ``GPTModule(n_experts, moe_top_k, ...)``;
   - ``hand-written GPT``: a plain torch.distributed loop on the same GPT: each experts module keeps its
     ``num_experts / ep`` experts as plain tensors, and its forward does ``dist.all_to_all_single`` of the counts,
     ``all_to_all_single_autograd`` of the rows, a stable argsort to regroup them by local expert, the example's
     grouped-mm experts, and the rows back; ``fully_shard`` per block and on the root over the world (the experts
     left out with ``ignored_params``, or ``fully_shard`` over the ``efsdp`` ranks when world > ep); expert
     gradients divided by ep after backward; AdamW and the LR schedule of ``GPTModule.configure_optimizers``, the
     loss all-reduced as the Lightning step's ``self.log(..., sync_dist=True)`` does;
   - ``hand-written GPT, ours' collectives``: the same loop doing the collectives ours does beyond it (see the
     table of other collectives): a barrier before the loss's all-reduce (Lightning's ``sync_dist`` does one on
     gloo), the root unit resharded after forward (re-gathered at once in backward), every experts module an FSDP
     unit (also on a 1-rank ``efsdp`` mesh, at world = ep), not resharded after forward. ours / this is what the
     library costs beyond that work;
   - ``ours Qwen3-MoE``: ``NDParallelStrategy(ep=E)`` on the Hugging Face model in a plain LightningModule
     (tests/hf_models.py ``HFCausalLM``; the experts found from the config's ``base_model_ep_plan``);
   - ``transformers Qwen3-MoE``: transformers' own expert parallelism, ``DistributedConfig(fsdp_size=world,
     ep_size=E, ep_implementation="all_to_all")`` applied to the model built from the config (what
     ``from_pretrained(distributed_config=...)`` does after building it: ``prepare_distribute_model`` then
     ``maybe_distribute_model``, which also ``fully_shard``s it by the config's FSDP plan); a plain AdamW loop. If it
     cannot run here (one training step is tried first, on every rank), the reason is recorded and it is left out.

   ``perf_counter`` at ``on_train_batch_start`` / ``on_train_batch_end`` (the hand-written loops: the same span),
   the slowest rank per step, ``--warmup`` steps per run left out; one more, untimed step at the end of every run is
   the one whose collectives are recorded (item 2) and after which the expert state is counted. Ratios: of the
   medians, and the median of paired step ratios (step k of both, moments apart). Losses of ours and the reference
   on the same model are compared step by step (same weights and batches): relative difference within 1e-5 under
   ``--precision 32-true`` (float rounding), within 2^-7 under ``bf16-mixed`` (two bf16 rounding steps: autocast
   rounds activations to 8 bits of mantissa, where two summation orders part).
   The recorded step's other collectives (FSDP2's all-gathers and reduce-scatters, the logged loss's all-reduce,
   barriers) are printed per variant, so that a difference in step time can be traced to a difference in work:
   e.g. Lightning's ``sync_dist`` reduction adds a barrier on gloo that the hand-written loop does not do, and the
   hand-written loop leaves the root unit gathered between forward and backward (``fully_shard``'s default).

4. Grouped-mm experts vs the per-expert loop, in this (parent) process, one thread (or the GPU): the SwiGLU
   experts' forward and backward (``torch.nn.functional.grouped_mm``; the loop is the example's fallback) on the same
   weights, inputs and output gradient, with uneven expert loads (one expert empty), at the model's size (one rank's
   routed rows) and a 4x larger one; paired repeats, alternating which goes first. Outputs and gradients compared (in
   fp32), and the example's ``GroupedExperts`` checked to give the grouped-mm result. TFLOP/s: 3 matmuls x 2 x rows
   x dim x hidden forward, x 3 with backward.

GPU rows: ``--device cuda --world 1 --precision bf16-mixed ...``: the same worker in one process on one GPU (NCCL at
world size 1), the Lightning variants with ``precision="bf16-mixed"``, the hand-written loops with forward and loss
under ``torch.autocast("cuda", torch.bfloat16)`` over fp32 weights, step times synchronized at both ends, and the
peak GPU memory (per run where runs are alone: the reference, the layout run, transformers' preflight; for the
lockstep rounds, whose models are alive at once, the process's peak over all rounds). What it measures: what the
library costs around one GPU's step (Lightning's loop, the strategy, the logged loss's barrier and all-reduce) against
plain loops doing the same work: at world 1 ours neither dispatches (ep=1: every expert on the rank) nor shards (one
rank), so the hand-written loops neither dispatch nor ``fully_shard`` either, and transformers' ``DistributedConfig``
with every size 1 applies nothing (a plain loop on the model). What world 1 cannot show: no all-to-all leaves the rank
(item 2 is trivially zero), no expert or FSDP sharding (item 1's ratios are 1), no communication cost or overlap.
Item 4 adds GPU-sized layers there: a Qwen3-30B-A3B MoE layer (hidden 2048, expert width 768, 128 experts, 4096
tokens x top-8) and a Mixtral-8x7B-like one (hidden 4096, width 14336, 8 experts, 4096 tokens x top-2), in bf16
under bf16-mixed (fp32 otherwise), on the device. The example's experts run in bf16 under bf16-mixed (it casts
the grouped matmul's operands as autocast casts a matmul's: torch's autocast has no rule for it). ``bf16-mixed``
at world >= 2 (CPU) runs too, but is not like for like: ours all-gathers and dispatches bf16 (FSDP2's
MixedPrecisionPolicy), the hand-written loops fp32.
A variant that fails in a round is recorded, printed (FAILED) and left out of the later rounds; the others go on.

Usage: python benchmarks/bench_moe.py [--world 2] [--ep 2] [--steps 25] [--warmup 3] [--rounds 3]
       [--n-layer 2 --n-embd 64 --n-head 4 --seq-len 64 --batch-size 8 --n-experts 8 --top-k 2 --expert-hidden 128]
       [--device cpu] [--precision 32-true] [--out benchmarks/results/bench_moe.json]
       python benchmarks/bench_moe.py --world 4          # ep 1, 2 and 4 for the state; timing at --ep (2)
       python benchmarks/bench_moe.py --world 2,4        # both, one launch each
       python benchmarks/bench_moe.py --world 1          # the world-1 code of the GPU rows, on the CPU (ep 1)
       # GPU rows (one GPU, ~60-90 s with ~25 s of start-up):
       python benchmarks/bench_moe.py --device cuda --world 1 --precision bf16-mixed --n-layer 4 --n-embd 1024 \\
           --n-head 16 --seq-len 1024 --batch-size 8 --n-experts 16 --top-k 2 --expert-hidden 1024 \\
           --vocab-size 32000 --steps 10 --warmup 3 --rounds 2 --layout-steps 2 --gmm-repeats 5 \\
           --out benchmarks/results/bench_moe_gpu.json
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    NOISE_NOTE,
    Lockstep,
    format_table,
    launch,
    peak_memory,
    quiet_worker,
    reset_peak_memory,
    run_metadata,
    slowest_rank_per_step,
    step_timer,
    summarize,
    synced_now,
    write_json,
)

MIMIC = "hand-written GPT, ours' collectives"
VARIANTS = ("ours GPT", "hand-written GPT", MIMIC, "ours Qwen3-MoE", "transformers Qwen3-MoE")
#: name of the ratio -> (ours, reference)
PAIRS = {"ours/hand-written": ("ours GPT", "hand-written GPT"),
         "ours/hand-written (ours' collectives)": ("ours GPT", MIMIC),
         "ours/transformers": ("ours Qwen3-MoE", "transformers Qwen3-MoE")}
SEED = 0
HF_LR = 3e-3  # HFCausalLM's AdamW: lr 3e-3, eps 1e-6; the transformers loop uses the same
#: relative tolerance of the loss comparison (ours vs the reference, same model, weights and batches) per --precision:
#: float rounding; two bf16 rounding steps (8-bit mantissa) under autocast
LOSS_TOLERANCE = {"32-true": 1e-5, "bf16-mixed": 2**-7}
#: item 4's GPU-sized layers (--device cuda): label, routed rows (tokens x top-k), hidden, expert width, experts
GMM_GPU_CASES = (("Qwen3-30B-A3B layer", 4096 * 8, 2048, 768, 128),
                 ("Mixtral-8x7B-like layer", 4096 * 2, 4096, 14336, 8))


# ---------------------------------------------------------------------------------------------------------------
# the device: the only places where CPU and CUDA runs differ
# ---------------------------------------------------------------------------------------------------------------
def autocast(cfg: dict[str, Any]) -> Any:
    """Forward and loss of the plain loops as Lightning's precision plugin runs them: under bf16-mixed, autocast to bf16
    over the fp32 weights; under 32-true a disabled autocast (a no-op)."""
    import torch

    return torch.autocast(cfg["device"], dtype=torch.bfloat16, enabled=cfg["precision"] == "bf16-mixed")


# ---------------------------------------------------------------------------------------------------------------
# measuring: expert state, collectives
# ---------------------------------------------------------------------------------------------------------------
def expert_state(named_params: Any, optimizer: Any) -> dict[str, int]:
    """This rank's bytes of the experts' parameters (names with ``.experts.``), gradients and optimizer state,
    from the local tensors (``to_local()`` of DTensors). AdamW's 0-d ``step`` counters apart: not sharded."""
    import torch

    def nbytes(t: Any) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = [p for name, p in named_params if ".experts." in name]
    moments = scalars = 0
    for p in params:
        for v in optimizer.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                if v.ndim == 0:
                    scalars += nbytes(v)
                else:
                    moments += nbytes(v)
    return {"params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "optim": moments, "optim_step_scalars": scalars, "tensors": len(params),
            "global_numel": sum(p.numel() for p in params)}  # DTensor.numel is global; the hand-written's is local


def collective_recorder() -> Any:
    """A dispatch mode recording the collectives dispatched while it is active (forward and backward: autograd runs
    a CPU backward on the calling thread). Made by a function so torch is imported only where it runs."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    from lightning_par._compat import torch_dispatch_mode

    class CollectiveRecorder(torch_dispatch_mode()):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[dict[str, Any]] = []
            self._counts: list[tuple[Any, Any, int, int]] = []  # (sent counts, received buffer, group rank, size)

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if getattr(func, "namespace", "") in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
                try:
                    self._note(func, args)
                except Exception as e:  # noqa: BLE001 - a recording problem must not break the step
                    self.calls.append({"op": str(func), "error": repr(e)})
            return out

        def _note(self, func: Any, args: tuple) -> None:
            name = f"{func.namespace}.{func._schema.name.split('::')[-1]}"
            call: dict[str, Any] = {"op": name, "backward": torch._C._current_graph_task_id() != -1}
            if name == "_c10d_functional.all_to_all_single":
                x, in_splits, pg, received = args[0], list(args[2]), _resolve_process_group(args[3]), None
            elif name == "c10d.alltoall_base_":
                received, x, pg, in_splits = args[0], args[1], dist.ProcessGroup.unbox(args[2]), list(args[4])
            else:  # FSDP's all-gathers and reduce-scatters, the logged loss's all-reduce, ...: the largest tensor
                tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                           if isinstance(t, torch.Tensor)]
                call["bytes"] = max((t.numel() * t.element_size() for t in tensors), default=0)
                self.calls.append(call)
                return
            rank, size = pg.rank(), pg.size()
            row = x.element_size() * (x[0].numel() if x.dim() > 1 else 1)
            in_splits = in_splits or [x.shape[0] // size] * size
            call.update(kind="rows" if x.is_floating_point() else "counts", group_size=size, rows=x.shape[0],
                        row_elements=x[0].numel() if x.dim() > 1 else 1,
                        rows_left=x.shape[0] - in_splits[rank], row_bytes=row, sent_bytes=x.shape[0] * row,
                        left_bytes=(x.shape[0] - in_splits[rank]) * row)
            self.calls.append(call)
            if call["kind"] == "counts":  # read after the step: the received buffer is filled once waited on
                self._counts.append((x.detach().clone(), received, rank, size))

        def summary(self, row_bytes: int) -> dict[str, Any]:
            """Measured bytes and the routing-exact prediction (``row_bytes`` per row: hidden x 4; the row size the
            row all-to-alls sent where they all sent one, e.g. bf16 rows under bf16-mixed FSDP)."""
            # float rows narrower than a token (``row_bytes`` / 4 elements) are the per-rank dispatch's routing
            # choices (local expert and weight per choice, beside each token it sends: transformers' experts)
            choices = [c for c in self.calls if c.get("kind") == "rows" and c["row_elements"] < row_bytes // 4]
            rows = [c for c in self.calls if c.get("kind") == "rows" and c not in choices]
            seen = {c["row_bytes"] for c in rows}
            row_bytes = seen.pop() if len(seen) == 1 else row_bytes
            counts = [c for c in self.calls if c.get("kind") == "counts"]
            choice_bytes = choices[0]["row_bytes"] if choices else 0
            out_off = in_off = routed = 0
            for sent, received, rank, size in self._counts:
                if choices and sent.dim() == 2:  # the per-rank dispatch's (tokens, choices) per destination rank
                    sent, received = sent[:, 0], received.detach()[:, 0]
                sent, received = sent.flatten().long(), received.detach().flatten().long()
                local = sent.numel() // size
                mine = slice(rank * local, (rank + 1) * local)
                out_off += int(sent.sum() - sent[mine].sum())  # my rows to other ranks' experts
                in_off += int(received.sum() - received[mine].sum())  # other ranks' rows to my experts
                routed += int(sent.sum())
            others: dict[str, dict[str, int]] = {}
            for c in self.calls:
                if "kind" not in c and "error" not in c:
                    entry = others.setdefault(c["op"], {"calls": 0, "bytes": 0})
                    entry["calls"] += 1
                    entry["bytes"] += c["bytes"]
            return {
                "rows_calls": {"forward": sum(not c["backward"] for c in rows),
                               "backward": sum(c["backward"] for c in rows)},
                "rows_sent_bytes": sum(c["sent_bytes"] for c in rows),
                "rows_left_bytes": sum(c["left_bytes"] for c in rows),
                "rows_left_bytes_forward": sum(c["left_bytes"] for c in rows if not c["backward"]),
                "rows_left_bytes_backward": sum(c["left_bytes"] for c in rows if c["backward"]),
                "row_bytes_seen": sorted({c["row_bytes"] for c in rows}),
                "counts_calls": len(counts),
                "counts_sent_bytes": sum(c["sent_bytes"] for c in counts),
                "routed_rows": routed,
                "routing_rows_out_off_rank": out_off,
                "routing_rows_in_off_rank": in_off,
                # the rows out and back in forward, their reverses in backward; the choices out, their gradient back
                "routing_predicted_left_bytes": 2 * (out_off + in_off) * row_bytes + (out_off + in_off) * choice_bytes,
                "choices_left_bytes": sum(c["left_bytes"] for c in choices),
                "other_collectives": others,
                "errors": [c for c in self.calls if "error" in c],
            }

    return CollectiveRecorder()


# ---------------------------------------------------------------------------------------------------------------
# models and data
# ---------------------------------------------------------------------------------------------------------------
def gpt_kwargs(cfg: dict[str, Any], n_steps: int) -> dict[str, Any]:
    return dict(vocab_size=cfg["vocab_size"], block_size=cfg["seq_len"], n_layer=cfg["n_layer"],
                n_head=cfg["n_head"], n_embd=cfg["n_embd"], max_steps=n_steps, warmup_steps=2,
                n_experts=cfg["n_experts"], moe_top_k=cfg["top_k"], moe_hidden=cfg["expert_hidden"])


def hf_overrides(cfg: dict[str, Any]) -> dict[str, Any]:
    """The tiny Qwen3-MoE at the GPT's sizes (tests/hf_models.py's qwen3_moe config, resized): every layer a
    mixture of experts of ``expert_hidden`` wide SwiGLU experts."""
    return dict(vocab_size=cfg["vocab_size"], hidden_size=cfg["n_embd"], intermediate_size=2 * cfg["expert_hidden"],
                num_hidden_layers=cfg["n_layer"], num_attention_heads=cfg["n_head"],
                num_key_value_heads=max(1, cfg["n_head"] // 2), head_dim=cfg["n_embd"] // cfg["n_head"],
                max_position_embeddings=cfg["seq_len"], num_experts=cfg["n_experts"],
                num_experts_per_tok=cfg["top_k"], moe_intermediate_size=cfg["expert_hidden"])


def token_loader(cfg: dict[str, Any], n_batches: int, rank: int, world: int, sampler: bool) -> Any:
    """Random tokens, ``n_batches`` batches of ``batch_size`` per rank; ``sampler=True`` adds the
    DistributedSampler Lightning puts in (shuffle, seed 0), so every variant sees the same batches."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    n = world * cfg["batch_size"] * n_batches
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, cfg["vocab_size"], (n, cfg["seq_len"] + 1), generator=g)
    data = TensorDataset(ids[:, :-1], ids[:, 1:])
    dist_sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED) if sampler else None
    return DataLoader(data, batch_size=cfg["batch_size"], sampler=dist_sampler)


def unsharded_reference(cfg: dict[str, Any]) -> dict[str, dict[str, int]]:
    """One process's expert state after one AdamW step: the GPT and the Qwen3-MoE, unsharded."""
    import torch
    import torch.nn.functional as F
    from hf_models import tiny_hf_model

    from example_projects.gpt.lit import GPTModule

    device = cfg["device"]
    x, y = (t.to(device) for t in next(iter(token_loader(cfg, 1, 0, 1, sampler=False))))
    torch.manual_seed(SEED)
    module = GPTModule(**gpt_kwargs(cfg, 1))
    module.configure_model()
    module.to(device)
    optimizer = module.configure_optimizers()["optimizer"]
    F.cross_entropy(module(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    out = {"gpt": expert_state(module.named_parameters(), optimizer)}
    torch.manual_seed(SEED)
    model = tiny_hf_model("qwen3_moe", **hf_overrides(cfg)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=HF_LR, eps=1e-6)
    F.cross_entropy(model(input_ids=x).logits.float().flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    out["qwen3_moe"] = expert_state(model.named_parameters(), optimizer)
    return out


# ---------------------------------------------------------------------------------------------------------------
# the variants: each trains n_timed steps, then one recorded step; returns times, losses, expert state, collectives
# ---------------------------------------------------------------------------------------------------------------
def run_lightning(cfg: dict[str, Any], world: int, strategy: Any, module: Any, n_timed: int,
                  yield_turn: Callable[[], None] | None = None) -> dict[str, Any]:
    """Trainer.fit under ``strategy`` for ``n_timed + 1`` steps; the last one recorded and not timed."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    last = n_timed  # batch index of the recorded step
    row_bytes = cfg["n_embd"] * 4

    class Probe(Callback):
        """After the timer (callbacks run in list order): record the last step, else hand the turn on."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.recorder: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == last:
                self.recorder = collective_recorder()
                self.recorder.__enter__()

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            # the last step's, before it: gradients (freed right after the step) beside the optimizer's state
            if self.recorder is not None:
                self.state = expert_state(pl_module.named_parameters(), trainer.optimizers[0])

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.losses.append(float(outputs["loss"]))
            if batch_idx == last:
                self.recorder.__exit__(None, None, None)
                self.comm = self.recorder.summary(row_bytes)
            elif yield_turn is not None:
                yield_turn()

    timer, probe = step_timer(cuda=cfg["device"] == "cuda"), Probe()
    trainer = pl.Trainer(
        accelerator=cfg["device"], devices=world, strategy=strategy, precision=cfg["precision"],
        max_steps=n_timed + 1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer, probe],
    )
    # the loader of every rank's batches, without a sampler: Lightning adds the DistributedSampler (shuffle, seed 0)
    trainer.fit(module, token_loader(cfg, n_timed + 1, 0, world, sampler=False))
    return {"step_times_s": timer.times[:n_timed], "losses": probe.losses, "expert_state": probe.state,
            "comm": probe.comm}


def run_ours_gpt(cfg: dict[str, Any], world: int, ep: int, n_timed: int,
                 yield_turn: Callable[[], None] | None = None) -> dict[str, Any]:
    import torch

    from example_projects.gpt.lit import GPTModule
    from lightning_par import NDParallelStrategy

    torch.manual_seed(SEED)
    module = GPTModule(**gpt_kwargs(cfg, n_timed + 1))
    return run_lightning(cfg, world, NDParallelStrategy(ep=ep), module, n_timed, yield_turn)


def run_ours_hf(cfg: dict[str, Any], world: int, ep: int, n_timed: int,
                yield_turn: Callable[[], None]) -> dict[str, Any]:
    import torch
    from hf_models import HFCausalLM

    from lightning_par import NDParallelStrategy

    torch.manual_seed(SEED)
    module = HFCausalLM(arch="qwen3_moe", lr=HF_LR, **hf_overrides(cfg))
    return run_lightning(cfg, world, NDParallelStrategy(ep=ep), module, n_timed, yield_turn)


def hand_dispatch_cls() -> type:
    """The hand-written expert-parallel experts module (a class made in the worker: torch is imported there)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    class HandDispatch(nn.Module):
        """``forward(x, counts)`` as the example's experts: ``x`` grouped by (global) expert. This rank's experts
        are ``inner``'s (plain tensors, ``num_experts / ep`` of them); the rows travel to their expert's rank and
        back."""

        def __init__(self, inner: nn.Module, group: Any, ep: int) -> None:
            super().__init__()
            self.inner, self.group, self.ep = inner, group, ep

        def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            local = counts.numel() // self.ep
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)  # [source rank, local expert]
            send_splits = counts.view(self.ep, local).sum(1).tolist()
            recv_splits = received.view(self.ep, local).sum(1).tolist()
            rows = wait_tensor(all_to_all_single_autograd(x, recv_splits, send_splits, self.group))
            expert_of_row = torch.arange(local, device=counts.device).repeat(self.ep).repeat_interleave(
                received, output_size=rows.shape[0])
            order = expert_of_row.argsort(stable=True)  # by local expert, then source rank
            out = self.inner(rows[order], received.view(self.ep, local).sum(0))
            back = torch.empty_like(out).index_copy(0, order, out)  # by source rank again
            return wait_tensor(all_to_all_single_autograd(back, send_splits, recv_splits, self.group))

    return HandDispatch


def run_hand_gpt(cfg: dict[str, Any], rank: int, world: int, ep: int, n_timed: int,
                 yield_turn: Callable[[], None], mimic: bool = False) -> dict[str, Any]:
    """The reference: the same GPT, expert parallelism and FSDP2 by hand, the work of one Lightning step.
    ``mimic``: the collectives ours issues too (see :data:`MIMIC`): a barrier before the loss's all-reduce (what
    Lightning's ``sync_dist`` does), the root resharded after forward, the experts not, and every experts
    module an FSDP unit of its own, also over a 1-rank ``efsdp`` mesh. At world 1 ours neither dispatches (ep=1) nor
    shards (one rank): nor does this loop (a plain model on the device; ``mimic`` adds the barrier)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from example_projects.gpt.lit import GPTModule

    torch.manual_seed(SEED)
    module = GPTModule(**gpt_kwargs(cfg, n_timed + 1))  # a factory: the same GPT, optimizer and schedule
    module.configure_model()  # on the CPU, as ours does: the same initial weights
    module.to(cfg["device"])
    model = module.model
    experts = []
    if world > 1:  # (the parser asks ep >= 2 there) world 1: ours neither dispatches nor shards, nor does this loop
        efsdp = world // ep
        expert_mesh = init_device_mesh(cfg["device"], (efsdp, ep), mesh_dim_names=("efsdp", "ep"))  # ep innermost
        dense_mesh = init_device_mesh(cfg["device"], (world,))
        ep_rank, dispatch_cls = expert_mesh["ep"].get_local_rank(), hand_dispatch_cls()
        for block in model.blocks:
            inner = block.mlp.experts
            local = cfg["n_experts"] // ep
            for name, p in list(inner.named_parameters(recurse=False)):  # keep this rank's experts only
                inner.register_parameter(name, nn.Parameter(p.detach()[ep_rank * local:(ep_rank + 1) * local].clone()))
            block.mlp.experts = dispatch_cls(inner, expert_mesh["ep"].get_group(), ep)
            experts.append(inner)
            if efsdp > 1 or mimic:  # ours makes every experts module an FSDP unit, on a 1-rank mesh too
                fully_shard(inner, mesh=expert_mesh["efsdp"], reshard_after_forward=not mimic)
        ignored = {p for inner in experts for p in inner.parameters()} if efsdp == 1 and not mimic else None
        for i, block in enumerate(model.blocks):
            fully_shard(block, mesh=dense_mesh, reshard_after_forward=i < len(model.blocks) - 1,
                        ignored_params=ignored)
        fully_shard(model, mesh=dense_mesh, ignored_params=ignored, reshard_after_forward=True if mimic else None)
    opt_cfg = module.configure_optimizers()
    optimizer, scheduler = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    expert_params = [p for inner in experts for p in inner.parameters()]

    def train_step(x: Any, y: Any) -> Any:
        optimizer.zero_grad(set_to_none=True)
        with autocast(cfg):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        logged = loss.detach().clone()  # on the device: NCCL reduces device tensors only
        if mimic:
            dist.barrier()
        dist.all_reduce(logged)  # what self.log(..., sync_dist=True) costs in the Lightning step
        loss.backward()
        for p in expert_params:  # ep ranks' tokens summed into each expert: the mean over the data ranks
            p.grad.div_(ep)
        optimizer.step()
        scheduler.step()
        return loss

    return {**timed_loop(cfg, rank, world, n_timed, yield_turn, train_step),
            "expert_state": expert_state(module.named_parameters(), optimizer)}


def timed_loop(cfg: dict[str, Any], rank: int, world: int, n_timed: int, yield_turn: Callable[[], None] | None,
               train_step: Callable[[Any, Any], Any]) -> dict[str, Any]:
    """``n_timed`` timed steps of a plain loop (taking turns with the other variants), then one more whose
    collectives are recorded. The batch goes to the device before the timed span, as Lightning's does (before
    ``on_train_batch_start``); on cuda the span is synchronized at both ends, as ``step_timer(cuda=True)``."""
    cuda = cfg["device"] == "cuda"
    times, losses, recorder = [], [], collective_recorder()
    for step, (x, y) in enumerate(token_loader(cfg, n_timed + 1, rank, world, sampler=True)):
        x, y = x.to(cfg["device"]), y.to(cfg["device"])
        if step == n_timed:
            recorder.__enter__()
        start = synced_now(cuda)
        loss = train_step(x, y)
        times.append(synced_now(cuda) - start)
        losses.append(float(loss))
        if step < n_timed and yield_turn is not None:
            yield_turn()
    recorder.__exit__(None, None, None)
    return {"step_times_s": times[:n_timed], "losses": losses, "comm": recorder.summary(cfg["n_embd"] * 4)}


def build_transformers_ep(cfg: dict[str, Any], world: int, ep: int) -> tuple[Any, Any]:
    """The tiny Qwen3-MoE under transformers' own expert parallelism and FSDP2, and its AdamW."""
    import torch
    from hf_models import tiny_hf_model
    from transformers import DistributedConfig

    torch.manual_seed(SEED)
    model = tiny_hf_model("qwen3_moe", **hf_overrides(cfg)).to(cfg["device"])  # built on the CPU, as ours
    cls = type(model)
    config = DistributedConfig(fsdp_size=world, ep_size=ep, ep_implementation="all_to_all")
    config, _, mesh_manager = cls.prepare_distribute_model(config)
    model = cls.maybe_distribute_model(model, config, mesh_manager)
    return model, torch.optim.AdamW(model.parameters(), lr=HF_LR, eps=1e-6)


def run_transformers(cfg: dict[str, Any], rank: int, world: int, ep: int, n_timed: int,
                     yield_turn: Callable[[], None] | None) -> dict[str, Any]:
    """transformers' expert parallelism: a plain loop, the work of HFCausalLM's Lightning step."""
    import torch.nn.functional as F

    model, optimizer = build_transformers_ep(cfg, world, ep)

    def train_step(x: Any, y: Any) -> Any:
        optimizer.zero_grad(set_to_none=True)
        with autocast(cfg):
            loss = F.cross_entropy(model(input_ids=x).logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        return loss

    return {**timed_loop(cfg, rank, world, n_timed, yield_turn, train_step),
            "expert_state": expert_state(model.named_parameters(), optimizer)}


def transformers_preflight(cfg: dict[str, Any], rank: int, world: int, ep: int) -> str | None:
    """One training step of the transformers variant on every rank; the first rank's error, or None if all ran.
    Failures seen so far are deterministic (the same on every rank, before or at the same collective)."""
    import torch.distributed as dist

    try:
        run_transformers(cfg, rank, world, ep, 0, None)
        error = None
    except Exception as e:  # noqa: BLE001 - recorded, the benchmark goes on without this variant
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"
    errors: list[str | None] = [None] * world
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)


def rotation(names: list[str], rnd: int) -> list[str]:
    """Even rounds A, B, C, D; odd rounds A, D, C, B: each variant follows each other one equally often."""
    return list(names) if rnd % 2 == 0 else [names[0], *names[:0:-1]]


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every rank: the unsharded reference, the ep layouts (state, bytes), then rounds of the variants in lockstep.
    On cuda (world 1): NCCL, this rank's GPU; the peak GPU memory of each part (``result["memory"]``)."""
    quiet_worker()
    import torch
    import torch.distributed as dist

    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # 0: one GPU, world 1
    dist.init_process_group("nccl" if cuda else "gloo")  # Lightning's strategies find it initialized and reuse it
    rank, world = dist.get_rank(), dist.get_world_size()
    ep, t0 = cfg["ep"], time.perf_counter()

    def progress(what: str) -> None:  # rank 0, as it goes: where the time went, and how far a cut-off run got
        if rank == 0:
            print(f"  [{time.perf_counter() - t0:5.1f} s] {what}", flush=True)

    try:
        memory: dict[str, Any] = {}
        reset_peak_memory(cuda)
        result: dict[str, Any] = {"rank": rank, "unsharded": unsharded_reference(cfg), "layouts": {}, "runs": [],
                                  "memory": memory}
        memory["unsharded reference (GPT, then Qwen3-MoE)"] = peak_memory(cuda)
        progress("unsharded reference")
        for layout_ep in [e for e in (1, 2, 4, 8) if e <= world and world % e == 0 and cfg["n_experts"] % e == 0]:
            dist.barrier()
            reset_peak_memory(cuda)
            result["layouts"][layout_ep] = run_ours_gpt(cfg, world, layout_ep, cfg["layout_steps"] - 1)
            memory[f"ours GPT ep={layout_ep}, alone ({cfg['layout_steps']} steps)"] = peak_memory(cuda)
            progress(f"layout ep={layout_ep}")
        dist.barrier()
        reset_peak_memory(cuda)
        if cfg["skip_transformers"]:
            result["transformers_error"] = "skipped (--skip-transformers)"
        else:
            result["transformers_error"] = transformers_preflight(cfg, rank, world, ep)
            memory["transformers Qwen3-MoE preflight, alone (1 step)"] = peak_memory(cuda)
            progress(f"transformers preflight: {'ran' if result['transformers_error'] is None else 'failed'}")
        names = [v for v in VARIANTS if not (v.startswith("transformers") and result["transformers_error"])]
        n = cfg["warmup"] + cfg["steps"]
        loops: dict[str, Callable[[Callable[[], None]], Any]] = {
            "ours GPT": lambda turn: run_ours_gpt(cfg, world, ep, n, turn),
            "hand-written GPT": lambda turn: run_hand_gpt(cfg, rank, world, ep, n, turn),
            MIMIC: lambda turn: run_hand_gpt(cfg, rank, world, ep, n, turn, mimic=True),
            "ours Qwen3-MoE": lambda turn: run_ours_hf(cfg, world, ep, n, turn),
            "transformers Qwen3-MoE": lambda turn: run_transformers(cfg, rank, world, ep, n, turn),
        }
        result["variant_errors"] = errors = {}

        def guarded(name: str) -> Callable[[Callable[[], None]], Any]:
            """A variant that fails is recorded and left out of the later rounds; the others go on (one run, blind,
            on a lent GPU: a failure of one must not cost the rest)."""
            def run(turn: Callable[[], None]) -> Any:
                try:
                    return loops[name](turn)
                except Exception as e:  # noqa: BLE001 - recorded, reported by the parent
                    return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"}
            return run

        reset_peak_memory(cuda)
        for rnd in range(cfg["rounds"]):
            gc.collect()
            dist.barrier()  # start each round together (outside the timed steps)
            left = [v for v in names if v not in errors]
            if not left:
                break
            order = rotation(left, rnd)
            outcome = Lockstep(order).run({name: guarded(name) for name in order})
            for name in order:
                if "error" in outcome[name]:
                    errors[name] = f"round {rnd}: {outcome[name]['error']}"
                else:
                    result["runs"].append({"round": rnd, "variant": name, "order": order, **outcome[name]})
            progress(f"round {rnd}" + (f" (failed so far: {', '.join(errors)})" if errors else ""))
        # the variants' models are alive at once in a round: no per-variant peak, the process's over all rounds
        memory[f"lockstep rounds, all {len(names)} variants alive at once (the process's peak)"] = peak_memory(cuda)
    finally:
        dist.destroy_process_group()
    return result


# ---------------------------------------------------------------------------------------------------------------
# grouped mm vs the loop (parent process)
# ---------------------------------------------------------------------------------------------------------------
def bench_grouped_mm(rows: int, dim: int, hidden: int, experts: int, repeats: int, device: str = "cpu",
                     dtype: str = "float32", label: str = "") -> dict[str, Any]:
    """SwiGLU experts forward + backward, grouped mm vs the example's per-expert loop, on the same tensors (made on
    ``device`` in ``dtype``; on cuda each timed step synchronized at both ends; the differences taken in fp32)."""
    import torch
    import torch.nn.functional as F

    from example_projects.gpt.moe import GroupedExperts

    cuda, kind = device == "cuda", getattr(torch, dtype)
    reset_peak_memory(cuda)
    g = torch.Generator(device).manual_seed(SEED)
    share = torch.rand(experts, generator=g, device=device) ** 2  # uneven loads, one expert idle
    share[experts // 2] = 0
    counts = (share / share.sum() * rows).floor().long()
    counts[0] += rows - int(counts.sum())
    offsets = counts.cumsum(0).to(torch.int32)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=kind)

    x0 = randn(rows, dim)
    ws0 = [randn(experts, dim, hidden) / dim**0.5, randn(experts, dim, hidden) / dim**0.5,
           randn(experts, hidden, dim) / hidden**0.5]
    grad_out = randn(rows, dim)  # a real output gradient (see the note on expanded ones)

    def grouped(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.grouped_mm(a, w, offs=offsets)

    starts = [0, *offsets.tolist()]

    def loop(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # example_projects/gpt/moe.py's fallback
        return torch.cat([a[starts[e]:starts[e + 1]] @ w[e] for e in range(w.shape[0])])

    def step(mm: Callable) -> tuple[float, list]:
        x = x0.clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in ws0]
        start = synced_now(cuda)
        out = mm(F.silu(mm(x, ws[0])) * mm(x, ws[1]), ws[2])
        out.backward(grad_out)
        return synced_now(cuda) - start, [out.detach(), x.grad, *(w.grad for w in ws)]

    def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
        """max |a - b| / max |b|, in fp32, a chunk at a time (a GPU-sized weight's fp32 copies would be GBs)."""
        num = den = 0.0
        for ca, cb in zip(a.flatten().split(1 << 24), b.flatten().split(1 << 24)):
            num = max(num, float((ca.float() - cb.float()).abs().max()))
            den = max(den, float(cb.float().abs().max()))
        return num / max(den, 1e-30)

    _, ref = step(grouped)
    _, alt = step(loop)
    diffs = [rel_diff(a, b) for a, b in zip(alt, ref)]
    del alt
    with torch.device("meta"):  # the example's module on the same weights, without allocating its own
        module = GroupedExperts(experts, dim, hidden)
    module.load_state_dict(dict(zip(("w_gate", "w_up", "w_down"), ws0)), assign=True)
    with torch.no_grad():
        example = module(x0, counts)
    example_diff = rel_diff(example, ref[0])
    del ref, example, module
    times: dict[str, list[float]] = {"grouped_mm": [], "loop": []}
    for r in range(repeats + 2):  # 2 warm-up repeats
        pair = [("grouped_mm", grouped), ("loop", loop)]
        for name, mm in (pair if r % 2 == 0 else pair[::-1]):
            t = step(mm)[0]
            if r >= 2:
                times[name].append(t)
    paired = [a / b for a, b in zip(times["grouped_mm"], times["loop"])]
    flops = 3 * 3 * 2 * rows * dim * hidden  # 3 matmuls, 2 FLOPs a multiply-add; backward twice the forward
    return {"label": label, "rows": rows, "dim": dim, "hidden": hidden, "experts": experts, "device": device,
            "dtype": dtype, "counts": counts.tolist(),
            "max_rel_diff_loop_vs_grouped": dict(zip(["out", "x_grad", "w_gate_grad", "w_up_grad", "w_down_grad"],
                                                     diffs)),
            "example_GroupedExperts_vs_grouped_mm": example_diff,
            "example_uses": "grouped_mm" if (dim * x0.element_size()) % 16 == 0 else "loop",
            "time": {k: summarize(v) for k, v in times.items()}, "times_s": times,
            "flops_per_step": flops,
            "tflops_per_s": {k: flops / statistics.median(v) / 1e12 for k, v in times.items()},
            "peak_memory": peak_memory(cuda),
            "grouped_over_loop_medians": statistics.median(times["grouped_mm"]) / statistics.median(times["loop"]),
            "grouped_over_loop_paired": statistics.median(paired)}


def expanded_grad_note() -> str | None:
    """torch's CPU grouped mm backward with an expanded (stride-0) output gradient, e.g. ``out.sum().backward()``."""
    import torch
    import torch.nn.functional as F

    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(2, 16, 16, requires_grad=True)
    try:
        F.grouped_mm(x, w, offs=torch.tensor([4, 8], dtype=torch.int32)).sum().backward()
    except RuntimeError as e:
        return (f"F.grouped_mm(...).sum().backward() fails on CPU with this torch: {e} (an expanded output gradient; "
                f"the MoE layer's is a real tensor, so training is not affected)")
    return None


# ---------------------------------------------------------------------------------------------------------------
# the parent: combine ranks, report
# ---------------------------------------------------------------------------------------------------------------
def uniform_formula(cfg: dict[str, Any], ep: int) -> dict[str, float]:
    """Per rank per step, even routing: 4 transfers of T x k rows of H x 4 bytes per MoE layer."""
    sent = 4 * cfg["n_layer"] * cfg["batch_size"] * cfg["seq_len"] * cfg["top_k"] * cfg["n_embd"] * 4
    return {"sent_bytes": sent, "left_bytes": sent * (ep - 1) / ep}


def state_row(state: dict[str, int], unsharded: dict[str, int]) -> dict[str, float]:
    return {k: state[k] / unsharded[k] for k in ("params", "grads", "optim")}


def combine_world(world: int, per_rank: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    warmup, ep = cfg["warmup"], cfg["ep"]
    unsharded = per_rank[0]["unsharded"]
    layouts = {}
    for layout_ep in per_rank[0]["layouts"]:
        runs = [r["layouts"][layout_ep] for r in per_rank]
        layouts[layout_ep] = {
            "ep": layout_ep, "efsdp": world // layout_ep,
            "expected_ratio": 1 / world,
            "expert_state_per_rank": [r["expert_state"] for r in runs],
            "ratio_per_rank": [state_row(r["expert_state"], unsharded["gpt"]) for r in runs],
            "comm_per_rank": [r["comm"] for r in runs],
            "formula": uniform_formula(cfg, layout_ep),
        }
    variants: dict[str, Any] = {}
    names = [v for v in VARIANTS if any(r["variant"] == v for r in per_rank[0]["runs"])]
    for name in names:
        runs = [[r for r in rank_result["runs"] if r["variant"] == name] for rank_result in per_rank]
        rounds = [slowest_rank_per_step([rank_runs[i]["step_times_s"] for rank_runs in runs])
                  for i in range(len(runs[0]))]
        last = [rank_runs[-1] for rank_runs in runs]
        ref = unsharded["gpt" if "GPT" in name else "qwen3_moe"]
        variants[name] = {
            "time": summarize([t for steps in rounds for t in steps[warmup:]]),
            "slowest_rank_step_times_s_per_round": rounds,
            "losses_per_rank_per_round": [[r["losses"] for r in rank_runs] for rank_runs in runs],
            "expert_state_per_rank": [r["expert_state"] for r in last],
            "ratio_per_rank": [state_row(r["expert_state"], ref) for r in last],
            "comm_per_rank": [r["comm"] for r in last],
        }
    ratios, parity, parity_rel = {}, {}, {}
    for label, (ours, ref) in PAIRS.items():
        if ours in variants and ref in variants:
            ratios[label] = time_ratios(variants, ours, ref, warmup)
            a, b = variants[ours]["losses_per_rank_per_round"], variants[ref]["losses_per_rank_per_round"]
            pairs = [(x, y) for ra, rb in zip(a, b) for la, lb in zip(ra, rb) for x, y in zip(la, lb)]
            parity[label] = max(abs(x - y) for x, y in pairs)
            parity_rel[label] = max(abs(x - y) / max(abs(y), 1e-30) for x, y in pairs)
    tolerance = LOSS_TOLERANCE[cfg["precision"]]
    runs_comm = [entry["comm_per_rank"] for entry in (*layouts.values(), *variants.values())]
    dispatch = {
        "measured_equals_routing_on_every_rank": all(c["rows_left_bytes"] + c["choices_left_bytes"]
                                                     == c["routing_predicted_left_bytes"]
                                                     for comm in runs_comm for c in comm),
        "recording_errors": sum(len(c["errors"]) for comm in runs_comm for c in comm),
    }
    return {"world_size": world, "ep": ep, "unsharded_expert_state": unsharded, "layouts": layouts,
            "dispatch_check": dispatch,
            "variants": variants, "time_ratios": ratios, "max_loss_diff": parity, "max_rel_loss_diff": parity_rel,
            "loss_tolerance_rel": tolerance,
            "losses_within_tolerance": {label: d <= tolerance for label, d in parity_rel.items()},
            "gpu_memory_rank0": per_rank[0]["memory"],
            "transformers_error": per_rank[0]["transformers_error"], "formula": uniform_formula(cfg, ep),
            "variant_errors": {f"rank {r}: {name}": e for r, res in enumerate(per_rank)
                               for name, e in res["variant_errors"].items()}}


def time_ratios(variants: dict[str, Any], ours: str, ref: str, warmup: int) -> dict[str, Any]:
    """ours / ref: ratio of medians; median of paired step ratios; that paired median per round."""
    paired = [[a / b for a, b in zip(o[warmup:], r[warmup:])]
              for o, r in zip(variants[ours]["slowest_rank_step_times_s_per_round"],
                              variants[ref]["slowest_rank_step_times_s_per_round"])]
    return {"of_medians": variants[ours]["time"]["median_s"] / variants[ref]["time"]["median_s"],
            "paired_median": statistics.median(x for rnd in paired for x in rnd),
            "paired_median_per_round": [statistics.median(rnd) for rnd in paired],
            "paired_per_step": paired}


def kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def state_table(results: list[dict[str, Any]]) -> str:
    rows = []
    for res in results:
        world, un = res["world_size"], res["unsharded_expert_state"]
        for model in ("gpt", "qwen3_moe"):
            u = un[model]
            rows.append([world, f"unsharded {'GPT' if model == 'gpt' else 'Qwen3-MoE'} (1 process)", "-", "-",
                         kib(u["params"]), kib(u["grads"]), kib(u["optim"]), "1.000", "1.000", "1.000", "1.000"])
        entries = [(f"ours GPT ep={e}" + ((" (FSDP2)" if world > 1 else " (one rank)") if e == 1 else ""), lay["ep"],
                    lay["efsdp"], lay) for e, lay in res["layouts"].items()]
        entries += [(name, res["ep"], world // res["ep"], v) for name, v in res["variants"].items()]
        for label, e, efsdp, entry in entries:
            i = max(range(len(entry["expert_state_per_rank"])),
                    key=lambda r: entry["expert_state_per_rank"][r]["params"])
            s, ratio = entry["expert_state_per_rank"][i], entry["ratio_per_rank"][i]
            rows.append([world, label, e, efsdp, kib(s["params"]), kib(s["grads"]), kib(s["optim"]),
                         f"{ratio['params']:.3f}", f"{ratio['grads']:.3f}", f"{ratio['optim']:.3f}",
                         f"{1 / (e * efsdp):.3f}"])
    headers = ["world", "layout (largest rank)", "ep", "efsdp", "params KiB", "grads KiB", "AdamW KiB",
               "params ratio", "grads ratio", "AdamW ratio", "1/(ep*efsdp)"]
    return format_table(headers, rows)


def comm_table(results: list[dict[str, Any]], cfg: dict[str, Any]) -> str:
    rows = []
    for res in results:
        world = res["world_size"]
        entries = [(f"ours GPT ep={e}", e, lay["comm_per_rank"]) for e, lay in res["layouts"].items()]
        entries += [(name, res["ep"], v["comm_per_rank"]) for name, v in res["variants"].items()]
        for label, e, comm in entries:
            formula = uniform_formula(cfg, e)
            for r, c in enumerate(comm):
                predicted = c["routing_predicted_left_bytes"]
                left = c["rows_left_bytes"] + c["choices_left_bytes"]  # the per-rank dispatch's choices included
                rows.append([world, label, r, f"{c['rows_calls']['forward']}+{c['rows_calls']['backward']}",
                             kib(c["rows_sent_bytes"]), kib(formula["sent_bytes"] if e > 1 else 0),
                             kib(left), kib(c["choices_left_bytes"]), kib(predicted), kib(formula["left_bytes"]),
                             f"{left / predicted:.3f}" if predicted else "-",
                             f"{left / formula['left_bytes']:.3f}" if formula["left_bytes"] else "-",
                             c["counts_calls"], c["counts_sent_bytes"]])
    headers = ["world", "run", "rank", "row a2a fwd+bwd", "sent KiB", "even sent KiB", "left KiB",
               "of which choices", "routing left KiB", "even left KiB", "left/routing", "left/even", "count a2a",
               "count bytes"]
    return format_table(headers, rows)


def other_collectives_table(results: list[dict[str, Any]]) -> str:
    """Rank 0's other collectives in the recorded step: calls and bytes (all-gathers: the gathered size)."""
    ops = {"all-gather": "c10d._allgather_base_", "reduce-scatter": "c10d._reduce_scatter_base_",
           "all-reduce": "c10d.allreduce_", "barrier": "c10d.barrier"}
    rows = []
    for res in results:
        entries = [(f"ours GPT ep={e}", lay["comm_per_rank"][0]) for e, lay in res["layouts"].items()]
        entries += [(name, v["comm_per_rank"][0]) for name, v in res["variants"].items()]
        for label, comm in entries:
            other = comm["other_collectives"]
            cells = []
            for op in ops.values():
                entry = other.get(op, {"calls": 0, "bytes": 0})
                cells.append(f"{entry['calls']} / {kib(entry['bytes'])}" if op != "c10d.barrier" else entry["calls"])
            rest = sorted(k for k in other if k not in ops.values() and not k.endswith(("wait_tensor",
                                                                                         "_wrap_tensor_autograd")))
            rows.append([res["world_size"], label, *cells, ", ".join(rest) or "-"])
    headers = ["world", "run (rank 0)", *(f"{k} calls / KiB" if k != "barrier" else "barriers" for k in ops),
               "others"]
    return format_table(headers, rows)


def time_table(results: list[dict[str, Any]]) -> str:
    rows = []
    for res in results:
        refs = {ref: label for label, (_, ref) in PAIRS.items()}
        for name, v in res["variants"].items():
            t = v["time"]
            cells = [res["world_size"], name, *(f"{t[k] * 1e3:.1f}" for k in ("median_s", "p25_s", "p75_s"))]
            label = refs.get(name)
            if label and label in res["time_ratios"]:
                r = res["time_ratios"][label]
                rounds = r["paired_median_per_round"]
                ok = res["losses_within_tolerance"][label]
                cells += [label, f"{r['of_medians']:.3f}", f"{r['paired_median']:.3f}",
                          f"{min(rounds):.3f}-{max(rounds):.3f}",
                          f"{res['max_rel_loss_diff'][label]:.1e}" + ("" if ok else " OVER")]
            else:
                cells += ["-", "-", "-", "-", "-"]
            rows.append([*cells, t["n"]])
    headers = ["world", "variant", "median ms", "p25 ms", "p75 ms", "ratio", "of medians", "paired",
               "paired per round", "max loss diff (rel)", "steps"]
    return format_table(headers, rows)


def gmm_table(gmm: list[dict[str, Any]]) -> str:
    rows = []
    for g in gmm:
        d, tf, mem = g["max_rel_diff_loop_vs_grouped"], g["tflops_per_s"], g["peak_memory"]
        rows.append([g["label"], f"{g['rows']}x{g['dim']}->{g['hidden']}, {g['experts']} experts",
                     f"{g['time']['grouped_mm']['median_s'] * 1e3:.2f}", f"{g['time']['loop']['median_s'] * 1e3:.2f}",
                     f"{tf['grouped_mm']:.3g}", f"{tf['loop']:.3g}",
                     f"{g['grouped_over_loop_medians']:.3f}", f"{g['grouped_over_loop_paired']:.3f}",
                     f"{max(d.values()):.1e}", f"{g['example_GroupedExperts_vs_grouped_mm']:.1e}",
                     f"{gib(mem['peak_allocated_bytes'])}" if mem else "-"])
    headers = ["case", "routed rows x dim -> hidden", "grouped ms", "loop ms", "grouped TFLOP/s", "loop TFLOP/s",
               "grouped/loop medians", "grouped/loop paired", "max rel diff (out, grads)", "example vs grouped",
               "peak GiB"]
    return format_table(headers, rows)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def memory_table(results: list[dict[str, Any]]) -> str:
    """Rank 0's peak GPU memory per part of the run (each part after a reset of the peak statistics)."""
    rows = [[res["world_size"], part, gib(m["peak_allocated_bytes"]), gib(m["peak_reserved_bytes"])]
            for res in results for part, m in res["gpu_memory_rank0"].items() if m]
    return format_table(["world", "part", "max allocated GiB", "max reserved GiB"], rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default="2", help="process count(s), comma-separated: 2, 4 or 2,4 (default 2); or 1 "
                                                "alone (the GPU rows' world)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size of the timed variants (default 2; 1 at "
                                                        "--world 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo, one thread per rank) or cuda (one GPU: --world 1, NCCL); default cpu")
    p.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true",
                   help="Lightning's precision; the plain loops autocast to bf16 under bf16-mixed (default 32-true)")
    p.add_argument("--steps", type=int, default=25, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps per run left out of the timing")
    p.add_argument("--rounds", type=int, default=3, help="repetitions (fresh models), rotation reversed in odd ones")
    p.add_argument("--layout-steps", type=int, default=2, help="steps of each ep layout run (the last is recorded)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--vocab-size", type=int, default=97)
    p.add_argument("--n-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-hidden", type=int, default=128, help="each expert's SwiGLU width")
    p.add_argument("--gmm-repeats", type=int, default=10, help="paired repeats of the grouped-mm comparison")
    p.add_argument("--skip-transformers", action="store_true", help="leave transformers' expert parallelism out")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds one launch may take before it is killed")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_moe.json"))
    args = p.parse_args(argv)
    args.world_list = [int(w) for w in args.world.split(",") if w.strip()]
    if not args.world_list or any(w < 1 for w in args.world_list) or (1 in args.world_list
                                                                     and len(args.world_list) > 1):
        p.error(f"--world={args.world!r}: give process counts >= 2, e.g. 2 or 4 or 2,4; or 1 alone")
    if args.world_list == [1]:
        if args.ep not in (None, 1):
            p.error(f"--ep={args.ep} at --world 1: one rank holds every expert, ep is 1 (the default at --world 1); "
                    f"drop --ep or pass --ep 1")
        args.ep = 1
    else:
        args.ep = 2 if args.ep is None else args.ep
        for w in args.world_list:
            if w % args.ep or args.n_experts % args.ep or args.ep < 2:
                p.error(f"--ep={args.ep} must be >= 2 and divide --world ({w}) and --n-experts ({args.n_experts})")
    if args.device == "cuda":
        if args.world_list != [1]:
            p.error(f"--device cuda runs at --world 1 only (one GPU: NCCL at world size 1), got --world {args.world}; "
                    f"pass --world 1")
        import torch

        if not torch.cuda.is_available():
            p.error(f"--device cuda: no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() is "
                    f"False); run on a GPU machine, or use --device cpu --world 1 for the same code on the CPU")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.layout_steps < 1:
        p.error("--steps, --rounds and --layout-steps must be >= 1, --warmup >= 0")
    if args.n_embd % args.n_head:
        p.error("--n-head must divide --n-embd")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("ep", "steps", "warmup", "rounds", "layout_steps", "n_layer", "n_embd",
                                         "n_head", "seq_len", "batch_size", "vocab_size", "n_experts", "top_k",
                                         "expert_hidden", "skip_transformers", "device", "precision")}
    cuda = args.device == "cuda"
    meta = run_metadata()
    start = time.perf_counter()
    results, launch_s = [], {}
    for world in args.world_list:
        print(f"world {world}: launching {world} process{'es' if world > 1 else ''} ({args.device}) ...", flush=True)
        t0 = time.perf_counter()
        per_rank = launch(world, worker, cfg, timeout=args.timeout)
        launch_s[world] = time.perf_counter() - t0
        results.append(combine_world(world, per_rank, cfg))
    import torch

    device_name = torch.cuda.get_device_name() if cuda else "CPU"
    tokens = cfg["batch_size"] * cfg["seq_len"]
    backend = "nccl" if cuda else "gloo"
    gmm_dtype = "bfloat16" if cuda and args.precision == "bf16-mixed" else "float32"
    meta.update(device=args.device, device_name=device_name, backend=backend, precision=args.precision,
                grouped_mm_dtype=gmm_dtype, threads_per_rank=None if cuda else 1, launch_wall_s=launch_s,
                measurement=("collectives: a TorchDispatchMode active for the recorded step (forward, backward, "
                             "optimizer) sees _c10d_functional.all_to_all_single (rows) and c10d.alltoall_base_ "
                             "(counts); bytes from each call's input and input split sizes"))
    record = {"benchmark": "moe", "args": vars(args), "model": cfg, "metadata": meta, "results": results,
              "grouped_mm": None, "grouped_mm_note": None}
    write_json(args.out, record)  # the training results first: kept if item 4 does not finish
    where = f"{device_name}, {backend}, world 1" if cuda else f"CPU, gloo, 1 thread/rank, {meta['cpu_count']} cores"
    print(f"\nMoE GPT: {cfg['n_layer']} blocks x {cfg['n_embd']} wide, every MLP {cfg['n_experts']} SwiGLU experts "
          f"({cfg['expert_hidden']} wide), top-{cfg['top_k']} softmax router; Qwen3-MoE at the same sizes; "
          f"{args.precision}, seq {cfg['seq_len']}, batch {cfg['batch_size']}/rank ({tokens} tokens), "
          f"vocabulary {cfg['vocab_size']}, AdamW; {where}; torch {torch.__version__}")
    print("\n1. Expert state per rank (params, grads, AdamW moments; the 0-d step counters apart), from the local "
          "shards after the last step, against one process's unsharded experts; expected 1/(ep*efsdp) = 1/world")
    print(state_table(results))
    print(f"\n2. All-to-all per step (recorded step), per rank: row a2a calls, bytes sent (all splits) and left (to "
          f"other ranks); 'even' = 4 x {tokens} tokens x top-{cfg['top_k']} x {cfg['n_embd']} x 4 B per layer "
          f"(x (ep-1)/ep for 'left'); 'routing' = 2 x (rows routed off-rank + rows received) x {cfg['n_embd']} x 4 B "
          f"from that step's counts" + ("; under bf16-mixed ours sends 2-byte rows (FSDP2 casts the experts' inputs), "
                                        "the routing column uses the row size seen" if args.precision == "bf16-mixed"
                                        else ""))
    print(comm_table(results, cfg))
    for res in results:
        check = res["dispatch_check"]
        print(f"world {res['world_size']}: bytes left == the routing's prediction on every rank of every run: "
              f"{check['measured_equals_routing_on_every_rank']}; recording errors: {check['recording_errors']}"
              + ("; trivially: at world 1 (ep=1) nothing leaves the rank" if res["world_size"] == 1 else ""))
    print("\nOther collectives in the recorded step (FSDP2's, the logged loss's), rank 0: calls / KiB (all-gather: the "
          "gathered size; reduce-scatter: the unreduced input)")
    print(other_collectives_table(results))
    print(f"\n3. Step time, slowest rank per step, {args.rounds} rounds x {args.steps} steps per variant, in lockstep "
          f"({args.warmup} warm-up steps per run left out), ep={cfg['ep']}{', synchronized' if cuda else ''}; "
          f"ratio = ours / the row's variant; max loss diff: ours vs that variant, every rank, step and round, "
          f"relative (tolerance {LOSS_TOLERANCE[args.precision]:.1e} under {args.precision}: "
          f"{'two bf16 rounding steps' if args.precision == 'bf16-mixed' else 'float rounding'})")
    print(time_table(results))
    for res in results:
        over = [label for label, ok in res["losses_within_tolerance"].items() if not ok]
        if over:
            print(f"world {res['world_size']}: LOSSES DIFFER beyond the tolerance: {', '.join(over)}")
    if cuda:
        print("\nPeak GPU memory (torch.cuda.max_memory_allocated / max_memory_reserved), rank 0, GiB; the peak "
              "statistics reset before each part")
        print(memory_table(results))
    for res in results:
        if res["transformers_error"]:
            print(f"world {res['world_size']}: transformers' expert parallelism left out: "
                  f"{res['transformers_error'].splitlines()[0]}")
        for name, error in res["variant_errors"].items():
            print(f"world {res['world_size']}: FAILED, left out from then on: {name}: {error}")
    print(f"\ngrouped mm vs loop (this process, {device_name if cuda else '1 thread'}) ...", flush=True)
    if not cuda:
        torch.set_num_threads(1)
    routed = cfg["batch_size"] * cfg["seq_len"] * cfg["top_k"]
    cases = [("the model's (one rank's routed rows)", routed, cfg["n_embd"], cfg["expert_hidden"], cfg["n_experts"]),
             ("4x the model's", 4 * routed, 4 * cfg["n_embd"], 4 * cfg["expert_hidden"], cfg["n_experts"]),
             *(GMM_GPU_CASES if cuda else ())]
    gmm = []
    for label, rows, dim, hidden, experts in cases:
        gmm.append(bench_grouped_mm(rows, dim, hidden, experts, args.gmm_repeats, args.device, gmm_dtype, label))
        print(f"  {label}: grouped / loop {gmm[-1]['grouped_over_loop_medians']:.3f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    gmm_note = expanded_grad_note()
    total_s = time.perf_counter() - start
    print(f"\n4. Grouped-mm experts vs the per-expert loop, SwiGLU forward + backward, 1 process, "
          f"{device_name if cuda else '1 thread'}, {gmm_dtype}, the same tensors, uneven loads (one expert idle); "
          f"TFLOP/s of 18 x rows x dim x hidden per step")
    print(gmm_table(gmm))
    if gmm_note:
        print(f"Note: {gmm_note}")
    if not cuda:
        print(f"\nNote: {NOISE_NOTE} World sizes above the core count ({meta['cpu_count']}) time-share cores.")
    meta.update(load_average_end=os.getloadavg() if hasattr(os, "getloadavg") else None, total_wall_s=total_s)
    out = write_json(args.out, {**record, "grouped_mm": gmm, "grouped_mm_note": gmm_note})
    print(f"Total {total_s:.0f} s; results written to {out}")


if __name__ == "__main__":
    main()
