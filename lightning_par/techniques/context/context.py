"""Context parallelism: exact attention over sequences sharded across the ranks of a cp process group.

Each rank holds a shard of the queries, keys and values of every sequence (layout: ``context_sharding``).
Queries stay where they are; K/V blocks move, and every (local queries, K/V block) pair is one small attention
that returns ``(out, lse)``. The blocks are merged with the online-softmax (log-sum-exp) rule, so the result is
the exact attention over the whole sequence. Two ways to move K/V, same block math:

- ``"ring"``: K/V hop one rank forward per step (point-to-point), the next hop in flight while the current block
  is computed. Backward sends K/V around again (nothing cp-sized is saved) and dK/dV travel with them.
- ``"allgather"``: one all-gather of K/V (cp x the K/V memory for a moment, one collective); backward gathers
  again and reduce-scatters dK/dV to their owners.

Plain torch.distributed (gloo and NCCL), no Lightning. On CPU each block is plain matmuls in fp32 (fp64 for fp64
inputs). On CUDA each block's forward and backward run through torch's fused attention kernels, as torch's own ring
attention does (``torch.distributed.tensor.experimental``'s ``_templated_ring_attention``): the kernel SDPA itself
would pick for the block (cuDNN or flash for fp16/bf16, the memory-efficient one for fp32), each backward given the
block's rows of the MERGED out and lse.
The kernels read lse as a contiguous array (the memory-efficient one padded to its 32-row tiles): a strided slice of
the merged lse gave wrong dq and dk (NaN for causal blocks) in an earlier version. Blocks the kernels cannot express
(a sliding window's partial mask, head dims they do not take) and the backward of attention sinks (whose lse has a
gradient of its own) stay on the math path. ``CUDA_KERNELS`` chooses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from lightning_par._compat import fused_attention_backward, fused_attention_forward, sdpa_kernel_choice
from lightning_par.techniques.context import ulysses as a2a
from lightning_par.techniques.context.context_sharding import (
    Block,
    block_plan,
    join_shards,
    local_chunk_ids,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "CommCounter",
    "context_parallel_attention",
    "context_parallel_sdpa",
    "join_shards",
    "local_chunk_ids",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]

Algorithm = Literal["ring", "allgather", "ulysses"]
ALGORITHMS = ("ring", "allgather", "ulysses")
#: Which kernels compute a block on CUDA: "auto" (the fused kernel torch's SDPA would pick for the block: cuDNN or
#: flash for fp16/bf16, memory-efficient for fp32; ``torch.nn.attention.sdpa_kernel`` narrows the choice; the math
#: path where none takes the block) or "math" (fp32 matmuls everywhere, the reference).
#: CPU tensors always take the math path.
CUDA_KERNELS: Literal["auto", "math"] = "auto"

# Collectives were renamed in torch 2.13; keep working on older releases.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommCounter:
    """Bytes this rank sent, keyed ``"<phase>/<op>"`` (``"forward/send"``, ``"backward/reduce_scatter"``, ...).

    Point-to-point sends count their payload. Collectives count what a bandwidth-optimal (ring) implementation
    sends per rank: all-gather of an n-byte shard and reduce-scatter to an n-byte shard both send ``(cp-1)*n``.
    """

    bytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, nbytes: int) -> None:
        self.bytes[key] = self.bytes.get(key, 0) + nbytes
        self.calls[key] = self.calls.get(key, 0) + 1

    def total(self, phase: str | None = None) -> int:
        return sum(n for k, n in self.bytes.items() if phase is None or k.startswith(phase + "/"))

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


@dataclass
class _Setup:
    group: dist.ProcessGroup | None
    rank: int
    size: int
    is_causal: bool
    load_balance: bool
    scale: float
    algorithm: str
    counter: CommCounter | None
    window: int | None = None  # sliding window: a query sees the `window` latest keys (itself included)
    #: (batch, whole sequence) document index of every token, in sequence order: a query sees keys of its own
    #: document only (packed sequences); None: one document a row
    documents: torch.Tensor | None = None
    #: (batch, whole sequence) whether each token may be seen as a key (False: padding); None: all may
    attendable: torch.Tensor | None = None

    @property
    def masks_by_token(self) -> bool:
        """Whether blocks need a mask from the tokens' positions (not just the causal triangle)."""
        return self.window is not None or self.documents is not None or self.attendable is not None


