"""QLoRA (``quantize_base="nf4"``, torchao's NF4Tensor) on CPU: a tiny Llama (wide enough for NF4's blocks) with
PEFT LoRA adapters, its frozen block weights in NF4.

- Parity: FSDP2 over 2 ranks, a pipeline over 2 stages, tensor parallelism over 2 ranks (with and without sequence
  parallelism), FSDP2 with activation checkpointing and with CPU offload, context parallelism over 2 ranks (FSDP
  over them), and over 4 processes FSDP2 x tp2, FSDP2 x pp2, pp2 x tp2 and HSDP 2 x 2, equal one QLoRA process (the
  torch-level ``quantize_base_weights`` applied by hand, plain Lightning) on the same data: losses at every step and
  final weights within 1e-5 (fp32 adapters; the NF4 codes are the same bits: quantization is deterministic and
  happens on the whole weight before tensor parallelism or FSDP cuts it, and a cut piece dequantizes to exactly
  its rows or columns of the whole weight).
- bf16-true: in step with one bf16 QLoRA process within bf16 rounding.
- Memory: the NF4 base weights each rank holds under FSDP2 (codes, int8 scales, scale factors) measured against
  bf16's bytes for the same elements: <= 0.30 (0.258 measured, also under FSDP2 x tp2); the gathered weight a
  layer runs with is NF4 too.
- Quality: the losses of a short fine-tune within a stated tolerance of LoRA over the unquantized weights.
- From a pretrained checkpoint (``pretrained=``, the model on the meta device): quantized shard by shard as it is
  read, under FSDP2, a pipeline, tp2 and FSDP2 x tp2, in parity with one process that quantized the same model;
  peak memory measured.
- The planner: NF4 bytes in the profile and the predictions; the command line's ``--quantize-base``.
- Checkpoints and export: adapter-only checkpoints (no NF4 in them) and full ones (everything but the frozen NF4
  weights, which are fingerprinted) resumed under another layout, other base weights refused; the merged model
  (adapters folded into the dequantized weights) loaded by ``from_pretrained``.
- Refused on every rank: a value that is not a format, float8 with it, a model on the meta device; a model
  quantized by bitsandbytes where FSDP or tp would cut its weights. Refused before any collective: a tensor-parallel
  style other than column- or row-parallel on an NF4 weight, a weight NF4 cannot cut exactly over tp.
"""

from __future__ import annotations

import functools
import math

import lightning.pytorch as pl
import pytest
import torch
from launch import launch
from workers import SEED, assert_parity, assert_raised_on_every_rank, fit_reference, max_loss_diff

from lightning_par import NDParallelStrategy
from lightning_par._compat import meta_nf4
from lightning_par.techniques.quantize.nf4_weights import (
    NF4_CUT,
    _nf4,
    dequantized,
    is_nf4,
    nf4_bytes,
    nf4_cut,
    quantize_base_weights,
    why_not_cut,
    why_not_quantizable,
)
from lightning_par.techniques.quantize.quantize_base import QuantizeBase

pytest.importorskip("peft", reason="needs peft (the dev extra)")
pytest.importorskip("torchao", reason="quantize_base needs torchao")

from finetune_workers import LoRALM  # noqa: E402
from hf_models import tiny_hf_model  # noqa: E402
from qlora_workers import (  # noqa: E402
    BF16_STEPS,
    BIG,
    PROBE,
    STEPS,
    WIDE,
    QLoRAByHand,
    plain_weights,
    pretrained_memory,
    save_base,
    world2,
    world4,
)

BLOCK_WEIGHTS = 4 * 7  # q, k, v, o, gate, up, down of each of the 4 blocks


class FinalWeights(pl.Callback):
    """The weights at the end of training, NF4 ones dequantized in place (``fit_reference``'s ``clone()`` of an
    NF4 tensor would quantize its dequantized values again: torchao's ``clone`` is ``to_nf4(dequantized)``)."""

    def on_train_end(self, trainer, pl_module) -> None:
        self.weights = plain_weights(pl_module.state_dict())


