"""Tensor parallelism as a technique of the engine: the plan, checked on the whole model, applied to what this rank
runs; loss parallelism while a step runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.tensor.parallel import loss_parallel

from lightning_par._compat import enable_async_tensor_parallel
from lightning_par.checks import check_bool
from lightning_par.collectives import raise_on_every_rank
from lightning_par.costs.profile import END_SECTIONS, ModelProfile
from lightning_par.costs.sheet import CostSheet, Transfer, busiest_sections, params_by_planned_module, per_cut
from lightning_par.dims import ParallelDims
from lightning_par.techniques.technique import Options, Target, Technique, planned
from lightning_par.techniques.tensor.sequence_regather import regathered_sequence
from lightning_par.techniques.tensor.tensor import (
    apply_tp,
    broadcast_replicated_parameters,
    quantized_cut_problems,
)
from lightning_par.techniques.tensor.tensor_plan import resolve_tp_plan, validate_tp_plan
from lightning_par.techniques.tensor.tensor_styles import style_price


def check_regather_with_compile(regather_sequence: bool, compile: bool) -> None:
    """The two do not combine: torch.compile does not trace the saved-tensor hooks that keep the chunks."""
    if regather_sequence and compile:
        raise ValueError("regather_sequence=True with compile=True: the saved-tensor hooks that keep the sequence "
                         "chunks are not traced by torch.compile. Turn one of them off.")


def check_async_tp_with_compile(async_tp: bool, compile: bool) -> None:
    """Async tensor parallelism is a pass of Inductor's over the compiled blocks: eager blocks have nothing to
    pipeline."""
    if async_tp and not compile:
        raise ValueError("async_tp=True with compile=False: the all-gathers and reduce-scatters are pipelined with "
                         "their matmuls by a torch.compile (Inductor) pass over each block. Pass compile=True too, "
                         "or drop async_tp.")


def check_async_tp_device(async_tp: bool, device_type: str) -> None:
    """Async tensor parallelism moves its chunks through CUDA symmetric memory."""
    if async_tp and device_type != "cuda":
        raise ValueError(f"async_tp=True on accelerator {device_type!r}: the pipelined all-gathers and "
                         f"reduce-scatters run on CUDA symmetric memory (NVLink). Run with accelerator='cuda', or "
                         f"drop async_tp.")


@dataclass(frozen=True)
class TensorParallelOptions(Options):
    """Tensor parallelism's options, under the names ``NDParallelStrategy`` takes them (the one source of their
    defaults; ``docs/strategies.md``'s option table names each)."""

    tp_plan: Mapping[str, Any] | None = None
    sequence_parallel: bool = planned(False, weigh=(True, False),
                                      flag="with tp > 1: weigh sequence parallelism on, off or both (default)")
    #: the planner turns it on with sequence parallelism where the model's head is vocabulary-parallel
    loss_parallel: bool = planned(False)
    regather_sequence: bool = planned(
        False, weigh=(False, True), flag="with sequence parallelism: weigh saving the gathered layer inputs as "
        "chunks gathered again in backward on, off or both (default: for the layouts that do not fit without it)")
    async_tp: bool = planned(
        False, weigh=(False, True), flag="with sequence parallelism on a GPU, weigh its collectives pipelined with "
        "their matmuls (Inductor's async tensor parallelism, which needs 2+ CUDA GPUs and has never run; the layout "
        "then needs compile=True): --async-tp (or both) weighs it beside the plain layouts, on forces it, off leaves "
        "it out. Default: left out of the ranking, and one line says which layout would win if it worked")

    UNTRIED = {"async_tp": "async TP needs 2+ CUDA GPUs and has never run"}
    LEGEND = (
        (r"\bSP\b", "SP = sequence parallelism"),
        (r"\bregather\b", "regather = sequence-parallel inputs gathered again in backward"),
        (r"\basync TP\b", "async TP = tensor-parallel collectives pipelined with their matmuls (compile=True)"),
        (r"\bLP\b", "LP = loss parallelism (cross-entropy on vocabulary-sharded logits)"),
    )

    def build(self) -> TensorParallel:
        return TensorParallel(self.tp_plan, self.sequence_parallel, self.loss_parallel, self.regather_sequence,
                              self.async_tp)

    def label(self, dims: ParallelDims) -> list[str]:
        return [word for on, word in ((self.sequence_parallel, "SP"), (self.regather_sequence, "regather"),
                                      (self.async_tp, "async TP"), (self.loss_parallel, "LP")) if on]

    def layout_kwargs(self, dims: ParallelDims) -> dict[str, Any]:
        out = super().layout_kwargs(dims)
        if self.async_tp:  # a pass of torch.compile's
            out["compile"] = True
        return out

    # ---- what the planner weighs (``planner/search.py`` calls these in its order; ``judge(predictions)`` says
    # whether a twin could come near the fastest of them) ----
    @staticmethod
    def check_weighed(weigh: Mapping[str, tuple]) -> None:
        """Refuse weighing only what cannot be: re-gathered chunks everywhere with async tp everywhere."""
        if weigh["regather_sequence"] == (True,) and weigh["async_tp"] == (True,):
            raise ValueError("regather_sequence=(True,) with async_tp=(True,): async tensor parallelism is compiled "
                             "and re-gathering is not (see NDParallelStrategy). Weigh one of them, or both: "
                             "(False, True).")

    @staticmethod
    def check_forced(forced: Mapping[str, Any], compile: bool) -> None:
        """``AutoParallelStrategy``'s fixed choices (None: the planner's), refused before any planning."""
        sequence_parallel, regather = forced.get("sequence_parallel"), forced.get("regather_sequence")
        async_tp = forced.get("async_tp")
        if regather and sequence_parallel is False:
            raise ValueError("regather_sequence=True with sequence_parallel=False: only sequence parallelism gathers "
                             "a layer's input from sequence chunks. Drop sequence_parallel=False (the planner then "
                             "weighs it), or drop regather_sequence.")
        check_regather_with_compile(bool(regather), compile)
        check_async_tp_with_compile(bool(async_tp), compile)
        if async_tp and (sequence_parallel is False or regather):
            raise ValueError("async_tp=True with sequence_parallel=False or regather_sequence=True: async tensor "
                             "parallelism pipelines sequence parallelism's collectives in compiled blocks. Drop one "
                             "of them.")

    @staticmethod
    def auto_weigh(weigh: dict[str, tuple], compile: bool) -> None:
        """What ``AutoParallelStrategy`` weighs unless told: no re-gathered chunks with ``compile`` (the hooks that
        keep the chunks are not traced by torch.compile)."""
        if compile and "regather_sequence" not in weigh:
            weigh["regather_sequence"] = (False,)

    @staticmethod
    def choices(sizes: Mapping[str, int], weighed: Mapping[str, tuple], profile: ModelProfile) -> list[dict[str, Any]]:
        """Sequence parallelism on and off as weighed, where the model's plan allows it at this tp (loss
        parallelism with it where the head is vocabulary-parallel)."""
        tp = sizes["tp"]
        sp_choices = [sp for sp in weighed["sequence_parallel"] if not sp or plan_fits(profile, tp, True)]
        if tp == 1 or not sp_choices:
            sp_choices = [False]
        head = "vocab_parallel_head" in {s for s in profile.tp_plan.values() if isinstance(s, str)}
        return [{"sequence_parallel": sp, "loss_parallel": sp and head} for sp in sp_choices]

    @staticmethod
    def regather(predictions: list, weigh: Mapping[str, tuple], judge: Callable, run: Callable,
                 after: Callable[[list], list]) -> list:
        """Re-gathered chunks: everywhere sequence parallelism is (weighed ``(True,)``), or the twins of the
        layouts that do not fit but could come near the fastest (``regather_twins``), each also as ``after``
        gives it (gradient accumulation's variants of a twin that still does not fit)."""
        if weigh["regather_sequence"] == (True,):
            return run([TensorParallelOptions.force(p.layout, weigh) for p in predictions])
        if len(weigh["regather_sequence"]) == 2:
            regathered = run(TensorParallelOptions.regather_twins(predictions, judge(predictions)))
            predictions = predictions + regathered + after(regathered)
        return predictions

    @staticmethod
    def force(layout: Any, weigh: Mapping[str, tuple]) -> Any:
        """``layout`` as the choices weighed alone make every layout (re-gathered chunks wherever sequence
        parallelism is)."""
        if weigh["regather_sequence"] == (True,):
            return replace(layout, regather_sequence=layout.sequence_parallel)
        return layout

    @staticmethod
    def regather_twins(predictions: list, judge: Any) -> list:
        """The ``regather_sequence`` twin of every sequence-parallel layout outside activation checkpointing that
        does not fit and could come near the fastest (``judge``): the twin saves the gathered layer inputs as
        chunks (it may fit where the layout does not, and run without recomputation where the fitting variants
        recompute) for one more exposed all-gather per input. A layout that fits gains nothing."""
        return [replace(p.layout, regather_sequence=True) for p in predictions
                if p.layout.sequence_parallel and not p.layout.regather_sequence and not p.fits
                and not p.layout.recomputes and judge.near(p, p.step_s)
                # at most every saved activation shrinks to 1/tp: a layout further over its budget stays over
                and (p.budget is None or p.memory - p.activations * (1 - 1 / p.layout.tp) <= p.budget)]

    @staticmethod
    def pipelined(predictions: list, weigh: Mapping[str, tuple], judge: Callable, run: Callable) -> list:
        """Async tensor parallelism: the twins of the layouts that could come near the fastest
        (``async_tp_twins``), or with ``(True,)`` every such layout pipelined instead."""
        if weigh["async_tp"] == (False,):
            return predictions
        forced = weigh["async_tp"] == (True,)
        pipelined = TensorParallelOptions.async_tp_twins(predictions, judge(predictions), everyone=forced)
        if forced:  # every such layout pipelined instead, the others as they are
            twinned = {replace(layout, async_tp=False) for layout in pipelined}
            predictions = [p for p in predictions if p.layout not in twinned]
        return predictions + run(pipelined)

    @staticmethod
    def async_tp_twins(predictions: list, judge: Any, everyone: bool = False) -> list:
        """The async tensor-parallel twin of every sequence-parallel layout (not re-gathering, not
        context-parallel: neither is compiled yet) that, with all its exposed tensor-parallel time gone (more than
        the twin saves: what does not fit behind its matmul stays), could come near the fastest (``judge``;
        ``everyone``: of each). Same memory, same compute: only the time differs, so only layouts that fit get a
        twin (``everyone``: all)."""
        return [replace(p.layout, async_tp=True) for p in predictions
                if p.layout.tp > 1 and p.layout.sequence_parallel and not p.layout.regather_sequence
                and p.layout.cp == 1 and not p.layout.async_tp
                and (everyone or (p.fits and judge.near(p, p.step_s - p.comm_s.get("tp", 0.0))))]


