"""What tests/test_qlora.py runs in each process: QLoRA (``quantize_base="nf4"``) on a tiny Hugging Face Llama with
PEFT LoRA adapters, under FSDP2 (also with activation checkpointing, with CPU offload), tensor and pipeline
parallelism and their combinations over 4 processes, and the inputs it refuses.

The model is wide enough for NF4's blocks: every block's linear weight holds whole blocks of 64 x 256 weights per
FSDP shard over 2 ranks (hidden 256, MLP 512, 2 key/value heads of 64: the smallest, k_proj, is 128 x 256)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from finetune_workers import LoRALM, MergeAtEnd
from hf_models import HFCausalLM
from lightning.pytorch.callbacks import Callback
from workers import SEED, error_of, fit

from lightning_par import NDParallelStrategy
from lightning_par.techniques.quantize.nf4_weights import dequantized, is_nf4, nf4_bytes, quantize_base_weights

STEPS = 6
BF16_STEPS = 4
#: a Llama whose linear weights NF4 takes whole (see the module docstring); vocabulary 32, 4 blocks
WIDE = dict(arch="llama", hidden_size=256, intermediate_size=512)
PROBE = "model.base_model.model.model.layers.0.self_attn.k_proj.base_layer"


class QLoRAByHand(LoRALM):
    """One QLoRA process without lightning_par's option: the torch-level function applied in ``__init__`` (what a
    user of plain PyTorch would do), so the reference shares no code path with the strategy but the quantizer."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        layers = self.model.base_model.model.model.layers
        self.quantized, self.left = quantize_base_weights(
            self, [f"model.base_model.model.model.layers.{i}" for i in range(len(layers))])


class BaseBytes(Callback):
    """Per rank: the bytes this rank holds for the NF4 base weights (codes, scales, their factors and mean) against
    bf16's bytes for the same local elements; which weights are NF4; the type of a base weight while its layer runs
    (FSDP's gathered parameter) and the NF4 codes this rank holds of one weight."""

    def __init__(self) -> None:
        self.gathered_types: list[str] = []

    def on_train_start(self, trainer, pl_module) -> None:
        nf4 = {n: p for n, p in pl_module.named_parameters() if is_nf4(p)}
        self.nf4_names = sorted(nf4)
        self.nf4_bytes = sum(nf4_bytes(p) for p in nf4.values())
        self.bf16_bytes = sum(getattr(p, "_local_tensor", p).numel() * 2 for p in nf4.values())
        self.trainable_quantized = [n for n, p in nf4.items() if p.requires_grad]
        self.nf4_dtypes = sorted({str(p.dtype) for p in nf4.values()})
        modules = dict(pl_module.named_modules())
        if getattr(modules.get(PROBE), "weight", None) is not None:  # this rank runs the probed layer
            local = getattr(modules[PROBE].weight, "_local_tensor", modules[PROBE].weight)
            self.probe_codes = local.quantized_data.clone() if is_nf4(local) else None
            modules[PROBE].register_forward_pre_hook(
                lambda m, args: self.gathered_types.append(type(m.weight).__name__))

    def measured(self) -> dict[str, Any]:
        return {k: getattr(self, k, None) for k in ("nf4_names", "nf4_bytes", "bf16_bytes", "trainable_quantized",
                                                    "probe_codes", "gathered_types", "nf4_dtypes")}


class MergeAndCount(MergeAtEnd):
    """The merged model written at the end (``save_hf_pretrained``, which gathers the full state dict), then how many
    base weights are still NF4 in the model: the gather dequantizes them only while it runs."""

    nf4_after: int | None = None

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self.nf4_after = sum(is_nf4(getattr(p, "_local_tensor", p)) for p in pl_module.parameters())


def plain_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict's values as plain tensors: NF4 weights dequantized (their own dtype)."""
    return {k: dequantized(v).detach().clone() for k, v in weights.items()}


