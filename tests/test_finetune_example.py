"""The fine-tuning example (example_projects/finetune) as the README runs it: ``prepare.py`` writes a pretrained base
model, ``train.py`` fine-tunes it with PEFT LoRA through LightningCLI under FSDP2, tensor and pipeline parallelism
(2 processes each). Per layout: the loss falls; the adapter-only checkpoint holds the adapters and their AdamW state
and nothing else; the merged model loads with ``from_pretrained``, its frozen weights are the base model's bit for
bit, it computes what base + the checkpoint's adapters compute, and it predicts the fine-tuning data better than the
base model. The FSDP2 run's adapter-only checkpoint resumes under tensor parallelism. Also: every YAML builds a
valid layout, the one-process path, and what is refused."""

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

pytest.importorskip("peft", reason="needs peft and transformers (the dev extra)")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "example_projects/finetune"
CONFIGS = EXAMPLE / "configs"
STEPS = 8
SEQ = 32
# a tiny Llama (2 layers of width 32) pre-trained for a few seconds on source code
TINY_BASE = ["--steps=40", "--num_hidden_layers=2", "--hidden_size=32", "--intermediate_size=64",
             "--num_attention_heads=4", "--num_key_value_heads=2", f"--seq_len={SEQ}", "--max_seq_len=64",
             "--batch_size=8", "--max_chars=100000", "--lr=0.01"]
SMALL = [f"--trainer.max_steps={STEPS}", "--trainer.val_check_interval=4", "--trainer.limit_val_batches=2",
         "--trainer.log_every_n_steps=1", f"--data.seq_len={SEQ}", "--data.batch_size=8", "--data.max_chars=100000",
         "--model.warmup_steps=1", "--model.lr=0.02"]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "model.base_model.model."  # the LightningModule's self.model is the PeftModel


