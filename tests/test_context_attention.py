"""Context-parallel attention: parity with full SDPA (real gloo processes), sharding helpers, bad inputs, bytes.

Multi-process tests share one launch per world size (a launch costs seconds); everything else is single process.
(pyproject puts the repo root and tests/ on sys.path, so spawned ranks can import ``context_workers``.)
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn.functional as F
from context_workers import Case, cases_for, parity_worker, sink_attention
from launch import launch

from lightning_par.techniques.context import context
from lightning_par.techniques.context.context import (
    context_parallel_attention,
    context_parallel_sdpa,
    join_shards,
    sequence_positions,
    shard_sequence,
)
from lightning_par.techniques.context.context_sharding import block_plan
from lightning_par.techniques.context.ulysses import kv_repeats

TOL = 1e-5


@functools.cache
def _launch(world: int) -> dict:
    """All configurations for one world size in ONE launch; each rank returns its diffs and byte counts."""
    return launch(world, parity_worker, cases_for(world))


# ---------------------------------------------------------------------------------------------------------------
# Multi-process: parity, bytes, extras


@pytest.mark.parametrize("world", [2, 4])
def test_parity_with_full_sdpa(world: int) -> None:
    failures, checked = [], 0
    for rank, res in enumerate(_launch(world)):
        for r in res["results"]:
            checked += 1
            bad = {k: f"{d:.2e}" for k, d in r["diffs"].items() if not d <= TOL}
            if bad:
                failures.append(f"cp={r['cp']} rank {rank} [{r['case']}]: {bad}")
    assert checked >= len(cases_for(world)) * world
    assert not failures, f"{len(failures)} of {checked} rank-configs exceed {TOL}:\n" + "\n".join(failures)


def _expected_bytes(algorithm: str, cp: int, kv_bytes: int, dkv_bytes: int) -> dict[str, int]:
    """Bytes one rank sends per forward+backward call (the formulas the benchmark reports too)."""
    if cp == 1:
        return {}
    if algorithm == "ring":  # K/V make cp-1 hops each way; dK/dV make cp hops (the last one home), in fp32
        return {"forward/send": (cp - 1) * kv_bytes, "backward/send": (cp - 1) * kv_bytes + cp * dkv_bytes}
    return {  # each rank gathers (cp-1)/cp of the global K/V, i.e. (cp-1) local shards; same for dK/dV
        "forward/all_gather": (cp - 1) * kv_bytes,
        "backward/all_gather": (cp - 1) * kv_bytes,
        "backward/reduce_scatter": (cp - 1) * dkv_bytes,
    }


def _expected_ulysses_bytes(case: Case, cp: int, q_numel: int, kv_numel: int, itemsize: int) -> dict[str, int]:
    """Bytes one rank sends by all-to-all per forward+backward call, and the ring's or all-gather's over the
    groups after it: each all-to-all keeps 1/u of its tensor (q, k and v in, the output back; their gradients the
    other way), key/value heads repeated where fewer than the group; the ring then moves the group's gathered
    keys and values, as many elements as this rank's repeated ones."""
    u = cp if case.algorithm == "ulysses" else case.ulysses
    repeats = kv_repeats(case.heads, case.kv_heads, u)
    kv = kv_numel * repeats
    moved = (2 * q_numel + kv) * itemsize * (u - 1) // u
    expected = {"forward/all_to_all": moved, "backward/all_to_all": moved}
    if case.algorithm != "ulysses":
        expected.update(_expected_bytes(case.algorithm, cp // u, kv * itemsize, kv * 4))
    return expected


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_communicated_match_formula(world: int) -> None:
    failures = []
    for rank, res in enumerate(_launch(world)):
        for r in res["results"]:
            cp, case = r["cp"], r["case"]
            ring = cp // case.ulysses
            if case.algorithm == "ulysses" or case.ulysses > 1:
                expected = _expected_ulysses_bytes(case, cp, r["q_numel"], r["kv_numel"], r["itemsize"])
            else:
                expected = _expected_bytes(case.algorithm, cp, r["kv_numel"] * r["itemsize"], r["kv_numel"] * 4)
            if r["bytes"] != expected:
                failures.append(f"cp={cp} rank {rank} [{case}]: got {r['bytes']}, expected {expected}")
            hops = {key: n for key, n in r["calls"].items() if key.endswith("/send")}
            if case.algorithm == "ring" and hops != {"forward/send": ring - 1, "backward/send": 2 * ring - 1}:
                failures.append(f"cp={cp} rank {rank} [{case}]: ring hop counts {r['calls']}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_unshard_and_errors_before_communication(world: int) -> None:
    for rank, res in enumerate(_launch(world)):
        extras = res["extras"]
        assert extras["unshard_roundtrip"], f"rank {rank}: unshard_sequence(shard_sequence(x)) != x"
        msgs = extras["bad_inputs"]
        assert f"cp = {world}" in msgs["odd_local_len"] and f"multiple of {2 * world}" in msgs["odd_local_len"]
        assert "attn_mask" in msgs["attn_mask"] and "is_causal" in msgs["attn_mask"]
        assert "dropout_p" in msgs["dropout"]


def test_cp_subgroups_in_a_larger_world() -> None:
    sub = [r for res in _launch(4) for r in res["results"] if r["cp"] == 2]
    assert len(sub) == 8, "world 4 runs 2 cases on each of two cp groups of 2"


# ---------------------------------------------------------------------------------------------------------------
# Sharding helpers (pure)


def test_shard_layout_and_positions() -> None:
    assert sequence_positions(16, 0, 2, True).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert sequence_positions(16, 1, 2, True).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sequence_positions(16, 1, 2, False).tolist() == list(range(8, 16))
    assert sequence_positions(8, 0, 1, True).tolist() == list(range(8))  # cp=1: the natural order
    assert sequence_positions(24, 2, 3, True, device="cpu").tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
    x = torch.arange(16.0).view(1, 16, 1)
    assert shard_sequence(x, 1, 0, 2, True).flatten().tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("dim", [0, 2, -1])
def test_join_shards_inverts_shard_sequence(cp: int, load_balance: bool, dim: int) -> None:
    x = torch.randn(4 * cp, 3, 4 * cp)
    shards = [shard_sequence(x, dim, r, cp, load_balance) for r in range(cp)]
    assert torch.equal(join_shards(shards, dim, load_balance), x)
    positions = [sequence_positions(x.size(dim), r, cp, load_balance) for r in range(cp)]
    assert sorted(torch.cat(positions).tolist()) == list(range(x.size(dim)))
    for r in range(cp):  # the positions say where each local token sits globally
        assert torch.equal(shards[r], x.index_select(dim, positions[r]))


def test_sharding_errors() -> None:
    with pytest.raises(ValueError, match=r"cannot be split into 2\*cp = 4 chunks.*multiple of 4.*load_balance=False"):
        shard_sequence(torch.zeros(2, 6), 1, 0, 2, True)
    with pytest.raises(ValueError, match=r"seq_len = 10 cannot be split into cp = 4 chunks"):
        sequence_positions(10, 0, 4, False)
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, 2\), got 2"):
        shard_sequence(torch.zeros(8), 0, 2, 2)
    with pytest.raises(ValueError, match="cp_size must be a positive int, got 0"):
        sequence_positions(8, 0, 0)


@pytest.mark.parametrize("cp", [1, 2, 3, 5])
@pytest.mark.parametrize("load_balance", [True, False])
def test_block_plan_matches_global_causal_mask(cp: int, load_balance: bool) -> None:
    """The planned rectangle (full / lower-triangular / skipped) equals the true mask from global positions."""
    seq = 4 * cp
    pos = [sequence_positions(seq, r, cp, load_balance) for r in range(cp)]
    n = seq // cp
    work = []
    for rank in range(cp):
        visible = 0
        for src in range(cp):
            truth = pos[src][None, :] <= pos[rank][:, None]
            planned = torch.zeros(n, n, dtype=torch.bool)
            blk = block_plan(rank, src, cp, n, True, load_balance)
            if blk is not None:
                planned[blk.q, blk.kv] = torch.ones(n, n, dtype=torch.bool).tril() if blk.causal else True
            assert torch.equal(planned, truth), f"cp={cp} lb={load_balance} rank={rank} src={src}"
            visible += int(truth.sum())
        work.append(visible)
    if load_balance:
        assert len(set(work)) == 1, f"unequal causal work per rank: {work}"
    assert block_plan(0, 1, cp, n, False, load_balance).causal is False  # non-causal: everything visible


# ---------------------------------------------------------------------------------------------------------------
# Single process (cp = 1, no process group): the block math itself, and validation


@pytest.mark.parametrize("algorithm", ["ring", "allgather"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "dv", "scale"), [(2, 2, 8, None), (4, 2, 8, 0.25), (3, 1, 5, None)])
def test_single_process_matches_sdpa(
    algorithm: str, is_causal: bool, heads: int, kv_heads: int, dv: int, scale
) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 12, 8, generator=g)
    k = torch.randn(2, kv_heads, 12, 8, generator=g)
    v = torch.randn(2, kv_heads, 12, dv, generator=g)
    dout = torch.randn(2, heads, 12, dv, generator=g)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*ours, is_causal=is_causal, algorithm=algorithm, scale=scale)
    expected = F.scaled_dot_product_attention(*ref, is_causal=is_causal, scale=scale, enable_gqa=heads != kv_heads)
    out.backward(dout)
    expected.backward(dout)
    torch.testing.assert_close(out, expected, atol=TOL, rtol=0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, atol=TOL, rtol=0)


