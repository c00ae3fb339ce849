"""The fine-tuning data: Python's reference documentation, as prose, from the running interpreter (no download).

The base model (``prepare.py``) learns characters from the standard library's source code
(``example_projects.gpt.data``); fine-tuning moves it to another domain, the language reference's English text that
``pydoc`` shows (``pydoc_data.topics``: about 465,000 characters, in every CPython installation). Same 97-character
vocabulary, so the base model's embedding and head fit unchanged.
"""

from __future__ import annotations

from example_projects.gpt.data import CharChunks, CharDataModule, encode


def build_docs_corpus(max_chars: int) -> str:
    """The pydoc topics (``assert`` ... ``yield``), in sorted order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))[:max_chars]


class DocsDataModule(CharDataModule):
    """Train/validation chunks of Python's reference documentation (the tail ``val_fraction`` is validation).

    Args: as :class:`example_projects.gpt.data.CharDataModule` (``max_chars`` caps the corpus).
    """

    def __init__(self, seq_len: int = 128, batch_size: int = 16, max_chars: int = 1_000_000,
                 val_fraction: float = 0.05, num_workers: int = 0) -> None:
        super().__init__(seq_len=seq_len, batch_size=batch_size, max_chars=max_chars, val_fraction=val_fraction,
                         num_workers=num_workers)

    def setup(self, stage: str) -> None:
        ids = encode(build_docs_corpus(self.max_chars))
        split = int(len(ids) * (1 - self.val_fraction))
        self.train_set = CharChunks(ids[:split], self.seq_len)
        self.val_set = CharChunks(ids[split:], self.seq_len)