def plan_fits(profile: ModelProfile, tp: int, sequence_parallel: bool) -> bool:
    """Whether the model's plan validates for ``tp`` (the engine's own check), cached on the profile."""
    key = (tp, sequence_parallel)
    if key not in profile.tp_checks:
        try:
            validate_tp_plan(profile.meta_module, profile.tp_source_plan, tp, sequence_parallel=sequence_parallel)
            profile.tp_checks[key] = bool(profile.tp_source_plan)
        except (ValueError, TypeError):
            profile.tp_checks[key] = False
    return profile.tp_checks[key]


class TensorParallel(Technique):
    """``parallelize_module`` with the plan (FQN globs -> styles) over the tp mesh, after the weights are broadcast
    within the tp group so that every rank starts from the same values. Under pipeline parallelism the plan is
    checked on the whole (meta) model, so every rank refuses a bad plan alike, and applied to this rank's stages."""

    def __init__(self, plan: Mapping[str, Any] | None = None, sequence_parallel: bool = False,
                 loss_parallel: bool = False, regather_sequence: bool = False, async_tp: bool = False) -> None:
        if plan is not None and not isinstance(plan, Mapping):
            raise TypeError(f"tp_plan must map FQN globs to style names, e.g. {{'model.blocks.*.attn.q': 'colwise'}}; "
                            f"got {type(plan).__name__}.")
        self.plan = dict(plan) if plan is not None else None
        self.sequence_parallel = check_bool("sequence_parallel", sequence_parallel)
        self.loss_parallel = check_bool("loss_parallel", loss_parallel)
        self.regather_sequence = check_bool("regather_sequence", regather_sequence)
        if self.regather_sequence and not self.sequence_parallel:
            raise ValueError("regather_sequence=True with sequence_parallel=False: only sequence parallelism gathers "
                             "a layer's input from sequence chunks. Pass sequence_parallel=True too, or drop "
                             "regather_sequence.")
        self.async_tp = check_bool("async_tp", async_tp)
        if self.async_tp and not self.sequence_parallel:
            raise ValueError("async_tp=True with sequence_parallel=False: async tensor parallelism pipelines the "
                             "all-gathers and reduce-scatters that sequence parallelism puts around the matmuls "
                             "(without it they are all-reduces, which it leaves alone). Pass sequence_parallel=True "
                             "too, or drop async_tp.")
        self._sequence_multiple: tuple[int, int, int] | None = None  # (tp, cp, pp): see shard_batch

    def check(self, dims: ParallelDims) -> None:
        if self.async_tp and dims.tp == 1:
            raise ValueError("async_tp=True with tp=1: there are no tensor-parallel collectives to pipeline. Set "
                             "tp > 1, or drop async_tp.")

    def apply(self, target: Target, dims: ParallelDims) -> None:
        if dims.tp == 1:
            return
        if self.sequence_parallel and dims.pp > 1:
            self._sequence_multiple = (dims.tp, dims.cp, dims.pp)
        plan = resolve_tp_plan(target.module, self.plan, loss_parallel=self.loss_parallel)
        resolved = validate_tp_plan(target.whole, plan, dims.tp, sequence_parallel=self.sequence_parallel,
                                    loss_parallel=self.loss_parallel)
        if target.keep is not None:
            plan = {fqn: style for fqn, style in resolved.items()
                    if any(fqn == owner or fqn.startswith(owner + ".") for owner in target.keep)}
        # FSDP's row shards of each tensor-parallel piece of a quantized weight
        shards_after = dims.mesh_size("dp_shard_cp")
        mine = validate_tp_plan(target.module, plan, dims.tp, sequence_parallel=self.sequence_parallel,
                                loss_parallel=self.loss_parallel, whole_model=target.keep is None)
        problems = quantized_cut_problems(target.module, mine, dims.tp, target.quantized_cut, shards_after)
        if dims.pp > 1:  # a pipeline rank sees its own layers: every rank raises what any rank found
            raise_on_every_rank(problems)
        elif problems:
            raise ValueError(" ".join(problems))
        tp_mesh = dims.mesh("tp")
        broadcast_replicated_parameters(target.module, tp_mesh)
        apply_tp(target.module, tp_mesh, plan, sequence_parallel=self.sequence_parallel,
                 loss_parallel=self.loss_parallel, whole_model=target.keep is None,
                 regather_sequence=self.regather_sequence, quantized_cut=target.quantized_cut,
                 shards_after=shards_after)
        if self.async_tp:  # before the Compile technique compiles the blocks
            enable_async_tensor_parallel(tp_mesh.get_group().group_name)

    def shard_batch(self, batch: Any) -> Any:
        """Under a pipeline only the first stage's ranks split the sequence (and would refuse an uneven split); the
        others would wait for them: every rank checks the batch's sequence length here, before any collective."""
        if self._sequence_multiple is None:
            return batch
        tp, cp, pp = self._sequence_multiple
        values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else [
            batch]
        for value in values:
            if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.size(1) % (tp * cp):
                raise ValueError(
                    f"sequence_parallel=True with pp={pp}, tp={tp}, cp={cp}: a batch holds sequences of length "
                    f"{value.size(1)} (dim 1 of shape {tuple(value.shape)}), not divisible by tp x cp = {tp * cp}. "
                    f"Pad or crop sequences to a multiple of {tp * cp}, or turn sequence_parallel off.")
        return batch

    def step_context(self, dims: ParallelDims) -> AbstractContextManager | None:
        # around backward too: its ops must see the DTensor gradients of the vocab-sharded logits; the gathered
        # inputs' chunks are packed in forward and gathered again in backward
        if dims.tp == 1 or not (self.loss_parallel or self.regather_sequence):
            return None
        return self._step_context()

    @contextmanager
    def _step_context(self) -> Iterator[None]:
        with ExitStack() as stack:
            if self.loss_parallel:
                stack.enter_context(loss_parallel())
            if self.regather_sequence:
                stack.enter_context(regathered_sequence())
            yield

    def account(self, sheet: CostSheet) -> None:
        """The plan's sharded parameters and the activations between a column- and a row-parallel layer split over
        tp (the residual stream too under sequence parallelism, the logits under loss parallelism). Per micro-batch
        on the busiest pipeline rank, which nothing hides: per block two all-reduces of the residual stream in
        forward and two in backward (sequence parallelism moves the same bytes as all-gathers and
        reduce-scatters); a vocabulary-parallel embedding's output all-reduce; the head's input-gradient
        all-reduce, plus its gathered logits (a head that gathers them) or loss parallelism's three all-reduces of
        one number per token; and per step, under sequence parallelism, one all-reduce of the gradient of every
        parameter tp leaves whole on the sequence shards (norms, position embeddings): each rank saw only its
        part of the sequence; and per step one all-reduce of each 'head_norm' weight's gradient (each rank
        normalized its own heads). Under sequence parallelism pipeline stages send 1/tp of the activations. With
        ``regather_sequence`` (not under autocast alone, where it changes nothing) backward gathers each saved layer
        input again that sequence parallelism gathered (the profile counts them: a block's attention and MLP
        inputs, a head's; none in checkpointed blocks), twice under a schedule that splits backward in two."""
        tp = sheet.dims.tp
        if tp == 1:
            return
        sheet.tp, sheet.sequence_sharded, sheet.vocab_sharded = tp, self.sequence_parallel, self.loss_parallel
        sheet.inputs_chunked = self.regather_sequence and not sheet.autocast_only
        sections, blocks = per_cut(sheet, ("tp_sections",), lambda: (
            frozenset(busiest_sections(sheet)),
            max(sum(s not in END_SECTIONS for s in r) for r in sheet.rank_sections)))
        tokens, m = sheet.microbatch_tokens, sheet.microbatches
        residual = tokens * sheet.profile.hidden_bytes * sheet.activation_scale
        # under autocast alone only the row-parallel matmuls' outputs are in half precision (the forward
        # reductions); what a norm or the embedding hands on and the gradients reaching them past autocast's casts
        # stay in the traced dtype (sequence parallelism's all-gathers, the backward reductions, the embedding's
        # all-reduce, the head's input gradient)
        whole_dtype = tokens * sheet.profile.hidden_bytes if sheet.autocast_only else residual
        block = (residual + whole_dtype) / 2  # half of the blocks' messages each way
        # recomputed forwards send their two again; selective keeps the reduce-scatters of sequence parallelism,
        # and the all-gathers it sends again cost half an all-reduce each
        forward = 2 * blocks * m
        pipelined = _pipelined_block_transfers(sheet, block) if self.async_tp else []
        sheet.transfers += pipelined
        # what async tp does not pipeline (blocks without a column/row pair: a mixture of experts' MLP) is sent as
        # it would be without it: the plain account's four all-reduces per block, less the pipelined halves
        plain = 4 * blocks * m - sum(t.count for t in pipelined) / 2
        if plain > 0:
            share = plain / (4 * blocks * m)
            sheet.transfers.append(Transfer("tp", "tp", "all_reduce", block, plain, False, forward * share,
                                            (forward / 2 if self.sequence_parallel else forward) * share))
        embeddings, heads, whole, head_norms = _planned_modules(sheet.profile, sections)
        for _ in range(embeddings):
            sheet.transfers.append(Transfer("tp", "tp", "all_reduce", whole_dtype, m, False))
        for style, vocabulary, itemsize in heads:
            sheet.transfers.append(Transfer("tp", "tp", "all_reduce", whole_dtype, m, False))
            if self.loss_parallel and style == "vocab_parallel_head":  # max, sum of exponentials, target's logit
                sheet.transfers.append(Transfer("tp", "tp", "all_reduce", tokens * 4, 3 * m, False))
            else:  # the sharded logits gathered whole (a vocabulary-parallel head does that too without loss parallel)
                logits = tokens * vocabulary * itemsize * sheet.activation_scale
                sheet.transfers.append(Transfer("tp", "tp", "all_gather", logits, m, False))
        if whole and self.sequence_parallel:  # one message each: the time of their mean size, len(whole) times
            sheet.transfers.append(Transfer("tp", "tp", "all_reduce", sum(whole) / len(whole), len(whole), False))
        if head_norms:  # each rank normalized only its own heads
            sheet.transfers.append(
                Transfer("tp", "tp", "all_reduce", sum(head_norms) / len(head_norms), len(head_norms), False))
        if sheet.inputs_chunked:  # backward gathers the saved layer inputs again (e.g. attention's and MLP's)
            in_blocks, at_ends = (n * (2 if sheet.split_backward else 1)
                                  for n in _regathered_inputs(sheet.profile, sections))
            sheet.regathered_in_blocks = Transfer("tp", "tp", "all_gather", residual, in_blocks * m, False)
            sheet.transfers.append(sheet.regathered_in_blocks)
            if at_ends:  # a head's input
                sheet.transfers.append(Transfer("tp", "tp", "all_gather", residual, at_ends * m, False))
        if self.sequence_parallel:  # pipeline stages hand on this rank's sequence chunk, not the whole sequence
            sheet.transfers = [t.copy_with(nbytes=t.nbytes / tp) if t.kind == "pp_send_recv" else t
                               for t in sheet.transfers]

    def describe(self, dims: ParallelDims) -> str | None:
        if dims.tp == 1:
            return None
        regather = ", sequence chunks gathered again in backward" if self.regather_sequence else ""
        regather += ", async (collectives pipelined with their matmuls)" if self.async_tp else ""
        return (f"tensor parallel (sequence parallel {self.sequence_parallel}{regather}, loss parallel "
                f"{self.loss_parallel})")