@functools.cache
def reference(module_cls: type = QLoRAByHand, precision: str = "32-true", steps: int = STEPS) -> dict:
    final = FinalWeights()
    out = fit_reference(module_cls=module_cls, max_steps=steps, callbacks=[final], precision=precision, **WIDE)
    out["weights"] = final.weights
    return out


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qlora")
    save_base(str(tmp / "base"))  # the runs' base model as a Hugging Face checkpoint, for pretrained=
    ranks = launch(2, world2, str(tmp), timeout=900)
    ranks[0]["merged"] = tmp / "merged"
    return ranks


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qlora4")
    save_base(str(tmp / "base"))
    return launch(4, world4, str(tmp), timeout=900)


def test_only_frozen_block_linear_weights_become_nf4():
    pl.seed_everything(SEED, verbose=False)
    model = QLoRAByHand(**WIDE)
    assert len(model.quantized) == BLOCK_WEIGHTS and not model.left
    nf4 = {n for n, p in model.named_parameters() if is_nf4(p)}
    assert nf4 == set(model.quantized)
    assert all(n.endswith(".base_layer.weight") for n in nf4)  # PEFT's frozen base layers, not the adapters
    assert not any(p.requires_grad for n, p in model.named_parameters() if n in nf4)
    assert not any(is_nf4(p) for n, p in model.named_parameters() if "lora_" in n or "embed" in n or "lm_head" in n
                   or "norm" in n)
    # NF4 with its double-quantized scales: 0.516 bytes per weight
    w = dict(model.named_parameters())[f"{PROBE}.weight"]
    assert nf4_bytes(w) / w.numel() == pytest.approx(0.516, abs=1e-3)
    # a second pass changes nothing; quantization is deterministic (the same model quantizes to the same codes)
    assert quantize_base_weights(model, ["model.base_model.model.model.layers"]) == ([], {})
    pl.seed_everything(SEED, verbose=False)
    again = dict(QLoRAByHand(**WIDE).named_parameters())[f"{PROBE}.weight"]
    assert torch.equal(w.quantized_data, again.quantized_data) and torch.equal(w.quantized_scalers,
                                                                                again.quantized_scalers)


def test_weights_nf4_cannot_take_are_left_and_named():
    layer = torch.nn.Linear(32, 32).requires_grad_(False)
    assert "not whole blocks of 16384" in why_not_quantizable(layer.weight)
    big = torch.nn.Linear(256, 64).requires_grad_(False)  # 16384 weights: one block of scales, not two shards
    assert why_not_quantizable(big.weight) is None
    assert "x 2 shards" in why_not_quantizable(big.weight, shards=2)
    root = torch.nn.Sequential(torch.nn.Sequential(layer, big, torch.nn.Linear(256, 64)))
    done, left = quantize_base_weights(root, ["0"])
    assert done == ["0.1.weight"] and list(left) == ["0.0.weight"]  # the trainable 0.2 is not touched
    assert type(root[0][2].weight) is torch.nn.Parameter and is_nf4(root[0][1].weight)


@pytest.mark.parametrize("value", ["int4", "NF4", 4, True])
def test_a_bad_value_is_refused(value):
    with pytest.raises(ValueError, match=rf"quantize_base={value!r} is not a 4-bit format: choose one of \['nf4'\]"):
        NDParallelStrategy(quantize_base=value)


def test_quantize_base_with_float8_is_refused():
    with pytest.raises(ValueError, match=r"quantize_base='nf4' with float8='rowwise'"):
        NDParallelStrategy(quantize_base="nf4", float8="rowwise")


@pytest.mark.parametrize("case, pattern", [
    ("bad_value", r"quantize_base='int4' is not a 4-bit format"),
    ("with_float8", r"quantize_base='nf4' with float8='tensorwise'"),
    ("meta_device", r"quantize_base='nf4': the frozen linear weights of the blocks are on the meta device "
                    r"\('model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight' and 27 more\)"),
])
def test_refused_on_every_rank(w2, case, pattern):
    assert_raised_on_every_rank([r["errors"] for r in w2], case, pattern)


@pytest.mark.parametrize("layout", ["fsdp2", "pp2", "tp2", "tp2_sp", "fsdp2_ac", "fsdp2_offload", "cp2",
                                    "replicate2"])
def test_qlora_layouts_equal_one_qlora_process(w2, layout):
    _assert_qlora_parity(w2, layout)


@pytest.mark.parametrize("layout", ["fsdp2_tp2", "fsdp2_pp2", "pp2_tp2", "hsdp"])
def test_qlora_combinations_over_4_processes_equal_one_qlora_process(w4, layout):
    _assert_qlora_parity(w4, layout)