def run(strategy: NDParallelStrategy, world: int, dp: int, callbacks: list[Callback] = (),
        **kwargs: Any) -> dict[str, Any]:
    measure = BaseBytes()
    kwargs.setdefault("max_steps", STEPS)
    out = fit(strategy, devices=world, dp_size=dp, module_cls=LoRALM, callbacks=[measure, *callbacks],
              **{**WIDE, **kwargs})
    out["weights"] = plain_weights(out["weights"])
    out["base"] = measure.measured()
    return out


def save_base(directory: str) -> None:
    """The Hugging Face model the LoRA modules start from (built at the runs' seed, before PEFT wraps it), written
    as a ``save_pretrained`` checkpoint."""
    pl.seed_everything(SEED, verbose=False)
    HFCausalLM(**WIDE).model.save_pretrained(directory)


def nd(**kw: Any) -> NDParallelStrategy:
    kw.setdefault("dp_shard", 1)
    return NDParallelStrategy(quantize_base="nf4", **kw)


def world2(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # refused on every rank before any collective (the runs after them in this job still succeed)
    out["errors"] = {
        "bad_value": error_of(lambda: run(NDParallelStrategy(dp_shard=2, quantize_base="int4"), 2, 2, max_steps=1)),
        "with_float8": error_of(lambda: run(nd(dp_shard=2, float8="tensorwise"), 2, 2, max_steps=1)),
        "meta_device": error_of(lambda: run(nd(dp_shard=2), 2, 2, max_steps=1, empty_init=True)),
    }
    # the merged model (adapters folded into the dequantized base weights) written at the end of the FSDP2 run
    merge = MergeAndCount(str(Path(tmp) / "merged"))
    full = str(Path(tmp) / "full")  # full checkpoints at steps 3 and 6: everything but the frozen NF4 weights
    out["fsdp2"] = run(nd(dp_shard=2), 2, 2, callbacks=[merge], ckpt_dir=full, ckpt_every_n_steps=3)
    out["fsdp2"]["nf4_after_merge"] = merge.nf4_after
    out["full_checkpoint"] = str(Path(full) / "step=3.ckpt")
    out["full_resumed_tp2"] = run(nd(tp=2), 2, 1, resume_from=out["full_checkpoint"])
    out["pp2"] = run(nd(pp=2, pp_microbatches=2), 2, 1)
    # tensor parallelism: each rank's NF4 rows (q, k, v, gate, up) or columns (o, down) cut from the whole codes
    out["tp2"] = run(nd(tp=2), 2, 1)
    out["tp2_sp"] = run(nd(tp=2, sequence_parallel=True), 2, 1)
    out["fsdp2_ac"] = run(nd(dp_shard=2, activation_checkpointing=True), 2, 2)
    out["fsdp2_offload"] = run(nd(dp_shard=2, cpu_offload=True), 2, 2)
    out["cp2"] = run(nd(cp=2), 2, 1)  # the sequence over 2 ranks, FSDP over them (NF4 shards over cp)
    out["replicate2"] = run(nd(dp_replicate=2), 2, 2)  # HSDP's replicated dimension: NF4 weights whole on both
    # bf16 weights (quantized from bf16) and bf16 adapters
    out["fsdp2_bf16"] = run(nd(dp_shard=2), 2, 2, max_steps=BF16_STEPS, precision="bf16-true")
    # adapters-only checkpoints: written at step 3 under FSDP2, resumed under the pipeline; the NF4 base weights are
    # not in them (the model quantizes the same initial weights to the same codes again)
    adapters = str(Path(tmp) / "adapters")
    run(nd(dp_shard=2, save_trainable_only=True), 2, 2, max_steps=3, ckpt_dir=adapters, ckpt_every_n_steps=3)
    out["adapters_resumed_pp2"] = run(nd(pp=2, pp_microbatches=2), 2, 1,
                                      resume_from=str(Path(adapters) / "step=3.ckpt"))
    out["adapter_checkpoint"] = str(Path(adapters) / "step=3.ckpt")
    # pretrained=: the model on the meta device, its NF4 placeholders filled from the Hugging Face checkpoint of the
    # same base model (FSDP2: each rank quantizes one whole weight at a time and keeps its rows; a pipeline stage:
    # its own weights whole); the adapters and their optimizer state resumed from step 3, as a user resumes
    base = str(Path(tmp) / "base")  # written by the test before the launch (save_base)
    for name, strategy, dp in (("pretrained_fsdp2", nd(dp_shard=2, pretrained=base), 2),
                               ("pretrained_pp2", nd(pp=2, pp_microbatches=2, pretrained=base), 1),
                               ("pretrained_tp2", nd(tp=2, pretrained=base), 1)):
        out[name] = run(strategy, 2, dp, empty_init=True, resume_from=str(Path(adapters) / "step=3.ckpt"))
    return out


def world4(tmp: str) -> dict[str, Any]:
    """The combinations: FSDP2 over tensor-parallel NF4 pieces (each rank's rows of its piece; also read from the
    pretrained checkpoint, resuming the adapters the first run wrote at step 3), FSDP2 with a pipeline, tensor
    parallelism inside pipeline stages, HSDP."""
    out: dict[str, Any] = {}
    adapters = str(Path(tmp) / "adapters4")
    out["fsdp2_tp2"] = run(nd(dp_shard=2, tp=2, save_trainable_only=True), 4, 2, ckpt_dir=adapters,
                           ckpt_every_n_steps=3)
    out["pretrained_fsdp2_tp2"] = run(nd(dp_shard=2, tp=2, pretrained=str(Path(tmp) / "base")), 4, 2,
                                      empty_init=True, resume_from=str(Path(adapters) / "step=3.ckpt"))
    out["fsdp2_pp2"] = run(nd(dp_shard=2, pp=2, pp_microbatches=2), 4, 2)
    out["pp2_tp2"] = run(nd(pp=2, tp=2, pp_microbatches=2), 4, 1)  # each stage's NF4 weights cut over tp
    out["hsdp"] = run(nd(dp_replicate=2, dp_shard=2), 4, 4)
    return out


# ---- memory while a pretrained checkpoint is loaded into NF4 shards -------------------------------------------------

#: a Llama whose weights dominate a process's memory (about 185 MiB in fp32), every block weight NF4-able at 2 shards
BIG = dict(arch="llama", vocab_size=8192, hidden_size=1024, intermediate_size=2048, num_hidden_layers=3,
           num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)


class SetupPeak(Callback):
    """This rank's peak private memory from the strategy's setup (model built on the meta device, sharded, given
    memory, the checkpoint read and quantized) to the start of training."""

    def setup(self, trainer, pl_module, stage) -> None:
        from test_pretrained import PeakMemory

        self.peak = PeakMemory().__enter__()

    def on_train_start(self, trainer, pl_module) -> None:
        self.peak.__exit__()
        self.nf4 = sum(is_nf4(p) for p in pl_module.parameters())


def pretrained_memory(directory: str) -> dict[str, Any]:
    measure = SetupPeak()
    out = fit(nd(dp_shard=2, pretrained=directory), devices=2, dp_size=2, module_cls=LoRALM, callbacks=[measure],
              empty_init=True, max_steps=1, **BIG)
    # torchao's quantizer works through a weight in chunks of 2**20 values, with 16 distances per value: a workspace
    # of the same size whatever the weight's, measured here on this run's largest weight alone
    from test_pretrained import PeakMemory

    from lightning_par.techniques.quantize.nf4_weights import BLOCK_SIZE, SCALER_BLOCK_SIZE, _nf4

    largest = torch.randn(BIG["intermediate_size"], BIG["hidden_size"])
    with PeakMemory() as workspace:
        _nf4().to_nf4(largest, BLOCK_SIZE, SCALER_BLOCK_SIZE)
    return {"anon_bytes": measure.peak.anon_bytes, "workspace_bytes": workspace.anon_bytes, "nf4": measure.nf4,
            "losses": out["losses"]}
