"""The Hugging Face example (example_projects/hf_lm) through LightningCLI and its YAML configs, as the README runs
it: a transformers causal LM, unchanged, under FSDP2, tensor, context and pipeline parallelism (2 processes each);
and the GPT example's vocabulary padding that lets tensor parallelism split its 97 characters."""

from __future__ import annotations

import importlib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytest.importorskip("transformers", reason="needs transformers (the dev extra)")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "example_projects/hf_lm/configs"
STEPS = 6
# a tiny model (2 layers of width 32, 4 query heads over 2 key/value heads) on a small corpus: a run takes seconds
SMALL = [f"--trainer.max_steps={STEPS}", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2",
         "--trainer.log_every_n_steps=1", "--data.max_chars=60000", "--data.seq_len=32", "--data.batch_size=4",
         "--model.num_hidden_layers=2", "--model.hidden_size=32", "--model.intermediate_size=64",
         "--model.num_attention_heads=4", "--model.num_key_value_heads=2", "--model.warmup_steps=2",
         "--trainer.enable_model_summary=true"]  # off in the examples; its table names the model's class
# the configs' last callback is the CommOverlapMonitor: profile steps 2-4 (after one warm-up step), log at step 4
PROFILE_EARLY = ["--trainer.callbacks.init_args.start_step=1", "--trainer.callbacks.init_args.every_n_steps=4"]


