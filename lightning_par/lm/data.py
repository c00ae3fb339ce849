"""A text data module for causal LMs: documents from local files or a ``datasets`` name, tokenized once with the
model's tokenizer (cached on disk), then packed into rows or padded.

Rows (every tensor of one length, ``seq_len``, so context parallelism can cut each along the sequence):

- ``packing=True``: documents laid end to end and cut into rows, ``{"input_ids", "labels", "position_ids"}``;
  ``position_ids`` restart at 0 where each document (or the rest of one cut by a row's end) begins, and a document's
  last token in a row has label -100, so nothing is predicted across a boundary. Attention stays inside each document
  (transformers finds the documents from the positions when the model makes no key/value cache; lightning_par's
  context parallelism does too). The last partial row is dropped.
- ``packing=False``: one document a row, cut at ``seq_len`` and right-padded, ``{"input_ids", "labels",
  "attention_mask"}``; labels -100 on the padding.

``labels[t]`` is the token after ``input_ids[t]`` (already shifted): the loss is ``cross_entropy(logits, labels,
ignore_index=-100)`` with no shift.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_par.hub import TOKENIZER_FILES, resolve_pretrained

#: bump when the cached format changes
CACHE_VERSION = 1
SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")


class Documents:
    """Tokenized documents: one flat tensor of token ids and each document's offsets into it."""

    def __init__(self, tokens: Tensor, offsets: Tensor) -> None:
        self.tokens, self.offsets = tokens, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Tensor:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def split(self, fraction: float) -> tuple[Documents, Documents]:
        """The first documents and the last ``fraction`` of them (at least one where there are two or more)."""
        n = len(self)
        held = min(n - 1, max(1, round(n * fraction))) if n > 1 and fraction > 0 else 0
        cut = n - held
        head = Documents(self.tokens[:self.offsets[cut]], self.offsets[:cut + 1])
        tail = Documents(self.tokens[self.offsets[cut]:], self.offsets[cut:] - self.offsets[cut])
        return head, tail

    @classmethod
    def of(cls, token_lists: Iterable[list[int]]) -> Documents:
        lists = [list(t) for t in token_lists]
        lengths = torch.tensor([0] + [len(t) for t in lists], dtype=torch.long)
        tokens = torch.tensor([i for t in lists for i in t], dtype=torch.long)
        return cls(tokens, lengths.cumsum(0))


def pack(documents: Documents, seq_len: int) -> dict[str, Tensor]:
    """Rows of ``seq_len`` tokens laid end to end from ``documents``: ``input_ids``, ``labels`` (the next token of
    the same document, -100 at the last token of each document in the row) and ``position_ids`` (0 where each
    document, or the rest of one, starts in the row). Drops the last partial row."""
    rows = len(documents.tokens) // seq_len
    n = rows * seq_len
    tokens = documents.tokens[:n]
    starts = torch.zeros(len(documents.tokens) + 1, dtype=torch.bool)
    starts[documents.offsets] = True
    starts = starts[:n].view(rows, seq_len).clone()
    starts[:, 0] = True  # a row starts a document, or the rest of one
    index = torch.arange(seq_len).expand(rows, seq_len)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    ends = torch.cat([starts[:, 1:], torch.ones(rows, 1, dtype=torch.bool)], dim=1)  # the next token starts anew
    input_ids = tokens.view(rows, seq_len)
    labels = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1).masked_fill(ends, -100)
    return {"input_ids": input_ids, "labels": labels, "position_ids": index - first}


def pad(documents: Documents, seq_len: int, pad_id: int) -> dict[str, Tensor]:
    """One row a document, cut at ``seq_len`` and right-padded with ``pad_id``: ``input_ids``, ``labels`` (-100 on the
    padding and at the last token) and ``attention_mask``. Documents of one token (nothing to predict) are left out."""
    kept = [documents[i][:seq_len] for i in range(len(documents)) if len(documents[i]) > 1]
    input_ids = torch.full((len(kept), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(kept), seq_len), dtype=torch.long)
    for row, doc in enumerate(kept):
        input_ids[row, :len(doc)] = doc
        mask[row, :len(doc)] = 1
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = input_ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


class Rows(Dataset):
    """The rows of :func:`pack` or :func:`pad` as a dataset of dicts."""

    def __init__(self, rows: dict[str, Tensor]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows["input_ids"])

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {k: v[i] for k, v in self.rows.items()}


def _expand(files: str | list[str] | None, parameter: str) -> list[Path]:
    """The files named, globs expanded; each must exist and have a known suffix."""
    if files is None:
        return []
    found: list[Path] = []
    for pattern in [files] if isinstance(files, str) else list(files):
        pattern = os.path.expanduser(str(pattern))
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches or not all(Path(m).is_file() for m in matches):
            raise FileNotFoundError(f"{parameter}: {pattern!r} names no file. Give paths or globs of {SUFFIXES} files.")
        for match in matches:
            if not match.endswith(SUFFIXES):
                raise ValueError(f"{parameter}: {match!r} is not one of {SUFFIXES} (json lines, parquet, plain text).")
            found.append(Path(match))
    return found


