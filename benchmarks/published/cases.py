"""The rows of ``collected_runs.yaml`` as the planner's published cases (tests/test_planner_published.py's
``PublishedCase``), and the half of the split each row belongs to (README.md, "The split").

``load_rows`` reads the rows, ``half_of`` says "fit" or "test" by the repository in the row's ``source`` (the
README's rule), and ``to_case`` turns a row into a ``PublishedCase`` or returns the one-line reason it is left out.
The reasons follow from the row alone (the README's four, a device the table lacks, and what the planner cannot
build); how the planner scores on a row is never one:

- ``precision``: FP8 and MXFP8, which have no peak in the device table (``lightning_par/devices.py``);
- ``software``: MaxText and Paxml, which run on JAX, outside PyTorch;
- ``device``: a device the table lacks (GB300, B300);
- ``DOUBT``: the collector marked the row's source as contradicting itself;
- ``incomplete``: the row's model shape, layout, GPU count, sequence or batch is missing;
- ``unmappable``: a model no architecture of tests/hf_models.py builds, or a layout outside the planner's space
  (its expert parallelism must lie within ``dp_shard x cp``; Megatron's can span tensor-parallel ranks too).

How a row becomes a case (every choice that the row does not state is in ``ASSUMED`` and in the case's ``config``):

- Model. The row's shape (``layers``, ``hidden``, ``heads``, ``kv_heads``, ``ffn``, experts) is used as printed;
  a field the row leaves null is taken from the model family's public configuration (``FAMILIES``: vocabularies,
  head widths, rotary bases), and the case's ``config`` names every field so filled. Families map to the
  architectures of tests/hf_models.py's ``TINY_CONFIGS`` (``PublishedCase.arch``):
  Llama 2/3/3.1 -> "llama"; Nemotron-4 (squared-ReLU, non-gated MLP, GQA) -> "apertus" with ``hidden_act="relu2"``
  (transformers' Apertus block has exactly that MLP: up, activation, down; its per-head q/k RMSNorms are extra);
  GPT-3 175B -> "gpt_neox" with sequential residuals, as benchmarks/planner_heldout.py's ``gpt_neox`` (Megatron's
  GPT layer); MPT -> the example GPT ("gpt"), as planner_heldout's ``mpt``; Grok-1 -> "mixtral" (8 experts, top 2,
  GQA 48/8); DeepSeek-V3 -> "deepseek_v3" (the test module's ``DEEPSEEK_V3``); Qwen3 MoE -> "qwen3_moe"; gpt-oss ->
  "gpt_oss"; Kimi K2 -> "deepseek_v3" (``KIMI_K2``). Llama 4 (dense and MoE layers interleaved, a shared expert,
  chunked attention) and OLMo (no shape in the row) are not mapped.
- Throughput. Whole-job tokens/s (dgxc-benchmarking) are divided by the GPUs; tokens/s per GPU (or per device) are
  used as printed; model TFLOP/s per GPU (NeMo's long-sequence rows) go to ``published_tflops``, which the harness
  converts with its own FLOP count.
- Layout. The data-parallel size is ``gpus / (tp x pp x cp)`` (the printed ``dp`` of Grok-1's dgxc rows is the
  expert-data-parallel size, ``dp / ep``). Megatron-Core rows (dgxc-benchmarking, NeMo, Megatron-Bridge; every
  one with the distributed optimizer: ``distributed_fused_adam``/``mcore_distributed_optim``, Megatron-Bridge's
  "FSDP = 0") plan their data parallelism as ``dp_shard`` with the ZeRO-1-like options of planner_heldout's
  ``MEGATRON_CORE_2024`` (``MEGATRON_CORE``): parameters whole, gradients and optimizer state sharded, one
  reduction per step, no replicas, 1F1B and interleaved 1F1B; equal pipeline stages up to 2024 (NeMo 24.x), unequal
  ones from 2025 (Megatron-Core 0.10's first/last-stage layer counts, which NeMo 25.04's Llama 3.1 405B at PP 8 x
  VP 8 over 126 layers needs). Expert parallelism lies within ``dp_shard x cp``, as Megatron-Core's does with ETP =
  TP. Megatron-Core splits each expert over the tp ranks unless told otherwise (``--expert-tensor-parallel-size``
  defaults to the tp size; before that option existed experts were always split so): a row with tp > 1 and experts
  is priced so (``experts_over_tp="split"``: ``costs.profile.price_experts_as``; the engine keeps experts whole on
  every tp rank), and one that prints ETP 1 with the tp ranks folded into the experts' mesh ("folded"); another
  ETP is unmappable. llm-foundry
  rows are FSDP over all GPUs (``dp_shard``, its ``FULL_SHARD``/``SHARD_GRAD_OP`` being the planner's choice of
  resharding, as planner_heldout's ``mpt``); torchtitan rows are FSDP (``dp_shard``) x TP x PP x CP as printed.
- Gradient accumulation. A row without a pipeline whose micro-batches per step (printed ``grad_accum``, else
  ``global_batch / (dp x micro_batch)``) are 1 fixes ``accumulate_grad_batches=1``; more than 1 leaves it to the
  planner (None), with the printed count in ``config``: the planner weighs, per layout, only the fewest
  micro-batches that fit (``planner.search.accumulated_variants``), so fixing the printed count would drop the
  published layout from the plan. A pipeline splits its batch into its own micro-batches (None as well).
- Activation checkpointing: ``True`` for full, ``False`` for none, ``None`` for selective or unstated (the planner's
  choice among the software's options, ``CHECKPOINTING``: Megatron's selective recomputes the attention core only,
  torchtitan's per-op policy is the planner's "selective"; neither is fixed, as the test module's torchtitan cases).
- ``async_tp`` where the row's techniques say TP communication overlap (``ub_tp_comm_overlap``/"TP comm overlap").
- ``fused_kernels`` (the non-matmul ops priced at ``devices.FUSED_TRAFFIC`` of eager PyTorch's bytes) for the
  software that fuses them: Megatron-Core over Transformer Engine (every dgxc-benchmarking, NeMo and
  Megatron-Bridge row) and torchtitan rows whose techniques name torch.compile; not for LLM Foundry (eager).
- Devices: "H100 ..." -> H100-SXM (Grand Teton's 96 GB H100 with ``memory_gib=96``), "A100 40GB"/"A100 80GB",
  "H200", "B200", "GB200"; links in ``ASSUMED``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
for _path in (str(ROOT), str(ROOT / "tests")):  # the published cases' harness lives with the tests
    if _path not in sys.path:
        sys.path.insert(0, _path)

from test_planner_published import (  # noqa: E402
    DEEPSEEK_V3,
    GPT_OSS_20B,
    GPT_OSS_120B,
    KIMI_K2,
    PublishedCase,
)

ROWS = Path(__file__).with_name("collected_runs.yaml")

#: README.md, "The split": by source repository
FIT_REPOSITORIES = ("mosaicml/llm-foundry", "pytorch/torchtitan")
TEST_REPOSITORIES = ("NVIDIA/dgxc-benchmarking", "NVIDIA-NeMo/Megatron-Bridge", "NVIDIA/NeMo", "allenai/OLMo-core")
MEGATRON_REPOSITORIES = ("NVIDIA/dgxc-benchmarking", "NVIDIA-NeMo/Megatron-Bridge", "NVIDIA/NeMo")

#: what the rows leave unsaid, and what is taken for it
ASSUMED = (
    "Links: NVIDIA's H100 and B200 rows (dgxc-benchmarking, NeMo, Megatron-Bridge; DGX H100/B200, DGX Cloud) 400 "
    "Gb/s InfiniBand per GPU between nodes of 8 (ib-ndr400, not printed); GB200 rows: NVLink between the harness' "
    "8-GPU nodes (nvswitch-nvl72: the trays of an NVL72 rack share one NVLink domain, and Megatron keeps tp, cp, ep "
    "and dp innermost, within a rack of 64-72 GPUs), so the traffic that crosses racks (pipeline sends, data "
    "parallelism beyond a rack) is priced at NVLink speed too; llm-foundry's A100 tables, '1600 Gbps node-node "
    "interconnect (RoCE)': 200 Gb/s per GPU (eth-200), its H100 tables (no interconnect printed): ib-ndr400, both as "
    "planner_heldout's MPT rows; torchtitan's Grand Teton and H200 hosts: RDMA 400 Gb/s per GPU (roce-400), Grand "
    "Teton's H100 with 96 GB (memory_gib=96; its HBM2e bandwidth, 2.4 TB/s, is not the table's 3.35). "
    "Shapes: fields a row leaves null come from the family's public configuration: Llama 3/3.1 vocabulary 128,256 "
    "(rope base 500,000) and 8 key/value heads, Llama 2 32,000, Nemotron-4 256,000, GPT-3 50,257 padded as Megatron "
    "pads it (to a multiple of 128 x tp), Grok-1 131,072, Qwen3 head width 128, gpt-oss head width 64, DeepSeek-V3 "
    "and Kimi K2 the test module's configs; GPT-3 attends with every head (kv_heads = heads). "
    "Nemotron-4 as transformers' Apertus block with hidden_act relu2 (its MLP exactly: up, squared ReLU, down; GQA "
    "as printed), but RMSNorm for Nemotron's LayerNorm1p, rotary over the whole head (Nemotron: half) and Apertus' "
    "per-head q/k RMSNorms on top. GPT-3 175B as GPT-NeoX with sequential residuals (rotary positions for GPT-3's "
    "learned ones). MPT as the example GPT (learned positions for ALiBi, biases on the output projections, an untied "
    "head), as planner_heldout. Grok-1 as Mixtral: SwiGLU experts for its gated GeLU ones (the same three matmuls), "
    "no attention logit soft-cap, two norms per block for its four. DeepSeek-V3 without its multi-token-prediction "
    "layer; routing as the model's config sets it (group-limited, 8 groups, 4 chosen), Megatron-Bridge's forced "
    "balance not modelled. Megatron-Core's distributed optimizer as the ZeRO-1-like FSDP variant (planner_heldout); "
    "TP communication overlap only where the row's techniques name it (unstated: none). torchtitan's rows whose "
    "sequence the table omits: the seq_len its train config at the benchmark's commit sets, as the row's note says.")


# ---------------------------------------------------------------------------------------------------------------
# rows and halves


def load_rows(path: str | Path = ROWS) -> list[dict[str, Any]]:
    """The rows of ``collected_runs.yaml``, in file order, each with its position as ``index``."""
    rows = yaml.safe_load(Path(path).read_text())["runs"]
    return [dict(row, index=i) for i, row in enumerate(rows)]


def repository(row: dict[str, Any]) -> str:
    """The repository ``owner/name`` that opens the row's ``source``."""
    return row["source"].split()[0]