def _train(tmp_path: Path, config: str, *extra: str) -> tuple[str, Path]:
    cmd = ["nice", sys.executable, "example_projects/hf_lm/train.py", "fit", "--config", str(CONFIGS / config),
           *SMALL, f"--trainer.logger.init_args.save_dir={tmp_path}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    match = re.search(r"TensorBoard logs: (\S+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    return proc.stdout + proc.stderr, Path(match.group(1))


def _scalars(log_dir: Path) -> dict[str, list[float]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _check_run(output: str, log_dir: Path, architecture: str, monitors: set[str]) -> dict[str, list[float]]:
    """The model is the transformers class asked for, the loss falls, validation's perplexity is exp(val/loss)
    (the same tokens seen two ways: a metric whose state went wrong shows here), the monitors logged, and the
    sharded checkpoint written at the end is complete."""
    assert re.search(rf"\bmodel +│ {architecture} ", output), output[-3000:]
    scalars = _scalars(log_dir)
    losses = scalars["train/loss"]
    assert len(losses) == STEPS and all(0 < v < 10 for v in losses), losses
    assert losses[-1] < losses[0] - 0.1, losses
    assert len(scalars["val/loss"]) == len(scalars["val/perplexity"]) == 2
    for loss, perplexity in zip(scalars["val/loss"], scalars["val/perplexity"]):
        assert math.log(perplexity) == pytest.approx(loss, abs=1e-4), (scalars["val/loss"], scalars["val/perplexity"])
    assert monitors <= set(scalars), sorted(monitors - set(scalars))
    (ckpt,) = (log_dir / "checkpoints").iterdir()
    assert (ckpt / "COMPLETE").is_file()
    return scalars


UTILIZATION = {"perf/step_time_s/max", "perf/step_time_s/max_rank", "perf/tokens_per_s/min"}
MEMORY = {"mem/rss_bytes/max", "mem/rss_bytes/max_rank"}
OVERLAP = {"comm/overlap_ratio/max", "comm/time_s_per_step/max"}


def test_fsdp2(tmp_path):
    output, log_dir = _train(tmp_path, "fsdp2.yaml", *PROFILE_EARLY)
    assert "dp_shard      groups of 2: [[0, 1]]" in output
    scalars = _check_run(output, log_dir, "LlamaForCausalLM", UTILIZATION | MEMORY | OVERLAP)
    assert {"comm/time_s/fsdp_all_gather/max", "comm/time_s/fsdp_reduce_scatter/max"} <= set(scalars)


def test_tensor_parallel_with_the_models_own_plan(tmp_path):
    """tp=2 from LlamaConfig.base_model_tp_plan: the embedding and lm_head are split over the padded vocabulary."""
    output, log_dir = _train(tmp_path, "tensor_parallel.yaml", *PROFILE_EARLY)
    assert "tp            groups of 2: [[0, 1]]" in output
    assert "tensor parallel (sequence parallel True" in output
    _check_run(output, log_dir, "LlamaForCausalLM", UTILIZATION | MEMORY | OVERLAP)


def test_context_parallel_with_another_architecture_from_the_command_line(tmp_path):
    """cp=2 (ring attention) of a Qwen2 model chosen by ``--model.model_type``: sequences of 64 split over 2 ranks."""
    output, log_dir = _train(tmp_path, "context_parallel.yaml", "--model.model_type=qwen2", "--data.seq_len=64",
                             *PROFILE_EARLY)
    assert "cp            groups of 2: [[0, 1]]" in output
    _check_run(output, log_dir, "Qwen2ForCausalLM", UTILIZATION | MEMORY | OVERLAP)


def test_pipeline_parallel_from_the_models_pp_plan(tmp_path):
    """Two stages cut from Qwen2's base_model_pp_plan, 1F1B over 4 micro-batches; the timeline monitor's picture."""
    output, log_dir = _train(tmp_path, "pipeline_parallel.yaml", "--trainer.callbacks.init_args.every_n_steps=3")
    rows = r"\n +0 +0 .* stages \[0\] \(blocks 0\)\n +1 +1 .* stages \[1\] \(blocks 1\)"
    assert re.search(rows, output), output[-3000:]
    _check_run(output, log_dir, "Qwen2ForCausalLM", MEMORY | {"pipeline/idle_fraction/rank1"})
    assert sorted(p.name for p in (log_dir / "pipeline_timeline").iterdir()) == ["step000001.png", "step000004.png"]


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_config_builds_a_valid_layout_and_model(config):
    """Each YAML's strategy constructs and fills its world size, its model config builds (on the meta device), and
    the tensor-parallel size divides what the model's plan splits: the padded vocabulary and the heads."""
    from example_projects.hf_lm.lit import HFCausalLMModule

    spec = yaml.safe_load((CONFIGS / config).read_text())
    trainer = spec["trainer"]
    module, _, name = trainer["strategy"]["class_path"].rpartition(".")
    strategy = getattr(importlib.import_module(module), name)(**trainer["strategy"].get("init_args", {}))
    world_size = trainer["devices"] * trainer.get("num_nodes", 1)
    dims = strategy.dims.resolve(world_size)
    assert dims.world_size == world_size
    lit = HFCausalLMModule(vocab_size=97, **spec["model"])
    config = lit.model_config
    assert config.model_type == spec["model"]["model_type"]
    assert config.vocab_size == 128 and config.max_position_embeddings == lit.hparams.max_seq_len
    for size in (config.vocab_size, config.num_attention_heads, config.num_key_value_heads):
        assert size % dims.tp == 0, (config, dims.tp)
    with torch.device("meta"):
        model = lit.build_model()
    assert model.lm_head.out_features == 128 and len(model.model.layers) == spec["model"]["num_hidden_layers"]


@pytest.mark.parametrize("kwargs, pattern", [
    ({"model_type": "not_a_model"}, r"model_type='not_a_model' is not a transformers model type"),
    ({"model_type": "vit"}, r"model_type='vit' has no causal-LM model in transformers"),
    ({"vocab_multiple": 0}, r"vocab_multiple=0 must be a positive int"),
])
def test_bad_options_are_refused_when_the_module_is_built(kwargs, pattern):
    from example_projects.hf_lm.lit import HFCausalLMModule

    with pytest.raises(ValueError, match=pattern):
        HFCausalLMModule(**kwargs)


@pytest.mark.parametrize("vocab_multiple, expected", [(1, 97), (2, 98), (64, 128)])
def test_gpt_vocabulary_padding(vocab_multiple, expected):
    """The GPT example pads its 97 characters so that tp can split the embedding and head; unpadded by default."""
    from example_projects.gpt.lit import GPTModule

    lit = GPTModule(vocab_size=97, n_layer=1, n_embd=32, n_head=2, vocab_multiple=vocab_multiple)
    lit.configure_model()
    assert lit.model.tok_emb.num_embeddings == lit.model.head.out_features == expected
    x = torch.randint(0, 97, (2, 8))
    assert lit(x).shape == (2, 8, expected) and torch.isfinite(lit.loss(lit(x), x))