# ----------------------------------------------------------------------------------------------------------------
# One block: attention that also returns its log-sum-exp, and its backward given the merged (out, lse)


def _expand_kv(k: torch.Tensor, v: torch.Tensor, q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA: repeat each K/V head for its group of query heads (same convention as SDPA's enable_gqa)."""
    g = q_heads // k.size(1)
    return (k, v) if g == 1 else (k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))


def _fold_kv_grad(d: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """GQA: a K/V head's gradient is the sum over the query heads that shared it (in fp32 or fp64)."""
    return d if d.size(1) == kv_heads else d.unflatten(1, (kv_heads, -1)).sum(2, dtype=_acc(d))


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32 for half/bf16/fp32 inputs, fp64 stays fp64."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
            visible: torch.Tensor | None = None, row0: int = 0) -> torch.Tensor:
    """Scaled scores; masked entries -inf. ``visible`` (batch or 1, 1, rows, cols; from the tokens' global positions
    and documents) replaces the plain lower-triangular mask where a sliding window, packed documents or padding
    apply; ``row0``: the first query row's index in its causal block (a row tile's), whose key ``j`` is masked past
    row ``row0 + i``."""
    s = (q.to(_acc(q)) @ k.to(_acc(q)).transpose(-2, -1)) * scale
    if visible is not None:
        s.masked_fill_(~visible, float("-inf"))
    elif causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1 + row0), float("-inf"))
    return s


#: the most bytes one block's scores (fp32) may take at once: the math path materializes them, and at the sequence
#: lengths context parallelism is for they would not fit a device (32k tokens over cp 4 with 32 heads: 8,192^2 x 32 x
#: 4 bytes = 8.6 GB a sample, and backward holds three such tensors). Beyond it a block's queries are cut into row
#: tiles, each against the keys it can see; the results are the untiled ones (tests/test_context_attention.py)
SCORE_TILE_BYTES = 256 * 2**20


