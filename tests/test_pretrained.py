"""Fine-tuning starts from pretrained weights, under any layout.

* A Hugging Face checkpoint as ``save_pretrained`` writes it (one safetensors file, or an index and shards) is read
  into a model built on the meta device and sharded by FSDP2, HSDP, TP or FSDP2 x TP, each rank reading only its
  slices: the logits of one batch and the full weights equal ``from_pretrained`` in one process. Per-rank peak
  memory of the whole setup (sharding, materialization, load) is measured against the model's size.
* A single-file Lightning checkpoint written by one process resumes under FSDP2 and TP with the loss trajectory of
  the one-process continuation; a file written by ``consolidate_checkpoint`` resumes too.
* A resumed checkpoint wins over the pretrained weights.
* Bad input (keys missing, shapes wrong, a path that is not a checkpoint, another optimizer) fails on every rank.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import launch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from workers import (
    SEED,
    SGDGPT,
    TINY_GPT,
    RecordLoss,
    assert_raised_on_every_rank,
    error_of,
    fit,
    max_loss_diff,
    max_weight_diff,
    token_dataset,
)

from example_projects.gpt.lit import GPTModule
from lightning_par import (
    FSDP2Strategy,
    NDParallelStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
    consolidate_checkpoint,
    full_state_dict,
)
from lightning_par.hf_conversions import shard_view, stored_names
from lightning_par.pretrained import check_hf_checkpoint, find_hf_model, load_hf_weights, save_hf_pretrained

LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=32)
QWEN = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32)
# big enough for memory to be measurable (about 193 MB of float32 weights), small enough for a test
BIG_LLAMA = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2048, num_hidden_layers=3, num_attention_heads=8,
                 num_key_value_heads=8, max_position_embeddings=64)
# mixtures of experts: transformers 5 stacks the experts (mlp.experts.gate_up_proj) while save_pretrained writes a
# tensor per expert (mlp.experts.3.gate_proj.weight); Mixtral's are also renamed (block_sparse_moe.experts.3.w1)
QWEN3_MOE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=32)
MIXTRAL = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32)
EXPERTS_KEY = "model.layers.0.mlp.experts.gate_up_proj"
PROBE = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(7))


def build_hf(kind: str, **config) -> nn.Module:
    import transformers

    names = {"llama": "Llama", "qwen": "Qwen2", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}[kind]
    return getattr(transformers, f"{names}ForCausalLM")(getattr(transformers, f"{names}Config")(**config))


def save_hf(directory: Path, kind: str, max_shard_size: str | None = None, **config) -> Path:
    """A 'pretrained' model: random weights, norms included (so a norm left at its init would show)."""
    torch.manual_seed(0)
    model = build_hf(kind, **config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def from_pretrained(directory: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).eval()


class LitCausalLM(pl.LightningModule):
    """A Hugging Face causal LM built from a config inside a LightningModule; the strategy loads the weights."""

    def __init__(self, kind: str = "llama", config: dict | None = None, **_: object) -> None:
        super().__init__()
        self.model = build_hf(kind, **(config or LLAMA))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(input_ids=x).logits.float().flatten(0, 1), y.flatten())

    def predict_step(self, batch, batch_idx):
        return self.model(input_ids=batch).logits

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-6)


# ---- per-rank memory -----------------------------------------------------------------------------------------------


def _status_kib(*fields: str) -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {f: int(re.search(rf"^{f}:\s+(\d+) kB", text, re.M).group(1)) for f in fields}


class PeakMemory:
    """This process's peak private memory (RssAnon, sampled every 0.5 ms) and peak resident memory (VmHWM, exact,
    reset through /proc/self/clear_refs; it also counts the memory-mapped checkpoint pages a rank reads, which are
    shared page cache) while the context is open, in bytes above the value at entry."""

    def __enter__(self) -> PeakMemory:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        start = _status_kib("RssAnon", "VmRSS")
        self.anon0, self.rss0, self.anon_peak = start["RssAnon"], start["VmRSS"], start["RssAnon"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.anon_peak = max(self.anon_peak, _status_kib("RssAnon")["RssAnon"])
            time.sleep(0.0005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, _status_kib("RssAnon")["RssAnon"])
        self.anon_bytes = (self.anon_peak - self.anon0) * 1024
        self.rss_bytes = (_status_kib("VmHWM")["VmHWM"] - self.rss0) * 1024


class MeasureSetup(Callback):
    """Peak memory from the first hook of a run to the first hook after the strategy's setup: spans
    configure_model, sharding, materialization and the pretrained load."""

    def setup(self, trainer, pl_module, stage):
        self.peak = PeakMemory().__enter__()

    def on_predict_start(self, trainer, pl_module):
        self.peak.__exit__()


# ---- what the ranks run --------------------------------------------------------------------------------------------


def predict(strategy, devices: int, kind: str, config: dict, callbacks=None, gather: bool = True,
            save_to: str | None = None) -> dict:
    """Build on the meta device, let the strategy shard and load, return one batch's logits and the full weights
    (and write them with ``save_hf_pretrained`` to ``save_to``)."""
    pl.seed_everything(SEED, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    with trainer.init_module(empty_init=True):
        module = LitCausalLM(kind, config)
    logits = trainer.predict(module, DataLoader(PROBE, batch_size=len(PROBE)))[0]
    weights = full_state_dict(module) if gather else {}
    out = {"logits": logits, "weights": {k.removeprefix("model."): v for k, v in weights.items()},
           "inv_freq": module.model.model.rotary_emb.inv_freq.clone()}
    if kind in ("qwen3_moe", "mixtral"):
        out["experts_read"] = _expert_pieces_read(module.model, strategy.pretrained)
    if save_to:
        save_hf_pretrained(module, save_to)
    return out


def _expert_pieces_read(model: nn.Module, directory: str) -> list[str]:
    """The stored per-expert tensors this rank reads for the first layer's stacked gate/up experts."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    stored = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    tensor = model.get_parameter(EXPERTS_KEY)
    pieces, missing, mismatched = stored_names(model).pieces(EXPERTS_KEY, tuple(tensor.shape), stored)
    assert not missing and not mismatched, (missing, mismatched)
    return [piece.key for piece in pieces if shard_view(tensor, piece, EXPERTS_KEY) is not None]