def half_of(row: dict[str, Any]) -> str:
    """"fit" or "test": the README's split, by the repository the row was read from."""
    repo = repository(row)
    if repo in FIT_REPOSITORIES:
        return "fit"
    if repo in TEST_REPOSITORIES:
        return "test"
    raise ValueError(f"{row['name']!r}: repository {repo!r} is in neither half of README.md's split")


# ---------------------------------------------------------------------------------------------------------------
# devices and links

#: the row's device (as printed) -> the device table's name and the GPUs' memory where it differs from the table's
_DEVICES: tuple[tuple[str, str, float | None], ...] = (
    (r"^GB200\b", "GB200", None),
    (r"^B200\b", "B200", None),
    (r"^H200\b", "H200", None),
    (r"^H100 SXM 96GB", "H100-SXM", 96),  # Grand Teton: 96 GB HBM2e at 500 W
    (r"^H100\b", "H100-SXM", None),
    (r"^A100 40GB", "A100-40GB", None),
    (r"^A100 80GB", "A100-80GB", None),
)


def device_of(row: dict[str, Any]) -> tuple[str, float | None] | None:
    for pattern, name, memory in _DEVICES:
        if re.search(pattern, row["device"] or ""):
            return name, memory
    return None


def link_of(row: dict[str, Any]) -> tuple[str, str]:
    """The link between nodes, and why (``ASSUMED``)."""
    repo, said = repository(row), row.get("interconnect") or ""
    if repo == "pytorch/torchtitan":
        return "roce-400", "RDMA 400 Gb/s per GPU (the file's hardware lines)"
    if row["device"].startswith("GB200"):
        return "nvswitch-nvl72", ("NVLink between the trays of an NVL72 rack (the harness plans 8 GPUs per node; "
                                  "traffic between racks priced at NVLink speed too)")
    if "1600 Gbps" in said:
        return "eth-200", "1,600 Gb/s RoCE per 8-GPU node as printed: 200 Gb/s per GPU (eth-200)"
    return "ib-ndr400", "400 Gb/s InfiniBand per GPU (assumed; not printed)"