def rows_per_tile(row_bytes: float) -> int:
    """The query rows of one tile, whose scores take ``row_bytes`` a row: as many as ``SCORE_TILE_BYTES`` holds,
    at least one (the planner sizes the transient with it too)."""
    return max(1, int(SCORE_TILE_BYTES // max(1, row_bytes)))


def _row_tiles(q: torch.Tensor, k: torch.Tensor, causal: bool) -> list[tuple[int, int, int]]:
    """(first row, end row, keys seen) per tile of the block's query rows: whole if its scores fit
    ``SCORE_TILE_BYTES``; a causal block's tile sees only the keys up to its last row."""
    b, h, rows, _ = q.shape
    keys = k.size(2)
    step = rows_per_tile(b * h * keys * _acc(q).itemsize)
    return [(r0, min(rows, r0 + step), min(keys, r0 + step) if causal else keys) for r0 in range(0, rows, step)]


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the -inf of rows that see no key replaced by 0, so that exp(x - lse) gives 0, not NaN."""
    return lse.masked_fill(lse.isneginf(), 0.0)


def _fused_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  visible: torch.Tensor | None) -> str | None:
    """The fused CUDA kernel that computes this block ("cudnn", "flash" or "efficient"): the one torch's SDPA would
    pick for it (``sdpa_kernel_choice``), so the blocks run what one unsplit SDPA call runs (cuDNN on an H200 with
    torch 2.11: 1.7x flash's speed at 32k tokens) and ``torch.nn.attention.sdpa_kernel`` chooses for both. None
    (the math path) off CUDA, for a partly masked block, or where no fused kernel takes the shapes."""
    if not q.is_cuda or CUDA_KERNELS == "math" or visible is not None:
        return None
    if v.size(-1) != q.size(-1):
        return None  # head dims not alike for q and v (MLA): the math path, as before
    kernel = sdpa_kernel_choice(q, k, v, causal)
    if kernel == "efficient" and q.dtype != torch.float32:
        # its half-precision backward given a block's rows of the merged out and lse returned wrong gradients (0.83
        # relative, cp 2 load-balanced) on an H200 with torch 2.11, fp32 exact: SDPA picks it in half precision only
        # where cuDNN and flash cannot run, and there the math path is the exact one
        return None
    return kernel


def _fused_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = fused_attention_forward(kernel, q, k, v, scale, causal)
    return out.float(), lse.float()


def _fused_backward(kernel: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's own backward of one block, given the block's rows of the merged out and lse: with the final lse,
    exp(scores - lse) is this block's slice of the whole softmax, and rowsum(dO * out) the whole row's delta."""
    dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out.to(q.dtype)))
    # in the kernel's dtype: the caller adds them into fp32 sums (GQA's shared heads too), casting as it adds
    return fused_attention_backward(kernel, dout, q, k, v, out, lse, scale, causal)


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
    visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v for one block, plus lse = log(sum exp(scores)) per query row (fp32 or fp64).
    A row that sees no key of this block (sliding window) gets out 0 and lse -inf, which the merge weighs 0.
    Row tile by row tile where the scores would exceed ``SCORE_TILE_BYTES``."""
    k, v = _expand_kv(k, v, q.size(1))
    kernel = _fused_kernel(q, k, v, causal, visible)
    if kernel is not None:
        return _fused_forward(kernel, q, k, v, scale, causal)
    tiles = _row_tiles(q, k, causal)
    if len(tiles) == 1:
        return _tile_forward(q, k, v, scale, causal, visible, 0)
    k, v = k.to(_acc(q)), v.to(_acc(q))  # once, not per tile
    out = q.new_empty((*q.shape[:3], v.size(-1)), dtype=_acc(q))
    lse = q.new_empty(q.shape[:3], dtype=_acc(q))
    for r0, r1, keys in tiles:
        out[:, :, r0:r1], lse[:, :, r0:r1] = _tile_forward(
            q[:, :, r0:r1], k[:, :, :keys], v[:, :, :keys], scale, causal,
            None if visible is None else visible[..., r0:r1, :keys], r0)
    return out, lse


def _tile_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                  visible: torch.Tensor | None, row0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of query rows ``row0`` on of a block against the keys ``k`` they may see."""
    s = _scores(q, k, scale, causal, visible, row0)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - _finite(lse).unsqueeze(-1)) @ v.to(s.dtype), lse