def _pipelined_block_transfers(sheet: CostSheet, nbytes: float) -> list[Transfer]:
    """Async tensor parallelism's block collectives, each priced behind the matmul it is pipelined with. Per group
    of a row-parallel layer and the column-parallel layers beside it (attention's projections, the MLP's; at most
    two per block, as the plain account counts), per micro-batch: forward all-gathers the group's input for its
    column-parallel matmuls (one all-gather feeds them all) and reduce-scatters the row-parallel matmul's output;
    backward all-gathers the output gradient for the row-parallel one and reduce-scatters the column-parallel input
    gradient: behind that matmul only where one column-parallel layer makes it (Inductor fuses a reduce-scatter
    with the one matmul that produces it; the sum of q's, k's and v's input gradients has none, so it stays
    exposed). Each carries the FLOPs of its matmul on this rank (``behind_flops``); the time model hides (tp - 1) /
    tp of them. On the pipeline rank that runs the most blocks, as the plain account."""
    def groups_of_the_rank_with_most_blocks() -> list[tuple[int, int, int]]:
        rank = max(sheet.rank_sections, key=lambda r: sum(s not in END_SECTIONS for s in r))
        return [g for section in rank if section not in END_SECTIONS
                for g in _column_row_groups(sheet.profile, section)[:2]]

    groups = per_cut(sheet, ("tp_groups",), groups_of_the_rank_with_most_blocks)
    m, per_param = sheet.microbatches, 2 * sheet.microbatch_tokens / sheet.dims.tp  # FLOPs of a matmul's forward
    out = []
    for column, row, columns in groups:
        backward_scatter = per_param * column if columns == 1 else 0.0
        out += [Transfer("tp", "tp", "all_gather", nbytes, m, False, m, m, "matmul", per_param * column),
                Transfer("tp", "tp", "reduce_scatter", nbytes, m, False, m, 0.0, "matmul", per_param * row),
                Transfer("tp", "tp", "reduce_scatter", nbytes, m, False, 0.0, 0.0, "matmul", backward_scatter),
                Transfer("tp", "tp", "all_gather", nbytes, m, False, 0.0, 0.0, "matmul", per_param * row)]
    return out