# ---------------------------------------------------------------------------------------------------------------
# model families


def _llama(shape: dict[str, Any], seq: int, vocab: int, theta: float) -> tuple[str, dict[str, Any]]:
    return "llama", dict(hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], vocab_size=vocab, rope_theta=theta,
                         tie_word_embeddings=False, max_position_embeddings=max(seq, 4096))


def _nemotron(shape: dict[str, Any], seq: int, vocab: int) -> tuple[str, dict[str, Any]]:
    """Nemotron-4: squared-ReLU MLP (no gate), GQA, untied embeddings: Apertus' block with ``relu2``."""
    return "apertus", dict(hidden_size=shape["hidden"], intermediate_size=shape["ffn"], hidden_act="relu2",
                           num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                           num_key_value_heads=shape["kv_heads"], head_dim=shape["hidden"] // shape["heads"],
                           vocab_size=vocab, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           tie_word_embeddings=False, max_position_embeddings=max(seq, 4096))


def _gpt_neox(shape: dict[str, Any], seq: int, vocab: int) -> tuple[str, dict[str, Any]]:
    """Megatron's GPT layer, as benchmarks/planner_heldout.py's ``gpt_neox``: fused qkv, 4h GeLU MLP, biases."""
    hidden, heads = shape["hidden"], shape["heads"]
    return "gpt_neox", dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                            num_hidden_layers=shape["layers"], intermediate_size=shape["ffn"], vocab_size=vocab,
                            max_position_embeddings=seq)