def _block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    visible: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of dq, dk, dv, given the FINAL (merged) out and lse of these query rows.

    With the final lse, exp(scores - lse) is this block's slice of the global softmax, so the ordinary attention
    backward applied block by block sums exactly to the full gradient (the flash-attention recomputation).
    ``dlse``: the gradient reaching lse itself (attention sinks use it); d lse / d scores = P adds ``P * dlse``.
    Row tile by row tile as the forward (``SCORE_TILE_BYTES``): dq per tile, dk and dv summed over the tiles.
    """
    kv_heads = k.size(1)
    k, v = _expand_kv(k, v, q.size(1))
    # the kernels take no gradient of lse
    kernel = None if dlse is not None else _fused_kernel(q, k, v, causal, visible)
    tiles = _row_tiles(q, k, causal)
    if kernel is not None:
        dq, dk, dv = _fused_backward(kernel, dout, q, k, v, out, lse, scale, causal)
    elif len(tiles) == 1:
        dq, dk, dv = _tile_backward(dout, q, k, v, out, lse, scale, causal, visible, dlse, 0)
    else:
        k, v = k.to(_acc(q)), v.to(_acc(q))  # once, not per tile
        dq = q.new_empty(q.shape, dtype=_acc(q))
        dk, dv = k.new_zeros(k.shape, dtype=_acc(q)), v.new_zeros(v.shape, dtype=_acc(q))
        for r0, r1, keys in tiles:
            rows = slice(r0, r1)
            dq[:, :, rows], gk, gv = _tile_backward(
                dout[:, :, rows], q[:, :, rows], k[:, :, :keys], v[:, :, :keys], out[:, :, rows], lse[:, :, rows],
                scale, causal, None if visible is None else visible[..., rows, :keys],
                None if dlse is None else dlse[:, :, rows], r0)
            dk[:, :, :keys] += gk
            dv[:, :, :keys] += gv
    return dq, _fold_kv_grad(dk, kv_heads), _fold_kv_grad(dv, kv_heads)


def _tile_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, causal: bool, visible: torch.Tensor | None,
                   dlse: torch.Tensor | None, row0: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of query rows ``row0`` on of a block (dk, dv over the keys ``k`` they may see, per query
    head: the caller folds them for GQA)."""
    # masked entries: exp(-inf) = 0; a row that sees no key at all (a padding query) has lse -inf and gets 0 too
    p = torch.exp(_scores(q, k, scale, causal, visible, row0) - _finite(lse).unsqueeze(-1))
    do = dout.to(p.dtype)
    dv = p.transpose(-2, -1) @ do
    # d(scores) = P * (dP - rowsum(dO * O)): rowsum(P * dP) over ALL blocks equals rowsum(dO * O).
    delta = (do * out.to(p.dtype)).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(p.dtype).unsqueeze(-1)
    ds = p * (do @ v.to(p.dtype).transpose(-2, -1) - delta) * scale
    return ds @ k.to(p.dtype), ds.transpose(-2, -1) @ q.to(p.dtype), dv


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Fold one block into the running (out, lse) of query rows ``rows``, in place (online softmax).

    With Z = exp(lse), a block's out is P V / Z. Attention over the union of two key sets is
    (Z_a out_a + Z_b out_b) / (Z_a + Z_b), i.e. lse = logaddexp(lse_a, lse_b) and each side is weighted by
    exp(lse_side - lse). Rows that have seen no keys yet carry lse = -inf, hence weight 0; a block's own lse is
    always finite because every planned block row sees at least one key.
    """
    new = torch.logaddexp(lse[:, :, rows], blk_lse)
    # the block's share exp(blk_lse - new) of the merged softmax; the running side's, exp(lse - new), is 1 minus it:
    # one in-place interpolation, one pass over out. Rows still without any key (sliding window) get share 0, not NaN
    share = torch.exp(blk_lse - _finite(new))
    out[:, :, rows].lerp_(blk_out, share.unsqueeze(-1))
    lse[:, :, rows] = new


# ----------------------------------------------------------------------------------------------------------------
# Moving K/V (and dK/dV): one class per algorithm, same three methods


class _Exchange:
    def __init__(self, s: _Setup, phase: str) -> None:
        self.s, self.phase = s, phase

    def _count(self, op: str, nbytes: int) -> None:
        if self.s.counter is not None:
            self.s.counter.add(f"{self.phase}/{op}", nbytes)


class _Ring(_Exchange):
    """Each step every rank sends its current block to rank+1 and receives the next from rank-1."""

    def __init__(self, s: _Setup, phase: str) -> None:
        super().__init__(s, phase)
        if s.size > 1:
            self.next = dist.get_global_rank(s.group, (s.rank + 1) % s.size)
            self.prev = dist.get_global_rank(s.group, (s.rank - 1) % s.size)
        self.pending: tuple[torch.Tensor, list] | None = None
        self.dkv: torch.Tensor | None = None

    def _shift(self, buf: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        recv = torch.empty_like(buf)
        ops = [
            dist.P2POp(dist.isend, buf, self.next, self.s.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.s.group, tag),
        ]
        self._count("send", buf.numel() * buf.element_size())
        with record_function("CP::ring_send_recv"):  # named so CommOverlapMonitor counts it as CP traffic
            return recv, dist.batch_isend_irecv(ops)

    def kv_blocks(self, kv: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (owner rank, packed K/V) for every rank's block; the next one is in flight during the yield."""
        for step in range(self.s.size):
            last = step == self.s.size - 1
            if not last:
                nxt, reqs = self._shift(kv, tag=0)
            yield (self.s.rank - step) % self.s.size, kv
            if not last:
                for r in reqs:
                    r.wait()
                kv = nxt

    def add_grad(self, src: int, dkv: torch.Tensor) -> None:
        """Add the partial dK/dV for ``src``'s block that arrived from rank-1, and pass it on to rank+1.

        The accumulator for a block travels one step behind the block itself; after cp hops it is back at its
        owner with every rank's contribution.
        """
        if self.s.size == 1:
            self.dkv = dkv
            return
        if self.pending is not None:
            incoming, reqs = self.pending
            for r in reqs:
                r.wait()
            dkv += incoming
        self.pending = self._shift(dkv, tag=1)

    def grads(self) -> torch.Tensor:
        if self.s.size == 1:
            return self.dkv
        incoming, reqs = self.pending
        for r in reqs:
            r.wait()
        return incoming


