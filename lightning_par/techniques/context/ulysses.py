"""Ulysses (all-to-all) sequence parallelism: trade the sequence split for a head split around the attention.

Each rank of a Ulysses group of ``k`` ranks holds ``1/k`` of the group's tokens for every head. One all-to-all per
tensor gives each rank all of the group's tokens for ``heads / k`` of the heads; the attention then runs over whole
rows (any kernel, any mask), and one all-to-all sends its output back to the sequence split. Per rank and tensor it
sends ``(k - 1) / k`` of its part, where a ring passes every other rank's keys and values (DeepSpeed-Ulysses;
Megatron-Core's ``cp_comm_type="a2a"``). Key/value heads fewer than ``k`` (grouped-query attention) are repeated
first, just enough for every rank to receive the ones its query heads read.

Plain torch.distributed (``all_to_all_single``, gloo and NCCL), no Lightning.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.profiler import record_function


class _AllToAll(torch.autograd.Function):
    """``to_heads``: ``(B, H, n, D)`` sequence pieces -> ``(B, H / k, k n, D)``, each rank keeping its head slice of
    every rank's piece, in rank order; else the inverse. Backward is the other direction."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, counter, phase: str, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.counter, ctx.to_heads = group, counter, to_heads
        return (_heads_to_sequence if to_heads else _sequence_to_heads)(x, group, counter, f"{phase}/all_to_all")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _sequence_to_heads if ctx.to_heads else _heads_to_sequence
        return back(grad.contiguous(), ctx.group, ctx.counter, "backward/all_to_all"), None, None, None, None


def _exchange(send: torch.Tensor, group: dist.ProcessGroup, counter, key: str) -> torch.Tensor:
    recv = torch.empty_like(send)
    with record_function("CP::all_to_all"):  # named so CommOverlapMonitor counts it as CP traffic
        dist.all_to_all_single(recv, send, group=group)
    if counter is not None:
        k = dist.get_world_size(group)
        counter.add(key, send.numel() * send.element_size() * (k - 1) // k)
    return recv


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup, counter, key: str) -> torch.Tensor:
    k = dist.get_world_size(group)
    b, h, n, d = x.shape
    send = x.reshape(b, k, h // k, n, d).transpose(0, 1).contiguous()  # (k, B, H/k, n, D): slice j to rank j
    recv = _exchange(send, group, counter, key)  # (k, B, H/k, n, D): rank i's piece of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // k, k * n, d)


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup, counter, key: str) -> torch.Tensor:
    k = dist.get_world_size(group)
    b, hk, kn, d = x.shape
    send = x.reshape(b, hk, k, kn // k, d).permute(2, 0, 1, 3, 4).contiguous()  # (k, B, H/k, n, D): piece i to i
    recv = _exchange(send, group, counter, key)  # (k, B, H/k, n, D): my piece of rank j's heads
    return recv.transpose(0, 1).reshape(b, k * hk, kn // k, d)


def kv_repeats(q_heads: int, kv_heads: int, k: int) -> int:
    """How many times each key/value head is repeated so that ``k`` ranks each get the ones their ``q_heads / k``
    query heads read: 1 where ``k`` divides the key/value heads, else ``k / gcd(kv_heads, k)`` (which divides the
    query heads' group size whenever ``k`` divides the query heads)."""
    return 1 if kv_heads % k == 0 else k // math.gcd(kv_heads, k)


def check_heads(q_heads: int, kv_heads: int, k: int) -> None:
    """Refuse head counts the all-to-all cannot split (on every rank alike: before any communication)."""
    if q_heads % k != 0:
        raise ValueError(
            f"Ulysses attention splits the heads over its {k} ranks, but this attention has {q_heads} query heads "
            f"(after tensor parallelism) that {k} does not divide. Choose cp_ulysses_size (or cp with "
            f"cp_algorithm='ulysses') dividing the heads, or cp_algorithm='ring'.")


def to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, counter=None,
             phase: str = "forward") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's head slice of the group's whole pieces of q, k, v (``(B, H, n, D)`` each -> ``(B, H / k, k n,
    D)``), key/value heads repeated where fewer than the group needs."""
    size = dist.get_world_size(group)
    check_heads(q.size(1), k.size(1), size)
    repeats = kv_repeats(q.size(1), k.size(1), size)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    return tuple(_AllToAll.apply(t.contiguous(), group, counter, phase, True) for t in (q, k, v))


def to_sequence(out: torch.Tensor, group: dist.ProcessGroup, counter=None, phase: str = "forward") -> torch.Tensor:
    """The attention's output ``(B, H / k, k n, D)`` back to this rank's piece of every head ``(B, H, n, D)``."""
    return _AllToAll.apply(out.contiguous(), group, counter, phase, False)


def head_slice(size: int, rank: int, heads: int) -> slice:
    """The query heads rank ``rank`` of a Ulysses group of ``size`` attends for."""
    per = heads // size
    return slice(rank * per, (rank + 1) * per)
