"""Sequence sharding for context parallelism: which tokens each cp rank holds, and where they sit globally.

Causal attention makes late tokens expensive (they attend to everything before them). Splitting the sequence
into ``cp`` contiguous pieces would give the last rank ``2*cp - 1`` times the work of the first. With
``load_balance=True`` the sequence is cut into ``2*cp`` equal chunks and rank ``i`` holds chunks ``i`` and
``2*cp - 1 - i`` (one early, one late), so every rank does the same work. All helpers here are pure except
:func:`unshard_sequence`, which gathers over the cp group.

Ulysses (all-to-all) attention over groups of ``ulysses`` consecutive cp ranks gathers each group's tokens back
into one piece before its attention, so the layout is two-level: the sequence is first split as for a ring of
``cp / ulysses`` ranks (load-balanced chunks when that ring has more than one rank), and each ring rank's part is
cut into ``ulysses`` contiguous pieces, one per rank of its group (cp rank = ring rank x ulysses + member). With
``ulysses = cp`` (plain Ulysses) that is ``cp`` contiguous pieces: every rank attends over the whole sequence for its
heads, so there is nothing to balance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist


def num_chunks(cp_size: int, load_balance: bool) -> int:
    """How many equal chunks the global sequence is cut into."""
    return 2 * cp_size if load_balance else cp_size


def local_chunk_ids(cp_rank: int, cp_size: int, load_balance: bool) -> tuple[int, ...]:
    """Global chunk indices held by ``cp_rank``, in the order they are concatenated locally."""
    return (cp_rank, 2 * cp_size - 1 - cp_rank) if load_balance else (cp_rank,)


def _check_layout(cp_rank: int, cp_size: int) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}. Pass the size of the cp group.")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank!r}. Pass this rank's index in the cp group.")


def ring_layout(cp_size: int, load_balance: bool, ulysses: int = 1) -> tuple[int, bool]:
    """The ring level of a cp group whose Ulysses groups have ``ulysses`` ranks: its size (``cp / ulysses``) and
    whether its chunks are load-balanced (only where that ring has more than one rank)."""
    if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1 or cp_size % ulysses != 0:
        raise ValueError(f"ulysses={ulysses!r} must be a positive divisor of the cp size {cp_size} (the ranks of one "
                         f"all-to-all group), e.g. 1 (no Ulysses) or {cp_size} (all-to-all over the whole cp group).")
    ring = cp_size // ulysses
    return ring, load_balance and ring > 1


def _check_divisible(seq_len: int, cp_size: int, load_balance: bool, what: str, ulysses: int = 1) -> None:
    ring, balanced = ring_layout(cp_size, load_balance, ulysses)
    n = math.lcm(num_chunks(ring, balanced), cp_size)
    if seq_len % n != 0:
        if ulysses > 1:
            how = (f"{n} equal pieces ({ring} ring ranks{', load-balanced,' if balanced else ''} x {ulysses} ranks "
                   f"per all-to-all group)")
        else:
            how = f"2*cp = {n} chunks (load_balance=True)" if balanced else f"cp = {n} chunks"
        raise ValueError(
            f"{what} = {seq_len} cannot be split into {how}. Pad the sequence to a multiple of {n}"
            + (", or pass load_balance=False." if balanced else ".")
        )


def shard_sequence(
    tensor: torch.Tensor, dim: int, cp_rank: int, cp_size: int, load_balance: bool = True, ulysses: int = 1
) -> torch.Tensor:
    """This rank's part of ``tensor`` along the sequence dimension ``dim`` (differentiable)."""
    _check_layout(cp_rank, cp_size)
    _check_divisible(tensor.size(dim), cp_size, load_balance, f"tensor.size({dim}) (the global sequence length)",
                     ulysses)
    ring, balanced = ring_layout(cp_size, load_balance, ulysses)
    chunks = tensor.chunk(num_chunks(ring, balanced), dim=dim)
    part = torch.cat([chunks[i] for i in local_chunk_ids(cp_rank // ulysses, ring, balanced)], dim=dim)
    return part if ulysses == 1 else part.chunk(ulysses, dim=dim)[cp_rank % ulysses]


def join_shards(shards: Sequence[torch.Tensor], dim: int, load_balance: bool = True,
                ulysses: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: rebuild the global tensor from every rank's shard, rank 0 first."""
    if ulysses > 1:  # each Ulysses group's pieces make one ring rank's part
        ring, balanced = ring_layout(len(shards), load_balance, ulysses)
        parts = [torch.cat(list(shards[r * ulysses:(r + 1) * ulysses]), dim=dim) for r in range(ring)]
        return join_shards(parts, dim, balanced)
    cp_size = len(shards)
    per_rank = 2 if load_balance else 1
    chunks: list[torch.Tensor | None] = [None] * num_chunks(cp_size, load_balance)
    for rank, shard in enumerate(shards):
        if shard.size(dim) % per_rank != 0:
            raise ValueError(
                f"shard of rank {rank} has odd length {shard.size(dim)} along dim {dim} with load_balance=True."
            )
        for cid, piece in zip(local_chunk_ids(rank, cp_size, load_balance), shard.chunk(per_rank, dim=dim)):
            chunks[cid] = piece
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def unshard_sequence(
    tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None, load_balance: bool = True,
    ulysses: int = 1,
) -> torch.Tensor:
    """Gather every rank's shard over the cp ``group`` and return the global tensor (no autograd)."""
    shards = [
        torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))
    ]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return join_shards(shards, dim, load_balance, ulysses)


def sequence_positions(
    seq_len: int, cp_rank: int, cp_size: int, load_balance: bool = True, device: torch.device | str | None = None,
    ulysses: int = 1,
) -> torch.Tensor:
    """Global positions (int64) of this rank's tokens for a global sequence of ``seq_len``.

    Index rotary tables or learned position embeddings with these, not with ``arange(local_len)``.
    """
    _check_layout(cp_rank, cp_size)
    _check_divisible(seq_len, cp_size, load_balance, "seq_len", ulysses)
    return shard_sequence(torch.arange(seq_len, device=device), 0, cp_rank, cp_size, load_balance, ulysses)


@dataclass(frozen=True)
class Block:
    """The part of a peer's K/V shard that this rank's queries may see under the causal mask."""

    q: slice  # local query rows that see at least part of the peer's shard
    kv: slice  # key columns of the peer's shard they see
    causal: bool  # True on the diagonal (our own shard): the lower-triangular mask applies inside it


_ALL = slice(None)


def block_plan(rank: int, src: int, cp_size: int, local_len: int, is_causal: bool, load_balance: bool) -> Block | None:
    """Which rectangle of ``src``'s K/V shard the queries of ``rank`` attend to; None when it is fully masked.

    Shards are unions of whole chunks, so each (query chunk, key chunk) pair is fully visible (key chunk earlier),
    diagonal (same chunk) or fully masked (key chunk later); the visible pairs always form one rectangle.
    """
    if not is_causal:
        return Block(_ALL, _ALL, False)
    if src == rank:
        # Our own K/V. Global positions increase along the local sequence even with two chunks, so the plain
        # lower-triangular mask on local indices is the causal mask on global positions.
        return Block(_ALL, _ALL, True)
    if not load_balance:
        return Block(_ALL, _ALL, False) if src < rank else None  # an earlier chunk is visible, a later one masked
    first, second = slice(0, local_len // 2), slice(local_len // 2, None)
    if src < rank:
        # K/V chunks (src, 2c-1-src): chunk src precedes both of our chunks (visible); chunk 2c-1-src follows
        # both (masked). So: all our queries x the first half of the peer's shard.
        return Block(_ALL, first, False)
    # src > rank: our early chunk `rank` precedes both K/V chunks (masked); our late chunk 2c-1-rank follows both
    # (src < c <= 2c-1-rank and 2c-1-src < 2c-1-rank). So: the second half of our queries x the whole shard.
    return Block(second, _ALL, False)


@lru_cache(maxsize=1024)
def blockwise_share(cp_size: int, chunk: float, window: int | None = None) -> float:
    """The share of a causal (seq x seq) score matrix that :func:`block_plan`'s blocks cover over all ranks of a
    load-balanced cp group, each block whole (the math path masks inside a block, it does not skip): ``(cp + 1) /
    2cp`` without a window. With a sliding window of ``window`` tokens, a block the window hides entirely is skipped
    (as ``context._plan`` skips it). ``chunk``: the tokens of one of the ``2 cp`` chunks (seq / 2cp)."""
    covered = 0
    for rank in range(cp_size):
        rows_of = local_chunk_ids(rank, cp_size, True)
        for src in range(cp_size):
            blk = block_plan(rank, src, cp_size, 2, True, True)  # local length 2: one index per chunk
            if blk is None:
                continue
            rows, cols = rows_of[blk.q], local_chunk_ids(src, cp_size, True)[blk.kv]
            if window is not None and not any(_sees(i, j, chunk, window) for i in rows for j in cols):
                continue
            covered += len(rows) * len(cols)
    return covered / (2 * cp_size) ** 2


def _sees(query_chunk: int, key_chunk: int, chunk: float, window: int) -> bool:
    """Whether some query of one chunk sees some key of another within a causal window: the nearest pair of an
    earlier key chunk is ``(i - j - 1) * chunk + 1`` tokens apart."""
    if query_chunk == key_chunk:
        return True
    return key_chunk < query_chunk and (query_chunk - key_chunk - 1) * chunk + 1 < window