class _AllGather(_Exchange):
    """All K/V blocks in one all-gather; all dK/dV blocks back to their owners in one reduce-scatter."""

    dkv_all: torch.Tensor | None = None

    def kv_blocks(self, kv: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        n, size = kv.numel(), self.s.size
        if size == 1:
            yield self.s.rank, kv
            return
        full = kv.new_empty(size * n)
        with record_function("CP::all_gather"):
            _all_gather(full, kv, group=self.s.group)
        self._count("all_gather", (size - 1) * n * kv.element_size())
        for src in range(size):
            yield src, full[src * n : (src + 1) * n]

    def add_grad(self, src: int, dkv: torch.Tensor) -> None:
        n = dkv.numel()
        if self.dkv_all is None:
            self.dkv_all = dkv.new_zeros(self.s.size * n)
        self.dkv_all[src * n : (src + 1) * n] = dkv

    def grads(self) -> torch.Tensor:
        size = self.s.size
        if size == 1:
            return self.dkv_all
        mine = self.dkv_all.new_empty(self.dkv_all.numel() // size)
        with record_function("CP::reduce_scatter"):
            _reduce_scatter(mine, self.dkv_all, group=self.s.group)
        self._count("reduce_scatter", (size - 1) * mine.numel() * mine.element_size())
        return mine


# ----------------------------------------------------------------------------------------------------------------
# Forward / backward drivers and the autograd Function


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])  # one contiguous buffer = one message per hop


def _unpack(buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return buf[: k.numel()].view(k.shape), buf[k.numel() :].view(v.shape)


def _plan(s: _Setup, src: int, n: int, device: torch.device) -> tuple[Block | None, torch.Tensor | None]:
    """The block of ``src``'s K/V that this rank's queries see, and (with a sliding window, packed documents or
    padding) which of its entries: checked on the tokens' global positions and documents. A block they hide entirely
    (no document spans it, or the window does not reach it) is skipped."""
    blk = block_plan(s.rank, src, s.size, n, s.is_causal, s.load_balance)
    if blk is None or not s.masks_by_token:
        return blk, None
    pq = sequence_positions(n * s.size, s.rank, s.size, s.load_balance, device=device)[blk.q]
    pk = sequence_positions(n * s.size, src, s.size, s.load_balance, device=device)[blk.kv]
    distance = pq[:, None] - pk[None, :]
    visible = distance >= 0 if s.is_causal else torch.ones_like(distance, dtype=torch.bool)
    if s.window is not None:
        visible = visible & (distance < s.window)
    visible = visible[None]  # (batch, rows, cols) from here
    if s.documents is not None:
        docs = s.documents.to(device)
        visible = visible & (docs[:, pq, None] == docs[:, None, pk])
    if s.attendable is not None:
        visible = visible & s.attendable.to(device)[:, None, pk]
    visible = visible.unsqueeze(1)  # over the heads
    return (blk, visible) if bool(visible.any()) else (None, None)


def _exchange(s: _Setup, phase: str) -> _Ring | _AllGather:
    return (_Ring if s.algorithm == "ring" else _AllGather)(s, phase)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: _Setup) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, n, _ = q.shape
    out = q.new_zeros((b, h, n, v.size(-1)), dtype=_acc(q))
    lse = q.new_full((b, h, n), float("-inf"), dtype=_acc(q))
    for src, kv in _exchange(s, "forward").kv_blocks(_pack(k, v)):
        blk, visible = _plan(s, src, n, q.device)
        if blk is None:
            continue  # every key of this block lies in the future of every local query (or outside the window)
        kb, vb = _unpack(kv, k, v)
        o, m = _block_forward(q[:, :, blk.q], kb[:, :, blk.kv], vb[:, :, blk.kv], s.scale, blk.causal, visible)
        _merge(out, lse, blk.q, o, m)
    return out, lse


