"""The recipes of ``example_projects/recipes/``: real models at full size (which cannot run here) and their tiny
twins (which do).

- Every full-size recipe parses as ``python -m lightning_par.lm fit --config recipe.yaml`` reads it
  (``--print_config``, in this process: nothing is instantiated, nothing downloaded), its strategy constructs and
  fills the recipe's world size (devices x num_nodes), the model's published ``config.json`` beside it has the sizes
  the layout cuts (tp divides the heads and the vocabulary, ep the experts, the pipeline's stages the layers), and the
  planner's command in its header comment planned this recipe: the same folder, world, sequence length and global
  batch (the data loader's batch x the data-parallel ranks x gradient accumulation).
- Every tiny twin (``--config recipe.yaml --config tiny.yaml``) trains on 2 CPU processes, launched as ``torchrun -m
  lightning_par.lm fit ...`` launches it (``tests/launch.py`` plays torchrun: the ranks run the module's ``main``
  with the command's arguments), in a directory of its own where ``tiny_data.py`` wrote the data: every requested
  optimizer step is taken and logged, the loss is finite and falls, validation ran, the layout is the twin's, a
  sharded checkpoint is complete and W&B wrote its offline run.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytest.importorskip("transformers", reason="needs transformers (the dev extra)")

from launch import launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = ROOT / "example_projects" / "recipes"
RECIPES = sorted(p.parent.name for p in RECIPES_DIR.glob("*/recipe.yaml"))
LAYOUT = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


def test_every_recipe_has_its_files():
    assert RECIPES == ["deepseek-v3", "llama3.1-70b", "llama3.1-70b-qlora", "llama3.1-8b", "qwen3-30b-a3b"]
    for recipe in RECIPES:
        assert {"recipe.yaml", "tiny.yaml", "config.json"} <= {p.name for p in (RECIPES_DIR / recipe).iterdir()}


def _print_config(argv: list[str], capsys) -> dict[str, Any]:
    """What ``python -m lightning_par.lm <argv> --print_config`` prints, as a dict."""
    from lightning_par.lm.__main__ import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--print_config"])
    assert stop.value.code in (0, None), capsys.readouterr().err[-3000:]
    return yaml.safe_load(capsys.readouterr().out)


def _strategy(trainer: dict[str, Any]):
    import importlib

    module, _, name = trainer["strategy"]["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**trainer["strategy"]["init_args"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_full_size_recipe_parses_and_its_layout_fits_the_model(recipe, capsys):
    from transformers import AutoConfig

    path = RECIPES_DIR / recipe / "recipe.yaml"
    config = _print_config(["fit", "--config", str(path)], capsys)
    trainer, model, data = config["trainer"], config["model"], config["data"]
    quantized = trainer["strategy"]["init_args"].get("quantize_base")  # QLoRA: bf16 weights and adapters
    assert trainer["accelerator"] == "gpu" and trainer["precision"] == ("bf16-true" if quantized else "bf16-mixed")
    assert trainer["logger"]["class_path"] == "lightning.pytorch.loggers.WandbLogger"
    assert "lightning.pytorch.callbacks.ModelCheckpoint" in [c["class_path"] for c in trainer["callbacks"]]
    assert trainer["val_check_interval"] and trainer["limit_val_batches"]
    world = trainer["devices"] * trainer["num_nodes"]
    dims = _strategy(trainer).dims.resolve(world)
    assert dims.world_size == world

    hf = AutoConfig.from_pretrained(RECIPES_DIR / recipe)  # the published config.json shipped beside the recipe
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    assert heads % dims.tp == 0 and kv_heads % dims.tp == 0 and hf.vocab_size % dims.tp == 0
    experts = next((getattr(hf, k) for k in ("num_experts", "n_routed_experts") if hasattr(hf, k)), None)
    assert dims.ep == 1 or experts % dims.ep == 0
    stages = dims.pp * (trainer["strategy"]["init_args"]["pp_stages_per_rank"] or (1 if dims.pp == 1 else 2))
    assert hf.num_hidden_layers >= stages
    if model["load_weights"]:  # a Hub ID for the weights and tokenizer; the shipped config is that model's
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", model["model"]) and not Path(model["model"]).exists()
        assert model["model"].split("/")[1].lower().replace("-", "") == recipe.removesuffix("-qlora").replace("-", "")
    else:  # pre-training from the shipped config; a Hub ID for the tokenizer
        assert model["model"] == f"example_projects/recipes/{recipe}" and re.fullmatch(r"[\w.-]+/[\w.-]+",
                                                                                          data["tokenizer"])

    # the planner's command in the header planned this recipe: its folder, world, sequence and global batch
    header = path.read_text().split("\nseed_everything")[0]
    command = " ".join(line.lstrip("# ").rstrip("\\ ") for line in header.splitlines()
                       if "lightning_par.plan" in line or line.startswith("#     --"))
    planned = dict(re.findall(r"--([\w-]+) (\S+)", command))
    assert planned["hf-config"] == f"example_projects/recipes/{recipe}"
    assert int(planned["world"]) == world and int(planned["seq-len"]) == data["seq_len"]
    accumulate = trainer["accumulate_grad_batches"]
    assert int(planned["batch"]) == data["batch_size"] * dims.dp_size * accumulate
    assert f"global batch: {planned['batch']} x {planned['seq-len']} tokens" in " ".join(header.split())


def test_a_tokenizer_named_by_hub_id_fetches_no_weights(monkeypatch, tmp_path):
    """DeepSeek-V3's recipe names its tokenizer by Hub ID: the data module fetches the tokenizer's files, not the
    1.3 TB of safetensors beside them (the model's own Hub ID still brings its weights)."""
    import huggingface_hub

    from lightning_par.hub import resolve_pretrained
    from lightning_par.lm import TextDataModule

    asked = []

    def snapshot_download(repo_id, **kwargs):
        asked.append((repo_id, kwargs["allow_patterns"]))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    (tmp_path / "corpus.txt").write_text("text")
    data = TextDataModule(tokenizer="deepseek-ai/DeepSeek-V3", train_files=str(tmp_path / "corpus.txt"))
    assert data._tokenizer_dir() == tmp_path
    resolve_pretrained("Qwen/Qwen3-30B-A3B")
    (_, tokenizer_files), (_, model_files) = asked
    assert "*.safetensors" not in tokenizer_files and "tokenizer*" in tokenizer_files
    assert "*.safetensors" in model_files


def test_the_model_is_built_in_the_precisions_dtype_not_the_configs():
    """The published configs say ``torch_dtype: bfloat16``; ``CausalLM`` builds in torch's default dtype, which the
    Trainer's precision sets around ``configure_model``: float32 weights (and AdamW state) under bf16-mixed, and one
    dtype per FSDP unit for DeepSeek-V3, whose router transformers keeps in float32."""
    from lightning_par.lm import CausalLM

    module = CausalLM(model=str(RECIPES_DIR / "deepseek-v3"), load_weights=False, config_overrides=dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1, vocab_size=128))
    assert module.model_config.dtype == torch.bfloat16
    with torch.device("meta"):
        assert {p.dtype for p in module.build_model().parameters()} == {torch.float32}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as bf16-true's module_init_context sets it
    try:
        with torch.device("meta"):
            dtypes = {n: p.dtype for n, p in module.build_model().named_parameters()}
    finally:
        torch.set_default_dtype(default)
    assert {d for n, d in dtypes.items() if not n.endswith("mlp.gate.weight")} == {torch.bfloat16}


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_the_slurm_script_launches_the_recipe(launcher, tmp_path, capsys):
    """``sbatch --nodes=8 slurm.sbatch llama3.1-70b``, with ``srun`` and ``scontrol`` stubbed (they print what they
    were given): the rendezvous is the first node, the command is the recipe's, and LightningCLI accepts it."""
    import os
    import shlex
    import subprocess

    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text("#!/bin/bash\nprintf 'gpu-017\\ngpu-018\\n'\n")
    (stubs / "srun").write_text('#!/bin/bash\necho "MASTER=$MASTER_ADDR:$MASTER_PORT"; printf \'%q \' "$@"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "activate").write_text("")
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path),
           "SLURM_JOB_NODELIST": "gpu-[017-024]", "SLURM_JOB_ID": "123456", "SLURM_JOB_NUM_NODES": "8",
           "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "12", "LAUNCHER": launcher}
    done = subprocess.run(["bash", str(RECIPES_DIR / "slurm.sbatch"), "llama3.1-70b", "--trainer.max_steps=10"],
                          env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    rendezvous, command = done.stdout.splitlines()
    assert rendezvous == "MASTER=gpu-017:23456"
    argv = shlex.split(command)
    if launcher == "torchrun":
        assert argv[:argv.index("torchrun")] == ["--ntasks-per-node=1", "--ntasks=8", "--kill-on-bad-exit=1"]
        assert {"--nnodes=8", "--nproc-per-node=8", "--rdzv-endpoint=gpu-017:23456"} <= set(argv)
    module = argv.index("lightning_par.lm")
    assert argv[module - 1] == "-m"
    args = [a.replace("example_projects/", f"{ROOT}/example_projects/") for a in argv[module + 1:]]
    assert args[:3] == ["fit", "--config", str(RECIPES_DIR / "llama3.1-70b" / "recipe.yaml")]
    trainer = _print_config(args, capsys)["trainer"]
    # (devices from the command line stays the string "8", which Lightning reads as 8 devices, as from torchrun's)
    assert (trainer["num_nodes"], int(trainer["devices"]), trainer["max_steps"]) == (8, 8, 10)


# ---- the tiny twins ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A directory laid out as the repository root, as a user runs the commands from: ``example_projects`` (a link)
    and the data ``tiny_data.py`` writes in ``runs/recipes/tiny``."""
    import sys

    sys.path.insert(0, str(RECIPES_DIR))
    try:
        import tiny_data
    finally:
        sys.path.remove(str(RECIPES_DIR))
    work = tmp_path_factory.mktemp("recipes")
    (work / "example_projects").symlink_to(ROOT / "example_projects")
    tiny_data.make(work / "runs" / "recipes" / "tiny", max_documents=60)
    return work


def _train_twins(recipes: list[str]) -> dict[str, dict[str, Any]]:
    """One rank of ``torchrun ... -m lightning_par.lm fit --config recipe.yaml --config tiny.yaml`` for each recipe in
    turn: the module's ``main`` with the command's arguments (one launch for every twin: the ranks import
    LightningCLI, transformers' models and W&B once; each twin has a Trainer, strategy and W&B run of its own)."""
    import wandb

    from lightning_par import ExpertBiasBalancer
    from lightning_par.lm.__main__ import main

    biases: list[float] = []  # the largest router bias after each of ExpertBiasBalancer's updates (a tiny model's
    update = ExpertBiasBalancer.on_before_optimizer_step  # routing flips between groups: its biases may end at 0)

    def recorded(self, *args):
        update(self, *args)
        biases.append(max(float(b.abs().max()) for b in self.biases))

    ExpertBiasBalancer.on_before_optimizer_step = recorded
    results = {}
    for recipe in recipes:
        biases.clear()
        folder = f"example_projects/recipes/{recipe}"
        try:
            cli = main(["fit", "--config", f"{folder}/recipe.yaml", "--config", f"{folder}/tiny.yaml"])
        except BaseException as error:
            raise RuntimeError(f"the tiny twin of {recipe} failed") from error
        finally:
            wandb.finish()  # as the end of a user's process does (a W&B run still open is reused by the next logger)
        trainer, module = cli.trainer, cli.model
        results[recipe] = {
            "global_step": trainer.global_step,
            "layout": {name: getattr(trainer.strategy.dims, name) for name in LAYOUT},
            "trainable": [n for n, p in module.named_parameters() if p.requires_grad],
            "nf4": sum(type(getattr(p, "_local_tensor", p)).__name__ == "NF4Tensor" for p in module.parameters()),
            "biases": list(biases),
            "csv": trainer.loggers[1].log_dir if trainer.global_rank == 0 else None,
            "checkpoints": trainer.checkpoint_callback.dirpath}
    return results


@pytest.fixture(scope="module")
def twins(workdir) -> list[dict[str, dict[str, Any]]]:
    """Every tiny twin trained, each rank's results (one launch of 2 processes)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workdir)  # (the ranks start in the launching process's directory)
        patch.setenv("WANDB_SILENT", "true")
        return launch(2, _train_twins, RECIPES, env={"WANDB_MODE": "offline"}, timeout=600)  # (four runs)


def _merged(recipe: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The recipe's YAML and its twin's, as written."""
    return tuple(yaml.safe_load((RECIPES_DIR / recipe / name).read_text()) for name in ("recipe.yaml", "tiny.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_tiny_twin_trains_through_the_command_line(recipe, workdir, twins):
    full, tiny = _merged(recipe)
    # the twin changes sizes only: the same model config and strategy class, its callbacks are the recipe's
    assert tiny["model"]["model"] == f"example_projects/recipes/{recipe}"
    assert "class_path" not in tiny["trainer"].get("strategy", {}) and "precision" not in tiny["trainer"]  # as is
    assert [c["class_path"] for c in tiny["trainer"]["callbacks"]] == [c["class_path"]
                                                                      for c in full["trainer"]["callbacks"]]
    assert tiny["trainer"]["logger"][0]["class_path"] == full["trainer"]["logger"]["class_path"]
    assert full["model"].get("lora") == tiny["model"].get("lora", full["model"].get("lora"))

    ranks = [rank[recipe] for rank in twins]
    steps = tiny["trainer"]["max_steps"]
    expected = {**full["trainer"]["strategy"]["init_args"], **tiny["trainer"].get("strategy", {}).get("init_args", {})}
    for result in ranks:
        assert result["global_step"] == steps
        assert result["layout"] == {name: expected[name] for name in LAYOUT}, result["layout"]
    result = ranks[0]

    rows = list(csv.DictReader(open(workdir / result["csv"] / "metrics.csv")))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert val and all(math.isfinite(v) and v < math.log(384) + 1 for v in val), val
    assert any(r.get("perf/tokens_per_s/min") for r in rows) and any(r.get("mem/rss_bytes/max") for r in rows)

    # the checkpoints beside W&B's files: runs/recipes/tiny/<project>/<W&B run id>/checkpoints
    checkpoints = (workdir / result["checkpoints"]).resolve()
    assert checkpoints.is_relative_to(workdir.resolve() / "runs" / "recipes" / "tiny")
    (checkpoint,) = checkpoints.iterdir()  # save_top_k: 1, the latest
    assert checkpoint.name.endswith(f"step={steps}.ckpt") and (checkpoint / "COMPLETE").is_file()
    runs = list((workdir / "runs/recipes/tiny/wandb").glob(f"offline-run-*-{checkpoints.parent.name}"))
    assert len(runs) == 1 and next(runs[0].glob("*.wandb")).stat().st_size > 0

    if "lora" in full["model"]:  # only the adapters train (on the experts too where the recipe names them)
        assert result["trainable"] and all("lora_" in n for n in result["trainable"])
        assert any("experts" in n for n in result["trainable"]) == bool(full["model"]["lora"].get("target_parameters"))
    else:
        assert not [n for n in result["trainable"] if "lora_" in n]
    if full["trainer"]["strategy"]["init_args"].get("quantize_base"):  # QLoRA: every block's 7 linear weights in NF4
        blocks = tiny["model"]["config_overrides"]["num_hidden_layers"]
        assert sum(rank[recipe]["nf4"] for rank in twins) == 7 * blocks * len(twins)  # sharded: each rank has all
    if any(c["class_path"].endswith("ExpertBiasBalancer") for c in full["trainer"]["callbacks"]):
        assert len(result["biases"]) == steps and max(result["biases"]) > 0  # moved toward balance at each step


def test_the_qlora_recipe_on_4_gpus_parses_and_was_planned_for_4(capsys):
    """``--config recipe.yaml --config 4gpus.yaml``: 4 devices, the planner's layout for 4 (its command in the
    file's header: world 4, the same sequence and global batch), the 4-bit weights kept."""
    folder = RECIPES_DIR / "llama3.1-70b-qlora"
    config = _print_config(["fit", "--config", str(folder / "recipe.yaml"), "--config", str(folder / "4gpus.yaml")],
                           capsys)
    trainer, data = config["trainer"], config["data"]
    dims = _strategy(trainer).dims.resolve(trainer["devices"] * trainer["num_nodes"])
    assert (dims.world_size, dims.cp, trainer["strategy"]["init_args"]["quantize_base"]) == (4, 4, "nf4")
    header = (folder / "4gpus.yaml").read_text().split("\ntrainer:")[0]
    command = " ".join(line.lstrip("# ").rstrip("\\ ") for line in header.splitlines()
                       if "lightning_par.plan" in line or line.startswith("#     --"))
    planned = dict(re.findall(r"--([\w-]+) (\S+)", command))
    assert int(planned["world"]) == 4 and int(planned["seq-len"]) == data["seq_len"]
    assert int(planned["batch"]) == data["batch_size"] * dims.dp_size * trainer["accumulate_grad_batches"]