def test_row_tiles_bound_the_scores_and_see_only_visible_keys(monkeypatch) -> None:
    """A block's query rows are cut into tiles whose fp32 scores fit ``SCORE_TILE_BYTES``; a causal block's tile
    sees the keys up to its last row. At a budget of 5 rows of a 2 x 3 x 12-key block: 12 rows in 3 tiles."""
    q, k = torch.zeros(2, 3, 12, 8), torch.zeros(2, 1, 12, 8)
    assert context._row_tiles(q, k, True) == [(0, 12, 12)]  # the default budget: one tile
    monkeypatch.setattr(context, "SCORE_TILE_BYTES", 5 * 2 * 3 * 12 * 4)
    assert context._row_tiles(q, k, True) == [(0, 5, 5), (5, 10, 10), (10, 12, 12)]
    assert context._row_tiles(q, k, False) == [(0, 5, 12), (5, 10, 12), (10, 12, 12)]


@pytest.mark.parametrize(("is_causal", "window", "sinks"), [(True, None, False), (True, 4, True), (False, None, False)])
def test_single_process_row_tiles_match_sdpa(monkeypatch, is_causal: bool, window: int | None, sinks: bool) -> None:
    """The math path tile by tile (3 query rows at a time, GQA) gives the attention and its gradients."""
    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(2, h, 13, 8, generator=g) for h in (4, 2, 2, 4))
    sink = torch.randn(4, generator=g)
    monkeypatch.setattr(context, "SCORE_TILE_BYTES", 3 * 2 * 4 * 13 * 4)
    assert len(context._row_tiles(q, k, is_causal)) == 5
    ours = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    ref = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out = context_parallel_attention(*ours[:3], is_causal=is_causal, window=window, sinks=ours[3] if sinks else None,
                                     load_balance=False)  # 13 rows: an odd length
    expected = (sink_attention(*ref[:3], ref[3], is_causal, window) if sinks or window else
                F.scaled_dot_product_attention(*ref[:3], is_causal=is_causal, enable_gqa=True))
    (out * dout).sum().backward()
    (expected * dout).sum().backward()
    torch.testing.assert_close(out, expected, atol=TOL, rtol=0)
    for a, b in zip(ours[:4] if sinks else ours[:3], ref):
        torch.testing.assert_close(a.grad, b.grad, atol=TOL, rtol=0)