def _column_row_groups(profile: ModelProfile, section: str) -> list[tuple[int, int, int]]:
    """(column-parallel weight elements, row-parallel weight elements, column-parallel layers) of each row-parallel
    layer of the block ``section`` with the column-parallel layers under the same parent module (the block's
    attention, its MLP), in the order the plan names them. Weights only (the matmuls' operands), whole (before tp)."""
    cache = profile.__dict__.setdefault("_tp_groups", {})
    if section in cache:
        return cache[section]
    column: dict[str, list[int]] = {}
    row: dict[str, int] = {}
    for module, owned in params_by_planned_module(profile).items():
        style = profile.tp_plan[module]
        weights = [p for p in owned if p.section == section and len(p.shape) == 2]
        if not weights or not isinstance(style, str):
            continue
        parent = module.rpartition(".")[0]
        pair = style_price(style).pair  # the column- and row-parallel halves of a pair (``tensor_styles``)
        if pair == "column":
            column.setdefault(parent, []).append(sum(p.numel for p in weights))
        elif pair == "row":
            row[parent] = row.get(parent, 0) + sum(p.numel for p in weights)
    cache[section] = [(sum(column.get(parent, [])), elements, len(column.get(parent, [])))
                      for parent, elements in row.items()]
    return cache[section]