def _assert_qlora_parity(ranks: list[dict], layout: str) -> None:
    assert_parity(ranks[0][layout], reference(), steps=STEPS)
    held = [n for r in ranks for n in r[layout]["base"]["nf4_names"]]
    assert len(set(held)) == BLOCK_WEIGHTS  # every block's frozen linear weights are NF4 on the ranks holding them
    assert not any(r[layout]["base"]["trainable_quantized"] for r in ranks)


def test_bf16_qlora_under_fsdp2_follows_one_bf16_qlora_process(w2):
    """bf16-true: the weights built in bf16 are quantized from bf16 (NF4 of dtype bf16, dequantized to bf16), the
    adapters train in bf16. FSDP2 reduces the bf16 gradients in another order than one process sums them: the
    losses stay within 1e-3 of one bf16 QLoRA process (measured: 1.7e-4; bf16's unit roundoff is 3.9e-3)."""
    result, ref = w2[0]["fsdp2_bf16"], reference(precision="bf16-true", steps=BF16_STEPS)
    assert max_loss_diff(result["losses"], ref["losses"]) <= 1e-3
    for r in w2:
        assert r["fsdp2_bf16"]["base"]["nf4_dtypes"] == ["torch.bfloat16"]
        assert r["fsdp2_bf16"]["base"]["nf4_bytes"] / r["fsdp2_bf16"]["base"]["bf16_bytes"] <= 0.30


def test_fsdp_shards_are_the_one_process_codes_and_gather_as_nf4(w2):
    """Each rank's shard holds its rows of the codes one process computes for the whole weight (quantized before
    the cut), and the weight a layer runs with after FSDP's all-gather is an NF4 tensor, not a dequantized one."""
    pl.seed_everything(SEED, verbose=False)
    whole = dict(QLoRAByHand(**WIDE).named_parameters())[f"{PROBE}.weight"]
    shards = [r["fsdp2"]["base"]["probe_codes"] for r in w2]
    assert torch.equal(torch.cat(shards), whole.quantized_data)
    for r in w2:
        assert r["fsdp2"]["base"]["gathered_types"] and set(r["fsdp2"]["base"]["gathered_types"]) == {"NF4Tensor"}


@pytest.mark.parametrize("layout, ranks", [("fsdp2", 2), ("tp2", 2), ("fsdp2_tp2", 4)])
def test_per_rank_base_weight_bytes(request, layout, ranks):
    """Measured per rank: the NF4 shards' bytes (codes, scales, factors, mean) over bf16's bytes for the same
    elements: 0.258 (0.5 + 1/64 + 4/16384 bytes per weight, over 2), under FSDP2, tp2 (the row-parallel pieces'
    second-level factors repeated: no more bytes at these shapes) and both."""
    for r in request.getfixturevalue("w2" if ranks == 2 else "w4"):
        b = r[layout]["base"]
        ratio = b["nf4_bytes"] / b["bf16_bytes"]
        assert ratio <= 0.30, ratio
        assert ratio == pytest.approx(0.258, abs=2e-3)
        # sharded: 1 / ranks of the block weights' elements on each rank (2 bytes each in bf16)
        assert b["bf16_bytes"] == 2 * sum(v.numel() for k, v in reference()["weights"].items()
                                          if ".base_layer." in k and "layers." in k) // ranks


def test_qlora_trains_like_lora_over_unquantized_weights():
    """A short fine-tune: QLoRA's loss at every step within 0.5 % of LoRA's over the fp32 weights it quantized
    (measured: 0.16 %), while NF4 really changed the numbers, and both trained."""
    q, lora = reference(), reference(LoRALM)
    base = [k for k in lora["weights"] if ".base_layer." in k and "layers." in k]
    assert max(float((q["weights"][k] - lora["weights"][k]).abs().max()) for k in base) > 1e-3  # quantized
    assert max_loss_diff(q["losses"], lora["losses"]) > 0
    assert max(abs(a - b) / b for a, b in zip(q["losses"], lora["losses"])) < 0.005
    assert q["losses"][-1] < q["losses"][0] and lora["losses"][-1] < lora["losses"][0]
    assert all(torch.equal(v, dequantized(v)) for v in q["weights"].values())  # plain tensors for comparison