@pytest.mark.parametrize(("is_causal", "window"), [(True, None), (True, 3), (False, None)])
def test_single_process_attention_sinks_match_an_extra_softmax_column(is_causal: bool, window: int | None) -> None:
    """gpt-oss's sinks: the lse-rescaled output and its gradients (q, k, v and the sinks themselves)."""
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, h, 10, 8, generator=g) for h in (4, 2, 2, 4))
    sinks = torch.randn(4, generator=g)
    ours = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = context_parallel_attention(*ours[:3], is_causal=is_causal, window=window, sinks=ours[3])
    expected = sink_attention(*ref[:3], ref[3], is_causal, window)
    (out * dout).sum().backward()
    (expected * dout).sum().backward()
    torch.testing.assert_close(out, expected, atol=TOL, rtol=0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, atol=TOL, rtol=0)


def test_sdpa_helper_is_plain_sdpa_without_a_group() -> None:
    assert context_parallel_sdpa() is F.scaled_dot_product_attention


def _err(**overrides) -> str:
    args = {"q": torch.randn(1, 4, 8, 16), "k": torch.randn(1, 2, 8, 16), "v": torch.randn(1, 2, 8, 16)}
    args.update(overrides)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError) as info:
        context_parallel_attention(q, k, v, **args)
    return str(info.value)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"algorithm": "tree"}, r"algorithm must be one of \('ring', 'allgather', 'ulysses'\), got 'tree'"),
        ({"attn_mask": torch.ones(8, 8, dtype=torch.bool)}, r"attn_mask is not supported.*is_causal=True/False"),
        ({"documents": torch.zeros(1, 7, dtype=torch.long)}, r"documents must be an integer tensor of shape \(batch=1, "
                                                             r"whole sequence=8\)"),
        ({"attendable": torch.ones(1, 8)}, r"attendable must be a boolean tensor"),
        ({"algorithm": "ulysses", "ulysses_group": object()}, r"ulysses_group is for the hybrid"),
        ({"k": torch.randn(1, 2, 6, 16), "v": torch.randn(1, 2, 6, 16)}, r"q and k local sequence lengths differ"),
        ({"v": torch.randn(1, 2, 4, 16)}, r"q, k, v shapes do not match"),
        ({"k": torch.randn(1, 2, 8, 32)}, r"q, k, v shapes do not match"),
        ({"k": torch.randn(2, 2, 8, 16), "v": torch.randn(2, 2, 8, 16)}, r"q, k, v shapes do not match"),
        ({"k": torch.randn(1, 3, 8, 16), "v": torch.randn(1, 3, 8, 16)}, r"q heads \(4\) must be a multiple of k/v"),
        ({"q": torch.randn(4, 8, 16)}, r"q must be a floating-point tensor of shape \(batch, heads, local_seq"),
        ({"v": torch.randn(1, 2, 8, 16, dtype=torch.float64)}, r"must share dtype and device"),
        (
            {"q": torch.randn(1, 4, 0, 16), "k": torch.randn(1, 2, 0, 16), "v": torch.randn(1, 2, 0, 16)},
            r"local sequence length 0",
        ),
        ({"scale": "0.1"}, r"scale must be a float or None"),
        ({"sinks": torch.randn(3)}, r"sinks must be a tensor of one logit per query head, shape \(4,\), got"),
    ],
)
def test_bad_inputs_raise_clear_errors(overrides: dict, pattern: str) -> None:
    assert re.search(pattern, _err(**overrides)), _err(**overrides)


