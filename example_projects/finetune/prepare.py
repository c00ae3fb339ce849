"""Make the "pretrained" model that the fine-tuning configs start from (there is no download here).

The hf_lm example's module (a transformers Llama built from a config) is pre-trained in one process on the standard
library's source code (``example_projects.gpt.data``, the GPT example's character data), then written with
``save_pretrained``, as a model from the Hub would come. Fine-tuning then adapts it to another domain, Python's
reference documentation (``data.py``): the base model already knows characters, words and indentation, so the
adapters have something to build on, and the fine-tuning loss starts from the base model's level, not from a random
model's ln(97) = 4.6.

    python example_projects/finetune/prepare.py                    # runs/finetune/base, about a minute on 2 cores
    python example_projects/finetune/prepare.py --steps 20 --hidden_size 32 --out /tmp/base   # a tiny one

An existing base model is kept (pass ``--force`` to make it again), so the README's command can always run it first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # make `example_projects` importable as a package

DEFAULT_OUT = "runs/finetune/base"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="directory save_pretrained writes to")
    p.add_argument("--force", action="store_true", help="pre-train and write again even if --out holds a model")
    p.add_argument("--steps", type=int, default=200, help="pre-training steps (0: a fixed-seed random model)")
    p.add_argument("--model_type", default="llama", help="any transformers causal LM type: llama, qwen2, ...")
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--intermediate_size", type=int, default=384)
    p.add_argument("--num_attention_heads", type=int, default=4)
    p.add_argument("--num_key_value_heads", type=int, default=2)
    p.add_argument("--max_seq_len", type=int, default=256,
                   help="the model's max_position_embeddings: fine-tuning sequences may be up to this long")
    p.add_argument("--seq_len", type=int, default=128, help="characters per pre-training sample")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--max_chars", type=int, default=1_000_000, help="size of the source-code corpus")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error(f"--steps={args.steps} must be >= 0")
    if args.seq_len > args.max_seq_len:
        p.error(f"--seq_len={args.seq_len} must not exceed --max_seq_len={args.max_seq_len}")
    return args


def prepare(args: argparse.Namespace) -> Path:
    """Pre-train (one process, CPU) and write the base model; returns its directory."""
    import lightning.pytorch as pl

    from example_projects.gpt.data import CharDataModule
    from example_projects.hf_lm.lit import HFCausalLMModule

    pl.seed_everything(args.seed, verbose=False)
    data = CharDataModule(seq_len=args.seq_len, batch_size=args.batch_size, max_chars=args.max_chars)
    module = HFCausalLMModule(
        model_type=args.model_type, vocab_size=data.vocab_size, vocab_multiple=64, max_seq_len=args.max_seq_len,
        num_hidden_layers=args.num_hidden_layers, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads, meta_init=False, lr=args.lr,
        warmup_steps=max(1, args.steps // 10), max_steps=max(1, args.steps))
    if args.steps:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                             enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
                             log_every_n_steps=max(1, args.steps // 10))
        trainer.fit(module, data)
        loss = float(trainer.logged_metrics["train/loss"])
        print(f"pre-trained {args.steps} steps on source code: train/loss {loss:.3f}")
    else:
        module.configure_model()
    out = Path(args.out)
    module.model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    if (out / "config.json").is_file() and not args.force:
        print(f"Base model exists, kept: {out.resolve()} (--force makes it again)")
        return
    start = time.perf_counter()
    prepare(args)
    print(f"Base model written in {time.perf_counter() - start:.0f} s: {out.resolve()}")


if __name__ == "__main__":
    main()