def _mpt(shape: dict[str, Any], seq: int, vocab: int) -> tuple[str, dict[str, Any]]:
    """MPT as the example GPT, as benchmarks/planner_heldout.py's ``mpt`` (``gpt``)."""
    return "gpt", dict(vocab_size=vocab, block_size=seq, n_layer=shape["layers"], n_head=shape["heads"],
                       n_embd=shape["hidden"])


def _mixtral(shape: dict[str, Any], seq: int, vocab: int) -> tuple[str, dict[str, Any]]:
    return "mixtral", dict(hidden_size=shape["hidden"], intermediate_size=shape["moe_ffn"] or shape["ffn"],
                           num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                           num_key_value_heads=shape["kv_heads"], num_local_experts=shape["experts"],
                           num_experts_per_tok=shape["experts_per_token"], vocab_size=vocab,
                           tie_word_embeddings=False, max_position_embeddings=max(seq, 4096))


def _qwen3_moe(shape: dict[str, Any], seq: int, vocab: int) -> tuple[str, dict[str, Any]]:
    return "qwen3_moe", dict(hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                             num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                             num_key_value_heads=shape["kv_heads"], head_dim=128,
                             moe_intermediate_size=shape["moe_ffn"], num_experts=shape["experts"],
                             num_experts_per_tok=shape["experts_per_token"], vocab_size=vocab,
                             tie_word_embeddings=False, max_position_embeddings=max(seq, 40960))