def test_adapter_only_checkpoint_resumes_under_another_layout(w2):
    """``save_trainable_only`` under FSDP2 at step 3 writes the adapters and their optimizer state, no NF4 weight;
    resumed under the pipeline (the base weights quantized again from the same initial values: the same codes), it
    continues as the uninterrupted run."""
    from lightning_par.checkpoint import stored_shapes

    stored = stored_shapes(w2[0]["adapter_checkpoint"], "state_dict.")
    assert stored and all("lora_" in k for k in stored), sorted(stored)[:4]
    assert_parity(w2[0]["adapters_resumed_pp2"], reference(), steps=STEPS - 3)


def test_a_full_checkpoint_leaves_the_nf4_weights_out_and_resumes_under_another_layout(w2):
    """A full checkpoint (``save_trainable_only`` off) of the FSDP2 run at step 3 holds every tensor but the frozen
    NF4 base weights (never changed by training, cut differently by every layout), and a fingerprint of each
    (float64 sum and sum of squares of its values over the whole weight); resumed under tp2, whose model quantized
    the same initial weights, training continues exactly as the uninterrupted run."""
    from lightning_par import checkpoint as ckpt

    stored = ckpt.stored_shapes(w2[0]["full_checkpoint"], "state_dict.")
    fingerprints = ckpt.read_meta(w2[0]["full_checkpoint"])[ckpt.QUANTIZED]
    assert len(fingerprints) == BLOCK_WEIGHTS and not set(fingerprints) & set(stored)
    assert any("lora_A" in k for k in stored) and any("embed_tokens" in k for k in stored)
    whole = reference()["weights"]
    some = next(iter(fingerprints))
    values = whole[some].double()
    assert fingerprints[some] == pytest.approx((float(values.sum()), float(values.square().sum())), rel=1e-9)
    assert_parity(w2[0]["full_resumed_tp2"], reference(), steps=STEPS - 3)
    # consolidating it for inference says what it lacks (a strict load_from_checkpoint would refuse it)
    from lightning_par import consolidate_checkpoint

    with pytest.warns(UserWarning, match=r"leaves out its 28 frozen 4-bit base weights .* save_hf_pretrained"):
        consolidated = consolidate_checkpoint(w2[0]["full_checkpoint"])
    assert not set(fingerprints) & set(consolidated["state_dict"])


def test_resuming_a_full_checkpoint_on_other_base_weights_is_refused(tmp_path):
    """The checks behind resuming: other base weights (their fingerprints differ), base weights quantized now but
    stored unquantized, and quantized then but not now: each refused naming a weight and the fix."""
    from lightning_par import checkpoint as ckpt

    here = {"a.weight": (1.0, 2.0), "b.weight": (3.0, 4.0)}
    ckpt.check_quantized_weights(tmp_path, here, {k: (v[0] * (1 + 1e-12), v[1]) for k, v in here.items()}, set())
    with pytest.raises(ValueError, match=r"saved from other base weights: 'b.weight' \(and 0 more\) sums to 3.0 "
                                         r"there and 3.5 in this model.*Pass the same pretrained="):
        ckpt.check_quantized_weights(tmp_path, here, {"a.weight": (1.0, 2.0), "b.weight": (3.5, 4.0)}, set())
    with pytest.raises(ValueError, match=r"'a.weight' and 1 more are quantized in this run \(quantize_base\) and "
                                         r"stored unquantized"):
        ckpt.check_quantized_weights(tmp_path, {}, here, {"a.weight", "b.weight", "c"})
    with pytest.raises(ValueError, match=r"'a.weight' and 1 more were 4-bit base weights .* Resume with the same "
                                         r"quantize_base on a layout that quantizes them"):
        ckpt.check_quantized_weights(tmp_path, here, {}, set())


