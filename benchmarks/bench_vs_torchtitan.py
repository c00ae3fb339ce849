"""lightning_par against torchtitan on one GPU: the same Llama 3 model, data, optimizer and options, side by side.

Per row of the matrix (priority order, see ``ROWS``), in one process, one after the other:

- ``torchtitan``: torchtitan's Llama 3 model (``Llama3Model``, built from a config at Llama-3.1-8B's dims with
  ``--layers`` of its 32 layers, or its debug model) parallelized by torchtitan's own code at world 1 and trained by a
  hand-written step as torchtitan's trainer does it (zero_grad, forward, cross-entropy, backward, clip 1.0, AdamW).
  Two levels, the first that imports is used and recorded as ``torchtitan_level``:

  * ``package``: ``torchtitan.models.llama3.parallelize_llama`` (its ``FullAC`` and ``apply_compile``; at world 1
    no ``apply_fsdp_to_decoder``: torchtitan shards only where ``dp_shard > 1 or cp > 1``) and its
    ``Float8LinearConverter``. Needs a torch newer than 2.11 (``torch.distributed.fsdp.DataParallelMeshDims``).
  * ``recipe``: where the package does not import (torch 2.11: ``torchtitan/distributed/fsdp.py`` imports
    ``DataParallelMeshDims``, which 2.11 lacks, and ``torchtitan.models.llama3/__init__`` imports it through
    ``parallelize.py``): the model file ``torchtitan/models/llama3/model.py`` is loaded directly, the config built as
    its ``llama3_configs`` builds it, and torchtitan's own ``FullAC`` and ``apply_compile`` are applied. Float8:
    torchtitan's converter if it imports, else by hand.

- ``ours``: the same model (same class, config, seed, initial weights) in a LightningModule trained by
  ``lightning.Trainer(strategy=lightning_par.FSDP2Strategy(activation_checkpointing=..., compile=...),
  precision="bf16-mixed")``; steps timed by a callback with CUDA-synchronized timestamps. Float8: the strategy's
  ``float8="tensorwise"`` option where this lightning_par has it (``--ours-float8 strategy``, the default), else
  ``torchao.float8.convert_to_float8_training`` by hand before the Trainer sees the model (``--ours-float8 hand``).

Same for both: synthetic random tokens (seeded), batch, sequence length, AdamW (lr 8e-4, betas 0.9/0.95, eps 1e-8,
weight decay 0.1, fused on CUDA; torchtitan's defaults, no LR schedule), grad-norm clip 1.0, cross-entropy in fp32.
Attention: torchtitan's ``ScaledDotProductAttention`` inner attention (causal; cuDNN/flash kernels) instead of its LM
default FlexAttention with block-causal document masks: random tokens have no document boundaries, so the two compute
the same thing, and SDPA needs no mask plumbing on our side.
Mixed precision at world 1 is autocast on both sides, as each framework does it there: torchtitan's trainer enters
``torch.autocast(bf16)`` when FSDP is off (``maybe_enable_amp``), ours ``precision="bf16-mixed"``; neither wraps the
model in FSDP at one rank. (The first GPU run, 2026-11-27, had the torchtitan side wrap the model in fully_shard at
world 1 with FSDP's bf16 policy, which torchtitan's trainer does not do at one rank: its file says so.)

Reported per side: tokens/s (from the median step), step ms (median of the steps after ``--warmup``), MFU with FLOPs
counted the same way for both: 6·N·T + 12·L·d·s·T per step (N = matmul parameters outside the embedding: every
block's linear weights and the output head; T tokens per step; L layers, d model dim, s sequence length; the
attention term is torchtitan's/PaLM's, full not causal) over the GPU's dense bf16 peak (float8 rows too), peak memory
(``torch.cuda.max_memory_allocated``, reset per side), the loss at the last step (same init and data: similar
losses), and per row the ratio ours / torchtitan of tokens/s.

Budget: ``--budget-s`` wall seconds; a row starts only if its estimated time fits (estimates from the rows measured
so far), else it is recorded as skipped. Each side runs in try/except (errors go to the JSON); the JSON is rewritten
after every side, so a run killed by an outer timeout keeps what it measured.

Usage (GPU):  python benchmarks/bench_vs_torchtitan.py --budget-s 200 --out benchmarks/results/vs_torchtitan.json
Usage (CPU smoke, tiny model, compile off): python benchmarks/bench_vs_torchtitan.py --device cpu --budget-s 600
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import format_table, quiet_worker, run_metadata, step_timer, synced_now, write_json  # noqa: E402

SEED = 0
ADAMW = dict(lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # torchtitan's default_adamw
MAX_NORM = 1.0  # torchtitan's training.max_norm default
GIB = 2**30
OPTIONS = {"ours_float8": "strategy"}  # set from --ours-float8

# (name, flavor, seq_len, batch, compile, ac, float8) in priority order: the first rows matter most.
ROWS: list[dict[str, Any]] = [
    dict(name="8B s2048 eager", flavor="8B", seq=2048, batch=2, compile=False, ac=False, float8=False),
    dict(name="8B s2048 compile", flavor="8B", seq=2048, batch=2, compile=True, ac=False, float8=False),
    dict(name="8B s2048 compile fp8", flavor="8B", seq=2048, batch=2, compile=True, ac=False, float8=True),
    dict(name="8B s8192 compile AC", flavor="8B", seq=8192, batch=1, compile=True, ac=True, float8=False),
    dict(name="8B s2048 eager AC", flavor="8B", seq=2048, batch=2, compile=False, ac=True, float8=False),
    dict(name="8B s2048 eager fp8", flavor="8B", seq=2048, batch=2, compile=False, ac=False, float8=True),
    dict(name="debug s2048 eager", flavor="debug", seq=2048, batch=8, compile=False, ac=False, float8=False),
    dict(name="debug s2048 compile", flavor="debug", seq=2048, batch=8, compile=True, ac=False, float8=False),
    dict(name="8B s2048 compile AC", flavor="8B", seq=2048, batch=2, compile=True, ac=True, float8=False),
    dict(name="8B s8192 compile AC fp8", flavor="8B", seq=8192, batch=1, compile=True, ac=True, float8=True),
    dict(name="8B s8192 eager AC", flavor="8B", seq=8192, batch=1, compile=False, ac=True, float8=False),
    # more tokens per matmul: float8's gain grows with the matmuls' size
    dict(name="8B s2048 b8 compile", flavor="8B", seq=2048, batch=8, compile=True, ac=False, float8=False),
    dict(name="8B s2048 b8 compile fp8", flavor="8B", seq=2048, batch=8, compile=True, ac=False, float8=True),
]
# CPU smoke: debug-model-sized, tiny, compile off (float8 emulated: torchao's emulate mode runs on the CPU); the
# compiled row last (Inductor's C++ on a CPU takes minutes: the budget may skip it).
CPU_ROWS: list[dict[str, Any]] = [
    dict(name="tiny s64 eager", flavor="tiny", seq=64, batch=2, compile=False, ac=False, float8=False),
    dict(name="tiny s64 eager AC", flavor="tiny", seq=64, batch=2, compile=False, ac=True, float8=False),
    dict(name="tiny s64 eager fp8(emulated)", flavor="tiny", seq=64, batch=2, compile=False, ac=False, float8=True),
    dict(name="tiny s64 compile AC", flavor="tiny", seq=64, batch=2, compile=True, ac=True, float8=False),
]

# dense bf16 peak FLOP/s (no sparsity) by device-name substring, first match wins
PEAK_BF16 = (("H200", 989.4e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989.4e12),
             ("A100", 312e12), ("L40S", 362e12), ("B200", 2250e12))


# ---------------------------------------------------------------------------------------------------------------
# torchtitan: import at the best level available
# ---------------------------------------------------------------------------------------------------------------
def load_torchtitan(level: str) -> dict[str, Any]:
    """torchtitan's pieces. ``level``: "auto" (package, else recipe), "package" or "recipe"."""
    api: dict[str, Any] = {"errors": {}}
    import torchtitan

    api["version"] = getattr(torchtitan, "__version__", "?")
    if level in ("auto", "package"):
        try:
            from torchtitan.models import llama3

            api.update(level="package", Llama3Model=llama3.Llama3Model, configs=llama3.llama3_configs,
                       parallelize_llama=llama3.parallelize_llama)
        except Exception as e:  # noqa: BLE001 - recorded: why the package path is not used
            api["errors"]["package"] = f"{type(e).__name__}: {e}"
            if level == "package":
                raise
    if "level" not in api:
        # the model file alone: torchtitan.models.llama3's __init__ imports parallelize.py -> distributed/fsdp.py
        path = Path(torchtitan.__file__).parent / "models" / "llama3" / "model.py"
        spec = importlib.util.spec_from_file_location("_torchtitan_llama3_model", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        api.update(level="recipe", Llama3Model=mod.Llama3Model, configs=None, parallelize_llama=None,
                   block_config_cls=mod.Llama3TransformerBlock.Config)
    else:
        from torchtitan.models.llama3.model import Llama3TransformerBlock

        api["block_config_cls"] = Llama3TransformerBlock.Config
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.parallel_dims import ParallelDims

    api.update(CompileConfig=CompileConfig, FullAC=FullAC, apply_compile=apply_compile, ParallelDims=ParallelDims)
    try:
        from torchtitan.components.quantization.float8 import Float8LinearConverter

        api["Float8LinearConverter"] = Float8LinearConverter
    except Exception as e:  # noqa: BLE001
        api["errors"]["float8_converter"] = f"{type(e).__name__}: {e}"
        api["Float8LinearConverter"] = None
    return api


def model_config(api: dict[str, Any], flavor: str, n_layers: int, seq_len: int) -> Any:
    """A ``Llama3Model.Config``: torchtitan's ``llama3_configs[flavor]`` where the package imports, else the same
    built here from torchtitan.models.common as its ``_build_llama3_layers`` does; then the first ``n_layers``
    layers, SDPA inner attention, RoPE cache of ``seq_len`` (what torchtitan's trainer sets)."""
    if api["level"] == "handwritten":
        return handwritten_config(flavor, n_layers, seq_len)
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if api["configs"] is not None and flavor in ("8B", "debug"):
        cfg = api["configs"]["8B" if flavor == "8B" else "debugmodel"](attn_backend="flex")
    else:
        cfg = _mirror_config(api, flavor)
    cfg.layers = list(cfg.layers[:n_layers])
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
    return cfg


def _mirror_config(api: dict[str, Any], flavor: str) -> Any:
    """torchtitan 0.3.0's ``llama3/__init__.py`` ``_8b`` / ``_debugmodel`` / ``_build_llama3_layers``, for when that
    file cannot be imported (it pulls parallelize.py). "tiny" is the debug model at 64 dims for the CPU smoke run."""
    from functools import partial

    import torch.nn as nn
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.common.param_init import depth_scaled_std

    if flavor == "8B":
        dim, n_heads, n_kv, vocab, n_layers = 4096, 32, 8, 128256, 32
        hidden = compute_ffn_hidden_dim(dim, multiple_of=1024, ffn_dim_multiplier=1.3)
    elif flavor == "debug":
        dim, n_heads, n_kv, vocab, n_layers = 256, 16, None, 2048, 6
        hidden = compute_ffn_hidden_dim(dim, multiple_of=256)
    else:  # tiny
        dim, n_heads, n_kv, vocab, n_layers = 64, 4, 2, 256, 2
        hidden = compute_ffn_hidden_dim(dim, multiple_of=64)
    linear_init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm_init = {"weight": nn.init.ones_}
    s = dim**-0.5
    out_init = {"weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s), "bias": nn.init.zeros_}

    def depth_init(layer_id: int) -> dict:
        return {"weight": partial(nn.init.trunc_normal_, std=depth_scaled_std(0.02, layer_id)),
                "bias": nn.init.zeros_}

    rope = ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama")
    layers = [
        api["block_config_cls"](
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
            attention=make_gqa_config(dim=dim, n_heads=n_heads, n_kv_heads=n_kv, wqkv_param_init=linear_init,
                                      wo_param_init=depth_init(i), inner_attention=ScaledDotProductAttention.Config(),
                                      fuse_qkv=True, rope=rope),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=hidden, w1_param_init=linear_init,
                                         w2w3_param_init=depth_init(i)),
        )
        for i in range(n_layers)
    ]
    return api["Llama3Model"].Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=out_init),
        layers=layers,
    )