@pytest.mark.parametrize("load_balance", [False, True])
def test_odd_local_length_is_fine_in_one_process_or_without_load_balance(load_balance: bool) -> None:
    q = torch.randn(1, 2, 7, 8)  # one process: nothing to balance, so no even split is asked for
    out = context_parallel_attention(q, q, q, is_causal=True, load_balance=load_balance)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, is_causal=True), atol=TOL, rtol=0)


def test_sdpa_helper_rejects_bad_algorithm() -> None:
    with pytest.raises(ValueError, match="algorithm must be one of"):
        context_parallel_sdpa(algorithm="tree")  # type: ignore[arg-type]


def test_case_names_are_readable() -> None:
    assert str(Case("ring", True, False, 8, 4, 2, scale=0.5)) == "ring causal=True lb=False S=8 H=4 Hkv=2 scale=0.5"


@pytest.mark.parametrize("options", [{}, {"weight": True}, {"label_smoothing": 0.1}, {"ignore_index": 3},
                                     {"dtype": torch.bfloat16}], ids=str)
def test_token_mean_cross_entropy_is_torchs_mean_on_one_rank(options):
    """On a group of one the token-weighted cross-entropy is ``F.cross_entropy``'s mean, with class weights, label
    smoothing, another ignore_index, and in bf16 (the count kept in fp32: 601 counted tokens are no bf16 number)."""
    import torch.distributed as dist

    from lightning_par.parallel.token_loss import token_mean_cross_entropy

    g = torch.Generator().manual_seed(0)
    dtype = options.get("dtype", torch.float32)
    logits = torch.randn(1003, 10, generator=g).to(dtype).requires_grad_()
    target = torch.randint(0, 10, (1003,), generator=g)
    ignore = options.get("ignore_index", -100)
    target[torch.arange(1003) % 5 < 2] = ignore  # 601 counted
    kwargs = {"ignore_index": ignore, "label_smoothing": options.get("label_smoothing", 0.0)}
    if options.get("weight"):
        kwargs["weight"] = torch.rand(10, generator=g).to(dtype)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ours = token_mean_cross_entropy(dist.group.WORLD, logits, target, **kwargs)
    finally:
        dist.destroy_process_group()
    # torch's mean of the same values in fp32 (torch's own bf16 mean is further from it than ours: its sum rounds)
    exact = logits.detach().float().requires_grad_()
    torchs = F.cross_entropy(exact, target, **{k: v.float() if k == "weight" else v for k, v in kwargs.items()})
    tol = 1e-6 if dtype == torch.float32 else 2**-7  # bf16: one rounding of the result
    assert ours.dtype == dtype
    assert abs(float(ours) - float(torchs)) <= tol * float(torchs)
    ours.backward()
    torchs.backward()
    assert (logits.grad.float() - exact.grad).abs().max() <= tol * float(exact.grad.abs().max())
