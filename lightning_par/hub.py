"""Where a model named by a Hub ID or a directory lives on this machine.

``resolve_pretrained("Qwen/Qwen2.5-0.5B")`` is a directory: the Hugging Face cache's snapshot of the repository
(``huggingface_hub.snapshot_download``: downloaded once, then read from the cache; with ``HF_HUB_OFFLINE=1`` only
the cache is read). A local directory is returned as it is. Only what a causal LM needs is fetched: the config, the
safetensors weights and the tokenizer's files (no ``.bin`` pickles, no other formats).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: the files a snapshot brings: configs and tokenizers (json, sentencepiece, vocabularies, merges) and safetensors
SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]
#: what a tokenizer needs: the same without the weights (a tokenizer named by the Hub ID of a 671 B model must not
#: bring its 1.3 TB of safetensors)
TOKENIZER_FILES = [pattern for pattern in SNAPSHOT_FILES if pattern != "*.safetensors"]


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now; huggingface_hub reads it once, at import."""
    from huggingface_hub import constants

    now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or now.strip().upper() in {"1", "ON", "YES", "TRUE"}


#: what a Hub repository ID looks like: ``name`` or ``org/name``
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def resolve_pretrained(name: str | os.PathLike, revision: str | None = None, cache_dir: str | None = None,
                       parameter: str = "model", allow_patterns: list[str] | None = None) -> Path:
    """The local directory of ``name``: a directory as it is, a Hub ID (``org/name``) through the Hugging Face cache.

    Args:
        name: a directory ``save_pretrained`` wrote, or a Hub repository ID.
        revision: a branch, tag or commit of the Hub repository (default: ``main``).
        cache_dir: the Hugging Face cache (default: huggingface_hub's, ``HF_HUB_CACHE``).
        parameter: the option's name in error messages.
        allow_patterns: the files of a Hub repository to fetch (default ``SNAPSHOT_FILES``: config, weights,
            tokenizer; ``TOKENIZER_FILES`` leaves the weights out).
    """
    if not isinstance(name, (str, os.PathLike)) or not str(name):
        raise TypeError(f"{parameter}={name!r} must be a Hugging Face Hub ID ('org/name') or the directory "
                        f"`save_pretrained` wrote.")
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    text = str(name)
    if path.exists():
        raise ValueError(f"{parameter}={text!r} is a file, not a Hugging Face checkpoint directory. Pass the directory "
                         f"`save_pretrained` wrote (config.json and the safetensors weights) or a Hub ID such as "
                         f"'Qwen/Qwen2.5-0.5B' (a Lightning .ckpt file resumes through `trainer.fit(ckpt_path=...)`).")
    if not _HUB_ID.match(text):
        raise FileNotFoundError(f"{parameter}={text!r} does not exist. Pass the directory `save_pretrained` wrote "
                                f"(config.json and the safetensors weights), or a Hub ID such as 'Qwen/Qwen2.5-0.5B'.")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = hub_offline()
    try:
        return Path(snapshot_download(text, revision=revision, cache_dir=cache_dir,
                                      allow_patterns=allow_patterns or SNAPSHOT_FILES, local_files_only=offline))
    except LocalEntryNotFoundError as error:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise FileNotFoundError(
            f"{parameter}={text!r} is not a local directory and not in the Hugging Face cache "
            f"({cache_dir or 'HF_HUB_CACHE'}), and {why}. Download it once where the Hub is reachable "
            f"(`hf download {text}`, into the same cache), or pass the directory `save_pretrained` wrote."
        ) from error
