"""The tiny twins' data, made on this machine with nothing downloaded: a byte-level BPE tokenizer (384 tokens, trained
here with the ``tokenizers`` library) and json-lines documents from Python's reference documentation
(``pydoc_data.topics``, in every CPython installation: one document a topic).

    python example_projects/recipes/tiny_data.py            # writes runs/recipes/tiny/{tokenizer,train.jsonl,val.jsonl}

The full-size recipes read the model's own tokenizer (its Hub ID) and your documents instead; ``tiny.yaml`` in each
recipe folder points ``data`` here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: the tokenizer's size: every twin's ``vocab_size`` (a multiple of 128, so tensor parallelism splits it evenly)
VOCAB_SIZE = 384
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
#: documents held out for validation (the last topics, in sorted order)
VAL_DOCUMENTS = 8


def documents(max_documents: int | None = None) -> list[str]:
    """The pydoc topics (``assert`` ... ``yield``) in sorted order, one document each."""
    from pydoc_data.topics import topics

    texts = [topics[name].strip() for name in sorted(topics)]
    return [t for t in texts if t][:max_documents]


def build_tokenizer(texts: list[str], directory: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """A byte-level BPE tokenizer trained on ``texts``, written as ``save_pretrained`` writes one (so
    ``AutoTokenizer.from_pretrained(directory)`` reads it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=PAD)
    tokenizer.save_pretrained(directory)


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def make(out: str | Path = "runs/recipes/tiny", max_documents: int | None = 120) -> Path:
    """Write ``out/tokenizer``, ``out/train.jsonl`` and ``out/val.jsonl`` (kept where they exist); returns ``out``."""
    out = Path(out)
    texts = documents(max_documents)
    if not (out / "tokenizer" / "tokenizer.json").is_file():
        build_tokenizer(texts, out / "tokenizer")
    if not (out / "val.jsonl").is_file():
        write_jsonl(out / "train.jsonl", texts[:-VAL_DOCUMENTS])
        write_jsonl(out / "val.jsonl", texts[-VAL_DOCUMENTS:])
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/recipes/tiny", help="where to write (default: runs/recipes/tiny)")
    parser.add_argument("--max-documents", type=int, default=120, help="pydoc topics to use (default 120)")
    args = parser.parse_args()
    print(f"Wrote {make(args.out, args.max_documents)}")