def read_texts(path: Path, text_field: str) -> list[str]:
    """The documents of one file: a ``.jsonl``/``.json`` file's ``text_field`` of each line (object), a
    ``.parquet`` file's ``text_field`` column, or a ``.txt`` file whole (one document)."""
    if path.suffix == ".txt":
        return [path.read_text()]
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as error:
            raise ImportError(f"Reading {path} needs pyarrow: `pip install pyarrow`.") from error
        table = pq.read_table(path, columns=[text_field]) if text_field in pq.read_schema(path).names else None
        if table is None:
            raise ValueError(f"text_field={text_field!r} is not a column of {path} (columns: "
                             f"{pq.read_schema(path).names}).")
        return [str(t) for t in table.column(text_field).to_pylist() if t]
    texts = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(f"{path}:{number} has no {text_field!r} field (text_field): "
                                 f"{sorted(record) if isinstance(record, dict) else type(record).__name__}.")
            texts.append(str(record[text_field]))
    return texts


class TextDataModule(pl.LightningDataModule):
    """Documents tokenized with the model's tokenizer, packed into rows (or padded), for :class:`CausalLM`.

    Args:
        tokenizer: a Hub ID or a directory holding the tokenizer; default: the model's (the ``model`` of the
            :class:`CausalLM` this data module trains).
        train_files: paths or globs of ``.jsonl`` (one JSON object a line), ``.parquet`` or ``.txt`` (one document a
            file) files.
        val_files: the validation documents; without them, the last ``val_fraction`` of the training documents.
        dataset: instead of files, a ``datasets.load_dataset`` name (with ``dataset_config`` and the splits
            ``train_split`` and ``val_split``; ``val_split=None`` holds out ``val_fraction``).
        text_field: the field (column) holding each document's text.
        seq_len: the tokens of a row.
        packing: pack documents into rows with ``position_ids`` restarting at each (True), or one padded document a
            row with an ``attention_mask`` (False).
        separate_documents: with ``packing``, give the rows' ``position_ids`` so that attention stays inside each
            document (True); False gives ``input_ids`` and ``labels`` only (attention spans the row's documents, as
            in classic concatenated pre-training).
        add_eos: end every document with the tokenizer's end-of-sequence token (where it has one).
        batch_size: rows per batch on each data-parallel rank.
        shuffle: shuffle the training rows each epoch.
        cache_dir: where tokenized documents are kept (a file per tokenizer, source and options: a second run, or
            another ``seq_len`` or ``packing``, does not tokenize again); None tokenizes every time.
        num_workers: DataLoader workers.
    """

    def __init__(self, tokenizer: str | None = None, train_files: str | list[str] | None = None,
                 val_files: str | list[str] | None = None, dataset: str | None = None,
                 dataset_config: str | None = None, train_split: str = "train", val_split: str | None = "validation",
                 text_field: str = "text", seq_len: int = 1024, packing: bool = True,
                 separate_documents: bool = True, add_eos: bool = True,
                 val_fraction: float = 0.05, batch_size: int = 8, shuffle: bool = True,
                 cache_dir: str | None = "~/.cache/lightning_par/tokenized", num_workers: int = 0) -> None:
        super().__init__()
        if (train_files is None) == (dataset is None):
            raise ValueError(f"Give either train_files (local .jsonl/.parquet/.txt files) or dataset (a "
                             f"datasets.load_dataset name), not {'both' if dataset else 'neither'}.")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len={seq_len!r} must be an int >= 2 (the tokens of a row).")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a positive int.")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} must be in [0, 1).")
        self.tokenizer_name = tokenizer
        self.train_files = _expand(train_files, "train_files")
        self.val_files = _expand(val_files, "val_files")
        self.dataset, self.dataset_config = dataset, dataset_config
        self.train_split, self.val_split = train_split, val_split
        self.text_field, self.seq_len, self.packing, self.add_eos = text_field, seq_len, packing, add_eos
        self.separate_documents = separate_documents
        self.val_fraction, self.batch_size, self.shuffle = val_fraction, batch_size, shuffle
        self.cache_dir = None if cache_dir is None else Path(cache_dir).expanduser()
        self.num_workers = num_workers
        self._tokenizer = None
        self.train_set: Rows | None = None
        self.val_set: Rows | None = None
        self.tokenized: list[str] = []  # the sources this process tokenized (not read from the cache)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_dir())
        return self._tokenizer

    def _tokenizer_dir(self) -> Path:
        if self.tokenizer_name is not None:
            return resolve_pretrained(self.tokenizer_name, parameter="tokenizer", allow_patterns=TOKENIZER_FILES)
        module = self.trainer.lightning_module if self.trainer is not None else None
        directory = getattr(module, "model_dir", None)
        if directory is None:
            raise ValueError(f"{type(self).__name__}(tokenizer=None) takes the tokenizer of the CausalLM it trains, "
                             f"and there is none ({type(module).__name__ if module else 'no trainer'}). Pass "
                             f"tokenizer=<a Hub ID or directory>.")
        return directory

    # ---- documents -------------------------------------------------------------------------------------------
    def _sources(self) -> dict[str, Any]:
        """Each split's source: its files, or its ``datasets`` split; ``"val": None`` holds out from train."""
        if self.dataset is not None:
            return {"train": ("dataset", self.train_split), "val": self.val_split and ("dataset", self.val_split)}
        return {"train": ("files", self.train_files), "val": ("files", self.val_files) if self.val_files else None}

    def _texts(self, source: tuple[str, Any]) -> list[str]:
        kind, what = source
        if kind == "files":
            return [text for path in what for text in read_texts(path, self.text_field)]
        try:
            from datasets import load_dataset
        except ImportError as error:
            raise ImportError(f"dataset={self.dataset!r} needs the datasets library: `pip install datasets`."
                              ) from error
        split = load_dataset(self.dataset, self.dataset_config, split=what)
        if self.text_field not in split.column_names:
            raise ValueError(f"text_field={self.text_field!r} is not a column of {self.dataset!r} split {what!r} "
                             f"(columns: {split.column_names}).")
        return [str(t) for t in split[self.text_field] if t]

    def _cache_key(self, source: tuple[str, Any]) -> str:
        """What the tokens depend on: the tokenizer (its vocabulary and rules), the source (files' paths, sizes and
        modification times; a dataset's name, config and split), the text field and ``add_eos``."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        rules = backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items()))
        kind, what = source
        if kind == "files":
            where = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in what]
        else:
            where = [self.dataset, self.dataset_config, what]
        parts = [CACHE_VERSION, type(tok).__name__, rules, tok.eos_token_id, kind, where, self.text_field,
                 self.add_eos]
        return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]

    def _tokenize(self, texts: list[str]) -> Documents:
        eos = self.tokenizer.eos_token_id if self.add_eos else None
        ids = self.tokenizer(texts)["input_ids"]
        return Documents.of(t + [eos] if eos is not None and (not t or t[-1] != eos) else t for t in ids)

    def documents(self, source: tuple[str, Any]) -> Documents:
        """The tokenized documents of ``source``, from the cache where they are there; tokenized (and cached)
        otherwise."""
        path = None if self.cache_dir is None else self.cache_dir / f"{self._cache_key(source)}.pt"
        if path is not None and path.is_file():
            saved = torch.load(path)
            return Documents(saved["tokens"].long(), saved["offsets"])
        texts = self._texts(source)
        if not texts:
            raise ValueError(f"{source[1]!r} holds no document (no non-empty {self.text_field!r}).")
        documents = self._tokenize(texts)
        self.tokenized.append(source[0] + ":" + (self.dataset or "") + str(source[1]))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            small = documents.tokens.to(torch.int32) if len(self.tokenizer) < 2**31 else documents.tokens
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            torch.save({"tokens": small, "offsets": documents.offsets}, partial)
            os.replace(partial, path)  # atomic: another process reads a whole file or none
        return documents

    # ---- Lightning hooks -------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """One process per node tokenizes and fills the cache; the others read it in :meth:`setup`."""
        if self.cache_dir is not None:
            for source in self._sources().values():
                if source is not None:
                    self.documents(source)

    def rows(self, documents: Documents) -> dict[str, Tensor]:
        if self.packing:
            rows = pack(documents, self.seq_len)
            if not self.separate_documents:
                del rows["position_ids"]
            return rows
        pad_id = self.tokenizer.pad_token_id
        pad_id = self.tokenizer.eos_token_id if pad_id is None else pad_id
        return pad(documents, self.seq_len, 0 if pad_id is None else pad_id)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        sources = self._sources()
        train = self.documents(sources["train"])
        if sources["val"] is not None:
            val = self.documents(sources["val"])
        else:
            train, val = train.split(self.val_fraction)
        self.train_set = Rows(self.rows(train))
        self.val_set = Rows(self.rows(val))
        if len(self.train_set) == 0:
            raise ValueError(f"The training documents ({len(train.tokens)} tokens) make no row of seq_len="
                             f"{self.seq_len}. Give more text or a smaller seq_len.")

    def train_dataloader(self) -> DataLoader:
        """Each data-parallel rank's rows. Lightning's own distributed sampler always shuffles training rows; this
        one follows ``shuffle`` (False: rank r of n reads rows r, r + n, ..., so a step's rows are one process's
        batch of ``n * batch_size``, in order)."""
        where = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        if where:  # also for one data-parallel rank (tp, cp): Lightning would add its shuffling sampler
            sampler = DistributedSampler(self.train_set, shuffle=self.shuffle, drop_last=True,
                                         seed=int(os.environ.get("PL_GLOBAL_SEED", 0)), **where)
            return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                              num_workers=self.num_workers)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_set:  # no validation rows: Lightning skips validation
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