def _hf_errors(dirs: dict[str, str]) -> dict:
    """Each must fail on every rank before any collective could hang: the next runs in the same job still work."""
    def run(path, config=LLAMA, module_cls=None):
        strategy = FSDP2Strategy(pretrained=Path(path))
        if module_cls is None:
            return predict(strategy, 4, "llama", config)
        trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False, max_steps=1,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module_cls(**TINY_GPT), DataLoader(token_dataset(8), batch_size=2))

    return {
        "missing_keys": error_of(lambda: run(dirs["llama"], {**LLAMA, "num_hidden_layers": 3})),
        "wrong_shapes": error_of(lambda: run(dirs["llama"], {**LLAMA, "intermediate_size": 256})),
        "a_file": error_of(lambda: run(Path(dirs["llama"]) / "config.json")),
        "not_a_checkpoint": error_of(lambda: run(dirs["empty"])),
        "no_hf_model": error_of(lambda: run(dirs["llama"], module_cls=GPTModule)),
    }


def _world4(dirs: dict[str, str]) -> dict:
    errors = _hf_errors(dirs)
    return {
        "errors": errors,
        "fsdp2": predict(FSDP2Strategy(activation_checkpointing=True, pretrained=dirs["llama"]), 4, "llama", LLAMA),
        "tp4": predict(TensorParallelStrategy(tp=4, pretrained=dirs["llama_sharded"]), 4, "llama", LLAMA),
        "dp2_x_tp2": predict(NDParallelStrategy(dp_shard=2, tp=2, pretrained=dirs["qwen_sharded"]), 4, "qwen", QWEN),
        "hsdp_tied": predict(FSDP2Strategy(dp_replicate=2, dp_shard=2, pretrained=dirs["qwen_tied"]), 4, "qwen",
                             {**QWEN, "tie_word_embeddings": True}),
        # a tensor per expert in the checkpoint, the experts stacked and sharded here: a rank reads its own
        "ep2_efsdp2_qwen3_moe": predict(NDParallelStrategy(dp_shard=4, ep=2, pretrained=dirs["qwen3_moe"]), 4,
                                        "qwen3_moe", QWEN3_MOE, save_to=dirs["saved_qwen3_moe"]),
        "ep4_mixtral": predict(NDParallelStrategy(dp_shard=4, ep=4, pretrained=dirs["mixtral_sharded"]), 4,
                               "mixtral", MIXTRAL),
        "fsdp2_qwen3_moe": predict(FSDP2Strategy(pretrained=dirs["qwen3_moe"]), 4, "qwen3_moe", QWEN3_MOE),
    }