def _regathered_inputs(profile: ModelProfile, sections: frozenset[str]) -> tuple[int, int]:
    """The layer inputs ``regather_sequence`` gathers again per micro-batch in ``sections``: in blocks (none under
    activation checkpointing) and in what runs before and after them (a head's)."""
    counts = {name: profile.sections[name].regathered_inputs for name in sections}
    return (sum(c for name, c in counts.items() if name not in END_SECTIONS),
            sum(c for name, c in counts.items() if name in END_SECTIONS))


def _planned_modules(
    profile: ModelProfile, sections: frozenset[str]
) -> tuple[int, list[tuple[str, int, int]], list[int], list[int]]:
    """What the plan's modules in ``sections`` communicate, worked out once per profile and pipeline cut (planning
    thousands of layouts): the number of vocabulary-parallel embeddings, each output head as (style, vocabulary,
    item size), the bytes of each trainable parameter tp leaves whole (all-reduced under sequence parallelism), and
    those of each trainable 'head_norm' parameter (always all-reduced)."""
    cache = profile.__dict__.setdefault("_tp_messages", {})
    if sections in cache:
        return cache[sections]
    embeddings, heads, whole, head_norms = 0, [], [], []
    for module, owned in params_by_planned_module(profile).items():
        style = profile.tp_plan[module]
        owned = [p for p in owned if p.section in sections]
        if not owned or not isinstance(style, str):
            continue
        if style in ("vocab_parallel_embedding", "embedding_rowwise"):
            embeddings += 1
        elif style in ("vocab_parallel_head", "colwise_rep"):
            weight = max(owned, key=lambda p: len(p.shape))  # (vocabulary, hidden)
            heads.append((style, weight.shape[0], weight.itemsize))
        elif style in ("sequence_parallel", "replicate"):
            whole += [p.numel * p.itemsize for p in owned if p.trainable and p.tp_dim is None]
        elif style == "head_norm":
            head_norms += [p.numel * p.itemsize for p in owned if p.trainable]
    cache[sections] = (embeddings, heads, whole, head_norms)
    return cache[sections]