@pytest.mark.parametrize("layout", ["pretrained_fsdp2", "pretrained_pp2", "pretrained_tp2", "pretrained_fsdp2_tp2"])
def test_pretrained_checkpoint_quantized_shard_by_shard_resumes_like_one_qlora_process(request, layout):
    """``pretrained=`` with the model on the meta device: the blocks' frozen weights become NF4 placeholders before
    FSDP cuts them; each rank then reads one whole weight at a time from the Hugging Face checkpoint, quantizes it
    as one process does and keeps its rows (FSDP2) or the whole weight (its pipeline stage). Resumed from the
    adapters of step 3, the run continues exactly as one QLoRA process that quantized the same base model in
    memory (losses and final weights within 1e-5; the dequantized base weights bit-equal). Under tp2 each rank cuts
    its rows or columns from the whole weight's codes (then, under FSDP2 x tp2, its FSDP rows of that piece)."""
    ranks = request.getfixturevalue("w4" if layout == "pretrained_fsdp2_tp2" else "w2")
    result = ranks[0][layout]
    assert_parity(result, reference(), steps=STEPS - 3)
    base = [k for k in result["weights"] if ".base_layer." in k and "layers." in k]
    assert base and all(torch.equal(result["weights"][k], reference()["weights"][k]) for k in base)
    held = [n for r in ranks for n in r[layout]["base"]["nf4_names"]]
    assert len(set(held)) == BLOCK_WEIGHTS


def test_pretrained_load_never_holds_the_model_unquantized(tmp_path, monkeypatch):
    """Measured on each of 2 ranks: the peak private memory from setup to the first step while a 184 MiB (fp32)
    Llama is built on the meta device, sharded and read from its checkpoint into NF4 shards. This rank's share:
    half of the unquantized embeddings and head (64 MiB over 2), NF4 shards of the block weights (about 8 MiB), and
    one whole weight in flight (8 MiB, with its NF4 copy): about 0.25 x the checkpoint; the whole model in fp32 on
    one rank would be 1 x, its fp32 shard 0.5 x. Besides it, torchao's quantizer needs a workspace of fixed size
    (2**20 values at a time, 16 distances each: about 140 MiB here, whatever the weight), measured alone on the
    same rank and counted apart."""
    torch.manual_seed(0)
    tiny_hf_model(**BIG).save_pretrained(tmp_path / "big")
    model_bytes = (tmp_path / "big" / "model.safetensors").stat().st_size
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # freed blocks go back to the system (see test_pretrained)
    results = launch(2, pretrained_memory, str(tmp_path / "big"), fresh_interpreter=True)
    for rank, r in enumerate(results):
        held = r["anon_bytes"] - r["workspace_bytes"]
        print(f"rank {rank}: checkpoint {model_bytes / 2**20:.1f} MiB, setup peak private memory "
              f"{r['anon_bytes'] / 2**20:.1f} MiB, of which the quantizer's workspace "
              f"{r['workspace_bytes'] / 2**20:.1f} MiB; the rest {held / 2**20:.1f} MiB ({held / model_bytes:.2f} x), "
              f"{r['nf4']} NF4 weights")
        assert r["nf4"] == 3 * 7
        assert 0 < r["workspace_bytes"] < 0.25 * 2**30  # a fixed workspace, not a copy of the model
        assert held <= 0.35 * model_bytes
    assert results[0]["losses"] == results[1]["losses"] and all(map(math.isfinite, results[0]["losses"]))


def test_merged_model_loads_with_from_pretrained(w2):
    """``save_hf_pretrained`` from the FSDP2 QLoRA run: the adapters merged into the dequantized base weights,
    written in the model's dtype; ``from_pretrained``'s logits equal the one-process QLoRA model's."""
    from transformers import AutoModelForCausalLM

    # the gather dequantized the base weights only while it ran: the model holds its NF4 weights again
    assert w2[0]["fsdp2"]["nf4_after_merge"] == len(w2[0]["fsdp2"]["base"]["nf4_names"]) > 0
    merged = AutoModelForCausalLM.from_pretrained(w2[0]["merged"]).eval()
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    pl.seed_everything(SEED, verbose=False)
    qlora = QLoRAByHand(**WIDE).eval()
    missing = qlora.load_state_dict({k: v for k, v in reference()["weights"].items() if ".base_layer." not in k},
                                    strict=False).missing_keys
    assert all(".base_layer." in k for k in missing)  # the NF4 weights: the same codes (same seed, checked above)
    probe = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (merged(input_ids=probe).logits - qlora(probe)).abs().max() <= 1e-5