def _run(*cmd: str) -> str:
    proc = subprocess.run(["nice", sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ft") / "base"
    output = _run("example_projects/finetune/prepare.py", f"--out={directory}", *TINY_BASE)
    assert re.search(r"pre-trained 40 steps on source code: train/loss \d\.\d+", output), output[-2000:]
    assert "Base model exists, kept" in _run("example_projects/finetune/prepare.py", f"--out={directory}")
    return directory


def _fine_tune(config: str, base: Path, save_dir: Path, *extra: str) -> tuple[str, Path]:
    output = _run("example_projects/finetune/train.py", "fit", "--config", str(CONFIGS / config), *SMALL,
                  f"--model.base_model={base}", f"--trainer.strategy.init_args.pretrained={base}",
                  f"--trainer.logger.init_args.save_dir={save_dir}", *extra)
    match = re.search(r"TensorBoard logs: (\S+)", output)
    assert match, output[-2000:]
    return output, Path(match.group(1))


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory, base):
    """``fine_tuned(config, *extra)``: one CLI run per distinct call in this module, (its output, its log dir)."""
    runs: dict[tuple[str, ...], tuple[str, Path]] = {}

    def run(config: str, *extra: str) -> tuple[str, Path]:
        if (config, *extra) not in runs:
            runs[(config, *extra)] = _fine_tune(config, base, tmp_path_factory.mktemp("run"), *extra)
        return runs[(config, *extra)]

    return run


def _scalars(log_dir: Path) -> dict[str, list[float]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _docs_validation_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The fine-tuning data's validation chunks (Python's reference documentation), as the runs split them."""
    from example_projects.finetune.data import DocsDataModule

    data = DocsDataModule(seq_len=SEQ, max_chars=100000)
    data.setup("fit")
    return data.val_set.x[:64], data.val_set.y[:64]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).item()


@pytest.mark.parametrize("config, layout", [
    ("fsdp2_lora.yaml", "dp_shard      groups of 2: [[0, 1]]"),
    ("tp_lora.yaml", "tp            groups of 2: [[0, 1]]"),
    ("pp_lora.yaml", "pp            groups of 2: [[0, 1]]"),
], ids=["fsdp2", "tp", "pp"])
def test_lora_fine_tuning_through_the_cli(fine_tuned, base, config, layout):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_par import consolidate_checkpoint
    from lightning_par.checkpoint import stored_shapes

    output, log_dir = fine_tuned(config)
    assert layout in output, output[-3000:]

    # the loss falls; the monitors and validation logged
    scalars = _scalars(log_dir)
    losses = scalars["train/loss"]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.1, losses
    assert {"perf/step_time_s/max", "perf/tokens_per_s/min", "mem/rss_bytes/max", "val/loss"} <= set(scalars)
    for loss, perplexity in zip(scalars["val/loss"], scalars["val/perplexity"]):
        assert math.log(perplexity) == pytest.approx(loss, abs=1e-4)

    # the adapter-only checkpoint of the last step: the 2 x 7 x 2 adapters and their AdamW moments, nothing else
    (ckpt,) = (log_dir / "checkpoints").iterdir()
    assert ckpt.name == f"epoch=0-step={STEPS}.ckpt" and (ckpt / "COMPLETE").is_file()
    weights = stored_shapes(ckpt, "state_dict.")
    assert len(weights) == 2 * len(TARGETS) * 2 and all(".lora_A." in k or ".lora_B." in k for k in weights), weights
    moments = stored_shapes(ckpt, "optimizer_0.state.")
    assert set(moments) == {f"{k}.{m}" for k in weights for m in ("exp_avg", "exp_avg_sq")} | {
        f"{k}.step" for k in weights}, sorted(moments)[:6]

    # the merged model: from_pretrained loads it; only the adapted projections differ from the base model
    base_model = AutoModelForCausalLM.from_pretrained(base).eval()
    merged = AutoModelForCausalLM.from_pretrained(log_dir / "merged").eval()
    base_sd, merged_sd = base_model.state_dict(), merged.state_dict()
    assert base_sd.keys() == merged_sd.keys()
    changed = {k for k in base_sd if not torch.equal(base_sd[k], merged_sd[k])}
    assert changed == {k for k in base_sd if k.endswith(tuple(f"{t}.weight" for t in TARGETS))}, sorted(changed)

    # ... and computes what the base model plus the checkpoint's adapters compute (PEFT, one process)
    adapters = {k.removeprefix("model."): v for k, v in consolidate_checkpoint(ckpt)["state_dict"].items()}
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS))).eval()
    missing, unexpected = peft_model.load_state_dict(adapters, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    x, y = _docs_validation_batch()
    with torch.no_grad():
        assert (merged(input_ids=x).logits - peft_model(input_ids=x).logits).abs().max() <= 1e-5
    # the adapters did something useful: the documentation is predicted better than by the base model
    assert _loss(merged, x, y) < _loss(base_model, x, y) - 0.005, (_loss(merged, x, y), _loss(base_model, x, y))


def test_adapter_only_checkpoint_resumes_under_another_layout(fine_tuned, base):
    """The FSDP2 run's adapter-only checkpoint (step 8) resumed under tensor parallelism for 2 more steps: the base
    comes from ``pretrained``, the adapters, their AdamW state and the loops from the checkpoint. The merged result
    continues the FSDP2 run's adapters: its change of the base weights is the FSDP2 run's plus a little (restarted
    adapters, B = 0, would have changed them by 2 steps' worth only)."""
    from transformers import AutoModelForCausalLM

    from lightning_par.checkpoint import stored_shapes

    _, fsdp2_dir = fine_tuned("fsdp2_lora.yaml")
    ckpt = fsdp2_dir / "checkpoints" / f"epoch=0-step={STEPS}.ckpt"
    output, log_dir = fine_tuned("tp_lora.yaml", f"--ckpt_path={ckpt}", f"--trainer.max_steps={STEPS + 2}",
                                 "--trainer.val_check_interval=2")
    assert "Restoring states from the checkpoint path" in output and "tp            groups of 2" in output
    steps = [e.step for e in EventAccumulator(str(log_dir)).Reload().Scalars("train/loss")]
    assert steps == [STEPS, STEPS + 1], steps
    (resumed_ckpt,) = (log_dir / "checkpoints").iterdir()
    assert resumed_ckpt.name == f"epoch=0-step={STEPS + 2}.ckpt"
    assert stored_shapes(resumed_ckpt, "state_dict.") == stored_shapes(ckpt, "state_dict.")

    base_sd = AutoModelForCausalLM.from_pretrained(base).state_dict()
    fsdp2_sd = AutoModelForCausalLM.from_pretrained(fsdp2_dir / "merged").state_dict()
    resumed_sd = AutoModelForCausalLM.from_pretrained(log_dir / "merged").state_dict()
    adapted = [k for k in base_sd if k.endswith(tuple(f"{t}.weight" for t in TARGETS))]
    before = torch.cat([(fsdp2_sd[k] - base_sd[k]).flatten() for k in adapted])
    after = torch.cat([(resumed_sd[k] - base_sd[k]).flatten() for k in adapted])
    assert (after - before).norm() < 0.25 * before.norm(), ((after - before).norm(), before.norm())


@pytest.fixture(scope="module")
def default_base(tmp_path_factory) -> Path:
    """prepare.py's default model size, not trained (``--steps 0``): what the YAMLs are written for."""
    from example_projects.finetune.prepare import parse_args, prepare

    return prepare(parse_args(["--steps=0", f"--out={tmp_path_factory.mktemp('ft') / 'base'}"]))


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_config_builds_a_valid_layout_and_model(config, default_base):
    """Each YAML's strategy constructs (its ``pretrained`` pointed at a base of prepare.py's default size) and fills
    its world size; the module builds the LoRA model from the base model's config on the meta device with the YAML's
    options; tp divides the heads and the vocabulary, pp leaves layers for every stage, micro-batches divide the
    batch, and the YAML's base_model and pretrained name the directory prepare.py writes by default."""
    from example_projects.finetune.lit import LoRAFineTuneModule
    from example_projects.finetune.prepare import DEFAULT_OUT

    spec = yaml.safe_load((CONFIGS / config).read_text())
    trainer, strategy_spec = spec["trainer"], spec["trainer"]["strategy"]
    assert strategy_spec["init_args"]["pretrained"] == spec["model"]["base_model"] == DEFAULT_OUT
    assert strategy_spec["init_args"]["save_trainable_only"] is True
    assert isinstance(spec["seed_everything"], int)  # tp: one seed keeps each rank's copy of a replicated lora_A equal
    module, _, name = strategy_spec["class_path"].rpartition(".")
    strategy = getattr(importlib.import_module(module), name)(**{**strategy_spec["init_args"],
                                                                 "pretrained": default_base})
    dims = strategy.dims.resolve(trainer["devices"])
    assert dims.world_size == trainer["devices"] == 2
    callbacks = {c["class_path"].rpartition(".")[2] for c in trainer["callbacks"]}
    assert {"ModelCheckpoint", "SaveMergedModel", "DeviceUtilizationMonitor", "MemoryMonitor"} <= callbacks

    lit = LoRAFineTuneModule(**{**spec["model"], "base_model": str(default_base)}, max_seq_len=spec["data"]["seq_len"])
    cfg = lit.model_config
    for size in (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size):
        assert size % dims.tp == 0, (config, size, dims.tp)
    assert cfg.num_hidden_layers >= dims.pp and spec["data"]["batch_size"] % strategy_spec["init_args"].get(
        "pp_microbatches", 1) == 0
    with torch.device("meta"):
        model = lit.build_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(spec["model"]["lora_target_modules"]) * cfg.num_hidden_layers
    assert all("lora_" in n for n in trainable)


def test_one_process_without_a_lightning_par_strategy_loads_the_base_itself(base, tmp_path):
    """Under Lightning's own single-device strategy the module reads the base weights itself (load_hf_weights):
    after two steps the frozen weights are still the base model's, bit for bit."""
    import lightning.pytorch as pl
    from transformers import AutoModelForCausalLM

    from example_projects.finetune.data import DocsDataModule
    from example_projects.finetune.lit import LoRAFineTuneModule

    pl.seed_everything(0, verbose=False)
    lit = LoRAFineTuneModule(base_model=str(base), max_seq_len=SEQ, max_steps=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lit, DocsDataModule(seq_len=SEQ, batch_size=4, max_chars=20000))
    expected = AutoModelForCausalLM.from_pretrained(base).state_dict()
    frozen = {n: p for n, p in lit.named_parameters() if not p.requires_grad}
    assert len(frozen) == len(expected)
    for name, param in frozen.items():
        key = name.removeprefix(PEFT_PREFIX).replace(".base_layer", "")
        assert torch.equal(param, expected[key]), name


@pytest.mark.parametrize("kwargs, pattern", [
    ({"lora_target_modules": ["q_proj", "qkv"]}, r"lora_target_modules: \['qkv'\] match no module of "
                                                 r"LlamaForCausalLM. Its Linear layers are named \['down_proj', "),
    ({"lora_r": 0}, r"lora_r=0 must be a positive int"),
    ({"lora_dropout": 1.0}, r"lora_dropout=1.0 must be a probability in \[0, 1\)"),
    ({"vocab_size": 500}, r"The data's vocabulary \(500 symbols\) is larger than the base model's \(vocab_size=128"),
    ({"max_seq_len": 65}, r"data.seq_len=65 is longer than the base model's max_position_embeddings=64"),
    ({"base_model": "/nonexistent"}, r"base_model='/nonexistent' does not exist"),
])
def test_bad_options_are_refused_when_the_module_is_built(base, kwargs, pattern):
    from example_projects.finetune.lit import LoRAFineTuneModule

    with pytest.raises((ValueError, FileNotFoundError), match=pattern):
        LoRAFineTuneModule(**{"base_model": str(base), "max_seq_len": SEQ, **kwargs})


def test_a_strategy_loading_other_weights_is_refused(base, default_base):
    """model.base_model and the strategy's pretrained must be one directory, else the adapters would train on a
    base the model was not built for; refused in configure_model (every rank, before any collective)."""
    import lightning.pytorch as pl

    from example_projects.finetune.lit import LoRAFineTuneModule
    from lightning_par import FSDP2Strategy

    for pretrained, seen in ((default_base, re.escape(repr(str(default_base)))), (None, "None")):
        lit = LoRAFineTuneModule(base_model=str(base), max_seq_len=SEQ)
        lit.trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(pretrained=pretrained),
                                 logger=False)
        with pytest.raises(ValueError, match=rf"model.base_model='{re.escape(str(base))}' but the strategy's "
                                             rf"pretrained={seen}: .* `trainer.strategy.init_args.pretrained: "):
            lit.configure_model()
