"""What tests/test_packed.py runs in each process: packed rows (several documents a row, positions restarting at
each) and right-padded rows, on a Hugging Face Qwen2 and on the example GPT, trained under every layout against
one process on the same global batch.

The batches are the user's: ``{"input_ids", "position_ids" or "attention_mask", "labels"}`` tensors of one length,
as ``DataCollatorWithFlattening`` (one packed row a sample here) and a padding collator give them; the strategy
shards every one of them along the sequence under context parallelism.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from hf_models import tiny_hf_model
from torch.utils.data import DataLoader, DistributedSampler
from workers import GLOBAL_BATCH, TINY_GPT, GPTModule, error_of, fit

from lightning_par import NDParallelStrategy, packed_documents

SEQ = 16
STEPS = 4


def packed_rows(n: int, boundary_labels: bool, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of ``SEQ`` tokens, each 1-4 documents of random lengths; labels are the next token of the same
    document, -100 at each document's last token where ``boundary_labels`` (nothing to predict across a boundary,
    as TRL's packing labels it), else the next token of the row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 32, (SEQ,), generator=g)
        cuts = sorted(set(torch.randint(1, SEQ, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()))
        starts = torch.zeros(SEQ, dtype=torch.bool)
        starts[cuts] = True
        doc = starts.long().cumsum(0)
        first = torch.zeros(SEQ, dtype=torch.long)
        first[cuts] = torch.tensor(cuts, dtype=torch.long)
        position_ids = torch.arange(SEQ) - torch.cummax(first, 0).values
        labels = torch.cat([ids[1:], torch.tensor([-100])])
        if boundary_labels:
            labels[:-1][doc[1:] != doc[:-1]] = -100
        rows.append({"input_ids": ids, "position_ids": position_ids, "labels": labels})
    return rows


def padded_rows(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of 8-16 tokens right-padded to ``SEQ`` (``attention_mask`` 0 and labels -100 on the padding)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=g))
        ids = torch.randint(0, 32, (SEQ,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        labels = torch.cat([ids[1:], torch.tensor([-100])]).masked_fill(torch.arange(SEQ) >= length - 1, -100)
        rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return rows


def _rows(kind: str) -> list[dict[str, torch.Tensor]]:
    return padded_rows(GLOBAL_BATCH * STEPS) if kind == "padded" else packed_rows(GLOBAL_BATCH * STEPS,
                                                                                 kind == "packed_masked")


def _loader(module: pl.LightningModule, kind: str, dp: int) -> DataLoader:
    """The rows in order: data-parallel rank r reads rows r, r + dp, ... (one step's rows are the one process's
    batch)."""
    where = getattr(module.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    rows = _rows(kind)
    return DataLoader(rows, batch_size=GLOBAL_BATCH // dp, sampler=DistributedSampler(rows, shuffle=False, **where))


class PackedHFCausalLM(pl.LightningModule):
    """A user's module fine-tuning a Hugging Face Qwen2 on packed (or padded) rows: it passes the batch's
    position ids (or padding mask) to the model, as with transformers in one process, and nothing else."""

    def __init__(self, rows: str = "packed", dp: int = 1, arch: str = "qwen2", **overrides: Any) -> None:
        super().__init__()
        self.rows, self.dp = rows, dp
        # no key/value cache in training, as TRL and transformers' Trainer set it: only then does transformers keep
        # packed documents apart (it finds them from the positions where no cache is made)
        self.model = tiny_hf_model(arch, use_cache=False, **overrides)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask).logits

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    def training_step(self, batch, batch_idx):
        rows = {k: batch[k] for k in ("position_ids", "attention_mask") if k in batch}
        loss = self.loss(self(batch["input_ids"], **rows), batch["labels"])
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        # SGD: updates in proportion to gradients, so the summation-order rounding of an embedding row that few
        # counted tokens reach stays at its size (Adam divides it by its own RMS, making it O(lr))
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return _loader(self, self.rows, self.dp)


class PackedGPT(GPTModule):
    """The example GPT on packed rows: its forward inside ``packed_documents`` (the documented way for a model of
    one's own), its positions the documents' own."""

    def __init__(self, rows: str = "packed", dp: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rows, self.dp = rows, dp

    def training_step(self, batch, batch_idx):
        with packed_documents(batch["position_ids"]):
            logits = self.model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        self.log("train/loss", loss)
        return loss

    def train_dataloader(self):
        return _loader(self, self.rows, self.dp)


class PipelinedPackedGPT(PackedGPT):
    """The example GPT passing the rows' positions to its forward, which a pipeline's traced stages cannot hand
    on: refused."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        return self.loss(self(batch["input_ids"], position_ids=batch["position_ids"]), batch["labels"])


def run(layout: dict[str, Any] | None, devices: int, dp: int, rows: str = "packed", gpt: bool = False,
        **kwargs: Any) -> dict[str, Any]:
    """Train ``STEPS`` steps under ``layout`` (None: one process)."""
    strategy = "auto" if layout is None else NDParallelStrategy(**layout)
    if gpt:
        return fit(strategy, devices=devices, dp_size=dp, max_steps=STEPS, module_cls=PackedGPT, module_loader=True,
                   rows=rows, dp=dp, **kwargs)
    return fit(strategy, devices=devices, dp_size=dp, max_steps=STEPS, module_cls=PackedHFCausalLM,
               module_loader=True, rows=rows, dp=dp, **kwargs)


#: name -> (layout, dp, rows, the example GPT instead of Qwen2, extra fit options)
WORLD2 = {
    "cp2_ring": (dict(dp_shard=1, cp=2), 1, "packed_masked", False, {}),
    "cp2_allgather_padded": (dict(dp_shard=1, cp=2, cp_algorithm="allgather"), 1, "padded", False, {}),
    "cp2_ulysses": (dict(dp_shard=1, cp=2, cp_algorithm="ulysses"), 1, "packed_masked", False, {}),
    "cp2_ulysses_padded": (dict(dp_shard=1, cp=2, cp_algorithm="ulysses"), 1, "padded", False, {}),
    "cp2_ring_checkpointed": (dict(dp_shard=1, cp=2, activation_checkpointing=True), 1, "packed_masked", False, {}),
    "fsdp2": (dict(dp_shard=2), 2, "packed", False, {}),
    # -100 labels over data-parallel ranks: one process's token mean with loss_normalization="tokens"
    "fsdp2_tokens": (dict(dp_shard=2, loss_normalization="tokens"), 2, "packed_masked", False, {}),
    "qwen3_moe_ep2_tokens": (dict(dp_shard=2, ep=2, loss_normalization="tokens"), 2, "packed_masked", False,
                             {"arch": "qwen3_moe"}),
    "tp2": (dict(dp_shard=1, tp=2), 1, "packed_masked", False, {}),
    # a pipeline's stages each take their micro-batch's positions (or padding mask) from the batch
    "pp2_1f1b": (dict(dp_shard=1, pp=2, pp_microbatches=4), 1, "packed_masked", False, {}),
    "pp2_gpipe_padded": (dict(dp_shard=1, pp=2, pp_schedule="gpipe", pp_microbatches=2), 1, "padded", False, {}),
    "gpt_cp2_ring": (dict(dp_shard=1, cp=2), 1, "packed_masked", True, {}),
    "gpt_cp2_ulysses": (dict(dp_shard=1, cp=2, cp_algorithm="ulysses"), 1, "packed_masked", True, {}),
    "gpt_fsdp2_checkpointed": (dict(dp_shard=2, activation_checkpointing=True), 2, "packed", True, {}),
    # the Mistral sliding window inside documents, Ulysses with key/value heads fewer than... the group's (1 of 2)
    "mistral_cp2_ulysses": (dict(dp_shard=1, cp=2, cp_algorithm="ulysses"), 1, "packed_masked", False,
                            {"arch": "mistral", "num_key_value_heads": 1}),
    "gpt_oss_cp2_ring": (dict(dp_shard=1, cp=2), 1, "packed_masked", False, {"arch": "gpt_oss"}),
    "gpt_oss_cp2_ulysses": (dict(dp_shard=1, cp=2, cp_algorithm="ulysses"), 1, "packed_masked", False,
                            {"arch": "gpt_oss"}),
}
WORLD4 = {
    "cp4_ring_ulysses2": (dict(dp_shard=1, cp=4, cp_ulysses_size=2), 1, "packed_masked", False, {}),
    "cp4_allgather_ulysses2_padded": (dict(dp_shard=1, cp=4, cp_ulysses_size=2, cp_algorithm="allgather"), 1,
                                      "padded", False, {}),
    "cp4_ulysses": (dict(dp_shard=1, cp=4, cp_algorithm="ulysses"), 1, "packed_masked", False, {}),
    "cp2_ulysses_x_tp2": (dict(dp_shard=1, cp=2, tp=2, cp_algorithm="ulysses"), 1, "packed_masked", False, {}),
    "cp2_x_tp2": (dict(dp_shard=1, cp=2, tp=2), 1, "packed_masked", False, {}),
    "pp2_x_cp2": (dict(dp_shard=1, pp=2, cp=2, pp_microbatches=2), 1, "packed_masked", False, {}),
    "pp2_x_dp2_tokens": (dict(dp_shard=2, pp=2, pp_microbatches=2, loss_normalization="tokens"), 2, "packed_masked",
                         False, {}),
    "gpt_cp4_ring_ulysses2": (dict(dp_shard=1, cp=4, cp_ulysses_size=2), 1, "packed_masked", True, {}),
}


def weight_diffs(result: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    return {k: float((v.float() - reference["weights"][k].float()).abs().max()) for k, v in result["weights"].items()}


def world(cases: dict[str, tuple]) -> dict[str, Any]:
    devices = 2 if cases is WORLD2 else 4
    out = {name: run(layout, devices, dp, rows, gpt, **kw) for name, (layout, dp, rows, gpt, kw) in cases.items()}
    if cases is WORLD2:
        out["errors"] = {
            # 4 heads, 2 key/value heads: Ulysses over 2 ranks is fine; over 3 heads it is refused
            "heads_not_divisible": error_of(lambda: run(dict(dp_shard=1, cp=2, cp_algorithm="ulysses"), 2, 1,
                                                        num_attention_heads=3, num_key_value_heads=1, head_dim=8)),
            "rows_through_traced_stages": error_of(lambda: fit(
                NDParallelStrategy(dp_shard=1, pp=2), devices=2, dp_size=1, max_steps=1, module_cls=PipelinedPackedGPT,
                module_loader=True, rows="packed", dp=1)),
        }
    return out


def world2() -> dict[str, Any]:
    return world(WORLD2)


def world4() -> dict[str, Any]:
    return world(WORLD4)


def references() -> dict[tuple, dict[str, Any]]:
    """One process per (rows, model, extra options) that any layout uses."""
    keys = {(rows, gpt, tuple(sorted(kw.items()))) for cases in (WORLD2, WORLD4) for _, _, rows, gpt, kw in
            cases.values()}
    return {key: run(None, 1, 1, key[0], key[1], **dict(key[2])) for key in sorted(keys)}


__all__ = ["PackedGPT", "PackedHFCausalLM", "TINY_GPT", "WORLD2", "WORLD4", "packed_rows", "padded_rows",
           "references", "run", "world2", "world4"]