@pytest.mark.parametrize("shape", [(256, 64), (128, 512), (64, 14336), (96, 1024), (1792, 512)])
def test_nf4_pieces_are_the_whole_weights_rows_and_columns_bit_for_bit(shape):
    """Tensor parallelism's pieces of an NF4 weight (``nf4_cut``): rows (column-parallel) and columns (row-parallel)
    over 2 and 4 ranks, each then cut into FSDP's 2 row shards: every piece dequantizes to exactly the same rows or
    columns of the whole NF4 weight, FSDP's rows of a piece (torch.chunk, torchao's own cut) to the piece's rows;
    a meta placeholder's pieces have the same inner tensors' shapes. 14336 columns over 4 (a Llama-3 MLP's 224
    blocks a row, its scale blocks of 256 straddling rows) need scale blocks of 8."""
    whole = _nf4().to_nf4(torch.randn(shape, dtype=torch.bfloat16), 64, 256)
    values = whole.get_original_weight()
    meta = meta_nf4(shape, torch.bfloat16, 64, 256)  # the placeholder pretrained= fills
    cut_any = False
    for dim in (0, 1):
        for parts in (2, 4):
            for shards_after in (1, 2):
                if why_not_cut(whole, dim, parts, shards_after) is not None:
                    continue
                cut_any = True
                for index in range(parts):
                    piece = nf4_cut(whole, dim, parts, index, shards_after)
                    expected = values.chunk(parts, dim)[index]
                    assert torch.equal(piece.get_original_weight(), expected), (dim, parts, index)
                    if shards_after > 1:
                        rows = torch.chunk(piece, shards_after, 0)  # FSDP2's cut (torchao's aten.split)
                        assert all(torch.equal(r.get_original_weight(), e)
                                   for r, e in zip(rows, expected.chunk(shards_after, 0)))
                    ghost = nf4_cut(meta, dim, parts, index, shards_after)
                    assert ghost.is_meta and ghost.scaler_block_size == piece.scaler_block_size
                    assert all(getattr(ghost, n).shape == getattr(piece, n).shape
                               for n in piece.__tensor_flatten__()[0])
    assert cut_any
    if shape == (64, 14336):
        assert nf4_cut(whole, 1, 4, 0).scaler_block_size == 8


def test_nf4_weights_tensor_parallelism_cannot_cut_are_refused_naming_them():
    """Before any collective: a style other than column- or row-parallel on an NF4 weight, NF4 weights without the
    cut, columns that are not whole 64-value blocks on every rank, rows FSDP cannot then cut: one line per reason,
    naming the first layer and how many more."""
    from lightning_par.techniques.tensor.tensor import quantized_cut_problems

    model = torch.nn.ModuleDict({name: torch.nn.Linear(cols, rows, bias=False) for name, (rows, cols) in {
        "gathered": (256, 64), "narrow": (256, 64), "also_narrow": (256, 64), "odd_rows": (258, 128)}.items()})
    model.requires_grad_(False)
    done, _ = quantize_base_weights(model, ["gathered", "narrow", "also_narrow", "odd_rows"])
    assert len(done) == 3  # 258 x 128 is no whole number of 64 x 256 blocks: left as it is
    plan = {"gathered": "colwise_rep", "narrow": "rowwise", "also_narrow": "rowwise", "odd_rows": "colwise"}
    problems = quantized_cut_problems(model, plan, 2, NF4_CUT)
    assert len(problems) == 2, problems
    assert "'gathered': a quantized weight (quantize_base) with the style 'colwise_rep'" in problems[0]
    assert "'narrow' (and 1 more): a quantized weight 'rowwise' over tp=2: (256, 64) cut into 2 pieces of its " \
           "columns (each row's piece whole 64-value NF4 blocks) is not possible" in problems[1]
    assert quantized_cut_problems(model, {"narrow": "colwise"}, 2, NF4_CUT) == []
    assert "cut into 2 pieces of 128 rows, each then into 3 FSDP row shards" in quantized_cut_problems(
        model, {"narrow": "colwise"}, 2, NF4_CUT, shards_after=3)[0]
    # FSDP's rows of a piece must be whole 64-value blocks too: 512 x 32 over tp2, then 256 shards of one row
    narrow_rows = _nf4().to_nf4(torch.randn(512, 32), 64, 256)
    assert why_not_cut(narrow_rows, 0, 2, 128) is None
    assert "into 256 FSDP row shards of whole 64-value blocks" in why_not_cut(narrow_rows, 0, 2, 256)
    assert "no cut for it: quantize it through the strategy's quantize_base=" in quantized_cut_problems(
        model, {"narrow": "colwise"}, 2, None)[0]