def _backward(dout, q, k, v, out, lse, s: _Setup, dlse: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = q.size(2)
    dq = torch.zeros_like(q, dtype=_acc(q))
    ex = _exchange(s, "backward")
    for src, kv in ex.kv_blocks(_pack(k, v)):
        dkv = kv.new_zeros(kv.numel(), dtype=_acc(kv))  # accumulated and sent in fp32 (fp64 for fp64 inputs)
        blk, visible = _plan(s, src, n, q.device)
        if blk is not None:
            (kb, vb), (dkb, dvb), r, c = _unpack(kv, k, v), _unpack(dkv, k, v), blk.q, blk.kv
            gq, gk, gv = _block_backward(
                dout[:, :, r], q[:, :, r], kb[:, :, c], vb[:, :, c], out[:, :, r], lse[:, :, r], s.scale, blk.causal,
                visible, None if dlse is None else dlse[:, :, r],
            )
            dq[:, :, r] += gq
            dkb[:, :, c] += gk
            dvb[:, :, c] += gv
        ex.add_grad(src, dkv)
    dk, dv = _unpack(ex.grads(), k, v)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _ContextParallelAttention(torch.autograd.Function):
    """Saves only local tensors (q, k, v, out, lse): activation memory per rank is 1/cp of the full attention.
    Returns (out, lse); lse is differentiable (attention sinks rescale out by it) and costs nothing when unused."""

    @staticmethod
    def forward(ctx, q, k, v, setup: _Setup):
        out, lse = _forward(q, k, v, setup)
        out = out.to(q.dtype)
        ctx.setup = setup
        ctx.set_materialize_grads(False)  # an unused lse gets no gradient tensor: the plain backward runs
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        return (*_backward(dout.contiguous(), q, k, v, out, lse, ctx.setup, dlse), None)


# ----------------------------------------------------------------------------------------------------------------
# Public API


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}.")