def _from(base: dict[str, Any], keys: dict[str, str]) -> Any:
    """A family whose whole config the test module holds: the row's printed sizes over it (``keys``: the config
    field of each shape field)."""
    def build(shape: dict[str, Any], seq: int, vocab: int) -> dict[str, Any]:
        model = dict(base, vocab_size=vocab, max_position_embeddings=max(seq, base["max_position_embeddings"]))
        model.update({field: shape[key] for key, field in keys.items() if shape.get(key) is not None})
        return model
    return build


_DSV3_KEYS = dict(layers="num_hidden_layers", hidden="hidden_size", heads="num_attention_heads",
                  ffn="intermediate_size", experts="n_routed_experts", experts_per_token="num_experts_per_tok",
                  moe_ffn="moe_intermediate_size")
_GPT_OSS_KEYS = dict(layers="num_hidden_layers", hidden="hidden_size", heads="num_attention_heads",
                     kv_heads="num_key_value_heads", moe_ffn="intermediate_size", experts="num_local_experts",
                     experts_per_token="num_experts_per_tok")

#: (pattern on the row's ``model``, arch, builder, the family's defaults for fields a row may leave null, what the
#: stand-in leaves out). The builder takes the completed shape, the sequence and the vocabulary.
FAMILIES: tuple[tuple[str, str, Any, dict[str, Any], str], ...] = (
    (r"^Llama 3(\.1)? ", "llama", lambda s, q, v: _llama(s, q, v, 500000.0),
     dict(vocab=128256, kv_heads=8, ffn={8192: 28672, 4096: 14336, 16384: 53248}), ""),
    (r"^Llama 2 ", "llama", lambda s, q, v: _llama(s, q, v, 10000.0), dict(vocab=32000), ""),
    (r"^Nemotron", "apertus", _nemotron, dict(vocab=256000),
     "Nemotron-4 as Apertus with relu2: RMSNorm for LayerNorm1p, full for half rotary, extra q/k RMSNorms"),
    (r"^GPT-3 \d", "gpt_neox", _gpt_neox, dict(vocab="gpt3"),
     "GPT-3 as GPT-NeoX with sequential residuals: rotary for learned positions"),
    (r"^MPT-", "gpt", _mpt, dict(vocab=50368),
     "MPT as the example GPT: learned positions for ALiBi, projection biases, an untied output head"),
    (r"^Grok-1", "mixtral", _mixtral, dict(vocab=131072),
     "Grok-1 as Mixtral: SwiGLU for gated-GeLU experts, no logit soft-cap, 2 norms per block for 4"),
    (r"^Qwen3-\d+B-A\d+B", "qwen3_moe", _qwen3_moe, dict(vocab=151936), ""),
    (r"^DeepSeek-V3", "deepseek_v3", lambda s, q, v: ("deepseek_v3", _from(DEEPSEEK_V3, _DSV3_KEYS)(s, q, v)),
     dict(vocab=DEEPSEEK_V3["vocab_size"]), "DeepSeek-V3 without its multi-token-prediction layer"),
    (r"^Kimi K2", "deepseek_v3", lambda s, q, v: ("deepseek_v3", _from(KIMI_K2, _DSV3_KEYS)(s, q, v)),
     dict(vocab=KIMI_K2["vocab_size"]), ""),
    (r"^gpt-oss-120b", "gpt_oss", lambda s, q, v: ("gpt_oss", _from(GPT_OSS_120B, _GPT_OSS_KEYS)(s, q, v)),
     dict(vocab=GPT_OSS_120B["vocab_size"]), ""),
    (r"^gpt-oss-20b", "gpt_oss", lambda s, q, v: ("gpt_oss", _from(GPT_OSS_20B, _GPT_OSS_KEYS)(s, q, v)),
     dict(vocab=GPT_OSS_20B["vocab_size"]), ""),
)
#: families no architecture of tests/hf_models.py builds
UNMAPPED = (
    (r"^Llama 4", "Llama 4 (dense and MoE layers interleaved, a shared expert, chunked attention) has no "
                  "architecture in tests/hf_models.py"),
    (r"^OLMo", "OLMo has no shape in the row"),
)
#: the fields every family needs from the row itself
_REQUIRED = ("layers", "hidden", "heads")
_MOE_REQUIRED = ("experts", "experts_per_token")