def test_a_model_quantized_by_bitsandbytes_is_refused_where_it_would_be_cut():
    """bitsandbytes is no dependency: its layer is recognized by name (a stand-in class of the same name here)."""
    from lightning_par.dims import ParallelDims
    from lightning_par.techniques.quantize.nf4_weights import refuse_bitsandbytes

    class Linear4bit(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Sequential(Linear4bit(8, 8)))
    refuse_bitsandbytes(model, ParallelDims(dp_shard=1, pp=2))  # a pipeline moves whole layers: it composes
    for dims in (ParallelDims(dp_shard=2), ParallelDims(dp_shard=1, tp=2), ParallelDims(dp_shard=1, cp=2)):
        with pytest.raises(ValueError, match=r"0.0 \(Linear4bit\) is quantized by bitsandbytes.* pass "
                                             r"quantize_base='nf4' to the strategy"):
            refuse_bitsandbytes(model, dims)


def test_the_start_up_summary_counts_nf4_bytes():
    from lightning_par.strategies.startup_summary import local_parameter_bytes

    pl.seed_everything(SEED, verbose=False)
    model = QLoRAByHand(**WIDE)
    params = dict(model.named_parameters())
    nbytes, numel = local_parameter_bytes(model)
    assert numel == sum(p.numel() for p in params.values())
    assert nbytes == sum(nf4_bytes(p) if is_nf4(p) else 4 * p.numel() for p in params.values())


def test_a_model_with_nothing_frozen_trains_unquantized_with_a_warning():
    """The option on a model whose weights all train (no adapters, nothing frozen): nothing to quantize, which is
    no error (the run is correct, only not QLoRA); a warning says what QLoRA quantizes. Frozen weights NF4 cannot
    cut into whole blocks are named."""
    from lightning_par.dims import ParallelDims
    from lightning_par.techniques.technique import Target

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(256, 128), torch.nn.Linear(32, 32)])

    model = Tiny()
    technique = QuantizeBase("nf4")
    with pytest.warns(UserWarning, match=r"quantized no weight: .* QLoRA quantizes frozen base weights: freeze them"):
        technique.apply(Target(model, torch.device("cpu"), "32-true", block_list="blocks"), ParallelDims(dp_shard=1))
    assert not any(is_nf4(p) for p in model.parameters())
    model.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"left 1 frozen linear weights unquantized: blocks.1.weight \(\(32, 32\)"):
        technique.apply(Target(model, torch.device("cpu"), "32-true", block_list="blocks"), ParallelDims(dp_shard=1))
    assert technique.layers == ["blocks.0.weight"] and is_nf4(model.blocks[0].weight)
    assert technique.describe(ParallelDims(dp_shard=1)) == "nf4 base weights (1 frozen linear weights)"


# ---- the planner prices the 4-bit weights ---------------------------------------------------------------------------


def _qlora_profile(quantized: bool):
    from lightning_par.costs.profile import profile_model
    from lightning_par.techniques.quantize.quantize_base import QuantizeOptions

    pl.seed_everything(SEED, verbose=False)
    module = LoRALM(**WIDE)
    batch = (torch.zeros(4, 16, dtype=torch.long),) * 2
    options = QuantizeOptions("nf4" if quantized else None)
    return module, profile_model(module, batch, prepare=options.before_trace)


def test_the_planner_counts_the_bytes_nf4_weights_hold():
    """``profile_model`` with the quantize options' ``before_trace``: each frozen block weight counted at the bytes
    its NF4 tensor holds (codes, scales, factors, mean, table), exactly those of the weights ``quantize_base``
    makes from the real model; everything else as before."""
    module, profile = _qlora_profile(quantized=True)
    _, plain = _qlora_profile(quantized=False)
    quantize_base_weights(module, [f"model.base_model.model.model.layers.{i}" for i in range(4)])
    real = {n: p for n, p in module.named_parameters() if is_nf4(p)}
    assert len(real) == BLOCK_WEIGHTS
    stored = {info.fqn: info.numel * info.itemsize for info in profile.params}
    for name, p in real.items():
        inner = p.__tensor_flatten__()[0]
        assert stored[name] == sum(getattr(p, k).numel() * getattr(p, k).element_size() for k in inner)
        # 4-bit codes, an int8 scale per 64, an fp32 factor per 64 x 256, the fp32 mean and the 16-value table
        assert stored[name] == p.numel() * (0.5 + 1 / 64 + 4 / 16384) + 4 + 64
    unchanged = [(i.fqn, i.itemsize) for i in profile.params if i.fqn not in real]
    assert unchanged == [(i.fqn, i.itemsize) for i in plain.params if i.fqn not in real]


