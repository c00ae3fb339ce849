"""What tests/test_lm.py builds and runs in each process: a tiny Llama and its word-level tokenizer saved as
``save_pretrained`` directories (no download), a small corpus of json-lines documents, and ``CausalLM`` +
``TextDataModule`` trained under a strategy or in one process."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

WORDS = [f"w{i}" for i in range(60)]
SPECIAL = ["[PAD]", "[UNK]", "[EOS]"]


def save_tiny_model(directory: Path, vocab_size: int = 64) -> Path:
    """A word-level tokenizer over ``WORDS`` and a 2-layer Llama of width 32 saved together in ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                        eos_token="[EOS]")
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def documents(n: int, seed: int = 0) -> list[str]:
    """``n`` documents of 3-20 words; each repeats a short pattern, so a model learns them in a few steps."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        start, step = rng.randrange(len(WORDS)), rng.choice([1, 2, 3])
        docs.append(" ".join(WORDS[(start + step * i) % len(WORDS)] for i in range(rng.randint(3, 20))))
    return docs


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


class RecordLoss(Callback):
    """The training loss of every step, averaged over ranks (each rank's loss is its share of the global mean
    under ``loss_normalization="tokens"``)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().float()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))


def train(model_dir: str, train_file: str, cache_dir: str, layout: dict[str, Any] | None, steps: int,
          global_batch: int = 8, data_options: dict[str, Any] | None = None, **module_options: Any
          ) -> dict[str, Any]:
    """``steps`` SGD steps of the tiny model on packed rows, under ``NDParallelStrategy(**layout)`` on the launched
    ranks or (None) in one process; the global batch is the same, in the same order. Returns the losses and, on
    rank 0, the full final weights."""
    from lightning_par import NDParallelStrategy, full_state_dict
    from lightning_par.lm import CausalLM, TextDataModule

    pl.seed_everything(0, verbose=False)
    strategy = "auto" if layout is None else NDParallelStrategy(**layout)
    dp = 1 if layout is None else layout.get("dp_shard", 1) * layout.get("dp_replicate", 1)
    record = RecordLoss()
    trainer = pl.Trainer(accelerator="cpu", devices=1 if layout is None else 2, strategy=strategy, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[record])
    module = CausalLM(model=model_dir, optimizer="sgd", learning_rate=0.5, lr_schedule="constant", **module_options)
    data = TextDataModule(tokenizer=model_dir, train_files=train_file, seq_len=16, batch_size=global_batch // dp,
                          shuffle=False, val_fraction=0.0, cache_dir=cache_dir, **(data_options or {}))
    trainer.fit(module, data)
    weights = full_state_dict(module)
    return {"losses": record.losses,
            "weights": {k: v.detach().clone() for k, v in weights.items()} if trainer.global_rank == 0 else None}
