"""Fine-tuning under every layout: frozen parameters (a frozen embedding, a frozen block, one frozen weight in a
trainable block) and Hugging Face PEFT LoRA, in parity with one process (losses every step, final weights, fp32,
1e-5; frozen weights unchanged bit for bit); gradients and optimizer state only for what trains; clipping over the
trainable weights; adapter-only checkpoints resumed under another layout; the merged model loaded by
``from_pretrained``; and what is refused."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
from finetune_workers import STEPS, ClippedPartlyFrozenLM, LoRALM, PartlyFrozenLM, world2, world4
from hf_models import HFCausalLM
from launch import launch
from workers import SEED, assert_parity, assert_raised_on_every_rank, fit_reference, max_weight_diff

from lightning_par.checkpoint import stored_shapes

pytest.importorskip("peft", reason="needs peft (the dev extra)")

FROZEN = ("model.model.embed_tokens.weight", "model.model.layers.1.", "model.model.layers.2.mlp.up_proj.weight")


@functools.cache
def reference(module_cls: type = PartlyFrozenLM, **kw) -> dict:
    return fit_reference(module_cls=module_cls, max_steps=STEPS, **kw)


@functools.cache
def initial(module_cls: type = PartlyFrozenLM, **kw) -> dict[str, torch.Tensor]:
    pl.seed_everything(SEED, verbose=False)
    return {k: v.detach().clone() for k, v in module_cls(**kw).state_dict().items()}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """The 'pretrained' model the LoRA runs start from: a Qwen2 saved by save_pretrained."""
    directory = tmp_path_factory.mktemp("base")
    pl.seed_everything(SEED, verbose=False)
    HFCausalLM("qwen2").model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def w2(tmp_path_factory, base_dir):
    return launch(2, world2, str(tmp_path_factory.mktemp("ft")), str(base_dir), timeout=900)


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ft4")
    return {"ranks": launch(4, world4, str(tmp), timeout=900), "merged": tmp / "merged"}


def _frozen_unchanged(weights: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> None:
    frozen = [k for k in start if k.startswith(FROZEN)]
    assert len(frozen) > 10
    for k in frozen:
        assert torch.equal(weights[k], start[k]), f"frozen {k} changed"


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "tp2_sp", "cp2", "pp2"])
def test_frozen_parameters_in_parity(w2, layout):
    result = w2[0]["frozen"][layout]
    assert_parity(result, reference(), steps=STEPS)
    _frozen_unchanged(result["weights"], initial())


@pytest.mark.parametrize("layout", ["frozen_dp2_x_tp2", "frozen_hsdp", "frozen_pp2_x_dp2"])
def test_frozen_parameters_in_parity_world4(w4, layout):
    assert_parity(w4["ranks"][0][layout], reference(), steps=STEPS)
    _frozen_unchanged(w4["ranks"][0][layout]["weights"], initial())


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "pp2"])
def test_gradients_and_optimizer_state_only_for_trainable_parameters(w2, layout):
    start = initial()
    trainable = {k for k in start if not k.startswith(FROZEN)}
    for rank in w2:
        b = rank["frozen"][layout]["bytes"]
        assert b["grad_names"] and set(b["grad_names"]) <= trainable, set(b["grad_names"]) - trainable
        assert set(b["state_names"]) == set(b["grad_names"])  # AdamW keeps state exactly where gradients are
        # AdamW: two moments per trainable element (plus scalar steps, left out): twice the gradient bytes
        assert b["state_bytes"] == 2 * b["grad_bytes"]
        assert b["grad_bytes"] < b["param_bytes"]


def test_clipping_counts_the_trainable_parameters_only(w2):
    assert_parity(w2[0]["frozen_clipped"], reference(ClippedPartlyFrozenLM, gradient_clip_val=0.05), steps=STEPS)


def test_frozen_model_checkpoint_resumes_under_another_layout(w2):
    assert_parity(w2[0]["frozen_resumed_tp"], reference(), steps=STEPS - 2)
    _frozen_unchanged(w2[0]["frozen_resumed_tp"]["weights"], initial())


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "tp2_sp", "pp2", "llama_fsdp2", "llama_tp2",
                                    "llama_tp2_sp_regather"])
def test_lora_in_parity_with_single_process_peft(w2, layout):
    arch = "llama" if layout.startswith("llama") else "qwen2"
    result = w2[0]["lora"][layout]
    assert_parity(result, reference(LoRALM, arch=arch), steps=STEPS)
    assert (result["gathered_again"] > 0) == ("regather" in layout)
    start = initial(LoRALM, arch=arch)
    for k, v in result["weights"].items():
        if "lora_" not in k:
            assert torch.equal(v, start[k]), f"base weight {k} changed"


@pytest.mark.parametrize("layout", ["lora_dp2_x_tp2", "lora_pp2_x_tp2"])
def test_lora_in_parity_world4(w4, layout):
    assert_parity(w4["ranks"][0][layout], reference(LoRALM), steps=STEPS)


def test_adapters_train_from_pretrained_weights_and_resume_from_adapter_only_checkpoints(w2, base_dir):
    """Meta-device model, base weights read from save_pretrained's files, adapters initialized by PEFT's rule (B = 0);
    the adapter-only checkpoint of step 2 resumed under TP continues exactly like the uninterrupted FSDP2 run."""
    from transformers import AutoModelForCausalLM

    whole, resumed = w2[0]["lora_from_pretrained"], w2[0]["lora_resumed_tp"]
    assert max(abs(a - b) for a, b in zip(resumed["losses"], whole["losses"][2:])) <= 1e-5
    assert max_weight_diff(resumed["weights"], whole["weights"]) <= 1e-5
    base = AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    for k, v in whole["weights"].items():
        if "lora_" not in k:
            key = k.removeprefix("model.base_model.model.").replace(".base_layer", "")
            assert torch.equal(v, base[key]), k
    # the adapter-only checkpoint stores the adapters (and their Adam moments): r = 4 on width 32 makes them 17% of
    # this tiny model's weights (2r/d of the adapted ones); on real widths it is well under 1% (bench_finetune)
    stored = {name: stored_shapes(path, "state_dict.") for name, path in w2[0]["checkpoints"].items()}
    assert all("lora_" in k for k in stored["adapters"]) and len(stored["adapters"]) == 2 * 28
    assert set(stored["adapters"]) < set(stored["full"])
    numel = {name: sum(s.numel() for s in shapes.values()) for name, shapes in stored.items()}
    assert numel["adapters"] < 0.2 * numel["full"], numel


def test_merged_model_loads_with_from_pretrained(w4):
    """save_hf_pretrained from the dp2 x tp2 run: adapters folded into the base weights; from_pretrained's logits
    equal those of the single-process PEFT model after the same training."""
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(w4["merged"]).eval()
    peft_model = LoRALM()
    peft_model.load_state_dict(reference(LoRALM)["weights"])
    probe = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = peft_model.eval()(probe)
        assert (merged(input_ids=probe).logits - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("case, pattern", [
    ("adapters_into_a_model_without", r"holds only the trainable weights of its model .* the checkpoint has "
                                      r"\['model.base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight'"),
    ("adapter_on_the_gathered_head", r"'model.base_model.model.lm_head' is a LoRA layer whose base layer is "
                                     r"'colwise_rep'; LoRA adapters can follow 'colwise' and 'rowwise'"),
    ("optimizer_with_only_frozen_weights", r"optimizer 0 \(AdamW\) was given only frozen parameters"),
])
def test_refused_on_every_rank(w2, case, pattern):
    assert_raised_on_every_rank([r["errors"] for r in w2], case, pattern)


def test_lora_targets_that_match_nothing_are_refused_by_peft():
    """PEFT refuses target modules that match nothing when the user wraps the model, on every rank alike (before the
    strategy exists), naming the targets."""
    with pytest.raises(ValueError, match=r"Target modules .*nope.* not found in the base model"):
        LoRALM(targets=("nope",))


@pytest.mark.parametrize("target_parameters", [[], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]],
                         ids=["attention", "attention_and_experts"])
def test_the_planner_prices_what_peft_trains(tmp_path, target_parameters):
    """``python -m lightning_par.plan --lora-rank``: gradients and AdamW state for exactly the parameters PEFT makes
    trainable (LoRA on modules, and on a mixture of experts' stacked parameters through ``target_parameters``), the
    weights all counted, and the experts still found inside PEFT's wrappers (expert-parallel layouts offered)."""
    import json

    from hf_models import _COMMON, TINY_CONFIGS, tiny_hf_model
    from peft import LoraConfig, get_peft_model

    from lightning_par.planner.cli import main

    config = tmp_path / "qwen3_moe.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", **_COMMON, **TINY_CONFIGS["qwen3_moe"][1]}))
    argv = ["--hf-config", str(config), "--device", "H100", "--seq-len", "16", "--batch", "2", "--precision",
            "32-true", "--lora-rank", "4", "--lora-targets", "q_proj", "v_proj", "--json", str(tmp_path / "out.json")]
    if target_parameters:
        argv += ["--lora-target-parameters", *target_parameters]
    peft_model = get_peft_model(tiny_hf_model("qwen3_moe"), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=target_parameters or None))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    every = sum(p.numel() for p in peft_model.parameters())
    assert main([*argv, "--world", "1"]) == 0
    one_rank = json.loads((tmp_path / "out.json").read_text())["layouts"]
    assert one_rank and all((row["grads"], row["optimizer"], row["params"]) == (4 * trainable, 8 * trainable, 4 * every)
                            for row in one_rank)
    assert main([*argv, "--world", "2"]) == 0
    two_ranks = json.loads((tmp_path / "out.json").read_text())["layouts"]
    assert any(row["strategy_kwargs"].get("ep") == 2 for row in two_ranks)


def test_lora_target_parameters_without_a_rank_is_refused():
    from lightning_par.planner.cli import main

    with pytest.raises(SystemExit, match="--lora-target-parameters names what LoRA adapts: pass --lora-rank too"):
        main(["--hf-config", "llama", "--world", "2", "--lora-target-parameters", "mlp.experts.down_proj"])