def _memory(directory: str) -> dict:
    measure = MeasureSetup()
    out = predict(FSDP2Strategy(pretrained=directory), 2, "llama", BIG_LLAMA, callbacks=[measure], gather=False)
    out["anon_bytes"], out["rss_bytes"] = measure.peak.anon_bytes, measure.peak.rss_bytes
    if dist.get_rank() == 0:  # the same measurement around a whole model in memory (no meta-device init)
        with PeakMemory() as control:
            whole = build_hf("llama", **BIG_LLAMA)
        del whole
        out["control_anon_bytes"] = control.anon_bytes
    return out


# ---- single-file Lightning checkpoints -----------------------------------------------------------------------------

SAMPLES = 96


def fit_one_process_with_checkpoints(ckpt_dir: Path) -> dict:
    """The one-process run (Lightning's own single-device strategy) that writes single-file checkpoints."""
    pl.seed_everything(SEED, verbose=False)
    record = RecordLoss()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=10, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[record, ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_top_k=-1,
                                           filename="{step}")],
    )
    model = GPTModule(**TINY_GPT)
    data = token_dataset(SAMPLES)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    trainer.fit(model, DataLoader(data, batch_size=8, sampler=sampler))
    return {"losses": record.losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


class TinyLlamaLM(LitCausalLM):
    def __init__(self, **_: object) -> None:
        super().__init__("llama", {**LLAMA, "vocab_size": 32})


def _single_file_and_resume(ckpt_dir: str, hf_dir: str) -> dict:
    ckpt = Path(ckpt_dir)
    not_a_checkpoint = ckpt / "notes.ckpt"  # written by the fixture
    single = str(ckpt / "step=4.ckpt")
    errors = {
        "not_a_checkpoint": error_of(lambda: fit(FSDP2Strategy(), 2, 2, resume_from=str(not_a_checkpoint))),
        "other_model": error_of(lambda: fit(FSDP2Strategy(), 2, 2, resume_from=single, n_layer=2)),
        "other_optimizer": error_of(lambda: fit(FSDP2Strategy(), 2, 2, resume_from=single, module_cls=SGDGPT)),
        "optimizer_under_pp": error_of(lambda: fit(PipelineParallelStrategy(pp=2), 2, 1, resume_from=single)),
    }
    out = {"errors": errors}
    out["fsdp2"] = fit(FSDP2Strategy(), 2, 2, resume_from=single, ckpt_dir=str(ckpt / "fsdp2"),
                       ckpt_every_n_steps=3)
    out["tp2"] = fit(TensorParallelStrategy(tp=2), 2, 1, resume_from=single)
    consolidated = ckpt / "consolidated.ckpt"
    if dist.get_rank() == 0:
        consolidate_checkpoint(ckpt / "fsdp2" / "step=6.ckpt", consolidated)
    dist.barrier()
    out["from_consolidated"] = fit(FSDP2Strategy(), 2, 2, resume_from=str(consolidated), max_steps=6)
    # weights alone map under pipeline parallelism too (each rank reads its stages' tensors)
    out["pp_from_consolidated"] = fit(PipelineParallelStrategy(pp=2), 2, 1, resume_from=str(consolidated), max_steps=6)

    # the pretrained load happens at every setup; a resumed checkpoint is restored after it and wins
    hf = ckpt / "hf"
    out["pretrained_fit"] = fit(FSDP2Strategy(pretrained=hf_dir), 2, 2, max_steps=2, module_cls=TinyLlamaLM,
                                empty_init=True, ckpt_dir=str(hf), ckpt_every_n_steps=2)
    out["pretrained_resumed"] = fit(FSDP2Strategy(pretrained=hf_dir), 2, 2, max_steps=2, module_cls=TinyLlamaLM,
                                    empty_init=True, resume_from=str(hf / "step=2.ckpt"))
    return out


# ---- fixtures ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    dirs = {
        "llama": save_hf(root / "llama", "llama", **LLAMA),
        "llama_sharded": save_hf(root / "llama_sharded", "llama", max_shard_size="40KB", **LLAMA),
        "qwen_sharded": save_hf(root / "qwen_sharded", "qwen", max_shard_size="40KB", **QWEN),
        "qwen_tied": save_hf(root / "qwen_tied", "qwen", max_shard_size="40KB", **QWEN, tie_word_embeddings=True),
        "tiny_llama": save_hf(root / "tiny_llama", "llama", **{**LLAMA, "vocab_size": 32}),
        "qwen3_moe": save_hf(root / "qwen3_moe", "qwen3_moe", **QWEN3_MOE),
        "mixtral_sharded": save_hf(root / "mixtral_sharded", "mixtral", max_shard_size="40KB", **MIXTRAL),
        "saved_qwen3_moe": root / "saved_qwen3_moe",
        "empty": root / "empty",
    }
    dirs["empty"].mkdir()
    return {k: str(v) for k, v in dirs.items()}