def _pad(vocab: int, multiple: int) -> int:
    return -(-vocab // multiple) * multiple


def model_of(row: dict[str, Any], seq: int, tp: int) -> tuple[str, dict[str, Any], list[str], str] | str:
    """(arch, config fields, the fields filled from the family, the stand-in's approximation), or a reason."""
    name, shape = row["model"], dict(row["shape"] or {})
    for pattern, why in UNMAPPED:
        if re.search(pattern, name):
            return f"unmappable: {why}"
    for pattern, arch, build, defaults, approximation in FAMILIES:
        if not re.search(pattern, name):
            continue
        missing = [k for k in _REQUIRED if shape.get(k) is None]
        if arch in ("mixtral", "qwen3_moe"):
            missing += [k for k in _MOE_REQUIRED if shape.get(k) is None]
        if missing:
            return f"incomplete: the shape lacks {', '.join(missing)}"
        filled: list[str] = []
        if arch == "gpt":  # the example GPT: every head attends, a 4h MLP (MPT's expansion ratio 4)
            shape.update(kv_heads=shape["heads"], ffn=4 * shape["hidden"])
        if shape.get("kv_heads") is None and arch != "deepseek_v3":  # (multi-head latent attention)
            shape["kv_heads"] = defaults.get("kv_heads", shape["heads"])
            filled.append(f"kv_heads {shape['kv_heads']}" + (" (every head)" if shape["kv_heads"] == shape["heads"]
                                                             else ""))
        if shape.get("ffn") is None:
            table = defaults.get("ffn")
            if isinstance(table, dict) and shape["hidden"] in table:
                shape["ffn"] = table[shape["hidden"]]
            else:
                shape["ffn"] = 4 * shape["hidden"]
            filled.append(f"ffn {shape['ffn']}")
        vocab = shape.get("vocab")
        if vocab is None:
            vocab = defaults["vocab"]
            if vocab == "gpt3":
                vocab = _pad(50257, 128 * tp)
                filled.append(f"vocab {vocab} (GPT-2 BPE's 50,257 padded to 128 x tp)")
            else:
                filled.append(f"vocab {vocab}")
        result = build(shape, seq, vocab)
        arch, model = result if isinstance(result, tuple) else (arch, result)
        return arch, model, filled, approximation
    return f"unmappable: no architecture of tests/hf_models.py stands in for {name!r}"


# ---------------------------------------------------------------------------------------------------------------
# software options

#: Megatron-Core as benchmarks/planner_heldout.py's ``MEGATRON_CORE_2024``: the distributed optimizer over the whole
#: data-parallel group (the ZeRO-1-like FSDP variant: parameters whole, one reduction per step), no replicas,
#: 1F1B and interleaved 1F1B; ``uneven_stages`` per release (``to_case``)
MEGATRON_CORE = dict(restrict={"dp_replicate": [1]}, schedules=("1f1b", "interleaved_1f1b"),
                     reshard_after_forward=(False,), accumulate_unsharded=(True,))


def _checkpointing(row: dict[str, Any]) -> bool | None:
    said = (row.get("activation_checkpointing") or "").lower()
    if said.startswith("full"):
        return True
    if said.startswith("none"):
        return False
    return None  # selective or unstated: the planner's choice among the software's options


def _tokens_per_gpu(row: dict[str, Any]) -> tuple[float | None, float | None, str]:
    """(tokens/s per GPU, model TFLOP/s per GPU, how) from the value and unit as printed."""
    value, unit = float(row["throughput_value"]), row["throughput_unit"]
    if unit.startswith("TFLOPS/GPU"):
        return None, value, f"{value:g} model TFLOP/s per GPU"
    if "whole job" in unit:
        return value / row["gpus"], None, f"{value:,.0f} tokens/s for the job / {row['gpus']} GPUs"
    return value, None, f"{value:,.0f} tokens/s per GPU"


def _seq_len(row: dict[str, Any]) -> tuple[int | None, str]:
    if row.get("seq_len"):
        return row["seq_len"], ""
    found = re.search(r"default to seq_len = (\d+)", row.get("note") or "")
    if found and repository(row) == "pytorch/torchtitan":
        return int(found.group(1)), f"seq {found.group(1)} from torchtitan's train config (the row's note)"
    return None, ""


# ---------------------------------------------------------------------------------------------------------------
# the conversion


def to_case(row: dict[str, Any]) -> PublishedCase | str:
    """The row as a ``PublishedCase``, or the one-line reason it is left out (``category: detail``)."""
    repo, software = repository(row), row.get("software") or ""
    if re.search(r"JAX|MaxText|Paxml", software):
        return f"software: {software.split(' (')[0]} runs on JAX, outside PyTorch"
    precision = row.get("precision")
    if precision in ("fp8", "mxfp8"):
        return f"precision: {precision} has no peak in the device table"
    device = device_of(row)
    if device is None:
        return f"device: {row['device']} is not in lightning_par/devices.py's table"
    if "DOUBT" in (row.get("note") or ""):
        return "DOUBT: " + (row["note"].split("DOUBT", 1)[1].lstrip(" :") or "marked in the note").split(". ")[0]
    if precision not in ("bf16", "fp16"):
        return f"incomplete: precision {precision!r}"
    if not row.get("gpus"):
        return "incomplete: no GPU count"
    seq, seq_note = _seq_len(row)
    if seq is None:
        return "incomplete: no sequence length"
    lay = row["layout"] or {}
    tp, pp, cp = (lay.get(k) or 1 for k in ("tp", "pp", "cp"))
    ep = lay.get("ep") or 1
    gpus = row["gpus"]
    if gpus % (tp * pp * cp):
        return f"incomplete: {gpus} GPUs are not a multiple of tp {tp} x pp {pp} x cp {cp}"
    dp = gpus // (tp * pp * cp)
    notes = [n for n in (seq_note,) if n]

    global_batch, micro = row.get("global_batch"), row.get("micro_batch")
    if global_batch is None and repo == "pytorch/torchtitan" and micro:
        global_batch = micro * dp  # torchtitan: the local batch on every data-parallel rank, no accumulation
        notes.append(f"global batch {global_batch} = local batch {micro} x dp {dp}")
    if global_batch is None:
        return "incomplete: no global batch"
    if global_batch % dp:
        return f"incomplete: global batch {global_batch} does not split over dp {dp}"

    mapped = model_of(row, seq, tp)
    if isinstance(mapped, str):
        return mapped
    arch, model, filled, approximation = mapped
    experts = row["shape"].get("experts")
    if ep > 1 and (not experts or (dp * cp) % ep or experts % ep):
        return (f"unmappable: ep {ep} is not within dp_shard {dp} x cp {cp} or does not divide the {experts} "
                f"experts, as the planner's ep must (Megatron's expert parallelism spans tensor-parallel ranks too)")

    # gradient accumulation: micro-batches per step without a pipeline
    accumulate: int | None = None
    printed_ga = lay.get("grad_accum")
    steps = printed_ga
    if steps is None and micro:
        steps = global_batch // (dp * micro) if global_batch % (dp * micro) == 0 else None
    if pp == 1 and steps == 1:
        accumulate = 1
    if printed_ga and micro and printed_ga * dp * micro != global_batch:
        notes.append(f"printed GA {printed_ga} x dp {dp} x micro-batch {micro} != global batch {global_batch}")

    published, tflops, how = _tokens_per_gpu(row)
    device_name, memory = device
    link, link_why = link_of(row)
    checkpointing = _checkpointing(row)
    techniques = row.get("techniques") or ""
    async_tp = tp > 1 and bool(re.search(r"TP comm overlap|tp_comm_overlap", techniques, re.I))

    options: dict[str, Any] = {}
    layout = {"dp_shard": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
    etp = lay.get("etp")
    if repo in MEGATRON_REPOSITORIES:  # Megatron-Core over Transformer Engine: fused non-matmul kernels
        options = dict(MEGATRON_CORE, uneven_stages=row["year"] >= 2025, fused_kernels=True)
        data = f"DP {dp} (distributed optimizer, planned ZeRO-1-like)"
        if experts and tp > 1:  # the experts split over tp unless the row prints ETP 1 (ETP defaults to TP)
            if etp not in (None, 1, tp):
                return f"unmappable: ETP {etp} is neither 1 nor TP {tp}, the two ways the planner prices experts"
            options["experts_over_tp"] = "folded" if etp == 1 else "split"
            data += f", ETP {tp if etp != 1 else 1}"
    elif repo == "mosaicml/llm-foundry":
        if (lay.get("fsdp") or gpus) != gpus or (tp, pp, cp) != (1, 1, 1):
            return f"incomplete: llm-foundry layout {lay} is not FSDP over all {gpus} GPUs"
        data = f"FSDP {gpus} ({lay.get('sharding_strategy')}, mixed precision {lay.get('mp_mode')})"
    elif repo == "pytorch/torchtitan":
        fsdp = lay.get("fsdp") or 1
        if fsdp != dp:
            return f"incomplete: torchtitan FSDP {fsdp} x tp {tp} x pp {pp} x cp {cp} is not {gpus} GPUs"
        data = f"FSDP {fsdp}"
        options = dict(fused_kernels="torch.compile" in techniques)
    else:
        return f"unmappable: no software options for {repo}"
    layout = {k: v for k, v in layout.items() if v > 1}

    sizes = " x ".join(f"{k.upper()} {v}" for k, v in (("tp", tp), ("pp", pp), ("vp", lay.get("vp") or 1),
                                                         ("cp", cp), ("ep", ep)) if v > 1)
    ga_text = f", GA {steps}" if steps else ""
    ac_text = row.get("activation_checkpointing") or "unstated"
    config = (f"{row['model']} ({arch}{': ' + approximation if approximation else ''}"
              f"{'; filled from the family: ' + ', '.join(filled) if filled else ''}), seq {seq}, global batch "
              f"{global_batch}, micro-batch {micro}{ga_text}, {precision}; {data}{' x ' + sizes if sizes else ''}; "
              f"AC: {ac_text}; {'TP comm overlap; ' if async_tp else ''}{gpus} {row['device']}, {link_why}; "
              f"{how}{'; ' + '; '.join(notes) if notes else ''}")
    return PublishedCase(
        row["name"], row["source"], config, model, world=gpus, global_batch=global_batch, seq_len=seq,
        published_tokens_per_s=published, published_tflops=tflops, layout=layout, device=device_name,
        inter_link=link, memory_gib=memory, activation_checkpointing=checkpointing, async_tp=async_tp,
        accumulate_grad_batches=accumulate, arch=arch,
        precision="bf16-mixed" if precision == "bf16" else "16-mixed", **options)


def convert(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], PublishedCase | str]]:
    """Every row with its case or its reason."""
    return [(row, to_case(row)) for row in rows]