def test_the_planner_predicts_qlora_parameters_at_their_nf4_bytes():
    """The same layout (FSDP over 2) predicted for LoRA over fp32 weights and for QLoRA: the parameters per rank
    differ by the block weights' fp32 bytes less their NF4 bytes, over 2; gradients and optimizer state (the
    adapters') are the same."""
    from lightning_par.devices import known_hardware
    from lightning_par.planner.predict import Layout, predict

    _, q = _qlora_profile(quantized=True)
    _, lora = _qlora_profile(quantized=False)
    hardware = known_hardware("H100")
    qp, lp = (predict(Layout(dp_shard=2), profile, hardware, 2, 16) for profile in (q, lora))
    frozen = [(a, b) for a, b in zip(q.params, lora.params) if a.itemsize != b.itemsize]
    assert len(frozen) == BLOCK_WEIGHTS
    saved = sum(b.numel * (b.itemsize - a.itemsize) for a, b in frozen) / 2
    assert lp.params - qp.params == pytest.approx(saved, rel=1e-9)
    assert (qp.grads, qp.optimizer) == (lp.grads, lp.optimizer)


def test_the_planner_command_line_plans_and_writes_a_qlora_run(tmp_path):
    """``python -m lightning_par.plan --lora-rank 8 --quantize-base nf4``: layouts with tensor parallelism weighed
    too, the model named as fine-tuned, and the written config sets ``quantize_base: nf4``."""
    import json

    import yaml

    from lightning_par.planner.cli import main

    argv = ["--hf-config", "llama", "--hf-override", "hidden_size=256", "intermediate_size=512",
            "num_hidden_layers=2", "num_attention_heads=4", "num_key_value_heads=2", "vocab_size=512", "--world", "4",
            "--device", "H100", "--seq-len", "128", "--batch", "8", "--lora-rank", "8", "--quantize-base", "nf4",
            "--yaml", str(tmp_path / "plan.yaml"), "--json", str(tmp_path / "plan.json")]
    assert main(argv) == 0
    written = yaml.safe_load((tmp_path / "plan.yaml").read_text())["trainer"]["strategy"]["init_args"]
    assert written["quantize_base"] == "nf4"
    layouts = json.loads((tmp_path / "plan.json").read_text())["layouts"]
    assert {row["strategy_kwargs"]["tp"] for row in layouts} >= {1, 2}
    assert "LoRA r=8, nf4 base weights" in (tmp_path / "plan.yaml").read_text()
    with pytest.raises(SystemExit, match="--lora-rank"):
        main(argv[:argv.index("--lora-rank")] + ["--quantize-base", "nf4"])



def test_the_planner_leaves_out_layouts_whose_tp_cannot_cut_the_nf4_weights():
    """On 6 devices the tiny Llama's k_proj (128 x 256, column-parallel) cuts into 64 rows per tp2 rank, which FSDP
    cannot then cut into 3 whole shards: tp2 x dp_shard3 is left out of a QLoRA plan, with its reason, and kept in
    the plan of the same model over unquantized weights (tp layouts that cut them are weighed: the command-line
    test above)."""
    from lightning_par import plan_layouts
    from lightning_par.costs.profile import profile_model
    from lightning_par.devices import known_hardware
    from lightning_par.techniques.quantize.quantize_base import QuantizeOptions

    def plan(quantized: bool):
        pl.seed_everything(SEED, verbose=False)
        module = LoRALM(**WIDE)
        batch = (torch.zeros(12, 16, dtype=torch.long),) * 2
        profile = profile_model(module, batch, prepare=QuantizeOptions("nf4" if quantized else None).before_trace)
        return plan_layouts(profile, batch, 6, known_hardware("H100"), restrict={"pp": [1], "cp": [1]})

    def tp2_dp3(p):
        return [x for x in p.predictions if (x.layout.tp, x.layout.dp_shard) == (2, 3)]

    quantized, plain = plan(True), plan(False)
    assert tp2_dp3(plain) and not tp2_dp3(quantized)
    assert quantized.skipped.get("tp does not cut the 4-bit weights into whole blocks")