def handwritten_config(flavor: str, n_layers: int, seq_len: int) -> Any:
    """The last resort where torchtitan does not import at all: its Llama 3 written out (fused wqkv, complex RoPE
    with Llama 3.1 scaling, GQA through causal SDPA, SwiGLU, RMSNorm, its initialization)."""
    from types import SimpleNamespace

    dims = {"8B": (4096, 32, 8, 128256, 14336), "debug": (256, 16, 16, 2048, 768), "tiny": (64, 4, 2, 256, 192)}
    dim, n_heads, n_kv, vocab, hidden = dims[flavor]
    cfg = SimpleNamespace(dim=dim, n_heads=n_heads, n_kv=n_kv, vocab_size=vocab, hidden=hidden, n_layers=n_layers,
                          seq_len=seq_len, theta=500000.0)
    cfg.build = lambda: handwritten_model_cls()(cfg)
    return cfg


def handwritten_model_cls() -> type:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def rope_freqs(head_dim: int, seq_len: int, theta: float, device: Any) -> Any:
        freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim))
        factor, low, high, old = 8.0, 1.0, 4.0, 8192  # Llama 3.1's RoPE scaling
        wavelen = 2 * math.pi / freqs
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old / low, freqs / factor, freqs)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        freqs = torch.where(mid, (1 - smooth) * freqs / factor + smooth * freqs, scaled)
        t = torch.arange(seq_len, device=device, dtype=torch.float32)
        return torch.polar(torch.ones(seq_len, head_dim // 2, device=device), torch.outer(t, freqs))

    def apply_rope(x: Any, freqs: Any) -> Any:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs[None, : x.shape[1], None, :]).flatten(3).type_as(x)

    class Block(nn.Module):
        def __init__(self, c: Any, layer_id: int) -> None:
            super().__init__()
            hd = c.dim // c.n_heads
            self.c, self.hd, self.layer_id = c, hd, layer_id
            self.attention_norm = nn.RMSNorm(c.dim, eps=1e-5)
            self.ffn_norm = nn.RMSNorm(c.dim, eps=1e-5)
            self.wqkv = nn.Linear(c.dim, (c.n_heads + 2 * c.n_kv) * hd, bias=False)
            self.wo = nn.Linear(c.n_heads * hd, c.dim, bias=False)
            self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
            self.w3 = nn.Linear(c.dim, c.hidden, bias=False)
            self.w2 = nn.Linear(c.hidden, c.dim, bias=False)

        def forward(self, x: Any, freqs: Any) -> Any:
            c, hd = self.c, self.hd
            b, s, _ = x.shape
            q, k, v = self.wqkv(self.attention_norm(x)).split([c.n_heads * hd, c.n_kv * hd, c.n_kv * hd], -1)
            q, k = apply_rope(q.view(b, s, -1, hd), freqs), apply_rope(k.view(b, s, -1, hd), freqs)
            v = v.view(b, s, -1, hd)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=c.n_kv != c.n_heads)
            h = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
            y = self.ffn_norm(h)
            return h + self.w2(F.silu(self.w1(y)) * self.w3(y))

    class HandwrittenLlama3(nn.Module):
        def __init__(self, c: Any) -> None:
            super().__init__()
            self.config = c
            self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
            self.layers = nn.ModuleDict({str(i): Block(c, i) for i in range(c.n_layers)})
            self.norm = nn.RMSNorm(c.dim, eps=1e-5)
            self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
            self.register_buffer("freqs_cis", torch.empty(c.seq_len, c.dim // c.n_heads // 2, dtype=torch.complex64),
                                 persistent=False)

        def init_weights(self, buffer_device: Any = None) -> None:
            c = self.config
            self.freqs_cis = rope_freqs(c.dim // c.n_heads, c.seq_len, c.theta, buffer_device)
            nn.init.normal_(self.tok_embeddings.weight, std=1.0)
            for blk in self.layers.values():
                depth_std = 0.02 / (2 * (blk.layer_id + 1)) ** 0.5
                nn.init.trunc_normal_(blk.wqkv.weight, std=0.02)
                nn.init.trunc_normal_(blk.w1.weight, std=0.02)
                for w in (blk.wo.weight, blk.w2.weight, blk.w3.weight):
                    nn.init.trunc_normal_(w, std=depth_std)
                nn.init.ones_(blk.attention_norm.weight)
                nn.init.ones_(blk.ffn_norm.weight)
            nn.init.ones_(self.norm.weight)
            std = c.dim**-0.5
            nn.init.trunc_normal_(self.lm_head.weight, std=std, a=-3 * std, b=3 * std)

        def forward(self, tokens: Any) -> Any:
            h = self.tok_embeddings(tokens)
            for layer in self.layers.values():
                h = layer(h, self.freqs_cis)
            return self.lm_head(self.norm(h))

    return HandwrittenLlama3


def float8_filter(module: Any, fqn: str) -> bool:
    """Blocks' linear layers only (not the output head), every dim a multiple of 16 (torchtitan's
    ``module_filter_fn`` with ``filter_fqns=["lm_head"]``)."""
    return (fqn.startswith("layers.") and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def torchao_float8_config(emulate: bool) -> Any:
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(emulate=True) if emulate else Float8LinearConfig.from_recipe_name("tensorwise")


def build_model(api: dict[str, Any], row: dict[str, Any], n_layers: int, device: Any, side: str) -> tuple[Any, str]:
    """The model on ``device`` with torchtitan's initialization at seed 0 (as its trainer: meta, ``to_empty``,
    ``init_weights``). Float8: torchtitan's converter on the config for the torchtitan side (where it imports), by
    hand (``convert_to_float8_training``) otherwise. Returns (model, how float8 was applied)."""
    import torch

    cfg = model_config(api, row["flavor"], n_layers, row["seq"])
    how = "off"
    emulate = device.type != "cuda"
    if row["float8"] and side == "torchtitan" and api["Float8LinearConverter"] is not None:
        conv_cfg = api["Float8LinearConverter"].Config(recipe_name="tensorwise", filter_fqns=["lm_head"],
                                                       emulate=emulate, model_compile_enabled=row["compile"])
        cfg = conv_cfg.build().convert(cfg)
        how = "torchtitan Float8LinearConverter(recipe_name='tensorwise', filter_fqns=['lm_head'])" + (
            ", emulate" if emulate else "")
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device=device)
    torch.manual_seed(SEED)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    if row["float8"] and how == "off":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=torchao_float8_config(emulate), module_filter_fn=float8_filter)
        how = "by hand: torchao convert_to_float8_training(tensorwise, blocks' linears)" + (
            ", emulate" if emulate else "")
    return model, how


def matmul_params(model: Any) -> int:
    """N: weights of every linear layer (blocks and head), i.e. parameters outside the embedding and the norms."""
    import torch.nn as nn

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def flops_per_step(n_matmul: int, n_layers: int, dim: int, seq: int, tokens: int) -> float:
    return 6.0 * n_matmul * tokens + 12.0 * n_layers * dim * seq * tokens


# ---------------------------------------------------------------------------------------------------------------
# the two sides
# ---------------------------------------------------------------------------------------------------------------
def make_batches(vocab: int, seq: int, batch: int, n: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab, (n * batch, seq + 1), generator=g)
    return [(ids[i * batch:(i + 1) * batch, :-1].contiguous(), ids[i * batch:(i + 1) * batch, 1:].contiguous())
            for i in range(n)]


def adamw(params: Any, cuda: bool) -> Any:
    import torch

    return torch.optim.AdamW(params, **ADAMW, fused=cuda, foreach=None if cuda else True)


def titan_parallelize(api: dict[str, Any], model: Any, row: dict[str, Any], cuda: bool, dump: str) -> None:
    """torchtitan's parallelize at world 1: its ``parallelize_llama`` (package level), or its recipe (AC, then
    compile) where the package does not import. At world 1 torchtitan applies no FSDP (``fsdp_enabled`` is
    ``dp_shard > 1 or cp > 1``) and its trainer runs the step under autocast (``maybe_enable_amp``): so does
    ``run_torchtitan``."""
    if api["level"] == "handwritten":
        handwritten_ac_compile(model, row)
        return
    pd = api["ParallelDims"](dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    compile_cfg = api["CompileConfig"](enable=row["compile"], components=["model"])
    ac_cfg = api["FullAC"].Config() if row["ac"] else None
    if api["level"] == "package":
        from torchtitan.config import ParallelismConfig, TrainingConfig

        if not cuda:  # torchtitan builds its mesh on "cuda" when no accelerator is found: the CPU smoke run only
            import torchtitan.distributed.parallel_dims as tt_pd

            tt_pd.device_type = "cpu"
        pd.build_mesh()
        api["parallelize_llama"](model, parallel_dims=pd, training=TrainingConfig(), parallelism=ParallelismConfig(),
                                 compile_config=compile_cfg, ac_config=ac_cfg, dump_folder=dump)
        return
    if ac_cfg is not None:
        ac_cfg.build(dump_folder=dump).apply(model)
    if row["compile"]:
        api["apply_compile"](model, compile_config=compile_cfg, parallel_dims=pd)


def handwritten_ac_compile(model: Any, row: dict[str, Any]) -> None:
    """torchtitan's FullAC (torch's non-reentrant checkpoint wrapper per block) and apply_compile (each block,
    fullgraph), written out for the hand-written level."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if row["ac"]:
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=True,
                                                                  determinism_check="default", early_stop=False))
    if row["compile"]:
        torch._dynamo.config.capture_scalar_outputs = True
        for block in model.layers.children():
            block.compile(backend="inductor", fullgraph=True)


def run_torchtitan(api: dict[str, Any], row: dict[str, Any], n_layers: int, device: Any, batches: list,
                   warmup: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    cuda = device.type == "cuda"
    model, how = build_model(api, row, n_layers, device, "torchtitan")
    n_matmul = matmul_params(model)
    with tempfile.TemporaryDirectory() as dump:
        titan_parallelize(api, model, row, cuda, dump)
    optimizer = adamw(model.parameters(), cuda)
    times, loss = [], None
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        start = synced_now(cuda)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):  # torchtitan's maybe_enable_amp without FSDP
            pred = model(x)
            loss = F.cross_entropy(pred.flatten(0, 1).float(), y.flatten())
        del pred
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
        optimizer.step()
        times.append(synced_now(cuda) - start)
    result = {"times_s": times[warmup:], "loss_last": float(loss), "float8": how, "n_matmul_params": n_matmul,
              "level": api["level"]}
    del model, optimizer, loss
    return result


def strategy_has_float8() -> bool:
    """Whether this lightning_par's strategies take ``float8=`` (added after this benchmark was first written)."""
    import inspect

    import lightning_par

    return "float8" in inspect.signature(lightning_par.NDParallelStrategy.__init__).parameters


def lit_module_cls() -> type:
    import lightning.pytorch as pl
    import torch.nn.functional as F

    class LitLlama(pl.LightningModule):
        def __init__(self, model: Any, cuda: bool) -> None:
            super().__init__()
            self.model = model
            self.cuda_fused = cuda

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())

        def configure_optimizers(self) -> Any:
            return adamw(self.parameters(), self.cuda_fused)

    return LitLlama


def run_ours(api: dict[str, Any], row: dict[str, Any], n_layers: int, device: Any, batches: list,
             warmup: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_par

    cuda = device.type == "cuda"
    strategy_float8 = row["float8"] and OPTIONS["ours_float8"] == "strategy" and strategy_has_float8()
    model, how = build_model(api, {**row, "float8": row["float8"] and not strategy_float8}, n_layers, device, "ours")
    if strategy_float8:
        how = "strategy option: FSDP2Strategy(float8='tensorwise')"
    n_matmul = matmul_params(model)  # float8 layers are nn.Linear subclasses: the same count either way

    class LastLoss(Callback):
        loss = None

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step >= trainer.max_steps:
                self.loss = float(outputs["loss"])

    import torch

    data = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    loader = DataLoader(data, batch_size=batches[0][0].shape[0], shuffle=False)
    timer, last = step_timer(cuda), LastLoss()
    options = dict(activation_checkpointing="full" if row["ac"] else False, compile=row["compile"],
                   block_list="model.layers")
    if strategy_float8:
        options["float8"] = "tensorwise"
    strategy = lightning_par.FSDP2Strategy(**options)
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu", devices=1, strategy=strategy, precision="bf16-mixed",
        max_steps=len(batches), logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, gradient_clip_val=MAX_NORM,
        use_distributed_sampler=False, callbacks=[timer, last],
    )
    trainer.fit(lit_module_cls()(model, cuda), loader)
    result = {"times_s": timer.times[warmup:], "loss_last": last.loss, "float8": how, "n_matmul_params": n_matmul,
              "strategy": f"FSDP2Strategy({', '.join(f'{k}={v!r}' for k, v in options.items())}), "
                          f"precision='bf16-mixed'"}
    del trainer, strategy, model
    return result


# ---------------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------------
def free_memory(cuda: bool) -> None:
    import torch

    gc.collect()
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def save_compile_config() -> Any:
    import torch

    try:
        return torch._dynamo.config.save_config(), torch._inductor.config.save_config()
    except Exception:  # noqa: BLE001 - best effort
        return None


def restore_compile_config(saved: Any) -> None:
    import torch

    if saved is not None:
        try:
            torch._dynamo.config.load_config(saved[0])
            torch._inductor.config.load_config(saved[1])
        except Exception:  # noqa: BLE001
            pass


def estimate_layers(total_bytes: float, fraction: float = 0.7) -> dict[str, Any]:
    """How many Llama-3.1-8B layers fit ``fraction`` of the GPU at seq 2048, batch 2, no AC (the most
    memory-hungry of the main rows), by a rough count: fp32 params + grads + AdamW's two moments = 16 B per parameter
    (+2 B for the transient bf16 all-gathered copy); per layer ~218.1 M parameters and ~2·(10·d + 4·ffn) bytes of
    saved activations per token; embedding + head 1.05 G parameters; logits 16 B per token per vocabulary entry
    (bf16 out, fp32 copy, log-softmax, gradients); 2 GiB of workspace."""
    d, ffn, vocab, tokens = 4096, 14336, 128256, 4096
    per_layer_params = d * (d + 2 * 1024) + d * d + 3 * d * ffn
    embed_params = 2 * vocab * d
    per_layer = 18 * per_layer_params + 2 * (10 * d + 4 * ffn) * tokens
    fixed = 18 * embed_params + 16 * vocab * tokens + 2 * GIB
    n = max(1, min(32, int((fraction * total_bytes - fixed) // per_layer)))
    return {"layers": n, "fraction": fraction, "per_layer_bytes": per_layer, "fixed_bytes": fixed,
            "estimated_bytes": fixed + n * per_layer, "total_bytes": total_bytes}


def summarize_side(res: dict[str, Any], row: dict[str, Any], n_layers: int, dim: int, peak: float | None,
                   cuda: bool) -> dict[str, Any]:
    import torch

    med = statistics.median(res["times_s"])
    tokens = row["batch"] * row["seq"]
    flops = flops_per_step(res["n_matmul_params"], n_layers, dim, row["seq"], tokens)
    out = {k: v for k, v in res.items() if k != "times_s"}
    out.update(step_ms_median=med * 1e3, step_ms_all=[t * 1e3 for t in res["times_s"]], tokens_per_s=tokens / med,
               flops_per_step=flops, tflops_per_s=flops / med / 1e12,
               mfu=(flops / med / peak) if peak else None,
               peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB if cuda else None,
               peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB if cuda else None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget-s", type=float, default=200.0, help="wall-clock budget of the whole run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vs_torchtitan.json"))
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default: 6 cuda, 2 cpu)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out (default: 3 cuda, 1 cpu)")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of the 8B model (default: the estimate for 70%% of the GPU's memory)")
    parser.add_argument("--rows", default=None, help="comma-separated row indices of the matrix (default: all)")
    parser.add_argument("--ours-float8", choices=("strategy", "hand"), default="strategy",
                        help="ours' float8: the strategy's float8='tensorwise' option (where this lightning_par has "
                             "it), or torchao's convert_to_float8_training by hand before the Trainer")
    parser.add_argument("--titan-level", choices=("auto", "package", "recipe", "handwritten"), default="auto",
                        help="auto: torchtitan's package, else its model file + recipe, else hand-written")
    args = parser.parse_args()
    t_start = time.perf_counter()
    OPTIONS["ours_float8"] = args.ours_float8

    import torch

    quiet_worker()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device; use --device cpu for the smoke run")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    steps = args.steps if args.steps is not None else (6 if cuda else 2)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    rows = ROWS if cuda else CPU_ROWS
    if args.rows:
        rows = [rows[int(i)] for i in args.rows.split(",")]

    gpu_name = torch.cuda.get_device_name(device) if cuda else None
    peak = next((p for k, p in PEAK_BF16 if gpu_name and k in gpu_name), None)
    total_mem = torch.cuda.get_device_properties(device).total_memory if cuda else 80e9
    layer_est = estimate_layers(total_mem)
    n_layers_8b = args.layers or layer_est["layers"]

    # one process group of one rank for both sides (lightning_par reuses an initialized one)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)

    meta = run_metadata()
    meta.update(gpu=gpu_name, peak_bf16_flops=peak, total_memory_bytes=total_mem if cuda else None)
    try:
        import torchao

        meta["torchao"] = getattr(torchao, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        meta["torchao"] = f"not importable: {type(e).__name__}: {e}"
    report: dict[str, Any] = {
        "benchmark": "vs_torchtitan", "meta": meta, "args": vars(args), "steps": steps, "warmup": warmup,
        "layers_8b": n_layers_8b, "layers_estimate": layer_est,
        "notes": [
            "One process, one GPU, world 1; torchtitan side first, then ours, per row; memory freed between sides.",
            "MFU: (6*N*T + 12*L*d*s*T) per step / median step time / dense bf16 peak of the GPU (float8 rows too); "
            "N = weights of all nn.Linear (blocks + output head), embedding and norms excluded; T tokens per step.",
            "ours float8: the strategy's float8='tensorwise' option where lightning_par has it (--ours-float8 "
            "strategy; with FSDP on CUDA it all-gathers weights in float8 and precomputes their scales after each "
            "optimizer step), else torchao convert_to_float8_training(tensorwise, blocks' aligned linears) by hand "
            "before the Trainer; each row's 'float8' field says which. torchtitan float8: its "
            "Float8LinearConverter(recipe_name='tensorwise', filter_fqns=['lm_head']) where it imports, else the "
            "by-hand call.",
            "torchtitan's FullAC turns dynamo's LRU cache off process-wide and its apply_compile sets dynamo flags; "
            "the dynamo/inductor configs are restored after each torchtitan side, the LRU cache flag is not.",
            "Attention: torchtitan's ScaledDotProductAttention (causal) on both sides, not its flex default.",
            "Mixed precision: autocast bf16 on both sides and no FSDP at world 1 (torchtitan's trainer: "
            "maybe_enable_amp; ours: precision='bf16-mixed').",
            "No LR schedule on either side (constant 8e-4); step time includes zero_grad, forward, loss, backward, "
            "clip, AdamW step; ours also Lightning's loop overhead inside the timed hooks.",
        ],
        "rows": [], "skipped": [],
    }
    try:
        if args.titan_level == "handwritten":
            raise ImportError("--titan-level handwritten")
        api = load_torchtitan(args.titan_level)
    except Exception as e:  # noqa: BLE001 - the last resort: torchtitan's model and recipe written out here
        print(f"torchtitan does not import ({type(e).__name__}: {e}); hand-written model and recipe",
              file=sys.stderr, flush=True)
        api = {"level": "handwritten", "version": None, "configs": None, "parallelize_llama": None,
               "Float8LinearConverter": None,
               "errors": {"torchtitan": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}}
    report["torchtitan"] = {"version": api["version"], "level": api["level"], "import_errors": api["errors"]}
    write_json(args.out, report)

    # time estimates per side, refined by what was measured: (flavor-class, compile) -> seconds
    est: dict[tuple[bool, bool], float] = {(True, False): 15.0, (True, True): 60.0, (False, False): 5.0,
                                           (False, True): 40.0}
    if not cuda:
        est = {k: 30.0 for k in est}
    for row in rows:
        big = row["flavor"] == "8B"
        need = 2 * est[(big, row["compile"])]
        elapsed = time.perf_counter() - t_start
        if elapsed + need > args.budget_s:
            report["skipped"].append({**row, "reason": f"budget: {elapsed:.0f}s spent + ~{need:.0f}s estimated > "
                                                        f"{args.budget_s:.0f}s"})
            write_json(args.out, report)
            continue
        n_layers = n_layers_8b if big else (6 if row["flavor"] == "debug" else 2)
        cfg = model_config(api, row["flavor"], n_layers, row["seq"])
        dim, vocab = cfg.dim, cfg.vocab_size
        batches = make_batches(vocab, row["seq"], row["batch"], warmup + steps)
        entry: dict[str, Any] = {**row, "layers": n_layers, "dim": dim, "vocab": vocab,
                                 "tokens_per_step": row["batch"] * row["seq"]}
        report["rows"].append(entry)
        for side, fn in (("torchtitan", run_torchtitan), ("ours", run_ours)):
            free_memory(cuda)
            saved = save_compile_config()  # torchtitan's apply_compile / AC set global dynamo flags: not for ours
            t0 = time.perf_counter()
            try:
                res = fn(api, row, n_layers, device, batches, warmup)
                entry[side] = summarize_side(res, row, n_layers, dim, peak, cuda)
            except Exception as e:  # noqa: BLE001 - recorded, the matrix goes on
                entry[side] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
                print(f"[{row['name']}] {side} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            entry[side]["wall_s"] = time.perf_counter() - t0
            restore_compile_config(saved)
            free_memory(cuda)
            write_json(args.out, report)
        est[(big, row["compile"])] = max(entry[s]["wall_s"] for s in ("torchtitan", "ours"))
        a, b = entry["torchtitan"].get("tokens_per_s"), entry["ours"].get("tokens_per_s")
        entry["ratio_tokens_per_s"] = b / a if a and b else None
        write_json(args.out, report)

    report["wall_s"] = time.perf_counter() - t_start
    write_json(args.out, report)
    print_table(report)


def print_table(report: dict[str, Any]) -> None:
    def f(x: Any, fmt: str) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    rows = []
    for e in report["rows"]:
        t, o = e.get("torchtitan", {}), e.get("ours", {})
        rows.append([e["name"], f(t.get("tokens_per_s"), ",.0f"), f(o.get("tokens_per_s"), ",.0f"),
                     f(e.get("ratio_tokens_per_s"), ".3f"), f(t.get("step_ms_median"), ".1f"),
                     f(o.get("step_ms_median"), ".1f"),
                     f(100 * t["mfu"] if t.get("mfu") else None, ".1f"), f(100 * o["mfu"] if o.get("mfu") else None,
                                                                          ".1f"),
                     f(t.get("peak_allocated_gib"), ".1f"), f(o.get("peak_allocated_gib"), ".1f"),
                     f(t.get("loss_last"), ".4f"), f(o.get("loss_last"), ".4f"),
                     ("tt:ERR " if "error" in t else "") + ("ours:ERR" if "error" in o else "")])
    tt = report.get("torchtitan", {})
    print(f"\ntorchtitan {tt.get('version')} level={tt.get('level')}  layers(8B)={report['layers_8b']}  "
          f"gpu={report['meta'].get('gpu')}  wall={report.get('wall_s', 0):.0f}s")
    print(format_table(["row", "tt tok/s", "ours tok/s", "ours/tt", "tt ms", "ours ms", "tt MFU%", "ours MFU%",
                        "tt GiB", "ours GiB", "tt loss", "ours loss", "errors"], rows))
    for s in report["skipped"]:
        print(f"skipped: {s['name']} ({s['reason']})")


if __name__ == "__main__":
    main()
