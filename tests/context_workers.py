"""Worker functions for tests/test_context_attention.py (module level, so spawned ranks can import them).

One launch per world size runs every configuration and returns plain numbers; the parent asserts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_par.techniques.context import context
from lightning_par.techniques.context.context import (
    CommCounter,
    context_parallel_attention,
    context_parallel_sdpa,
    shard_sequence,
    unshard_sequence,
)


@dataclass(frozen=True)
class Case:
    algorithm: str
    is_causal: bool
    load_balance: bool
    seq_len: int  # global
    heads: int
    kv_heads: int
    head_dim: int = 16
    batch: int = 2
    scale: float | None = None
    transposed: bool = False  # q/k/v are non-contiguous views of a (B, S, H, D) tensor
    via_sdpa: bool = False  # call through context_parallel_sdpa instead of context_parallel_attention
    window: int | None = None  # causal sliding window (Mistral-style), on global positions
    sinks: bool = False  # a learned logit per head in every softmax's denominator (gpt-oss)
    tiled: bool = False  # every block's query rows one at a time (SCORE_TILE_BYTES at its least)
    documents: bool = False  # packed rows: random document boundaries per row, a query seeing its own document
    padding: bool = False  # right padding hidden as keys (Hugging Face's 2-D attention_mask)
    ulysses: int = 1  # with "ring"/"allgather": the hybrid, all-to-all inside groups of this many ranks

    def __str__(self) -> str:
        extras = "".join(
            f" {k}={getattr(self, k)}"
            for k in ("scale", "transposed", "via_sdpa", "window", "sinks", "tiled", "documents", "padding",
                      "ulysses")
            if getattr(self, k) != Case.__dataclass_fields__[k].default
        )
        return (
            f"{self.algorithm} causal={self.is_causal} lb={self.load_balance} S={self.seq_len} "
            f"H={self.heads} Hkv={self.kv_heads}{extras}"
        )


def cases_for(cp: int) -> list[Case]:
    """Both algorithms x causal/not x load balance on/off x a few shapes (one with GQA), plus odd corners."""
    shapes = [(2 * cp, 2, 2), (10 * cp, 4, 4), (32 * cp // 2, 4, 2)]  # (global S, H, Hkv): local 2, 10, 16
    cases = [
        Case(alg, causal, lb, s, h, hkv)
        for alg in ("ring", "allgather")
        for causal in (False, True)
        for lb in (True, False)
        for s, h, hkv in shapes
    ]
    cases += [Case(alg, causal, False, 3 * cp, 2, 1) for alg in ("ring", "allgather") for causal in (False, True)]
    cases += [
        Case("ring", True, True, 8 * cp, 4, 2, scale=0.3),
        Case("allgather", True, True, 8 * cp, 2, 2, head_dim=8, transposed=True),
        Case("ring", True, True, 4 * cp, 4, 4, transposed=True, via_sdpa=True),
    ]
    # sliding windows: narrower than a chunk, across chunk boundaries, and wider than the sequence (= causal)
    cases += [
        Case(alg, True, lb, 8 * cp, 4, 2, window=w)
        for alg in ("ring", "allgather")
        for lb in (True, False)
        for w in (3, 5 * cp, 8 * cp + 1)
    ]
    # attention sinks, with causal load balancing, a sliding window, GQA, and without causality
    cases += [Case(alg, True, True, 8 * cp, 4, 2, sinks=True) for alg in ("ring", "allgather")]
    cases += [Case("ring", True, False, 8 * cp, 4, 4, window=3, sinks=True), Case("ring", False, True, 4 * cp, 2, 1,
                                                                                    sinks=True)]
    # the math path's row tiles (one query row at a time): causal with load balance and GQA, a window, sinks over a
    # window, full attention
    cases += [Case("ring", True, True, 10 * cp, 4, 2, tiled=True), Case("allgather", True, False, 8 * cp, 4, 2,
                                                                         window=5, tiled=True),
              Case("ring", True, True, 8 * cp, 4, 2, window=3, sinks=True, tiled=True),
              Case("allgather", False, True, 4 * cp, 2, 1, tiled=True)]
    # packed documents and padding: ring/all-gather with and without load balance, windows, sinks, full attention
    cases += [Case(alg, True, lb, 8 * cp, 4, 2, documents=True) for alg in ("ring", "allgather") for lb in (True,
                                                                                                         False)]
    cases += [Case("ring", True, True, 8 * cp, 4, 2, documents=True, padding=True, window=5, sinks=True),
              Case("ring", False, True, 8 * cp, 2, 2, documents=True, padding=True),
              Case("allgather", True, True, 8 * cp, 2, 1, padding=True, tiled=True)]
    # Ulysses over the whole group: GQA with fewer key/value heads than ranks, windows, sinks, documents, not causal
    cases += [Case("ulysses", True, True, 4 * cp, 2 * cp, kv) for kv in sorted({1, cp, 2 * cp})]
    cases += [Case("ulysses", True, False, 8 * cp, 2 * cp, 2, window=5, sinks=True, documents=True, padding=True),
              Case("ulysses", False, True, 4 * cp, cp, 1, transposed=True),
              Case("ulysses", True, True, 4 * cp, 3 * cp, 3, via_sdpa=True)]
    if cp == 4:  # the hybrid: all-to-all in pairs, then the ring or the all-gather over the two pairs
        cases += [Case(alg, True, lb, 8 * cp, 4, kv, ulysses=2) for alg in ("ring", "allgather") for lb in (True,
                                                                                                         False)
                  for kv in (1, 4)]
        cases += [Case("ring", True, True, 8 * cp, 4, 2, ulysses=2, window=7, sinks=True, documents=True,
                       padding=True)]
    return cases


def token_tables(case: Case, g: torch.Generator) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Random packed documents (several per row, boundaries anywhere) and right padding (a row's last tokens)."""
    documents = attendable = None
    if case.documents:
        starts = torch.rand(case.batch, case.seq_len, generator=g) < 0.2
        starts[:, 0] = False
        documents = starts.long().cumsum(-1)
    if case.padding:
        keep = torch.randint(case.seq_len // 2, case.seq_len, (case.batch, 1), generator=g)
        attendable = torch.arange(case.seq_len)[None, :] < keep
    return documents, attendable


def dense_visible(case: Case, documents: torch.Tensor | None, attendable: torch.Tensor | None) -> torch.Tensor:
    """One process's (batch, 1, S, S) mask: causal, window, same document, key not padding."""
    n = case.seq_len
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    visible = (distance >= 0) if case.is_causal else torch.ones(n, n, dtype=torch.bool)
    if case.window is not None:
        visible = visible & (distance < case.window)
    visible = visible.expand(case.batch, n, n)
    if documents is not None:
        visible = visible & (documents[:, :, None] == documents[:, None, :])
    if attendable is not None:
        visible = visible & attendable[:, None, :]
    return visible.unsqueeze(1)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, is_causal: bool,
                   window: int | None = None, scale: float | None = None,
                   visible: torch.Tensor | None = None) -> torch.Tensor:
    """One process, written out as transformers' eager gpt-oss attention: the sink logit joins each row's softmax
    as one more column, which is then dropped. ``visible``: a whole mask instead of causal/window."""
    g = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = q @ k.transpose(-2, -1) * (q.size(-1) ** -0.5 if scale is None else scale)
    n = q.size(2)
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    hidden = (distance < 0) if is_causal else torch.zeros(n, n, dtype=torch.bool)
    if window is not None:
        hidden |= distance >= window
    if visible is not None:
        hidden = ~visible
    scores = scores.masked_fill(hidden, float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(q.size(0), -1, n, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def _run_case(case: Case, seed: int, group: dist.ProcessGroup | None, hybrid: tuple | None = None) -> dict:
    if not case.tiled:
        return _run_parity(case, seed, group, hybrid)
    before, context.SCORE_TILE_BYTES = context.SCORE_TILE_BYTES, 1
    try:
        return _run_parity(case, seed, group, hybrid)
    finally:
        context.SCORE_TILE_BYTES = before


def _run_parity(case: Case, seed: int, group: dist.ProcessGroup | None, hybrid: tuple | None = None) -> dict:
    """``hybrid``: (ring group, Ulysses group) for cases with ``ulysses`` > 1."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    ulysses = cp if case.algorithm == "ulysses" else case.ulysses
    g = torch.Generator().manual_seed(seed)  # same seed on every rank: every rank builds the same global tensors

    def make(heads: int) -> torch.Tensor:
        if case.transposed:
            return torch.randn(case.batch, case.seq_len, heads, case.head_dim, generator=g).transpose(1, 2)
        return torch.randn(case.batch, heads, case.seq_len, case.head_dim, generator=g)

    q, k, v, dout = make(case.heads), make(case.kv_heads), make(case.kv_heads), make(case.heads)

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    gqa = case.heads != case.kv_heads
    sinks = torch.randn(case.heads, generator=g) if case.sinks else None
    ref_sinks = sinks.clone().requires_grad_() if case.sinks else None
    documents, attendable = token_tables(case, g)
    masked = documents is not None or attendable is not None
    if case.sinks:
        visible = dense_visible(case, documents, attendable) if masked else None
        ref_out = sink_attention(*ref, ref_sinks, case.is_causal, case.window, case.scale, visible)
    elif masked:
        ref_out = F.scaled_dot_product_attention(*ref, attn_mask=dense_visible(case, documents, attendable),
                                                 scale=case.scale, enable_gqa=gqa)
    elif case.window is None:
        ref_out = F.scaled_dot_product_attention(*ref, is_causal=case.is_causal, scale=case.scale, enable_gqa=gqa)
    else:  # the dense sliding-window mask of one process
        distance = torch.arange(case.seq_len)[:, None] - torch.arange(case.seq_len)[None, :]
        mask = (distance >= 0) & (distance < case.window)
        ref_out = F.scaled_dot_product_attention(*ref, attn_mask=mask, scale=case.scale, enable_gqa=gqa)
    ref_out.backward(dout)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, 2, rank, cp, case.load_balance, ulysses)

    if case.transposed:  # shard along S of the (B, S, H, D) storage, then view as (B, H, S, D): non-contiguous
        local = [shard_sequence(t.transpose(1, 2), 1, rank, cp, case.load_balance, ulysses).transpose(1, 2)
                 for t in (q, k, v)]
    else:
        local = [shard(t) for t in (q, k, v)]
    local = [t.detach().requires_grad_() for t in local]
    local_sinks = sinks.clone().requires_grad_() if case.sinks else None
    counter = CommCounter()
    groups = dict(group=group) if case.ulysses == 1 else dict(group=hybrid[0], ulysses_group=hybrid[1])
    if case.via_sdpa:
        attn = context_parallel_sdpa(
            algorithm=case.algorithm, load_balance=case.load_balance, comm_counter=counter, **groups,
            tokens=lambda: {"documents": documents, "attendable": attendable},
        )
        out = attn(*local, is_causal=case.is_causal, scale=case.scale, enable_gqa=gqa)
    else:
        out = context_parallel_attention(
            *local,
            is_causal=case.is_causal,
            algorithm=case.algorithm,
            load_balance=case.load_balance,
            scale=case.scale,
            comm_counter=counter,
            window=case.window,
            sinks=local_sinks,
            documents=documents,
            attendable=attendable,
            **groups,
        )
    out.backward(shard(dout))
    diffs = {"out": (out - shard(ref_out)).abs().max().item()}
    if case.sinks:  # each rank's sink gradient covers its own query rows: their sum is the whole gradient
        dist.all_reduce(local_sinks.grad, group=group)
        diffs["dsinks"] = (local_sinks.grad - ref_sinks.grad).abs().max().item()
    for name, loc, full in zip(("dq", "dk", "dv"), local, ref):
        diffs[name] = (loc.grad - shard(full.grad)).abs().max().item()
    return {
        "case": case,
        "cp": cp,
        "diffs": diffs,
        "bytes": dict(counter.bytes),
        "calls": dict(counter.calls),
        "kv_numel": local[1].numel() + local[2].numel(),
        "q_numel": local[0].numel(),
        "itemsize": q.element_size(),
    }


def _bad_inputs(group: dist.ProcessGroup | None) -> dict[str, str]:
    """Each bad call must raise ValueError on every rank BEFORE communicating (else this launch would hang)."""
    q = torch.randn(1, 2, 3, 8)  # local length 3: odd, so the global length cannot split into 2*cp chunks
    messages = {}
    calls = {
        "odd_local_len": lambda: context_parallel_attention(q, q, q, group=group, is_causal=True),
        "attn_mask": lambda: context_parallel_attention(q, q, q, torch.ones(3, 3, dtype=torch.bool), group=group),
        "dropout": lambda: context_parallel_sdpa(group)(q, q, q, dropout_p=0.1),
    }
    for name, call in calls.items():
        try:
            call()
            messages[name] = "no error"
        except ValueError as e:
            messages[name] = str(e)
    return messages


def parity_worker(cases: list[Case]) -> dict:
    """Every case on the whole world as the cp group, then extras (unshard, bad inputs, cp sub-groups)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        x = torch.arange(2 * 8 * world * 3.0).view(2, 8 * world, 3)
        roundtrip = all(
            torch.equal(unshard_sequence(shard_sequence(x, 1, rank, world, lb), 1, load_balance=lb), x)
            for lb in (True, False)
        )
        extras = {"unshard_roundtrip": roundtrip, "bad_inputs": _bad_inputs(None)}

        results = [_run_case(c, 1000 + i, None) for i, c in enumerate(cases) if c.ulysses == 1]
        if world == 4:  # the hybrid's groups: all-to-all in pairs {0, 1}, {2, 3}; the ring over {0, 2}, {1, 3}
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            hybrid = (rings[rank % 2], pairs[rank // 2])
            results += [_run_case(c, 1000 + i, None, hybrid) for i, c in enumerate(cases) if c.ulysses > 1]
        if world == 4:  # two cp groups of 2 (like dp=2 x cp=2): ring peers must map group ranks to global ranks
            groups = pairs
            mine = groups[rank // 2]
            sub = [Case(alg, True, True, 16, 2, 2) for alg in ("ring", "allgather")]
            results += [_run_case(c, 5000 + 10 * (rank // 2) + i, mine) for i, c in enumerate(sub)]
        return {"results": results, "extras": extras}
    finally:
        dist.destroy_process_group()