@pytest.fixture(scope="module")
def world4(hf_dirs):
    return launch(4, _world4, hf_dirs)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("single")
    return ckpt_dir, fit_one_process_with_checkpoints(ckpt_dir)


@pytest.fixture(scope="module")
def resumed(one_process, hf_dirs):
    ckpt_dir, _ = one_process
    (ckpt_dir / "notes.ckpt").write_text("not a checkpoint")
    return launch(2, _single_file_and_resume, str(ckpt_dir), hf_dirs["tiny_llama"])


# ---- Hugging Face checkpoints --------------------------------------------------------------------------------------


def test_save_pretrained_wrote_both_forms(hf_dirs):
    assert (Path(hf_dirs["llama"]) / "model.safetensors").is_file()
    for name in ("llama_sharded", "qwen_sharded", "qwen_tied"):
        assert len(list(Path(hf_dirs[name]).glob("model-*-of-*.safetensors"))) > 2
        assert (Path(hf_dirs[name]) / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("case, directory", [
    ("fsdp2", "llama"),  # one model.safetensors; activation checkpointing wraps the blocks
    ("tp4", "llama_sharded"),  # an index and shards, from here on
    ("dp2_x_tp2", "qwen_sharded"),
    ("hsdp_tied", "qwen_tied"),  # lm_head tied to the embedding: the checkpoint holds only the embedding
    ("ep2_efsdp2_qwen3_moe", "qwen3_moe"),  # a tensor per expert stored, the experts stacked in the model
    ("ep4_mixtral", "mixtral_sharded"),  # and renamed (block_sparse_moe.experts.0.w1.weight)
    ("fsdp2_qwen3_moe", "qwen3_moe"),
])
def test_sharded_load_equals_from_pretrained(world4, hf_dirs, case, directory):
    reference = from_pretrained(Path(hf_dirs[directory]))
    with torch.no_grad():
        expected = reference(input_ids=PROBE).logits
    for rank, result in enumerate(world4):
        assert (result[case]["logits"] - expected).abs().max() <= 1e-5, (case, rank)
    weights = world4[0][case]["weights"]
    reference_weights = reference.state_dict()
    assert weights.keys() == reference_weights.keys()
    assert all(torch.equal(weights[k], reference_weights[k]) for k in weights)  # a copy: bit for bit
    for result in world4:  # not in the checkpoint: recomputed after meta-device init
        assert torch.equal(result[case]["inv_freq"], reference.model.rotary_emb.inv_freq)


@pytest.mark.parametrize("case", ["ep2_efsdp2_qwen3_moe", "ep4_mixtral", "fsdp2_qwen3_moe"])
def test_each_rank_reads_only_its_experts(world4, case):
    """4 experts, each on one of the 4 ranks (ep2 x efsdp2, ep4, FSDP2 over dim 0): a rank reads the gate and up
    tensors of its one expert, and the ranks together read every stored tensor once."""
    reads = [result[case]["experts_read"] for result in world4]
    assert all(len(r) == 2 for r in reads), reads
    names = ("gate_proj", "up_proj") if "qwen" in case else ("w1", "w3")
    stored = "mlp" if "qwen" in case else "block_sparse_moe"
    assert sorted(sum(reads, [])) == sorted(f"model.layers.0.{stored}.experts.{e}.{n}.weight"
                                            for e in range(4) for n in names)


def test_save_hf_pretrained_under_expert_parallelism_writes_what_from_pretrained_loads(world4, hf_dirs):
    """Written from the ep2 x efsdp2 shards as a tensor per expert (transformers' own layout on disk)."""
    from safetensors import safe_open

    saved = Path(hf_dirs["saved_qwen3_moe"])
    with safe_open(saved / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in f.keys()
    reloaded = from_pretrained(saved).state_dict()
    reference = from_pretrained(Path(hf_dirs["qwen3_moe"])).state_dict()
    assert reloaded.keys() == reference.keys()
    assert all(torch.equal(reloaded[k], reference[k]) for k in reference)


@pytest.mark.parametrize("case, error", [
    ("missing_keys", r"ValueError: The Hugging Face checkpoint .* does not fit the model at prefix 'model\.': missing "
                     r"\['model\.layers\.2\.input_layernorm\.weight'"),
    ("wrong_shapes", r"shape mismatch \['model\.layers\.0\.mlp\.down_proj\.weight: checkpoint \(64, 128\) vs model "
                     r"\(64, 256\)'"),
    ("a_file", r"ValueError: pretrained='.*config\.json' is a file, not a Hugging Face checkpoint directory"),
    ("not_a_checkpoint", r"ValueError: pretrained='.*empty' holds neither model\.safetensors nor "
                         r"model\.safetensors\.index\.json"),
    ("no_hf_model", r"ValueError: GPTModule holds no Hugging Face PreTrainedModel, .* Pass prefix="),
])
def test_bad_pretrained_input_fails_on_every_rank(world4, case, error):
    assert_raised_on_every_rank([r["errors"] for r in world4], case, error)


def test_memory_per_rank_stays_well_below_the_model(tmp_path, monkeypatch):
    directory = save_hf(tmp_path / "big", "llama", **BIG_LLAMA)
    model_bytes = (directory / "model.safetensors").stat().st_size
    # glibc serves allocations from memory freed earlier (RSS would not show them) unless every block above 64 KiB
    # gets its own mapping, returned on free; the ranks inherit this at start
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    results = launch(2, _memory, str(directory), fresh_interpreter=True)  # glibc reads MALLOC_* at start
    expected = from_pretrained(directory)(input_ids=PROBE).logits
    for rank, result in enumerate(results):
        assert (result["logits"] - expected).abs().max() <= 1e-5
        print(f"rank {rank}: model {model_bytes / 2**20:.1f} MiB, setup peak private memory "
              f"{result['anon_bytes'] / 2**20:.1f} MiB ({result['anon_bytes'] / model_bytes:.2f} x), peak resident "
              f"incl. mapped checkpoint pages {result['rss_bytes'] / 2**20:.1f} MiB "
              f"({result['rss_bytes'] / model_bytes:.2f} x)")
        # half the model (this rank's shards) plus one tensor's slice in flight; a full copy would be >= 1 x
        assert result["anon_bytes"] <= 0.75 * model_bytes
    control = results[0]["control_anon_bytes"]
    print(f"control (the whole model built in memory): {control / 2**20:.1f} MiB ({control / model_bytes:.2f} x)")
    assert control >= 0.95 * model_bytes  # the measurement sees a whole model when there is one


# ---- in one process ------------------------------------------------------------------------------------------------


def test_load_into_a_plain_module_with_a_tie_broken_by_the_user(hf_dirs):
    """No process group; the tied head is its own parameter: both are read from the key they are tied to."""
    with torch.device("meta"):
        module = LitCausalLM("qwen", {**QWEN, "tie_word_embeddings": True})
    module.to_empty(device="cpu")
    module.model.lm_head.weight = nn.Parameter(torch.zeros_like(module.model.lm_head.weight))
    assert load_hf_weights(module, hf_dirs["qwen_tied"]) == []
    reference = from_pretrained(Path(hf_dirs["qwen_tied"]))
    assert torch.equal(module.model.lm_head.weight, reference.model.embed_tokens.weight)
    assert torch.equal(module.model(input_ids=PROBE).logits, reference(input_ids=PROBE).logits)


def test_parameters_outside_the_hugging_face_model_are_left_and_reported(hf_dirs):
    module = LitCausalLM("llama", LLAMA)
    module.value_head = nn.Linear(64, 1)
    before = module.value_head.weight.detach().clone()
    assert load_hf_weights(module, hf_dirs["llama"]) == ["value_head.weight", "value_head.bias"]
    assert torch.equal(module.value_head.weight, before)
    # an explicit prefix: the Hugging Face model is the module itself
    assert load_hf_weights(module.model, hf_dirs["llama"], prefix="") == []
    with pytest.raises(ValueError, match=r"No parameter of LitCausalLM starts with prefix='nope\.'"):
        load_hf_weights(module, hf_dirs["llama"], prefix="nope")


def test_hf_model_is_found_or_refused():
    assert find_hf_model(LitCausalLM("llama", LLAMA))[0] == "model."
    two = nn.ModuleDict({"a": build_hf("llama", **LLAMA), "b": build_hf("llama", **LLAMA)})
    with pytest.raises(ValueError, match=r"holds several: \['a', 'b'\].*Pass prefix="):
        find_hf_model(two)


def test_bad_checkpoint_directories(hf_dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="path='.*nope' does not exist"):
        check_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(TypeError, match="path=3 must be the directory"):
        check_hf_checkpoint(3)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save({}, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"\['pytorch_model.bin'\]: PyTorch pickles.*safe_serialization=True"):
        check_hf_checkpoint(pickled)
    stray = tmp_path / "stray"
    save_hf(stray, "llama", max_shard_size="40KB", **LLAMA)
    (stray / "adapter_model.safetensors").write_bytes(next(stray.glob("model-*.safetensors")).read_bytes())
    with pytest.raises(ValueError, match=r"not in the index \['adapter_model.safetensors'\]"):
        check_hf_checkpoint(stray)


# ---- single-file Lightning checkpoints -----------------------------------------------------------------------------


def test_one_process_wrote_single_files(one_process):
    ckpt_dir, _ = one_process
    assert (ckpt_dir / "step=4.ckpt").is_file()


@pytest.mark.parametrize("case", ["fsdp2", "tp2"])
def test_single_file_resumes_like_the_one_process_continuation(one_process, resumed, case):
    _, reference = one_process
    result = resumed[0][case]
    assert result["global_step"] == 10
    assert max_loss_diff(result["losses"], reference["losses"][4:]) <= 1e-5
    assert max_weight_diff(result["weights"], reference["weights"]) <= 1e-5


@pytest.mark.parametrize("case", ["from_consolidated", "pp_from_consolidated"])
def test_consolidated_file_resumes(resumed, one_process, case):
    ckpt_dir, _ = one_process
    consolidated = torch.load(ckpt_dir / "consolidated.ckpt", weights_only=False)
    result = resumed[0][case]
    assert result["global_step"] == 6 and result["losses"] == []
    assert max_weight_diff(result["weights"], consolidated["state_dict"]) == 0.0


def test_resumed_checkpoint_wins_over_pretrained_weights(resumed, hf_dirs):
    fitted, again = resumed[0]["pretrained_fit"], resumed[0]["pretrained_resumed"]
    assert again["global_step"] == 2 and again["losses"] == []
    assert max_weight_diff(again["weights"], fitted["weights"]) == 0.0
    start = from_pretrained(Path(hf_dirs["tiny_llama"])).state_dict()
    assert max_weight_diff({k.removeprefix("model."): v for k, v in again["weights"].items()}, start) > 1e-3


@pytest.mark.parametrize("case, error", [
    ("not_a_checkpoint", r"ValueError: ckpt_path='.*notes\.ckpt' is not a checkpoint torch\.load can read"),
    ("other_model", r"ValueError: .*step=4\.ckpt' was saved from a different model: missing \[\], unexpected "
                    r"\['model\.blocks\.2"),
    ("other_optimizer", r"ValueError: optimizer_states\[0\]: the checkpoint's optimizer has param groups of sizes "
                        r"\[\d+, \d+\], this run's \[\d+\]"),
    ("optimizer_under_pp", r"ValueError: optimizer_states\[0\]: .* Under pipeline parallelism each rank's optimizer "
                           r"holds only its stages' parameters"),
])
def test_bad_single_files_fail_on_every_rank(resumed, case, error):
    assert_raised_on_every_rank([r["errors"] for r in resumed], case, error)


def test_transformers_converters_are_read_backwards():
    """Guards the transformers API the expert loading reads (``get_model_conversion_mapping``, ``WeightConverter``
    with ``MergeModulelist``/``Concatenate``): a change there fails here first, in one process."""
    names = stored_names(build_hf("mixtral", **MIXTRAL))
    gate_up = next(c for c in names.converters if c.target == ".experts.gate_up_proj")
    assert (gate_up.sources, gate_up.stack_dim, gate_up.concat_dim) == ((".experts.*.w1.weight",
                                                                         ".experts.*.w3.weight"), 0, 1)
    assert names.names("model.layers.1.mlp.gate.weight") == ["model.layers.1.mlp.gate.weight",
                                                            "model.layers.1.block_sparse_moe.gate.weight"]
    stored = {f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight": type("Md", (), {"size": (64, 64)})()
              for e in range(4) for w in ("w1", "w3")}
    pieces, missing, mismatched = names.pieces("model.layers.1.mlp.experts.gate_up_proj", (4, 128, 64), stored)
    assert not missing and not mismatched
    assert [(p.key.split("experts.")[1], p.offsets, p.sizes) for p in pieces[:2] + pieces[4:5]] == [
        ("0.w1.weight", (0, 0, 0), (1, 64, 64)), ("1.w1.weight", (1, 0, 0), (1, 64, 64)),
        ("0.w3.weight", (0, 64, 0), (1, 64, 64))]
    del stored["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    assert names.pieces("model.layers.1.mlp.experts.gate_up_proj", (4, 128, 64), stored)[1] == [
        "model.layers.1.block_sparse_moe.experts.2.w3.weight"]  # named as missing, as the loader reports it
    assert stored_names(torch.nn.Linear(2, 2)).converters == ()  # not a transformers model: names as they are