def _validate(q, k, v, attn_mask, algorithm, load_balance, scale, cp_size, ulysses: int = 1) -> None:
    _check_algorithm(algorithm)
    if attn_mask is not None:
        raise ValueError(
            f"attn_mask is not supported by context-parallel attention (got {type(attn_mask).__name__}"
            f"{tuple(getattr(attn_mask, 'shape', ()))}): a dense mask cannot follow K/V blocks around the cp group. "
            "Pass attn_mask=None and is_causal=True/False; only full or causal attention is supported."
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(
                f"{name} must be a floating-point tensor of shape (batch, heads, local_seq, head_dim), got "
                f"{getattr(t, 'shape', type(t).__name__)}."
            )
    if len({q.dtype, k.dtype, v.dtype}) != 1 or len({q.device, k.device, v.device}) != 1:
        raise ValueError(
            f"q, k, v must share dtype and device, got dtypes {(q.dtype, k.dtype, v.dtype)} and devices "
            f"{(q.device, k.device, v.device)}. Cast them to one dtype/device."
        )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if k.shape[:3] != v.shape[:3] or q.size(0) != k.size(0) or q.size(-1) != k.size(-1):
        raise ValueError(
            f"q, k, v shapes do not match: {shapes}. Expected q (B, H, S, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)."
        )
    if q.size(2) != k.size(2):
        raise ValueError(
            f"q and k local sequence lengths differ: {shapes}. Context parallelism shards one sequence: "
            "q, k and v must be this rank's shards of the same tokens (self-attention)."
        )
    if q.size(1) % k.size(1) != 0:
        raise ValueError(
            f"q heads ({q.size(1)}) must be a multiple of k/v heads ({k.size(1)}) for grouped-query attention: "
            f"{shapes}. Give k and v a head count that divides the query head count."
        )
    n, chunks = q.size(2) * ulysses, 2 * cp_size if load_balance else cp_size  # n: the ring level's
    if n == 0 or (load_balance and n % 2 != 0):
        raise ValueError(
            f"local sequence length {q.size(2)} is inconsistent with cp = {cp_size * ulysses} and load_balance="
            f"{load_balance}: the global length {n * cp_size} must split into {chunks} equal non-empty chunks (each "
            f"rank holds two with load balancing). Pad the global sequence to a multiple of {chunks} and shard it "
            "with shard_sequence(), or pass load_balance=False."
        )
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale must be a float or None (1/sqrt(head_dim)), got {scale!r}.")


def _resolve_group(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1  # single process: cp = 1, no communication
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            "group: this process is not a member of the given cp process group. Pass the cp group "
            "that contains this rank (e.g. device_mesh['cp'].get_group())."
        )
    return group, rank, dist.get_world_size(group)


@torch.compiler.disable  # collectives and an autograd Function: a compiled block runs it eagerly, between its graphs
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    algorithm: Algorithm = "ring",
    load_balance: bool = True,
    scale: float | None = None,
    comm_counter: CommCounter | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    attendable: torch.Tensor | None = None,
    ulysses_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Exact attention over sequences sharded across ``group`` (the cp group); returns this rank's output shard.

    ``q`` (B, H, S_local, D), ``k``/``v`` (B, Hkv, S_local, D/Dv) are this rank's shards as made by
    :func:`shard_sequence` with the same ``load_balance`` (causal masking uses their global positions). ``Hkv``
    may divide ``H`` (GQA). ``group=None`` means the default group, or cp = 1 if torch.distributed is not
    initialized. ``comm_counter`` collects the bytes this rank sends (forward and backward). ``window``: causal
    sliding-window attention, each query seeing the ``window`` latest tokens up to itself (Mistral's
    ``sliding_window``), on global positions. ``sinks`` (H,): a learned logit per head that joins every softmax's
    denominator and attends to nothing (gpt-oss's attention sinks, transformers' ``s_aux``).

    ``documents`` (B, S_global) integers: packed sequences, a query seeing keys of its own document only (the whole
    rows, in sequence order, the same on every rank: ``parallel/documents.document_ids`` makes them from position
    ids).
    ``attendable`` (B, S_global) bools: tokens that may be seen as keys (False: padding; Hugging Face's 2-D
    ``attention_mask``). Blocks they hide entirely are skipped.

    ``algorithm="ulysses"``: all-to-all over ``group`` instead of moving keys and values: every rank attends over
    the whole sequence for ``H / cp`` of the heads (its tokens: ``shard_sequence(..., ulysses=cp)``). The hybrid:
    ``ulysses_group`` (a group of ``k`` consecutive cp ranks) with ``"ring"`` or ``"allgather"`` over ``group``
    (the ``cp / k`` ranks holding the same member index in each Ulysses group): all-to-all inside each Ulysses
    group, then the ring over the groups' gathered parts (tokens: ``shard_sequence(..., ulysses=k)``).
    """
    _check_algorithm(algorithm)
    if algorithm == "ulysses":
        if ulysses_group is not None:
            raise ValueError("ulysses_group is for the hybrid (all-to-all inside groups, then 'ring' or 'allgather' "
                             "over group); with algorithm='ulysses' the all-to-all spans group itself: pass only "
                             "group.")
        ulysses_group, (group, rank, size) = _resolve_group(group)[0], (None, 0, 1)
    else:
        group, rank, size = _resolve_group(group)
    ulysses = 1 if ulysses_group is None else dist.get_world_size(ulysses_group)
    balanced = bool(load_balance) and size > 1
    _validate(q, k, v, attn_mask, algorithm, balanced, scale, size, ulysses)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1 or not is_causal):
        raise ValueError(f"window={window!r} must be a positive int, and only with is_causal=True (a causal "
                         f"sliding window); pass window=None for full causal attention.")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (q.size(1),)):
        raise ValueError(f"sinks must be a tensor of one logit per query head, shape ({q.size(1)},), got "
                         f"{getattr(sinks, 'shape', type(sinks).__name__)}.")
    whole = q.size(2) * size * ulysses
    documents = _check_token_table("documents", documents, q.size(0), whole, integer=True)
    attendable = _check_token_table("attendable", attendable, q.size(0), whole, integer=False)
    if ulysses > 1:
        a2a.check_heads(q.size(1), k.size(1), ulysses)
        member = dist.get_rank(ulysses_group)
        if sinks is not None:
            sinks = sinks[a2a.head_slice(ulysses, member, q.size(1))]
        q, k, v = a2a.to_heads(q, k, v, ulysses_group, comm_counter)
    if ulysses > 1 and size == 1 and sinks is None and window is None and documents is None and attendable is None \
            and CUDA_KERNELS == "auto":
        # whole rows on this rank, nothing to merge and no mask beyond causality: torch's own kernel (flash or the
        # memory-efficient one on a GPU, which skip the masked half; the blocked math path would not)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=bool(is_causal), scale=scale,
                                             enable_gqa=q.size(1) != k.size(1))
        return a2a.to_sequence(out, ulysses_group, comm_counter)
    setup = _Setup(group, rank, size, bool(is_causal), balanced, scale, "ring" if size == 1 else algorithm,
                   comm_counter, window, documents, attendable)
    out, lse = _ContextParallelAttention.apply(q, k, v, setup)
    if sinks is not None:
        # softmax over [scores, sink]: the keys' share of the denominator is exp(lse) / (exp(lse) + exp(sink))
        with_sink = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
        out = (out * torch.exp(lse - with_sink).unsqueeze(-1)).to(q.dtype)
    return out if ulysses == 1 else a2a.to_sequence(out, ulysses_group, comm_counter)


def _check_token_table(name: str, table: torch.Tensor | None, batch: int, whole: int,
                       integer: bool) -> torch.Tensor | None:
    if table is None:
        return None
    kind = "an integer" if integer else "a boolean"
    ok = isinstance(table, torch.Tensor) and (not table.is_floating_point() if integer else table.dtype == torch.bool)
    if not ok or table.dim() != 2 or table.size(1) != whole or table.size(0) not in (1, batch):
        raise ValueError(f"{name} must be {kind} tensor of shape (batch={batch}, whole sequence={whole}) covering "
                         f"every cp rank's tokens in sequence order, got {getattr(table, 'dtype', type(table))} "
                         f"{tuple(getattr(table, 'shape', ()))}.")
    return table


def context_parallel_sdpa(
    group: dist.ProcessGroup | None = None,
    *,
    algorithm: Algorithm = "ring",
    load_balance: bool = True,
    comm_counter: CommCounter | None = None,
    ulysses_group: dist.ProcessGroup | None = None,
    tokens: Callable[[], dict] | None = None,
) -> Callable[..., torch.Tensor]:
    """A drop-in for ``F.scaled_dot_product_attention`` bound to a cp group: route a model's attention through it.

    The model then sees only its shard of every sequence: shard the inputs and targets with
    ``shard_sequence(x, seq_dim, cp_rank, cp_size, load_balance)``, take position embeddings / rotary angles at
    ``sequence_positions(...)``, and average the loss over the cp ranks too. For example::

        attn = context_parallel_sdpa(mesh["cp"].get_group())
        y = attn(q, k, v, is_causal=True)  # q, k, v: (B, H, S / cp, D), this rank's tokens

    ``tokens``: called at every attention, returns the ``documents`` / ``attendable`` tables of the rows running now
    (``context_routing``'s scope). With a cp group of size 1 and no Ulysses group it returns
    ``F.scaled_dot_product_attention`` itself (same layout, fastest kernel) unless ``tokens`` is given.
    """
    _check_algorithm(algorithm)
    if _resolve_group(group)[2] == 1 and ulysses_group is None and tokens is None:
        return F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p:
            raise ValueError(f"dropout_p={dropout_p} is not supported by context-parallel attention; pass 0.0.")
        if query.size(-3) != key.size(-3) and not enable_gqa:
            raise ValueError(f"q has {query.size(-3)} heads and k has {key.size(-3)}: pass enable_gqa=True for GQA.")
        kw = dict(group=group, algorithm=algorithm, load_balance=load_balance, comm_counter=comm_counter,
                  ulysses_group=ulysses_group, **(tokens() if tokens is not None else {}))
        return context_parallel_attention(query, key, value, attn_mask, is_causal=is_causal, scale=scale, **kw)

    return sdpa
