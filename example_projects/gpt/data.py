"""Character-level data from text already on the machine: the Python standard library's own sources.

No download: the corpus is built from the ``.py`` files of the running interpreter's stdlib, in sorted order, so
every machine with the same Python builds the same corpus. Characters outside printable ASCII map to ``?``.
"""

from __future__ import annotations

import string
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

VOCAB = sorted(set(string.printable) - set("\x0b\x0c\r"))  # 97 characters; '?' stands for everything else
STOI = {c: i for i, c in enumerate(VOCAB)}


def build_corpus(max_chars: int) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def encode(text: str) -> torch.Tensor:
    unknown = STOI["?"]
    return torch.tensor([STOI.get(c, unknown) for c in text], dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    return "".join(VOCAB[i] for i in ids.tolist())


class CharChunks(Dataset):
    """Non-overlapping chunks of ``seq_len + 1`` characters -> (input ids, next-character targets)."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        n = (len(ids) - 1) // seq_len
        self.x = ids[: n * seq_len].view(n, seq_len)
        self.y = ids[1 : n * seq_len + 1].view(n, seq_len)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class CharDataModule(pl.LightningDataModule):
    """Train/validation chunks of the stdlib corpus.

    Args:
        seq_len: characters per sample.
        batch_size: samples per batch on each data-parallel rank (global batch = batch_size x data-parallel size).
        max_chars: corpus size in characters.
        val_fraction: the tail of the corpus kept for validation.
    """

    def __init__(self, seq_len: int = 128, batch_size: int = 16, max_chars: int = 2_000_000, val_fraction: float = 0.05,
                 num_workers: int = 0) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1, e.g. 0.05.")
        self.seq_len, self.batch_size, self.max_chars = seq_len, batch_size, max_chars
        self.val_fraction, self.num_workers = val_fraction, num_workers

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)

    def setup(self, stage: str) -> None:
        ids = encode(build_corpus(self.max_chars))
        split = int(len(ids) * (1 - self.val_fraction))
        self.train_set = CharChunks(ids[:split], self.seq_len)
        self.val_set = CharChunks(ids[split:], self.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True, num_workers=self.num_workers)
